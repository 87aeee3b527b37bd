"""The offline model kit: diffusers-layout model directories written without hub access.

``python -m diffusion.kit --preset {tiny,sd2-base,tiny-clip,tiny-mmdit,tiny-t5,tiny-captioner} --out DIR``

- ``sd2-base``: SD2-base's exact UNet, VAE, text encoder and scheduler configs plus its tokenizer, and
  no weights (the UNet is trained from scratch; real VAE/text encoder weights come from the hub).
- ``tiny``: the same structure at small widths, CPU-fast: random seeded UNet and text encoder, and a
  VAE fitted on sample scenes so decoded images can be judged by eye. The fitted VAE ships with the
  package (``diffusion/kit/assets/tiny-vae``, see :mod:`diffusion.kit.vae_fit`), so the preset
  builds in seconds; ``--refit-vae`` fits it again instead (a few minutes on CPU).
- ``tiny-mmdit``: the tiny kit with an MMDiT (SD3's ``SD3Transformer2DModel``, random, seeded) in
  ``transformer/`` for its denoiser and a flow-matching scheduler, for the flow recipe.
- ``mmdit-base``: configs only (as ``sd2-base``): the micro-budget recipe's ~1.3B MMDiT over SD2's VAE
  and text encoder, with a flow-matching scheduler (yamls/micro-budget/).
- ``tiny-t5``: the long-caption kit: a tiny random ``T5EncoderModel`` as its text encoder, with a
  T5-style tokenizer trained here on the sample captions (:mod:`diffusion.kit.t5_tokenizer`), and both
  denoisers at the tiny kits' sizes (``unet/`` and ``transformer/``: ``model.denoiser`` picks; auto
  takes the transformer), over the shipped fitted VAE.
- ``tiny-vae16``, ``tiny-dcae``: the tiny MMDiT kit in other latent spaces, for tests: a random 16-channel
  ``AutoencoderKL`` with a shift factor (SD3's and Flux's kind, /8) and a random ``AutoencoderDC``
  (DC-AE's kind: 32 channels, /32, deterministic latents), each with an MMDiT reading its channels.
  Random autoencoders decode noise: for the latent contract, not for judging images.
- ``tiny-flux``: Flux.1's transformer (``FluxTransformer2DModel``: 2x2-packed 16-channel latents, no guidance
  embedding, as schnell) at toy widths over the tiny-vae16 autoencoder's architecture, fitted on the sample scenes
  (shipped in ``diffusion/kit/assets/tiny-vae16``, with its shift and scale), Flux's two text encoders in
  FluxPipeline's layout (the tiny CLIP in ``text_encoder/`` + ``tokenizer/``, its pooled vector; a tiny T5 in
  ``text_encoder_2/`` + ``tokenizer_2/``, its sequence) and a flow-matching scheduler.
- ``tiny-sana``: SANA's linear-attention DiT (``SanaTransformer2DModel``) at toy widths over the tiny DC-AE, fitted
  likewise (``diffusion/kit/assets/tiny-dcae``), the tiny CLIP text encoder and a flow-matching scheduler.
- ``flux-schnell``: configs only (as ``mmdit-base``): Flux.1-schnell's transformer (11.9B), its 16-channel VAE and
  its two text encoders in FluxPipeline's layout (CLIP-L, T5-XXL), with a flow-matching scheduler: MLPerf
  Training's Flux benchmark (yamls/mlperf-flux/).
- ``tiny-clip``: a tiny random ``CLIPModel`` (text + vision, 64 px) with tokenizer and image processor,
  for CLIP-score / FID tests.
- ``tiny-captioner``: a tiny random image-to-text model (BLIP's ``BlipForConditionalGeneration``, 64 px)
  with its processor and a small word vocabulary, for the converter's ``--recaption`` tests.

:func:`ensure_kit` builds a kit only when it is missing or incomplete. It builds in a temporary
directory beside the target, writes the stamp file last and renames the directory into place, so a
killed build never leaves a half kit that looks complete; a file lock makes concurrent callers (test
sessions sharing ``.cache/``) wait for one build instead of racing.

It never deletes what it did not write. The stamp (``kit.json``) lists the files the kit wrote, and
replacing a kit (older kit version, another preset with ``force``) removes only those. A folder that is
not one of our kits, or a kit holding files it did not write, is refused with a :class:`KitError`
naming them; so is another preset's kit unless ``force`` is given.
"""

from __future__ import annotations

import argparse
import contextlib
import errno
import fcntl
import json
import os
import pathlib
import shutil
import tempfile
import time

from diffusion.errors import KitError, UserError
from diffusion.kit import vae_fit
from diffusion.kit.vae_fit import FIT_INFO, HELD_OUT_SEED, TINY_VAE, TINY_VAE_ASSET, VAE_SEED  # noqa: F401
from diffusion.kit.tokenizer import MAX_LENGTH, VOCAB_SIZE, write_clip_tokenizer

KIT_VERSION = 4  # bump when a preset's contents change: older kits are then rebuilt
# A preset whose contents changed alone: its own version, so only it is rebuilt (tiny-flux 5: two text encoders)
PRESET_VERSIONS = {"tiny-flux": 5, "flux-schnell": 5, "tiny-clip": 5}  # tiny-clip 5: its fitted heads/


def kit_version(preset: str) -> int:
    return PRESET_VERSIONS.get(preset, KIT_VERSION)

STAMP = "kit.json"
PRESETS = ("tiny", "sd2-base", "tiny-clip", "tiny-mmdit", "mmdit-base", "tiny-captioner", "tiny-t5", "tiny-vae16",
           "tiny-dcae", "tiny-flux", "tiny-sana", "flux-schnell")

