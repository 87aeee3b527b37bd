"""Sampling: a trained denoiser plus the frozen parts of its model reference → images.

One path for every consumer (``diffusion.generate``, ``diffusion.evaluate``, the image-logging callback,
the demo): the diffusers pipeline of the denoiser's class (``StableDiffusionPipeline`` for the UNet,
``StableDiffusion3Pipeline`` for the MMDiT: :mod:`diffusion.models.denoisers`) assembled from the
denoiser being trained or loaded, the VAE, text encoder and tokenizer of the model reference
(:mod:`diffusion.models.loading`), and the scheduler of the objective it was trained with
(:mod:`diffusion.models.objectives`). What the model is comes from one
:class:`~diffusion.models.description.ModelDescription`, which checkpoints carry. The unconditional
input is the embedding of ``""`` padded to 77 tokens, exactly the empty-caption embedding training
substitutes for dropped captions.

DDPM objectives sample the noise schedule training used (zero terminal SNR included, with "trailing"
spacing and guidance rescale 0.7 by default, as Lin et al. 2023 do); checkpoints written before that was
recorded fall back to the model reference's scheduler config. Flow models sample with the flow-matching
Euler (or Heun) scheduler at the shift they were trained with.
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
from typing import TYPE_CHECKING

import torch

from diffusion.errors import ModelReferenceError, UserError
from diffusion.models import denoisers, loading
from diffusion.models.description import ModelDescription
from diffusion.models.objectives.ddpm import (SCHEDULERS as DDPM_SCHEDULERS, ZTSNR_GUIDANCE_RESCALE,  # noqa: F401
                                              default_guidance_rescale, load_sampling_scheduler,
                                              supports_zero_terminal_snr, with_training_schedule)
from diffusion.models.objectives.flow import SAMPLERS as FLOW_SCHEDULERS

if TYPE_CHECKING:
    from PIL import Image

SCHEDULERS = DDPM_SCHEDULERS + tuple(s for s in FLOW_SCHEDULERS if s not in DDPM_SCHEDULERS)


@dataclasses.dataclass
class TrainedModel:
    """A denoiser ready to sample with, and its description."""

    denoiser: torch.nn.Module
    description: ModelDescription
    ema_used: bool | None = None  # a Composer checkpoint's: whether its EMA weights were loaded; None for an export

    # the description's parts, for the callers that read them
    @property
    def model_ref(self) -> str:
        return self.description.model_ref

    @property
    def resolution(self) -> int | None:
        return self.description.resolution

    @property
    def noise_schedule(self) -> dict | None:
        return self.description.noise_schedule

    @property
    def prediction_type(self) -> str | None:
        return self.description.prediction_type

    @property
    def scaling_factor(self) -> float | None:
        return self.description.scaling_factor

    @property
    def zero_terminal_snr(self) -> bool:
        return self.description.zero_terminal_snr


def is_diffusers_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.exists(os.path.join(path, "model_index.json"))


def describe_reference(model_ref: str, *, prediction_type: str | None = None, noise_schedule: dict | None = None,
                       scaling_factor: float | None = None) -> ModelDescription:
    """The description of a diffusers directory or model reference as it stands: its denoiser's class and
    config, the objective its scheduler config samples (flow matching → ``flow``, else its prediction
    type and noise schedule), its VAE's scaling factor."""
    adapter = denoisers.adapter(denoisers.resolve_class(model_ref))
    config = adapter.load_config(model_ref)
    scheduler = _scheduler_config(loading.resolve_model(model_ref, components=()))
    if scheduler and scheduler.get("_class_name", "").startswith("FlowMatch"):
        objective, params = "flow", {"shift": float(scheduler.get("shift", 1.0)),
                                     "num_train_timesteps": int(scheduler.get("num_train_timesteps", 1000))}
    else:
        objective = prediction_type or (scheduler or {}).get("prediction_type") or "epsilon"
        params = {"noise_schedule": noise_schedule or (loading.noise_schedule_of(scheduler) if scheduler else None)}
    if scaling_factor is None:
        scaling_factor = loading.load_vae_config(model_ref).get("scaling_factor")
    root = loading.resolve_model(model_ref, components=())
    guided = _export_record(root).get("embedded_guidance") if config.get("guidance_embeds") else None
    return ModelDescription(model_ref=model_ref, denoiser=adapter.class_name, denoiser_config=config,
                            objective=objective, objective_params=params, scaling_factor=scaling_factor,
                            resolution=trained_resolution(root), text_dim=adapter.text_dim(config),
                            pooled_text=adapter.pooled_text and loading.pooled_text_slots(model_ref) is not None,
                            embedded_guidance=guided, **text_conditioning(root))


