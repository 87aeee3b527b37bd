"""Sampling: a trained UNet plus the frozen parts of its model reference → images.

One path for every consumer (``diffusion.generate``, ``diffusion.evaluate``, the image-logging callback,
the demo): a diffusers ``StableDiffusionPipeline`` assembled from the UNet being trained or loaded and
the VAE, text encoder, tokenizer and scheduler of the model reference (:mod:`diffusion.models.loading`).
With ``negative_prompt=None`` the pipeline's unconditional input is the embedding of ``""`` padded to 77
tokens, which is exactly the empty-caption embedding training substitutes for dropped captions.

The noise schedule is the one training used: a checkpoint carries it (``noise_schedule`` in the model's
extra state: betas, and ``rescale_betas_zero_snr`` when trained with zero terminal SNR); checkpoints
written before that fall back to the model reference's scheduler config. A zero-terminal-SNR schedule
is sampled as Lin et al. (2023, "Common Diffusion Noise Schedules and Sample Steps are Flawed") do:
"trailing" timestep spacing, so the first step is the last training timestep (pure noise, ᾱ = 0), and
classifier-free guidance rescaled by ``guidance_rescale`` (default 0.7; 0 for other schedules).
"""

from __future__ import annotations

import contextlib
import dataclasses
import inspect
import json
import os
from typing import TYPE_CHECKING

import torch

from diffusion.models import loading

if TYPE_CHECKING:
    from PIL import Image

SCHEDULERS = ("ddim", "euler", "dpm++")
ZTSNR_GUIDANCE_RESCALE = 0.7  # the paper's φ for zero-terminal-SNR models


def default_guidance_rescale(zero_terminal_snr: bool) -> float:
    """``guidance_rescale`` when none is given: 0.7 for a zero-terminal-SNR model, else 0 (off)."""
    return ZTSNR_GUIDANCE_RESCALE if zero_terminal_snr else 0.0


@dataclasses.dataclass
class TrainedModel:
    """A UNet ready to sample with, and what decoding its latents needs to agree with training."""

    unet: torch.nn.Module
    model_ref: str  # VAE, text encoder, tokenizer and scheduler come from here
    scaling_factor: float | None  # VAE latent scaling factor used in training (None: the VAE config's)
    prediction_type: str | None  # "epsilon" or "v_prediction" (None: the scheduler config's)
    resolution: int | None = None  # training resolution in pixels, the default sample size
    ema_used: bool = False
    # the training noise schedule (loading.SCHEDULE_KEYS); None: the model reference's (older checkpoints)
    noise_schedule: dict | None = None

    @property
    def zero_terminal_snr(self) -> bool:
        return bool(self.noise_schedule and self.noise_schedule.get("rescale_betas_zero_snr"))


def is_diffusers_dir(path: str) -> bool:
    return os.path.isdir(path) and os.path.exists(os.path.join(path, "model_index.json"))


def load_trained(checkpoint: str, *, model_ref: str | None = None, ema: bool = True) -> TrainedModel:
    """Load a UNet from a Composer checkpoint (EMA weights by default) or a diffusers directory.

    ``model_ref`` overrides where the VAE, text encoder and tokenizer come from (default: the training
    run's model reference recorded in the checkpoint, or the diffusers directory itself). The noise
    schedule is the checkpoint's own (a diffusers directory's ``scheduler/`` config), whatever
    ``model_ref`` says; a Composer checkpoint written before checkpoints carried it has none, and
    sampling falls back to the model reference's.
    """
    checkpoint = os.fspath(checkpoint)
    if is_diffusers_dir(checkpoint):
        from diffusers import UNet2DConditionModel
        unet = UNet2DConditionModel.from_pretrained(os.path.join(checkpoint, "unet"))
        ref = model_ref or checkpoint
        config = _scheduler_config(checkpoint)
        return TrainedModel(unet=unet.eval(), model_ref=ref,
                            scaling_factor=loading.load_vae_config(checkpoint).get("scaling_factor"),
                            prediction_type=config.get("prediction_type") if config else None,
                            noise_schedule=loading.noise_schedule_of(config) if config else None)
    if os.path.isdir(checkpoint):
        raise FileNotFoundError(f"{checkpoint!r} is a directory without model_index.json: pass a Composer "
                                f"checkpoint file or a diffusers pipeline directory")
    from diffusion.models.checkpoint import load_unet
    unet, info = load_unet(checkpoint, ema=ema)
    return TrainedModel(unet=unet.eval(), model_ref=model_ref or info["model_ref"],
                        scaling_factor=info.get("scaling_factor"), prediction_type=info.get("prediction_type"),
                        resolution=info.get("resolution"), ema_used=bool(info.get("ema_used")),
                        noise_schedule=info.get("noise_schedule"))