# What each preset writes at its top level, for kits stamped before the stamp listed its files.
_DIFFUSERS_LAYOUT = frozenset({"unet", "vae", "text_encoder", "tokenizer", "scheduler", "model_index.json", STAMP})
LEGACY_TOP_LEVEL = {
    "sd2-base": _DIFFUSERS_LAYOUT,
    "tiny": _DIFFUSERS_LAYOUT,
    "tiny-mmdit": frozenset({"transformer", "vae", "text_encoder", "tokenizer", "scheduler", "model_index.json", STAMP}),
    "mmdit-base": frozenset({"transformer", "vae", "text_encoder", "tokenizer", "scheduler", "model_index.json", STAMP}),
    "tiny-clip": frozenset({  # CLIPModel, the CLIP tokenizer and image processor's save_pretrained
        STAMP, "config.json", "model.safetensors", "pytorch_model.bin", "generation_config.json",
        "vocab.json", "merges.txt", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.json",
        "added_tokens.json", "preprocessor_config.json",
    }),
    "tiny-captioner": frozenset({STAMP, "config.json", "model.safetensors", "generation_config.json", "vocab.txt",
                                 "tokenizer_config.json", "special_tokens_map.json", "tokenizer.json",
                                 "preprocessor_config.json", "processor_config.json"}),
}


