"""Model references: one function turns a hub id or a local directory into a local diffusers layout.

A *model reference* is either a Hugging Face hub id (``stabilityai/stable-diffusion-2-base``) or a
local directory in the diffusers layout (``unet/ vae/ text_encoder/ tokenizer/ scheduler/
model_index.json``), such as the ones ``python -m diffusion.kit`` writes. Every component
loader below goes through :func:`resolve_model`, and nothing else in the codebase resolves references.
"""

from __future__ import annotations

import json
import logging
import os

from diffusion.errors import ModelReferenceError

COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")


class _DropLoadingNoise(logging.Filter):
    """Drops two diffusers messages that say nothing about this run; every other message passes.

    - "`accelerate` was not found ... pip install accelerate", on every model load without
      ``accelerate``: loading works the same without it (``low_cpu_mem_usage`` only lowers peak memory
      while loading).
    - "There are modules in X that should be kept in float32: []. Casting directly with `to()` ...",
      on every ``.to(dtype)`` (diffusers 0.39 warns even when the list is empty; with modules listed,
      the warning is real and still shown).
    """

    NOISE = ("`accelerate` was not found", "that should be kept in float32: []. ")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        return not any(text in message for text in self.NOISE)


# The loggers that print them (diffusers' own module loggers); importing this module, which every model
# load goes through, installs the filter once per process, Ray workers included.
_NOISY_LOGGERS = ("diffusers.models.modeling_utils", "diffusers.pipelines.pipeline_utils")
for _name in _NOISY_LOGGERS:
    if not any(isinstance(f, _DropLoadingNoise) for f in logging.getLogger(_name).filters):
        logging.getLogger(_name).addFilter(_DropLoadingNoise())