def _scheduler_config(ref: str) -> dict | None:
    path = os.path.join(ref, "scheduler", "scheduler_config.json")
    if not os.path.exists(path):
        return None
    with open(path) as f:
        return json.load(f)


def default_size(unet, model_ref: str) -> int:
    """Pixels per side the UNet was built for: its latent ``sample_size`` times the VAE downsampling."""
    return int(unet.config.sample_size) * loading.vae_downsample(loading.load_vae_config(model_ref))


def load_sampling_scheduler(model_ref: str, name: str = "ddim", prediction_type: str | None = None,
                            noise_schedule: dict | None = None):
    """A sampler of the training noise schedule, predicting what the UNet was trained to predict.

    ``noise_schedule`` (a checkpoint's, :func:`diffusion.models.loading.noise_schedule_of`) replaces
    the schedule of ``model_ref``'s scheduler config; None keeps it (checkpoints that do not carry one).
    """
    if name not in SCHEDULERS:
        raise ValueError(f"unknown scheduler {name!r}; choose one of {', '.join(SCHEDULERS)}")
    scheduler = loading.load_scheduler(model_ref, name)
    extra = {"algorithm_type": "dpmsolver++"} if name == "dpm++" else {}
    return with_training_schedule(type(scheduler), scheduler.config, noise_schedule, prediction_type, **extra)


def supports_zero_terminal_snr(scheduler_class) -> bool:
    """Whether a diffusers scheduler class can rescale its betas to zero terminal SNR."""
    return "rescale_betas_zero_snr" in inspect.signature(scheduler_class.__init__).parameters


def with_training_schedule(scheduler_class, config, noise_schedule: dict | None = None,
                           prediction_type: str | None = None, **overrides):
    """``scheduler_class`` built from ``config`` with the training noise schedule and prediction type.

    A zero-terminal-SNR schedule also gets "trailing" timestep spacing: its first sampling step is the
    last training timestep, where training saw pure noise (with the reference's "leading" spacing DDIM
    would start at t = 961, whose ᾱ is not 0, from noise that is).
    """
    config = dict(config)
    if noise_schedule:
        overrides.update({k: v for k, v in noise_schedule.items() if k in loading.SCHEDULE_KEYS})
    if prediction_type:
        overrides["prediction_type"] = prediction_type
    if overrides.get("rescale_betas_zero_snr", config.get("rescale_betas_zero_snr")):
        if not supports_zero_terminal_snr(scheduler_class):
            raise ValueError(f"{scheduler_class.__name__} cannot sample a zero-terminal-SNR schedule "
                             f"(no rescale_betas_zero_snr); use one of {', '.join(SCHEDULERS)}")
        overrides["timestep_spacing"] = "trailing"
    return scheduler_class.from_config(config, **overrides)