SD2_UNET = dict(
    sample_size=64, in_channels=4, out_channels=4, layers_per_block=2,
    block_out_channels=(320, 640, 1280, 1280),
    down_block_types=("CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "CrossAttnDownBlock2D", "DownBlock2D"),
    up_block_types=("UpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=1024, attention_head_dim=(5, 10, 20, 20), use_linear_projection=True,
)
SD2_VAE = dict(
    sample_size=512, in_channels=3, out_channels=3, latent_channels=4, layers_per_block=2,
    block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=0.18215,
)
# SD2-base's text encoder config, special-token ids included (the pooled output is unused).
SD2_TEXT = dict(
    hidden_size=1024, intermediate_size=4096, num_attention_heads=16, num_hidden_layers=23, hidden_act="gelu",
    vocab_size=VOCAB_SIZE, max_position_embeddings=MAX_LENGTH, projection_dim=512,
    bos_token_id=0, eos_token_id=2, pad_token_id=1,
)
SCHEDULER = dict(
    num_train_timesteps=1000, beta_schedule="scaled_linear", beta_start=0.00085, beta_end=0.012,
    prediction_type="epsilon", clip_sample=False, set_alpha_to_one=False, steps_offset=1,
)
SCHEDULER_CLASS = "DDIMScheduler"  # same config keys as DDPM (training) and deterministic to sample with

_TINY_TOKENS = dict(vocab_size=VOCAB_SIZE, max_position_embeddings=MAX_LENGTH,
                    bos_token_id=49406, eos_token_id=49407, pad_token_id=0)
TINY_TEXT = dict(hidden_size=64, intermediate_size=256, num_attention_heads=4, num_hidden_layers=2,
                 hidden_act="gelu", projection_dim=64, **_TINY_TOKENS)
TINY_UNET = dict(
    sample_size=8, in_channels=4, out_channels=4, layers_per_block=1, block_out_channels=(32, 64),
    down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"), up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
    cross_attention_dim=TINY_TEXT["hidden_size"], attention_head_dim=(2, 4), use_linear_projection=True,
)

# SD3-medium's transformer as published (stabilityai/stable-diffusion-3-medium-diffusers,
# transformer/config.json): for FLOP counts (diffusion.cost --flops sd3-medium), not a kit.
SD3_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                  attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                  caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=192)
SD3_TEXT_TOKENS = 77 + 256  # CLIP tokens and T5 tokens, concatenated along the sequence

# The MMDiT preset: SD3's transformer at the tiny UNet's scale (latent 8×8 at 64 px, patches of 2), the
# tiny text encoder's width as its joint-attention and pooled widths, and a flow-matching scheduler.
TINY_MMDIT = dict(
    sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=4, attention_head_dim=16,
    num_attention_heads=4, joint_attention_dim=TINY_TEXT["hidden_size"], caption_projection_dim=64,
    pooled_projection_dim=TINY_TEXT["hidden_size"], pos_embed_max_size=32,
)
FLOW_SCHEDULER = dict(num_train_timesteps=1000, shift=1.0)
# The micro-budget recipe's MMDiT (yamls/micro-budget/): DiT-XL's width (1152, 18 heads) and depth (28),
# joint attention over SD2's text encoder (1024) and VAE (4 channels), patches of 2: ~1.3B parameters,
# the size of MicroDiT-XL/2 (1.16B). Queries and keys RMS-normalised (diffusers' qk_norm, as MicroDiT, SD3.5
# and SD3's paper do) against attention logits growing in bf16; the tiny kits and their recorded losses stay
# without it.
MMDIT_BASE = dict(sample_size=64, patch_size=2, in_channels=4, out_channels=4, num_layers=28, attention_head_dim=64,
                  num_attention_heads=18, joint_attention_dim=SD2_TEXT["hidden_size"], caption_projection_dim=1152,
                  pooled_projection_dim=SD2_TEXT["hidden_size"], pos_embed_max_size=96, qk_norm="rms_norm")


def model_index() -> dict:
    import diffusers
    return {
        "_class_name": "StableDiffusionPipeline",
        "_diffusers_version": diffusers.__version__,
        "unet": ["diffusers", "UNet2DConditionModel"],
        "vae": ["diffusers", "AutoencoderKL"],
        "text_encoder": ["transformers", "CLIPTextModel"],
        "tokenizer": ["transformers", "CLIPTokenizer"],
        "scheduler": ["diffusers", SCHEDULER_CLASS],
        "safety_checker": [None, None],
        "feature_extractor": [None, None],
        "requires_safety_checker": False,
    }


def _write_json(path: pathlib.Path, data: dict) -> None:
    with open(path, "w") as f:
        json.dump(data, f, indent=2)


def _write_common(out: pathlib.Path) -> None:
    """Tokenizer, scheduler and model_index.json: identical in every diffusers-layout preset."""
    import diffusers
    write_clip_tokenizer(out / "tokenizer")
    getattr(diffusers, SCHEDULER_CLASS)(**SCHEDULER).save_config(out / "scheduler")
    _write_json(out / "model_index.json", model_index())


def build_sd2_base(out: pathlib.Path) -> dict:
    """Configs only: modules are built on the meta device, so nothing is allocated."""
    import torch
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextConfig
    with torch.device("meta"):
        UNet2DConditionModel(**SD2_UNET).save_config(out / "unet")
        AutoencoderKL(**SD2_VAE).save_config(out / "vae")
    config = CLIPTextConfig(**SD2_TEXT)
    config.architectures = ["CLIPTextModel"]
    config.save_pretrained(out / "text_encoder")
    _write_common(out)
    return {}


def build_tiny(out: pathlib.Path, progress: bool = True, refit_vae: bool = False) -> dict:
    """Random seeded UNet and text encoder; the shipped fitted VAE (or, with ``refit_vae``, a VAE
    fitted here on sample scenes, a few minutes on CPU)."""
    import torch
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    UNet2DConditionModel(**TINY_UNET).save_pretrained(out / "unet")
    torch.manual_seed(1)
    CLIPTextModel(CLIPTextConfig(**TINY_TEXT)).save_pretrained(out / "text_encoder")
    if refit_vae:
        from diffusion.kit import vae_fit
        fit = vae_fit.fit_tiny_vae(out / "vae", progress=progress)
        source = "fitted"
    else:
        fit = copy_tiny_vae(out / "vae")
        source = "shipped"
    _write_common(out)
    return {"vae": source, "vae_fit": fit}


def copy_tiny_vae(out: pathlib.Path, asset: pathlib.Path = TINY_VAE_ASSET) -> dict:
    """Copy the shipped fitted VAE (config and weights) to ``out``; returns its fit info."""
    try:
        with open(asset / FIT_INFO) as f:
            fit = json.load(f)
    except OSError as e:
        raise FileNotFoundError(f"the shipped tiny VAE is missing ({e}); regenerate it with "
                                f"python -m diffusion.kit.vae_fit --out {asset}") from None
    out.mkdir(parents=True, exist_ok=True)
    for name in ("config.json", "diffusion_pytorch_model.safetensors"):
        shutil.copyfile(asset / name, out / name)
    return fit


def build_tiny_mmdit(out: pathlib.Path) -> dict:
    """The tiny kit with an MMDiT (``SD3Transformer2DModel``) for its denoiser and a flow-matching
    scheduler: the same tokenizer, text encoder and fitted VAE, so it trains on the same converted data."""
    import diffusers
    import torch
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    torch.manual_seed(0)
    SD3Transformer2DModel(**TINY_MMDIT).save_pretrained(out / "transformer")
    torch.manual_seed(1)
    CLIPTextModel(CLIPTextConfig(**TINY_TEXT)).save_pretrained(out / "text_encoder")
    fit = copy_tiny_vae(out / "vae")
    write_clip_tokenizer(out / "tokenizer")
    diffusers.FlowMatchEulerDiscreteScheduler(**FLOW_SCHEDULER).save_config(out / "scheduler")
    _write_json(out / "model_index.json", _mmdit_index())
    return {"vae": "shipped", "vae_fit": fit}


def _mmdit_index(vae: str = "AutoencoderKL") -> dict:
    import diffusers
    return {"_class_name": "StableDiffusion3Pipeline", "_diffusers_version": diffusers.__version__,
            "transformer": ["diffusers", "SD3Transformer2DModel"], "vae": ["diffusers", vae],
            "text_encoder": ["transformers", "CLIPTextModel"], "tokenizer": ["transformers", "CLIPTokenizer"],
            "scheduler": ["diffusers", "FlowMatchEulerDiscreteScheduler"]}


# Random tiny autoencoders of the other latent spaces (seeded; for the latent contract, not legible images:
# python -m diffusion.kit.vae_fit --kind vae16 / dcae fits these architectures on the sample scenes).
# A 16-channel AutoencoderKL, /8, with a scaling and a shift factor as SD3's and Flux's VAEs have.
TINY_VAE16 = dict(vae_fit.TINY_VAE16, scaling_factor=0.5, shift_factor=0.1)
# DC-AE's shape at toy widths: six stages (/32), 32 latent channels, residual blocks only.
TINY_DCAE = dict(vae_fit.TINY_DCAE, scaling_factor=0.41407)
# The tiny MMDiT for each: 16 channels at 8x8 latents (64 px), patches of 2; 32 channels at 2x2, patches of 1.
TINY_MMDIT_VAE16 = dict(TINY_MMDIT, in_channels=16, out_channels=16)
TINY_MMDIT_DCAE = dict(TINY_MMDIT, in_channels=32, out_channels=32, patch_size=1, sample_size=2)
# Flux.1's transformer at toy widths: 16-channel latents packed 2x2 (in_channels 64), one double-stream and two
# single-stream blocks, rotary axes summing to the head width; T5's sequence (the tiny T5, 64 wide) for the text and
# CLIP's pooled vector (the tiny CLIP, 64 wide) for the pool, as in Flux.1.
TINY_FLUX = dict(patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=16,
                 num_attention_heads=4, joint_attention_dim=TINY_TEXT["hidden_size"],
                 pooled_projection_dim=TINY_TEXT["hidden_size"], guidance_embeds=False, axes_dims_rope=(4, 6, 6))
# Flux.1-schnell's transformer as published (black-forest-labs/FLUX.1-schnell, transformer/config.json): for
# FLOP counts (diffusion.cost --flops flux-schnell), not a kit. T5 reads 256 tokens at MLPerf's settings.
FLUX_SCHNELL = dict(patch_size=1, in_channels=64, num_layers=19, num_single_layers=38, attention_head_dim=128,
                    num_attention_heads=24, joint_attention_dim=4096, pooled_projection_dim=768, guidance_embeds=False,
                    axes_dims_rope=(16, 56, 56))
FLUX_TEXT_TOKENS = 256
# SANA's DiT at toy widths on the tiny DC-AE's 32-channel 2x2 latents (64 px), the tiny text encoder's width.
TINY_SANA = dict(in_channels=32, out_channels=32, num_attention_heads=2, attention_head_dim=16, num_layers=2,
                 num_cross_attention_heads=2, cross_attention_head_dim=16, cross_attention_dim=32,
                 caption_channels=TINY_TEXT["hidden_size"], sample_size=2, patch_size=1)
# SANA-1.6B at 1024 px as published (Efficient-Large-Model/Sana_1600M_1024px_diffusers, transformer/config.json;
# diffusers' defaults): for FLOP counts (diffusion.cost --flops sana-1.6b). Gemma-2 reads 300 tokens of 2,304.
SANA_1600M = dict(in_channels=32, out_channels=32, num_attention_heads=70, attention_head_dim=32, num_layers=20,
                  num_cross_attention_heads=20, cross_attention_head_dim=112, cross_attention_dim=2240,
                  caption_channels=2304, mlp_ratio=2.5, sample_size=32, patch_size=1)
SANA_TEXT_TOKENS = 300
# The MLPerf Flux recipe's kit (yamls/mlperf-flux/), configs only: Flux.1-schnell's transformer, its 16-channel VAE
# (black-forest-labs/FLUX.1-schnell, vae/config.json: scale 0.3611, shift 0.1159) and its two text encoders: CLIP-L's
# text model (openai/clip-vit-large-patch14, 768 wide: the pooled vector) and T5-XXL v1.1 (google/t5-v1_1-xxl, 4096
# wide: the sequence).
FLUX_VAE = dict(sample_size=1024, in_channels=3, out_channels=3, latent_channels=16, layers_per_block=2,
                block_out_channels=(128, 256, 512, 512), down_block_types=("DownEncoderBlock2D",) * 4,
                up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=0.3611, shift_factor=0.1159,
                use_quant_conv=False, use_post_quant_conv=False)
T5_XXL = dict(d_model=4096, d_kv=64, d_ff=10240, num_layers=24, num_heads=64, feed_forward_proj="gated-gelu",
              vocab_size=32128, relative_attention_num_buckets=32, tie_word_embeddings=False, pad_token_id=0,
              eos_token_id=1, decoder_start_token_id=0)
CLIP_L_TEXT = dict(hidden_size=768, intermediate_size=3072, num_attention_heads=12, num_hidden_layers=12,
                   hidden_act="quick_gelu", vocab_size=VOCAB_SIZE, max_position_embeddings=MAX_LENGTH, projection_dim=768)


def build_tiny_latent_kit(out: pathlib.Path, preset: str) -> dict:
    """``tiny-vae16``, ``tiny-dcae``, ``tiny-flux`` or ``tiny-sana``: an autoencoder of that latent space (random;
    for tiny-flux and tiny-sana the shipped one fitted on the scenes) and a transformer reading its channels, over
    the tiny kit's CLIP text encoder, its tokenizer and a
    flow-matching scheduler."""
    import diffusers
    import torch
    from diffusers import (AutoencoderDC, AutoencoderKL, FluxTransformer2DModel, SanaTransformer2DModel,
                           SD3Transformer2DModel)
    from transformers import CLIPTextConfig, CLIPTextModel

    vae_class, vae, denoiser, config = {
        "tiny-vae16": (AutoencoderKL, TINY_VAE16, SD3Transformer2DModel, TINY_MMDIT_VAE16),
        "tiny-dcae": (AutoencoderDC, TINY_DCAE, SD3Transformer2DModel, TINY_MMDIT_DCAE),
        "tiny-flux": (AutoencoderKL, TINY_VAE16, FluxTransformer2DModel, TINY_FLUX),
        "tiny-sana": (AutoencoderDC, TINY_DCAE, SanaTransformer2DModel, TINY_SANA)}[preset]
    torch.manual_seed(0)
    denoiser(**config).save_pretrained(out / "transformer")
    torch.manual_seed(1)
    CLIPTextModel(CLIPTextConfig(**TINY_TEXT)).save_pretrained(out / "text_encoder")
    if preset == "tiny-flux":  # Flux's second text encoder: T5, whose sequence the transformer attends to
        _write_tiny_t5(out / "text_encoder_2", out / "tokenizer_2", max_length=MAX_LENGTH)
    fitted = {"tiny-flux": "vae16", "tiny-sana": "dcae"}.get(preset)  # their autoencoders, fitted on the scenes
    if fitted:
        info = {"vae": "shipped", "vae_fit": copy_tiny_vae(out / "vae", vae_fit.KINDS[fitted][2])}
    else:
        torch.manual_seed(2)
        vae_class(**vae).save_pretrained(out / "vae")
        info = {"vae": "random"}
    write_clip_tokenizer(out / "tokenizer")
    diffusers.FlowMatchEulerDiscreteScheduler(**FLOW_SCHEDULER).save_config(out / "scheduler")
    index = _mmdit_index(vae_class.__name__)
    if denoiser is not SD3Transformer2DModel:
        pipeline = {FluxTransformer2DModel: "FluxPipeline", SanaTransformer2DModel: "SanaPipeline"}[denoiser]
        index.update(_class_name=pipeline, transformer=["diffusers", denoiser.__name__])
    if preset == "tiny-flux":
        index.update(text_encoder_2=["transformers", "T5EncoderModel"],
                     tokenizer_2=["transformers", "PreTrainedTokenizerFast"])
    _write_json(out / "model_index.json", index)
    return info


# The tiny T5 encoder: the tiny CLIP text encoder's width (so the tiny UNet and MMDiT configs fit it), two
# layers, relative position buckets (no learned length limit: any --text-length).
TINY_T5 = dict(d_model=TINY_TEXT["hidden_size"], d_kv=16, d_ff=128, num_layers=2, num_heads=4,
               feed_forward_proj="relu", pad_token_id=0, eos_token_id=1, decoder_start_token_id=0)


def _write_tiny_t5(encoder: pathlib.Path, tokenizer: pathlib.Path, max_length: int = 64) -> int:
    """The tiny T5 encoder (random, seed 1) and its tokenizer trained on the sample captions; its vocabulary size."""
    import torch
    from transformers import T5Config, T5EncoderModel
    from diffusion.kit.t5_tokenizer import write_t5_tokenizer
    vocab = write_t5_tokenizer(tokenizer, max_length=max_length)
    torch.manual_seed(1)
    T5EncoderModel(T5Config(vocab_size=vocab, **TINY_T5)).save_pretrained(encoder)
    return vocab


def build_tiny_t5(out: pathlib.Path) -> dict:
    """A T5 text encoder (random, seeded) with its trained tokenizer, the tiny UNet and MMDiT, the fitted VAE."""
    import diffusers
    import torch
    from diffusers import SD3Transformer2DModel, UNet2DConditionModel
    from transformers import T5Config, T5EncoderModel
    from diffusion.kit.t5_tokenizer import write_t5_tokenizer

    vocab = write_t5_tokenizer(out / "tokenizer")
    torch.manual_seed(0)
    UNet2DConditionModel(**TINY_UNET).save_pretrained(out / "unet")
    torch.manual_seed(0)
    SD3Transformer2DModel(**TINY_MMDIT).save_pretrained(out / "transformer")
    torch.manual_seed(1)
    T5EncoderModel(T5Config(vocab_size=vocab, **TINY_T5)).save_pretrained(out / "text_encoder")
    fit = copy_tiny_vae(out / "vae")
    getattr(diffusers, SCHEDULER_CLASS)(**SCHEDULER).save_config(out / "scheduler")
    index = model_index()
    index.update(text_encoder=["transformers", "T5EncoderModel"], tokenizer=["transformers", "PreTrainedTokenizerFast"])
    _write_json(out / "model_index.json", index)
    return {"vae": "shipped", "vae_fit": fit, "vocab_size": vocab}


def build_mmdit_base(out: pathlib.Path) -> dict:
    """Configs only (as sd2-base): the micro-budget MMDiT, SD2's VAE and text encoder, a flow scheduler."""
    import diffusers
    import torch
    from diffusers import AutoencoderKL, SD3Transformer2DModel
    from transformers import CLIPTextConfig
    with torch.device("meta"):
        SD3Transformer2DModel(**MMDIT_BASE).save_config(out / "transformer")
        AutoencoderKL(**SD2_VAE).save_config(out / "vae")
    config = CLIPTextConfig(**SD2_TEXT)
    config.architectures = ["CLIPTextModel"]
    config.save_pretrained(out / "text_encoder")
    write_clip_tokenizer(out / "tokenizer")
    diffusers.FlowMatchEulerDiscreteScheduler(**FLOW_SCHEDULER).save_config(out / "scheduler")
    _write_json(out / "model_index.json", _mmdit_index())
    return {}


def build_flux_schnell(out: pathlib.Path) -> dict:
    """Configs only (as mmdit-base): Flux.1-schnell's transformer, its VAE, its two text encoders' configs in
    FluxPipeline's layout (CLIP-L in ``text_encoder/`` with the CLIP tokenizer, T5-XXL in ``text_encoder_2/``), a flow
    scheduler. The weights and T5's tokenizer come from the hub when converting (yamls/mlperf-flux/)."""
    import diffusers
    import torch
    from diffusers import AutoencoderKL, FluxTransformer2DModel
    from transformers import CLIPTextConfig, T5Config
    with torch.device("meta"):
        FluxTransformer2DModel(**FLUX_SCHNELL).save_config(out / "transformer")
        AutoencoderKL(**FLUX_VAE).save_config(out / "vae")
    for config, folder, architecture in ((CLIPTextConfig(**CLIP_L_TEXT), "text_encoder", "CLIPTextModel"),
                                         (T5Config(**T5_XXL), "text_encoder_2", "T5EncoderModel")):
        config.architectures = [architecture]
        config.save_pretrained(out / folder)
    write_clip_tokenizer(out / "tokenizer")
    diffusers.FlowMatchEulerDiscreteScheduler(**FLOW_SCHEDULER).save_config(out / "scheduler")
    index = _mmdit_index()
    index.update(_class_name="FluxPipeline", transformer=["diffusers", "FluxTransformer2DModel"],
                 text_encoder_2=["transformers", "T5EncoderModel"], tokenizer_2=["transformers", "T5TokenizerFast"])
    _write_json(out / "model_index.json", index)
    return {}


def build_tiny_clip(out: pathlib.Path) -> dict:
    """A tiny random CLIPModel with the CLIP tokenizer and a 64 px image processor in one directory."""
    import torch
    from transformers import CLIPConfig, CLIPImageProcessor, CLIPModel
    text = dict(hidden_size=32, intermediate_size=64, num_attention_heads=4, num_hidden_layers=2, **_TINY_TOKENS)
    vision = dict(image_size=64, patch_size=8, hidden_size=32, intermediate_size=64,
                  num_attention_heads=4, num_hidden_layers=2)
    torch.manual_seed(3)
    CLIPModel(CLIPConfig(text_config=text, vision_config=vision, projection_dim=32)).save_pretrained(out)
    write_clip_tokenizer(out)
    CLIPImageProcessor(size={"shortest_edge": 64}, crop_size={"height": 64, "width": 64}).save_pretrained(out)
    return {"heads": install_heads(out)}  # heads/: aesthetic, nsfw, watermark for the converter's --embed


HEADS_DIR = "heads"
HEAD_KINDS = ("aesthetic", "nsfw", "watermark")
# fitted by diffusion.kit.heads (python -m diffusion.kit.heads refits them; fitting takes a minute)
HEADS_ASSET = pathlib.Path(__file__).parent / "assets" / "tiny-clip-heads"


def install_heads(model_dir) -> dict:
    """Copy the shipped heads (:data:`HEADS_ASSET`, fitted by :func:`diffusion.kit.heads.fit_heads` to the tiny
    CLIP, which is seeded, so its embeddings and the fit never change) into ``model_dir/heads/``."""
    import json
    import shutil
    model_dir = pathlib.Path(model_dir)
    (model_dir / HEADS_DIR).mkdir(exist_ok=True)
    for kind in HEAD_KINDS:
        shutil.copyfile(HEADS_ASSET / f"{kind}.safetensors", model_dir / HEADS_DIR / f"{kind}.safetensors")
    return json.loads((HEADS_ASSET / "fit.json").read_text())


# The tiny captioner's vocabulary: BERT's special tokens (BLIP's tokenizer is BERT's), then words, so
# that even a random model's captions read as words.
CAPTIONER_SPECIAL = ("[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]")
CAPTIONER_WORDS = tuple("a an the photo picture painting drawing of with on in under and near red green blue yellow "
                        "white black orange purple grey circle square triangle stripe shape sky sun tree house field "
                        "grass water road cat dog bird small large bright dark".split())


def build_tiny_captioner(out: pathlib.Path) -> dict:
    """A tiny random BLIP captioner (``BlipForConditionalGeneration``, 64 px) with its processor: an
    image processor and a BERT tokenizer over :data:`CAPTIONER_WORDS`. Its word head never picks a
    special token, end of text included, so every caption is ``max_new_tokens`` words; its weights are
    initialised wide enough that different images get different captions."""
    import torch
    from transformers import (BertTokenizer, BlipConfig, BlipForConditionalGeneration, BlipImageProcessor,
                              BlipProcessor)
    out.mkdir(parents=True, exist_ok=True)
    vocab = out / "vocab.txt"
    vocab.write_text("\n".join(CAPTIONER_SPECIAL + CAPTIONER_WORDS) + "\n")
    tokenizer = BertTokenizer(str(vocab), model_max_length=32)
    pad, _, cls, sep, _ = range(len(CAPTIONER_SPECIAL))
    text = dict(vocab_size=len(CAPTIONER_SPECIAL) + len(CAPTIONER_WORDS), hidden_size=32, intermediate_size=64,
                num_attention_heads=4, num_hidden_layers=2, max_position_embeddings=32, encoder_hidden_size=32,
                bos_token_id=cls, eos_token_id=sep, sep_token_id=sep, pad_token_id=pad, initializer_range=0.2)
    vision = dict(image_size=64, patch_size=16, hidden_size=32, intermediate_size=64, num_attention_heads=4,
                  num_hidden_layers=2, initializer_range=0.02)  # BLIP's default, 1e-10, blinds a random model
    torch.manual_seed(4)
    model = BlipForConditionalGeneration(BlipConfig(text_config=text, vision_config=vision, projection_dim=32,
                                                    image_text_hidden_size=32))
    with torch.no_grad():  # the head's bias (tied to its output layer's), saved with the weights
        model.text_decoder.cls.predictions.bias[list(range(len(CAPTIONER_SPECIAL)))] = -1e4
    model.save_pretrained(out)
    vocab.unlink()  # the processor writes the tokenizer's files, vocab.txt among them
    BlipProcessor(image_processor=BlipImageProcessor(size={"height": 64, "width": 64}),
                  tokenizer=tokenizer).save_pretrained(out)
    return {}


def build_kit(preset: str, out, progress: bool = True, refit_vae: bool = False) -> pathlib.Path:
    """Write ``preset`` into ``out`` (not atomically; see :func:`ensure_kit`), stamp file last."""
    _check_preset(preset, refit_vae)
    out = pathlib.Path(out)
    out.mkdir(parents=True, exist_ok=True)
    start = time.perf_counter()
    if preset == "sd2-base":
        info = build_sd2_base(out)
    elif preset == "tiny":
        info = build_tiny(out, progress=progress, refit_vae=refit_vae)
    elif preset == "tiny-mmdit":
        info = build_tiny_mmdit(out)
    elif preset == "mmdit-base":
        info = build_mmdit_base(out)
    elif preset == "tiny-captioner":
        info = build_tiny_captioner(out)
    elif preset == "tiny-t5":
        info = build_tiny_t5(out)
    elif preset in ("tiny-vae16", "tiny-dcae", "tiny-flux", "tiny-sana"):
        info = build_tiny_latent_kit(out, preset)
    elif preset == "flux-schnell":
        info = build_flux_schnell(out)
    else:
        info = build_tiny_clip(out)
    stamp = {"preset": preset, "kit_version": kit_version(preset), "build_seconds": round(time.perf_counter() - start, 1),
             **info, "files": sorted(_files(out) | {STAMP})}
    _write_json(out / STAMP, stamp)
    return out


def _check_preset(preset: str, refit_vae: bool = False) -> None:
    if preset not in PRESETS:
        raise ValueError(f"unknown kit preset {preset!r}; choose one of {', '.join(PRESETS)}")
    if refit_vae and preset != "tiny":
        raise ValueError(f"refitting the VAE applies to the tiny preset only, not {preset!r}")


def _files(root: pathlib.Path) -> set[str]:
    """Every file (and symlink) under ``root``, as POSIX paths relative to it; links are not followed."""
    found = set()
    for parent, dirs, files in os.walk(root):
        rel = pathlib.Path(parent).relative_to(root)
        links = [d for d in dirs if os.path.islink(os.path.join(parent, d))]
        for name in files + links:
            found.add((rel / name).as_posix())
    return found


def read_stamp(out) -> dict | None:
    try:
        with open(pathlib.Path(out) / STAMP) as f:
            return json.load(f)
    except (OSError, ValueError):
        return None


def is_complete(preset: str, out) -> bool:
    """The kit ``preset`` of this kit version is at ``out``, its weight files whole (a copy cut short or
    damaged since, which every loader would refuse, is built again)."""
    stamp = read_stamp(out)
    if not (stamp and stamp.get("preset") == preset and stamp.get("kit_version") == kit_version(preset)):
        return False
    from diffusion.models.loading import check_weight_files
    try:
        for folder in sorted(p for p in pathlib.Path(out).iterdir() if p.is_dir()):
            check_weight_files(str(folder))
    except (UserError, OSError):  # a damaged file, or the kit being replaced under us: look again under the lock
        return False
    return True


@contextlib.contextmanager
def _build_lock(out: pathlib.Path):
    with open(out.parent / f".{out.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)


def _show(names, limit: int = 5) -> str:
    names = [n if n.isprintable() else ascii(n) for n in sorted(names)]
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names)} in all)" if len(names) > limit else "")