# Beside model_index.json in an export of a model trained with text masks or another text length, or of a
# transformer: how its denoiser reads text, the size it was trained at and (a guidance-distilled transformer)
# the guidance its embedding read (diffusers' configs have no place for them: the UNet's sample_size is that
# size, a transformer's is not read or changes its position embedding), so sampling the export conditions,
# draws and guides as trained.
TEXT_CONDITIONING = "text_conditioning.json"


def _export_record(root: str) -> dict:
    """A diffusers directory's :data:`TEXT_CONDITIONING`, or {}."""
    path = os.path.join(root, TEXT_CONDITIONING)
    if not os.path.isfile(path):
        return {}
    with open(path) as f:
        return json.load(f)


def text_conditioning(root: str) -> dict:
    """``{"text_mask": ..., "text_length": ...}`` of a diffusers directory's :data:`TEXT_CONDITIONING`, or {}."""
    data = _export_record(root)
    return {"text_mask": bool(data["text_mask"]), "text_length": int(data["text_length"])} if data else {}


def trained_resolution(root: str) -> int | None:
    """The training resolution in pixels a diffusers directory's :data:`TEXT_CONDITIONING` records, or None."""
    resolution = _export_record(root).get("resolution")
    return int(resolution) if resolution else None


def load_trained(checkpoint: str, *, model_ref: str | None = None, ema: bool = True) -> TrainedModel:
    """Load a denoiser from a Composer checkpoint (EMA weights by default) or a diffusers directory.

    ``model_ref`` overrides where the VAE, text encoder and tokenizer come from (default: the training
    run's model reference recorded in the checkpoint, or the diffusers directory itself). The objective
    and its schedule are the checkpoint's own (a diffusers directory's ``scheduler/`` config), whatever
    ``model_ref`` says; a Composer checkpoint written before checkpoints carried the noise schedule has
    none, and sampling falls back to the model reference's.
    """
    checkpoint = os.fspath(checkpoint)
    if is_diffusers_dir(checkpoint):
        description = describe_reference(checkpoint)
        denoiser = description.with_embedded_guidance(description.adapter.from_pretrained(checkpoint))
        if model_ref:
            description.model_ref = model_ref
        return TrainedModel(denoiser=denoiser.eval(), description=description)
    if os.path.isdir(checkpoint):
        raise FileNotFoundError(f"{checkpoint!r} is a directory without model_index.json: pass a Composer "
                                f"checkpoint file or a diffusers pipeline directory")
    from diffusion.models.checkpoint import load_denoiser
    denoiser, description, ema_used = load_denoiser(checkpoint, ema=ema)
    if model_ref:
        _check_text_encoder(model_ref, description)
        description.model_ref = model_ref
    return TrainedModel(denoiser=denoiser.eval(), description=description, ema_used=ema_used)


def _check_text_encoder(model_ref: str, description: ModelDescription) -> None:
    """A ``model_ref`` whose text encoder is of another kind than the one the checkpoint learned from (a T5 for
    a CLIP-trained model, of the same width) would condition it on embeddings it never saw: one line."""
    if not description.text_encoder_type:
        return
    theirs = loading.text_encoder_type(loading.load_text_encoder_config(model_ref))
    if theirs != description.text_encoder_type:
        names = loading.TEXT_ENCODERS
        raise UserError(f"--model {model_ref}: its text encoder is a {names.get(theirs, theirs)}, and this checkpoint "
                        f"was trained on a {names.get(description.text_encoder_type, description.text_encoder_type)}'s "
                        f"embeddings: give a model reference with that text encoder, or leave --model out")