class Sampler:
    """The frozen parts of a model reference, loaded once; called with a UNet to generate images.

    The image logger keeps one and calls it at every eval with the current (EMA) UNet. ``noise_schedule``
    is the training schedule a checkpoint carries (None: ``model_ref``'s scheduler config).
    """

    def __init__(self, model_ref: str, *, scheduler: str = "ddim", scaling_factor: float | None = None,
                 prediction_type: str | None = None, noise_schedule: dict | None = None):
        self.model_ref = model_ref
        self.vae = loading.load_vae(model_ref)
        if scaling_factor is not None:
            # Decode with the factor training multiplied by, whatever the VAE config says.
            self.vae.register_to_config(scaling_factor=float(scaling_factor))
        self.text_encoder = loading.load_text_encoder(model_ref)
        self.tokenizer = loading.load_tokenizer(model_ref)
        self.scheduler = load_sampling_scheduler(model_ref, scheduler, prediction_type, noise_schedule)

    @property
    def zero_terminal_snr(self) -> bool:
        return bool(self.scheduler.config.get("rescale_betas_zero_snr"))

    def pipeline(self, unet):
        """A ``StableDiffusionPipeline`` around ``unet`` (safety checker off)."""
        from diffusers import StableDiffusionPipeline
        return StableDiffusionPipeline(vae=self.vae, text_encoder=self.text_encoder, tokenizer=self.tokenizer,
                                       unet=unet, scheduler=self.scheduler, safety_checker=None,
                                       feature_extractor=None, requires_safety_checker=False)

    @torch.no_grad()
    def __call__(self, unet, prompts, *, steps: int = 25, guidance_scale: float = 7.5,
                 guidance_rescale: float | None = None, negative_prompt: str | None = None, seed: int = 0,
                 size=None, images_per_prompt: int = 1, batch_size: int = 8, device=None,
                 progress: bool = False) -> list[Image.Image]:
        """Images for ``prompts`` in order (each prompt ``images_per_prompt`` times, consecutively).

        Image ``i`` starts from noise seeded with ``seed + i`` on the CPU, so it is the same whatever
        the batch size or device. ``guidance_rescale`` (φ in [0, 1]) pulls the guided prediction's
        spread back toward the conditional one's; None: 0.7 for a zero-terminal-SNR schedule, else 0.
        """
        if guidance_rescale is None:
            guidance_rescale = default_guidance_rescale(self.zero_terminal_snr)
        prompts = [prompts] if isinstance(prompts, str) else list(prompts)
        if not prompts:
            raise ValueError("no prompts to sample")
        height, width = _size_pair(size if size is not None else default_size(unet, self.model_ref))
        first = next(unet.parameters())
        device = torch.device(device) if device is not None else first.device
        for frozen in (self.vae, self.text_encoder):
            if (frozen.device, frozen.dtype) != (device, first.dtype):
                frozen.to(device=device, dtype=first.dtype)
        pipe = self.pipeline(unet)
        pipe.set_progress_bar_config(disable=not progress)
        expanded = [p for p in prompts for _ in range(images_per_prompt)]
        images = []
        with _eval_mode(unet), _autocast(device, first.dtype):
            for start in range(0, len(expanded), batch_size):
                chunk = expanded[start:start + batch_size]
                generators = [torch.Generator("cpu").manual_seed(seed + start + i) for i in range(len(chunk))]
                out = pipe(chunk, height=height, width=width, num_inference_steps=steps,
                           guidance_scale=guidance_scale, guidance_rescale=guidance_rescale,
                           negative_prompt=[negative_prompt] * len(chunk) if negative_prompt else None,
                           generator=generators, output_type="pil")
                images.extend(out.images)
        return images


def sample_images(unet, model_ref: str, prompts, *, scheduler: str = "ddim", scaling_factor: float | None = None,
                  prediction_type: str | None = None, noise_schedule: dict | None = None,
                  **kwargs) -> list[Image.Image]:
    """One-shot :class:`Sampler`: load the frozen components, generate, return PIL images."""
    sampler = Sampler(model_ref, scheduler=scheduler, scaling_factor=scaling_factor,
                      prediction_type=prediction_type, noise_schedule=noise_schedule)
    return sampler(unet, prompts, **kwargs)


def _size_pair(size) -> tuple[int, int]:
    if isinstance(size, int):
        return size, size
    height, width = (int(s) for s in size)
    return height, width


@contextlib.contextmanager
def _eval_mode(module):
    was_training = module.training
    module.eval()
    try:
        yield
    finally:
        module.train(was_training)


def _autocast(device: torch.device, dtype: torch.dtype):
    # On GPUs a float32 UNet (as trained under amp) samples in bf16, as in training.
    if device.type == "cuda" and dtype == torch.float32:
        return torch.autocast("cuda", dtype=torch.bfloat16)
    return contextlib.nullcontext()