def _owned_files(out: pathlib.Path, preset: str, force: bool) -> list[str]:
    """The files of the existing kit at ``out`` that replacing it may delete, all of them ours.

    Raises :class:`KitError` when ``out`` is not one of our kits, when it holds files the kit did not
    write, or when it holds another preset's kit and ``force`` is not given.
    """
    if out.is_symlink():
        raise KitError(f"{out} is a symbolic link; give the folder it points to, or a new folder")
    if not out.is_dir():
        raise KitError(f"{out} exists and is not a folder; choose an empty or new folder")
    entries = [p.name for p in out.iterdir()]
    if not entries:
        return []
    stamp = read_stamp(out)
    found = stamp.get("preset") if isinstance(stamp, dict) else None
    if found not in PRESETS:
        raise KitError(f"{out} holds files that are not a model kit ({_show(entries)}); "
                       "choose an empty or new folder")
    present = _files(out)
    listed = stamp.get("files")
    if isinstance(listed, list):
        ours = {str(f) for f in listed} | {STAMP}
        foreign = present - ours
    else:  # stamped before kits listed their files: ours only if it holds nothing but the preset's entries
        foreign_entries = set(entries) - LEGACY_TOP_LEVEL[found]
        foreign = {f for f in present if f.split("/")[0] in foreign_entries}
    if foreign:
        raise KitError(f"{out} holds a {found} kit and files it did not write ({_show(foreign)}); "
                       "move them out or choose another folder")
    if found != preset and not force:
        raise KitError(f"{out} holds a {found} kit, not {preset}; use --force to replace it "
                       "or choose another folder")
    return sorted(present)