def resolve_model(ref: str, components=COMPONENTS) -> str:
    """Return a local directory in the diffusers layout for ``ref``.

    A local directory is used as is (checked for ``model_index.json`` or the components asked for).
    Anything else is treated as a hub id and fetched with ``huggingface_hub.snapshot_download``
    (only the files of ``components``); without network access this fails with a clear message
    unless the files are already in the local hub cache.
    """
    ref = os.fspath(ref)
    expanded = os.path.expanduser(ref)
    if os.path.isdir(expanded):
        missing = [c for c in components if not os.path.isdir(os.path.join(expanded, c))]
        if missing and not os.path.exists(os.path.join(expanded, "model_index.json")):
            raise ModelReferenceError(
                f"{ref!r} is a directory but not a diffusers layout: missing {', '.join(missing)} "
                f"(expected {', '.join(COMPONENTS)} and model_index.json)")
        return os.path.abspath(expanded)
    if ref.startswith((".", "/", "~")) or ref.count("/") != 1:
        raise ModelReferenceError(f"model reference {ref!r}: no such directory, and not a hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
        patterns = ["model_index.json"] + [f"{c}/*" for c in components]
        return snapshot_download(ref, allow_patterns=patterns,
                                 ignore_patterns=["*.bin", "*.ckpt", "*.msgpack", "*.onnx*", "*fp16*"])
    except Exception as e:  # offline, unknown repo, gated, ...
        raise ModelReferenceError(
            f"could not fetch model {ref!r} from the hub ({type(e).__name__}: {e}); pass a local "
            f"diffusers directory instead, e.g. one written by `python -m diffusion.kit`") from e


def component_path(ref: str, name: str) -> str:
    """The local directory of component ``name`` (``unet``, ``transformer``, ``vae`` ...) of ``ref``."""
    path = os.path.join(resolve_model(ref, components=(name,)), name)
    if not os.path.isdir(path):
        raise ModelReferenceError(f"model {ref!r} has no {name}/ component")
    return path


def _has_weights(path: str) -> bool:
    return any(f.endswith((".safetensors", ".bin")) for f in os.listdir(path))


def require_weights(ref: str, components=("vae", "text_encoder")) -> None:
    """Fail early, in one line, when a component of ``ref`` has a config but no weights (e.g. the
    ``sd2-base`` kit, whose VAE and text encoder come from the hub), or weights that do not read whole."""
    for name in components:
        path = component_path(ref, name)
        if not _has_weights(path):
            raise ModelReferenceError(f"{path} has a config but no weights: point --model at a copy with weights")
        check_weight_files(path)


def check_weight_files(path: str) -> None:
    """Each ``.safetensors`` file of the component folder ``path`` reads whole: its header parses and the file
    is as long as the header says (``safe_open`` checks both; no tensor is read). A copy cut short or damaged
    is then one line naming the file, where the loaders raised three chained tracebacks (in the converter,
    from a Ray actor after the cluster had started)."""
    from safetensors import safe_open
    for name in sorted(n for n in os.listdir(path) if n.endswith(".safetensors")):
        file = os.path.join(path, name)
        try:
            with safe_open(file, framework="pt") as f:
                f.keys()
        except Exception as e:  # SafetensorError, OSError: whatever a damaged file raises
            raise ModelReferenceError(f"{file} does not read as a whole safetensors file ({type(e).__name__}: "
                                      f"{' '.join(str(e).split())[:200]}): the copy is damaged or cut short; copy "
                                      f"or download it again") from None


# Text encoders by their config's ``model_type``: CLIP's text tower (SD2) or an encoder-only T5 (long
# captions: PixArt, SD3's third encoder). Each is read as its last hidden state; T5 reads its padding
# through an attention mask (:func:`text_encoder_takes_mask`), CLIP as SD2 was trained, without one.
TEXT_ENCODERS = {"clip_text_model": "CLIPTextModel", "t5": "T5EncoderModel", "umt5": "UMT5EncoderModel",
                 "mt5": "MT5EncoderModel"}
CLIP_TEXT = "clip_text_model"


def text_encoder_type(config: dict) -> str:
    """The ``model_type`` of a text encoder config, checked against :data:`TEXT_ENCODERS`."""
    kind = config.get("model_type") or CLIP_TEXT
    if kind not in TEXT_ENCODERS:
        raise ModelReferenceError(f"text encoder of type {kind!r} is not supported; the text encoder must be one of "
                                  f"{', '.join(TEXT_ENCODERS.values())} (config model_type {', '.join(TEXT_ENCODERS)})")
    return kind


def text_encoder_width(config: dict) -> int:
    """D of ``text_embeds``: CLIP's ``hidden_size``, T5's ``d_model``."""
    return int(config.get("hidden_size") or config["d_model"])


def text_encoder_takes_mask(kind: str) -> bool:
    """Whether the text encoder reads an attention mask over its padding (T5: bidirectional, trained with
    one), or reads the padded sequence whole (CLIP, causal: SD2's conditioning includes the padding)."""
    return kind != CLIP_TEXT


# Pipelines whose model reference holds two text encoders, the first pooled: Flux's layout, CLIP in
# ``text_encoder/``+``tokenizer/`` (its pooled vector) and T5 in ``text_encoder_2/``+``tokenizer_2/`` (its
# sequence, the embeddings every denoiser attends to). FluxPipeline reads T5 without an attention mask.
POOLED_PIPELINES = ("FluxPipeline",)
FIRST_SLOTS, SECOND_SLOTS = ("text_encoder", "tokenizer"), ("text_encoder_2", "tokenizer_2")


def _model_index(root: str) -> dict:
    """The model_index.json of the model directory ``root`` ({} where it has none)."""
    try:
        with open(os.path.join(root, "model_index.json")) as f:
            return json.load(f)
    except (OSError, ValueError):
        return {}


def unencoded_text_slots(ref: str) -> list[str]:
    """The text encoders ``ref``'s model_index.json names beyond the one (or Flux's two) that are encoded:
    SD3's ``text_encoder_2`` and ``text_encoder_3`` (a second CLIP and T5), which would be left out."""
    index = _model_index(resolve_model(ref, components=()))
    slots = ("text_encoder_3",) if index.get("_class_name") in POOLED_PIPELINES else ("text_encoder_2", "text_encoder_3")
    return [s for s in slots if (index.get(s) or [None])[0]]


def pooled_text_slots(ref: str) -> tuple[str, str] | None:
    """``(encoder, tokenizer)`` folders of ``ref``'s pooled text encoder where it has two (Flux's layout:
    ``text_encoder``, ``tokenizer``), else None."""
    root = resolve_model(ref, components=())
    index = _model_index(root)
    second = index.get("text_encoder_2") or [None]
    if index.get("_class_name") in POOLED_PIPELINES and second[0] and os.path.isdir(os.path.join(root, "text_encoder_2")):
        return FIRST_SLOTS
    return None


def text_slots(ref: str) -> tuple[str, str]:
    """``(encoder, tokenizer)`` folders of the text encoder whose sequence conditions the denoiser: ``text_encoder``,
    or in Flux's layout (:func:`pooled_text_slots`) ``text_encoder_2``."""
    return SECOND_SLOTS if pooled_text_slots(ref) else FIRST_SLOTS


def text_components(ref: str) -> tuple[str, ...]:
    """Every text encoder folder of ``ref`` (one, or Flux's two)."""
    return ("text_encoder", "text_encoder_2") if pooled_text_slots(ref) else ("text_encoder",)


def sequence_reads_mask(ref: str, kind: str) -> bool:
    """Whether the sequence encoder of ``ref`` reads an attention mask: :func:`text_encoder_takes_mask`, except
    in Flux's layout, where T5 reads the padded ids whole, as FluxPipeline encodes a prompt."""
    return text_encoder_takes_mask(kind) and not pooled_text_slots(ref)


def _load_tokenizer_at(ref: str, folder: str, kind: str):
    if kind == CLIP_TEXT:
        from transformers import CLIPTokenizer
        return CLIPTokenizer.from_pretrained(component_path(ref, folder))
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(component_path(ref, folder))


def _load_text_encoder_at(ref: str, folder: str, kind: str, dtype=None):
    import transformers
    require_weights(ref, (folder,))
    model = getattr(transformers, TEXT_ENCODERS[kind]).from_pretrained(component_path(ref, folder), dtype=dtype)
    return model.eval().requires_grad_(False)


def load_tokenizer(ref: str):
    """The tokenizer of ``ref``'s text encoder: CLIP's (max length 77, pad ``!`` = 0 for SD2), or the one
    ``tokenizer/`` names for another encoder (T5's); in Flux's layout T5's, ``tokenizer_2/``."""
    return _load_tokenizer_at(ref, text_slots(ref)[1], text_encoder_type(load_text_encoder_config(ref)))


def load_text_encoder(ref: str, dtype=None):
    """The text encoder of ``ref`` by its config's ``model_type`` (:data:`TEXT_ENCODERS`), frozen: the one whose
    sequence conditions the denoiser (in Flux's layout T5, ``text_encoder_2/``)."""
    return _load_text_encoder_at(ref, text_slots(ref)[0], text_encoder_type(load_text_encoder_config(ref)), dtype)


def load_pooled_text_encoder(ref: str, dtype=None):
    """``(model, tokenizer)`` of ``ref``'s pooled text encoder (Flux's CLIP, :func:`pooled_text_slots`), frozen; None
    where ``ref`` has one text encoder."""
    slots = pooled_text_slots(ref)
    if slots is None:
        return None
    with open(os.path.join(component_path(ref, slots[0]), "config.json")) as f:
        kind = text_encoder_type(json.load(f))
    if kind != CLIP_TEXT:
        raise ModelReferenceError(f"{ref}: its pooled text encoder ({slots[0]}/) is {kind}, not CLIP's text model")
    return _load_text_encoder_at(ref, slots[0], kind, dtype), _load_tokenizer_at(ref, slots[1], kind)


def pooled_text_width(ref: str) -> int | None:
    """P of ``pooled_text_embeds``: the pooled encoder's hidden size (None: one text encoder)."""
    slots = pooled_text_slots(ref)
    if slots is None:
        return None
    with open(os.path.join(component_path(ref, slots[0]), "config.json")) as f:
        return text_encoder_width(json.load(f))


def autoencoder_class(vae_config: dict) -> str:
    """The diffusers autoencoder class a ``vae/`` config names (``AutoencoderKL`` where it names none),
    checked against the ones the converter and sampler run (:data:`diffusion.schema.AUTOENCODERS`)."""
    from diffusion import schema
    name = vae_config.get("_class_name") or "AutoencoderKL"
    if name not in schema.AUTOENCODERS:
        raise ModelReferenceError(f"vae/ of class {name!r} is not supported; the autoencoder must be one of "
                                  f"{', '.join(schema.AUTOENCODERS)}")
    return name


def load_vae(ref: str, dtype=None):
    """The autoencoder of ``ref`` by its config's class (:func:`autoencoder_class`), frozen."""
    import diffusers
    require_weights(ref, ("vae",))
    path = component_path(ref, "vae")
    model = getattr(diffusers, autoencoder_class(load_vae_config(ref))).from_pretrained(path, torch_dtype=dtype)
    return model.eval().requires_grad_(False)


def load_image_encoder(ref: str, dtype=None):
    """A transformers vision encoder (DINOv2, DINOv3, SigLIP's vision tower, a ViT) by its config, through
    ``AutoModel``: a local directory with ``config.json`` and weights, or a hub id; frozen, in eval mode.
    Returns ``(model, preprocessing)``: the image mean and std its preprocessor_config.json records
    (ImageNet's where none)."""
    import transformers
    expanded = os.path.expanduser(os.fspath(ref))
    path = os.path.abspath(expanded)
    if not os.path.isdir(expanded):
        if ref.startswith((".", "/", "~")) or ref.count("/") != 1:
            raise ModelReferenceError(f"vision encoder {ref!r}: no such directory, and not a hub id (owner/name)")
        try:
            from huggingface_hub import snapshot_download
            path = snapshot_download(ref, allow_patterns=["*.json", "*.safetensors"])
        except Exception as e:  # offline, unknown repo, gated, ...
            raise ModelReferenceError(f"could not fetch vision encoder {ref!r} from the hub ({type(e).__name__}: "
                                      f"{e}); pass a local directory instead") from e
    if not os.path.isfile(os.path.join(path, "config.json")) or not _has_weights(path):
        raise ModelReferenceError(f"vision encoder {ref!r}: {path} needs config.json and weights (a transformers "
                                  f"model directory, e.g. save_pretrained's)")
    model = transformers.AutoModel.from_pretrained(path, dtype=dtype)
    if hasattr(model, "vision_model"):  # SigLIP / CLIP: the vision tower
        model = model.vision_model
    preprocessing = {"image_mean": [0.485, 0.456, 0.406], "image_std": [0.229, 0.224, 0.225]}
    processor = os.path.join(path, "preprocessor_config.json")
    if os.path.isfile(processor):
        with open(processor) as f:
            saved = json.load(f)
        preprocessing.update({k: saved[k] for k in ("image_mean", "image_std") if k in saved})
    return model.eval().requires_grad_(False), preprocessing


def latent_space_of(vae_config: dict):
    """The :class:`~diffusion.schema.LatentSpace` of an autoencoder config: an ``AutoencoderKL`` stores
    posterior moments, an ``AutoencoderDC`` (no posterior) its latents; the scaling factor is the config's
    (SD's 0.18215 where a KL config has none), the shift its ``shift_factor`` (0 where none)."""
    from diffusion import schema
    name = autoencoder_class(vae_config)
    default_scale = 0.18215 if name == "AutoencoderKL" else 1.0
    return schema.LatentSpace(autoencoder=name, channels=int(vae_config.get("latent_channels", schema.LATENT_CHANNELS)),
                              downsample=vae_downsample(vae_config),
                              scaling_factor=float(vae_config.get("scaling_factor") or default_scale),
                              shift_factor=float(vae_config.get("shift_factor") or 0.0),
                              stored=schema.MOMENTS if name == "AutoencoderKL" else schema.LATENTS)


def load_unet_config(ref: str) -> dict:
    with open(os.path.join(component_path(ref, "unet"), "config.json")) as f:
        return json.load(f)


def load_text_encoder_config(ref: str) -> dict:
    """The (sequence) text encoder's config.json (:func:`text_encoder_width` is the D of ``text_embeds``), without
    weights."""
    with open(os.path.join(component_path(ref, text_slots(ref)[0]), "config.json")) as f:
        return json.load(f)


def load_vae_config(ref: str) -> dict:
    with open(os.path.join(component_path(ref, "vae"), "config.json")) as f:
        return json.load(f)


def load_scheduler(ref: str, name: str = "ddpm"):
    """The noise scheduler of ``ref``'s ``scheduler/`` config as DDPM (training) or a sampler."""
    import diffusers
    classes = {
        "ddpm": diffusers.DDPMScheduler,
        "ddim": diffusers.DDIMScheduler,
        "euler": diffusers.EulerDiscreteScheduler,
        "dpm++": diffusers.DPMSolverMultistepScheduler,
        "dpmsolver++": diffusers.DPMSolverMultistepScheduler,
    }
    if name not in classes:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {', '.join(classes)}")
    return classes[name].from_pretrained(component_path(ref, "scheduler"))


# The scheduler config keys that define the noise schedule a UNet was trained on (the rest of a
# scheduler config is how to sample: spacing, offsets, solver settings).
SCHEDULE_KEYS = ("num_train_timesteps", "beta_schedule", "beta_start", "beta_end", "trained_betas",
                 "rescale_betas_zero_snr")


def noise_schedule_of(scheduler_config) -> dict:
    """The noise schedule of a scheduler config, as checkpoints carry it: :data:`SCHEDULE_KEYS`, with
    ``rescale_betas_zero_snr`` (zero terminal SNR) False when the config does not have it."""
    config = dict(scheduler_config)
    schedule = {k: config.get(k) for k in SCHEDULE_KEYS}
    schedule["rescale_betas_zero_snr"] = bool(schedule["rescale_betas_zero_snr"])
    if schedule["trained_betas"] is not None:
        schedule["trained_betas"] = [float(b) for b in schedule["trained_betas"]]
    return schedule


def vae_downsample(vae_config: dict) -> int:
    """Spatial downsampling factor of an autoencoder config (8 for SD2's AutoencoderKL, 32 for DC-AE's f32)."""
    blocks = vae_config.get("block_out_channels") or vae_config["encoder_block_out_channels"]
    return 2 ** (len(blocks) - 1)


# ---- image-to-text models (the converter's --recaption) ---------------------------------------------
# A captioner is a transformers directory (config.json, weights and its processor's files), not a
# diffusers layout: a hub id (Salesforce/blip-image-captioning-base) or a local directory such as
# the ``tiny-captioner`` kit.
_CAPTIONER_SKIP = ["*.h5", "*.msgpack", "*.onnx*", "*.ckpt", "*.tflite", "*.ot", "*.gguf"]


def resolve_captioner(ref: str) -> str:
    """A local directory holding the image-to-text model ``ref`` (a hub id is fetched, or found in the
    local hub cache)."""
    ref = os.fspath(ref)
    expanded = os.path.expanduser(ref)
    if os.path.isdir(expanded):
        if not os.path.exists(os.path.join(expanded, "config.json")):
            raise ModelReferenceError(f"{ref!r} is a directory but not a transformers model: no config.json")
        return os.path.abspath(expanded)
    if ref.startswith((".", "/", "~")) or ref.count("/") != 1:
        raise ModelReferenceError(f"captioning model {ref!r}: no such directory, and not a hub id (owner/name)")
    try:
        from huggingface_hub import snapshot_download
        return snapshot_download(ref, ignore_patterns=_CAPTIONER_SKIP)
    except Exception as e:  # offline, unknown repo, gated, ...
        raise ModelReferenceError(
            f"could not fetch captioning model {ref!r} from the hub ({type(e).__name__}: {e}); pass a local "
            f"directory instead, e.g. one written by `python -m diffusion.kit --preset tiny-captioner`") from e


def load_captioner(ref: str, dtype=None):
    """(processor, model) of the image-to-text model ``ref``, through transformers' Auto classes
    (``AutoModelForImageTextToText`` covers BLIP, Florence-2, LLaVA, ...), in eval mode."""
    from transformers import AutoModelForImageTextToText, AutoProcessor
    path = resolve_captioner(ref)
    processor = AutoProcessor.from_pretrained(path)
    model = AutoModelForImageTextToText.from_pretrained(path, dtype=dtype)
    return processor, model.eval().requires_grad_(False)