def _scheduler_config(ref: str) -> dict | None:
    path = os.path.join(ref, "scheduler", "scheduler_config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def default_size(denoiser, model_ref: str) -> int:
    """Pixels per side the denoiser was built for: its latent ``sample_size`` times the VAE downsampling."""
    adapter = denoisers.adapter_for(denoiser)
    return adapter.sample_size(denoiser) * loading.vae_downsample(loading.load_vae_config(model_ref))


class Sampler:
    """The frozen parts of a model, loaded once; called with a denoiser to generate images.

    ``model`` is a :class:`~diffusion.models.description.ModelDescription` (a checkpoint's, or the
    model's being trained) or a model reference, described as it stands with ``prediction_type``,
    ``noise_schedule`` and ``scaling_factor`` replacing its own where given. ``scheduler`` names the
    sampler (:data:`SCHEDULERS`; None: the objective's first). The image logger keeps one and calls it
    at every eval with the current (EMA) denoiser.
    """

    def __init__(self, model: ModelDescription | str, *, scheduler: str | None = None,
                 scaling_factor: float | None = None, prediction_type: str | None = None,
                 noise_schedule: dict | None = None, dtype: torch.dtype | None = None):
        # dtype: the run's compute dtype (bf16 under amp_bf16). The text encoders are loaded and kept in it
        # (T5-XXL in fp32 is ~19 GB on every rank that samples) and sampling runs under autocast to it;
        # None: every frozen component follows the denoiser's dtype, as before.
        self.dtype = dtype
        if not isinstance(model, ModelDescription):
            model = describe_reference(model, prediction_type=prediction_type, noise_schedule=noise_schedule,
                                       scaling_factor=scaling_factor)
        self.description = model
        self.model_ref = model_ref = model.model_ref
        self.scheduler = sampling_scheduler(model, scheduler)  # a sampler the pipeline cannot drive: refused first
        self.space = space = model.space()  # the latent space training was in: what decoding inverts
        found = loading.latent_space_of(loading.load_vae_config(model_ref))
        if (found.autoencoder, found.channels, found.downsample) != (space.autoencoder, space.channels, space.downsample):
            raise ModelReferenceError(
                f"the model was trained in {space.describe()}, but the vae/ of {model_ref} is {found.describe()}: "
                f"give the model reference whose autoencoder made the training data")
        self.vae = loading.load_vae(model_ref)
        # Decode with the factors training used, whatever the VAE config says (exports carry them).
        self.vae.register_to_config(scaling_factor=float(space.scaling_factor))
        if space.shift_factor or self.vae.config.get("shift_factor") is not None:
            self.vae.register_to_config(shift_factor=float(space.shift_factor))
        self.text_encoder = loading.load_text_encoder(model_ref, dtype)
        self.tokenizer = loading.load_tokenizer(model_ref)
        self.pooled_encoder = self._pooled_encoder(model, dtype)

    @staticmethod
    def _pooled_encoder(model: ModelDescription, dtype=None):
        """(CLIP, its tokenizer) where the denoiser was trained on the model reference's second text encoder's
        pooled vector (Flux's layout), else None; a checkpoint and a reference that disagree are refused."""
        if not model.adapter.pooled_text:
            return None
        two = loading.pooled_text_slots(model.model_ref) is not None
        if two != bool(model.pooled_text):
            trained = ("CLIP's pooled vector beside T5's sequence" if model.pooled_text
                       else "one text encoder (the mean of its sequence as the pooled vector)")
            raise ModelReferenceError(
                f"the {model.denoiser} was trained on {trained}, but {model.model_ref} has "
                f"{'two text encoders' if two else 'one text encoder'}: give the model reference it was trained "
                f"with (--model)")
        return loading.load_pooled_text_encoder(model.model_ref, dtype) if two else None

    @property
    def zero_terminal_snr(self) -> bool:
        return bool(self.scheduler.config.get("rescale_betas_zero_snr"))

    def pipeline(self, denoiser):
        """The diffusers pipeline of ``denoiser``'s class around it (safety checker off). An autoencoder
        the pipeline cannot hold (DC-AE in an SD pipeline) is left out of it: :meth:`decode` decodes."""
        adapter = denoisers.adapter_for(denoiser)
        holds = self.space.autoencoder in adapter.pipeline_autoencoders
        pooled = {"pooled_encoder": self.pooled_encoder} if self.pooled_encoder is not None else {}
        pipe = adapter.pipeline(denoiser, vae=self.vae if holds else None, text_encoder=self.text_encoder,
                                tokenizer=self.tokenizer, scheduler=self.scheduler, **pooled)
        if not holds:  # the pipeline's latent size comes from the autoencoder's downsampling
            from diffusers.image_processor import VaeImageProcessor
            pipe.vae_scale_factor = self.space.downsample
            pipe.image_processor = VaeImageProcessor(vae_scale_factor=self.space.downsample)
        return pipe

    def decode(self, latents: torch.Tensor) -> torch.Tensor:
        """Images in [-1, 1] from the denoiser's latents: ``z = latent / scaling_factor + shift_factor``,
        the inverse of training's one scaling, through the autoencoder's decoder."""
        z = latents / self.space.scaling_factor
        if self.space.shift_factor:
            z = z + self.space.shift_factor
        return self.vae.decode(z.to(self.vae.dtype), return_dict=False)[0]

    @torch.no_grad()
    def __call__(self, denoiser, prompts, *, steps: int = 25, guidance_scale: float = 7.5,
                 guidance_rescale: float | None = None, negative_prompt: str | None = None, seed: int = 0,
                 size=None, images_per_prompt: int = 1, batch_size: int = 8, device=None,
                 progress: bool = False) -> list[Image.Image]:
        """Images for ``prompts`` in order (each prompt ``images_per_prompt`` times, consecutively).

        Image ``i`` starts from noise seeded with ``seed + i`` on the CPU, so it is the same whatever
        the batch size or device. ``guidance_rescale`` (φ in [0, 1], DDPM models) pulls the guided
        prediction's spread back toward the conditional one's; None: 0.7 for a zero-terminal-SNR
        schedule, else 0.
        """
        if guidance_rescale is None:
            guidance_rescale = default_guidance_rescale(self.zero_terminal_snr)
        elif guidance_rescale and self.description.objective == "flow":  # the flow pipelines take no such argument
            raise UserError(f"--guidance-rescale {guidance_rescale}: rescaling applies to DDPM models (epsilon or "
                            f"v-prediction); this checkpoint was trained with rectified flow, whose sampler has none")
        self.guidance_rescale = guidance_rescale  # what this call applied (the protocol's record)
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            raise ValueError("no prompts to sample")
        if size is None:  # the denoiser config's size
            size = denoisers.adapter_for(denoiser).sample_size(denoiser) * self.space.downsample
        self.size = size  # what this call drew (the protocol's record)
        height, width = _size_pair(size)
        _check_size(height, width, getattr(denoiser, "config", None), self.space.downsample,
                    denoisers.adapter_for(denoiser).packing)
        first = next(denoiser.parameters())
        device = torch.device(device) if device is not None else first.device
        encoders = self.dtype or first.dtype
        for frozen, dtype in ((self.vae, first.dtype), (self.text_encoder, encoders),
                              *((e, encoders) for e in (self.pooled_encoder or ())[:1])):
            if (frozen.device, frozen.dtype) != (device, dtype):
                frozen.to(device=device, dtype=dtype)
        pipe = self.pipeline(denoiser)
        adapter = denoisers.adapter_for(denoiser)
        length, masked = self.description.text_length, self.description.text_mask
        if masked:
            adapter.enable_text_mask(denoiser)
        pipe.set_progress_bar_config(disable=not progress)
        expanded = [p for p in prompts for _ in range(images_per_prompt)]
        images = []
        with _eval_mode(denoiser), _autocast(device, first.dtype, self.dtype):
            for start in range(0, len(expanded), batch_size):
                chunk = expanded[start:start + batch_size]
                generators = [torch.Generator("cpu").manual_seed(seed + start + i) for i in range(len(chunk))]
                kwargs = adapter.prompt_kwargs(pipe, chunk, negative_prompt, guidance_rescale, length, masked)
                with adapter.text_mask_hook(denoiser, kwargs.pop("text_masks", None)):
                    out = pipe(**kwargs, height=height, width=width, num_inference_steps=steps,
                               **adapter.call_kwargs(guidance_scale, denoiser), generator=generators, output_type="latent")
                # decoded here, not by the pipeline: one decoding (shift included) for every pipeline
                images.extend(pipe.image_processor.postprocess(self.decode(adapter.unpack(pipe, out.images, height, width)),
                                                               output_type="pil"))
        return images


def sampling_scheduler(model: ModelDescription, name: str | None = None, flag: str = "--scheduler"):
    """The diffusers scheduler ``name`` (:data:`SCHEDULERS`; None: the objective's first) that samples ``model`` as
    trained; one the denoiser's pipeline cannot drive is refused in one line naming ``flag``: FluxPipeline always
    sets sigmas of its own, which a scheduler whose ``set_timesteps`` takes none (flow-matching Heun) refuses, as
    diffusers' ``retrieve_timesteps`` asks, only once sampling has begun."""
    objective = model.build_objective()
    name = objective.check_sampler(name)
    build = lambda sampler: objective.sampling_scheduler(model.model_ref, sampler)  # noqa: E731
    takes_sigmas = lambda scheduler: "sigmas" in inspect.signature(scheduler.set_timesteps).parameters  # noqa: E731
    scheduler = build(name)
    if model.adapter.passes_sigmas and not takes_sigmas(scheduler):
        usable = [s for s in objective.samplers if takes_sigmas(build(s))]
        raise UserError(f"{flag} {name}: the {model.denoiser}'s pipeline sets the sampler's sigmas itself, and "
                        f"{type(scheduler).__name__} takes none: it samples with {', '.join(usable)}")
    return scheduler


def sample_images(denoiser, model: ModelDescription | str, prompts, *, scheduler: str | None = None,
                  scaling_factor: float | None = None, prediction_type: str | None = None,
                  noise_schedule: dict | None = None, **kwargs) -> list[Image.Image]:
    """One-shot :class:`Sampler`: load the frozen components, generate, return PIL images."""
    sampler = Sampler(model, scheduler=scheduler, scaling_factor=scaling_factor,
                      prediction_type=prediction_type, noise_schedule=noise_schedule)
    return sampler(denoiser, prompts, **kwargs)


def _size_pair(size) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    height, width = (int(s) for s in size)
    return height, width


def _check_size(height: int, width: int, config, downsample: int, packing: int = 1) -> None:
    """Refuse, before any memory is spent, an image size the denoiser cannot sample: a side that is not a
    whole number of its patches of latent pixels (the config's, times the ``packing`` of its pipeline: Flux's 2x2,
    which FluxPipeline would round down without a word), or more patches than an MMDiT's positional table holds
    (diffusers would refuse both only after embedding the latents: 23 GB at 100000 px)."""
    patch = int(getattr(config, "patch_size", None) or 1) * packing
    step = downsample * patch
    if height < step or width < step or height % step or width % step:
        fit = lambda side: max(step, side // step * step)  # noqa: E731
        raise UserError(f"image size {height}x{width} (height x width): each side must be a multiple of {step} px "
                        f"for this model ({downsample}x autoencoder" + (f", {patch}x{patch} patches" if patch > 1
                        else "") + f"), e.g. {fit(height)}x{fit(width)}")
    table = getattr(config, "pos_embed_max_size", None)
    if table and max(height, width) > table * step:
        raise UserError(f"image size {height}x{width} (height x width): this model's positional table covers at "
                        f"most {table * step} px a side ({table} patches of {step} px)")


@contextlib.contextmanager
def _eval_mode(module):
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def _autocast(device: torch.device, dtype: torch.dtype, compute: torch.dtype | None = None):
    if compute is not None and compute != dtype:  # encoders kept in the run's compute dtype
        return torch.autocast(device.type, dtype=compute)
    # On GPUs a float32 UNet (as trained under amp) samples in bf16, as in training.
    if device.type == "cuda" and dtype == torch.float32:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