def _remove_kit(out: pathlib.Path, files: list[str]) -> None:
    """Delete the kit's own ``files`` and the folders they leave empty, then ``out`` itself."""
    try:
        for rel in files:
            (out / rel).unlink(missing_ok=True)
        for parent, _, _ in sorted(os.walk(out), key=lambda entry: -len(pathlib.Path(entry[0]).parts)):
            os.rmdir(parent)  # fails, leaving it, if anything not ours appeared meanwhile
    except OSError as e:
        raise KitError(f"{out}: could not remove the old kit ({e.strerror}: {e.filename})") from None


def ensure_kit(preset: str, out, progress: bool = True, force: bool = False, refit_vae: bool = False) -> pathlib.Path:
    """The kit ``preset`` at ``out``, built first if missing, incomplete or from an older kit version.

    ``force`` rebuilds a complete kit and may replace another preset's kit; ``refit_vae`` (tiny only)
    rebuilds with a VAE fitted here instead of the shipped one. Only the kit's own files are ever
    removed: see :func:`_owned_files` for what is refused with a :class:`KitError`.
    """
    _check_preset(preset, refit_vae)
    out = pathlib.Path(out).expanduser().absolute()
    rebuild = force or refit_vae
    if not rebuild and is_complete(preset, out):
        return out
    out.parent.mkdir(parents=True, exist_ok=True)
    with _build_lock(out):  # checks run under the lock: another process may be replacing the kit
        if not rebuild and is_complete(preset, out):  # another process built it while we waited
            return out
        if out.exists() or out.is_symlink():
            _owned_files(out, preset, force)  # refuse before spending time on a build
        prefix = f".{out.name}.building-"
        for stale in out.parent.glob(prefix + "*"):  # left by a killed build; we hold the lock now
            shutil.rmtree(stale, ignore_errors=True)
        building = pathlib.Path(tempfile.mkdtemp(prefix=prefix, dir=out.parent))
        try:
            building.chmod(0o755)  # mkdtemp makes it private; the cache is shared
            build_kit(preset, building, progress=progress, refit_vae=refit_vae)
            if out.exists() or out.is_symlink():  # a stale, other-preset or forced kit of ours
                _remove_kit(out, _owned_files(out, preset, force))  # checked again: it may have changed
            os.replace(building, out)
        finally:
            shutil.rmtree(building, ignore_errors=True)
    return out


DESCRIPTION = """Write an offline model kit: a diffusers-layout model directory built without hub access.

Presets: tiny (a CPU-fast SD-layout model: random seeded UNet and text encoder, the real CLIP tokenizer,
the shipped fitted tiny VAE), sd2-base (SD2-base's exact configs and tokenizer, no weights: the UNet is
trained from scratch, the VAE and text encoder weights come from the hub), tiny-clip (a tiny random
CLIPModel with tokenizer and image processor, for diffusion.evaluate), tiny-captioner (a tiny random
BLIP image-to-text model with its processor, for the converter's --recaption), tiny-t5 (a tiny random T5
text encoder with a tokenizer trained on the sample captions, the tiny UNet and MMDiT: long captions),
tiny-vae16 and tiny-dcae (the tiny MMDiT over a random 16-channel AutoencoderKL, or a random DC-AE),
tiny-flux (Flux.1's transformer at toy widths over a 16-channel AutoencoderKL fitted on the scenes), tiny-sana
(SANA's DiT at toy widths over a DC-AE fitted on the scenes), flux-schnell (configs only: MLPerf's Flux.1-schnell,
yamls/mlperf-flux/).
Input: the preset. Output: --out with unet/ vae/ text_encoder/ tokenizer/ scheduler/ model_index.json
(tiny-clip, tiny-captioner: a transformers model directory) and kit.json, which lists the files the kit wrote. An
existing complete kit is kept as it is; a folder holding other files is refused."""
EXAMPLES = """examples:
  python -m diffusion.kit --preset tiny --out .cache/kit/tiny          # what make demo and the tests use
  python -m diffusion.kit --preset sd2-base --out kits/sd2-base        # model.ref for yamls/sd2-base-256.yaml
  python -m diffusion.kit --preset tiny-clip --out .cache/kit/tiny-clip
  python -m diffusion.kit --preset tiny-mmdit --out .cache/kit/tiny-mmdit  # yamls/tiny-mmdit-flow-cpu.yaml
  python -m diffusion.kit --preset mmdit-base --out kits/mmdit-base       # yamls/micro-budget/
  python -m diffusion.kit --preset tiny-captioner --out .cache/kit/tiny-captioner  # --recaption offline
  python -m diffusion.kit --preset tiny-t5 --out .cache/kit/tiny-t5    # convert with --text-length 32
  python -m diffusion.kit --preset tiny-vae16 --out .cache/kit/tiny-vae16  # 16-channel latents (random VAE)
  python -m diffusion.kit --preset tiny-dcae --out .cache/kit/tiny-dcae    # DC-AE latents, /32 (random)
  python -m diffusion.kit --preset tiny-flux --out .cache/kit/tiny-flux    # FluxTransformer2DModel, 16 channels
  python -m diffusion.kit --preset tiny-sana --out .cache/kit/tiny-sana    # SanaTransformer2DModel on DC-AE
  python -m diffusion.kit --preset flux-schnell --out kits/flux-schnell   # yamls/mlperf-flux/ (configs only)"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m diffusion.kit", description=DESCRIPTION, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--preset", required=True, choices=PRESETS, help="which kit to write")
    parser.add_argument("--out", required=True, metavar="DIR",
                        help="output directory: new, empty, or one of our kits")
    parser.add_argument("--force", action="store_true",
                        help="rebuild even if a complete kit is there, or replace another preset's kit; "
                             "replaces only the kit's own files (listed in kit.json), never others")
    parser.add_argument("--refit-vae", action="store_true",
                        help="tiny preset: fit the VAE here (a few minutes on CPU) instead of copying "
                             "the shipped one")
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.refit_vae and args.preset != "tiny":
        parser.error("--refit-vae applies to the tiny preset only")
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise FileExistsError(errno.EEXIST, "--out is a file; give a directory for the kit", args.out)
    out = ensure_kit(args.preset, args.out, force=args.force, refit_vae=args.refit_vae)
    stamp = read_stamp(out) or {}
    stamp["files"] = len(stamp.get("files", ()))  # the list is in kit.json; a count is enough here
    print(json.dumps({"kit": str(out), **stamp}, indent=2))


if __name__ == "__main__":
    from diffusion import cli
    cli.run(main, "kit")
