"""The ComposerModel: a diffusers UNet trained to denoise latents drawn from stored VAE moments.

One training step, per sample: latent = (mean + σ·ε_z) · scaling_factor  (the ONLY place latents are
scaled), noise ε ~ N(0, I) (+ optional offset), t ~ U{0..T-1}, x_t = √ᾱ_t·latent + √(1-ᾱ_t)·ε,
loss = MSE(UNet(x_t, t, text), target) with target = ε (epsilon) or v, optionally min-SNR-γ weighted.
The random numbers come with the batch, drawn per sample from (seed, epoch, key) by the loader
(:class:`diffusion.train.batches.NoiseDraws`): the step is the same whatever the microbatch size or
the number of ranks, and the forward has no generator or host sync for ``torch.compile`` to break on.
Eval uses the same path with noise and timesteps pinned per held-out sample, so evals are comparable.
The conditioning is the batch's text embeddings, or, from a dataset of token ids, the frozen text
encoder's output on the batch's ids (:mod:`diffusion.models.text_encoder`), computed in the step.
"""

from __future__ import annotations

import functools
import json
import os
import warnings

import torch
import torch.nn.functional as F
from composer.models import ComposerModel
from torchmetrics import MeanMetric

from diffusion import schema
from diffusion.models import loading
from diffusion.models.text_encoder import FrozenTextEncoder

# Modules FSDP wraps (and activation checkpointing recomputes) one by one: by name, so the wrapping
# survives diffusers moving classes between modules.
_BLOCKS = frozenset({"ResnetBlock2D", "BasicTransformerBlock"})
EXTRA_STATE_KEYS = ("model_ref", "unet_config", "scaling_factor", "prediction_type", "resolution", "text_dim",
                    "noise_schedule")


class StableDiffusion(ComposerModel):
    """``forward`` noises a batch of moments; ``loss`` is the (weighted) MSE to the prediction target."""

    def __init__(self, unet, noise_scheduler, *, scaling_factor: float, model_ref: str, resolution: int,
                 downsample: int = 8, prediction_type: str | None = None, offset_noise: float = 0.0,
                 min_snr_gamma: float | None = None, input_perturbation: float = 0.0, eval_seed: int = 0,
                 text_encoder: FrozenTextEncoder | None = None):
        super().__init__()
        self.unet = unet
        self.text_encoder = text_encoder  # not a submodule: see diffusion.models.text_encoder
        self.model_ref = model_ref
        self.scaling_factor = float(scaling_factor)
        self.resolution = int(resolution)
        self.latent_size = self.resolution // downsample
        self.text_dim = int(unet.config.cross_attention_dim)
        self.prediction_type = prediction_type or noise_scheduler.config.prediction_type
        if self.prediction_type not in ("epsilon", "v_prediction"):
            raise ValueError(f"prediction_type {self.prediction_type!r}: only epsilon and v_prediction are trained")
        self.num_timesteps = int(noise_scheduler.config.num_train_timesteps)
        self.offset_noise = offset_noise
        self.min_snr_gamma = min_snr_gamma
        self.input_perturbation = input_perturbation
        self.eval_seed = eval_seed
        # Carried in checkpoints (get_extra_state): samplers and export rebuild exactly this schedule.
        self.noise_schedule = loading.noise_schedule_of(noise_scheduler.config)
        alphas_cumprod = noise_scheduler.alphas_cumprod.to(torch.float64)
        # Not persistent: the schedule is rebuilt from the model reference, not carried in checkpoints.
        self.register_buffer("sqrt_alphas_cumprod", alphas_cumprod.sqrt().float(), persistent=False)
        self.register_buffer("sqrt_one_minus_alphas_cumprod", (1 - alphas_cumprod).sqrt().float(), persistent=False)
        self.register_buffer("snr", (alphas_cumprod / (1 - alphas_cumprod)).float(), persistent=False)
        # Checkpoints written before the noise moved into the batch hold a step counter: not needed now.
        self._register_load_state_dict_pre_hook(_drop_noise_step)
        self.loaded_extra_state: dict | None = None
        # Composer's FSDP and activation checkpointing ask the root's children for these.
        unet.fsdp_wrap_fn = _is_block
        unet.activation_checkpointing_fn = _is_block

    # ---- the one place latents are scaled ------------------------------------------------------------
    def sample_latents(self, moments: torch.Tensor, generator=None, eps: torch.Tensor | None = None) -> torch.Tensor:
        """Draw a latent from the stored posterior moments (with ``eps`` as the standard normal draw
        when given) and scale it for the UNet."""
        if moments.shape[1:] != (2 * schema.LATENT_CHANNELS, self.latent_size, self.latent_size):
            raise ValueError(f"moments of shape {tuple(moments.shape[1:])} do not fit a {self.resolution}px model "
                             f"(expected {(2 * schema.LATENT_CHANNELS, self.latent_size, self.latent_size)})")
        mean, logvar = moments.float().chunk(2, dim=1)
        std = torch.exp(0.5 * logvar.clamp(-30.0, 20.0))
        if eps is None:
            eps = _randn(mean.shape, generator, mean.device)
        return (mean + std * eps) * self.scaling_factor

    # ---- training ------------------------------------------------------------------------------------
    def forward(self, batch: dict) -> dict:
        moments = batch[schema.BATCH_MOMENTS]
        latents = self.sample_latents(moments, eps=self._draw(batch, schema.BATCH_POSTERIOR_NOISE, moments))
        noise = self._draw(batch, schema.BATCH_NOISE, moments)
        if self.offset_noise:
            noise = noise + self.offset_noise * self._draw(batch, schema.BATCH_OFFSET_NOISE, moments)[..., None, None]
        timesteps = (self._draw(batch, schema.BATCH_TIMESTEP_DRAW, moments) * self.num_timesteps).long()
        timesteps = timesteps.clamp(0, self.num_timesteps - 1)
        perturbed = noise
        if self.input_perturbation and self.training:
            perturbed = noise + self.input_perturbation * self._draw(batch, schema.BATCH_PERTURBATION_NOISE, moments)
        return self._denoise(latents, noise, perturbed, timesteps, self.conditioning(batch))

    def conditioning(self, batch: dict) -> torch.Tensor:
        """The batch's text embeddings: stored ones, or the frozen text encoder's output on its token ids."""
        if schema.BATCH_TEXT_EMBEDS in batch:
            return batch[schema.BATCH_TEXT_EMBEDS]
        if self.text_encoder is None:
            raise ValueError("the batch holds token ids but no text embeddings, and this model has no text encoder "
                             "to encode them (model.text=ids builds one)")
        return self.text_encoder(batch[schema.BATCH_INPUT_IDS])

    @staticmethod
    def _draw(batch: dict, name: str, moments: torch.Tensor) -> torch.Tensor:
        """The batch's per-sample draw ``name``; a batch built by hand without them gets fresh ones."""
        if name in batch:
            return batch[name].to(device=moments.device, dtype=torch.float32)
        n, latent_channels = moments.shape[0], moments.shape[1] // 2
        if name == schema.BATCH_TIMESTEP_DRAW:
            return torch.rand(n, device=moments.device)
        if name == schema.BATCH_OFFSET_NOISE:
            return torch.randn(n, latent_channels, device=moments.device)
        return torch.randn(n, latent_channels, *moments.shape[2:], device=moments.device)

    def _denoise(self, latents, noise, input_noise, timesteps, text_embeds) -> dict:
        a = self.sqrt_alphas_cumprod[timesteps].view(-1, 1, 1, 1)
        s = self.sqrt_one_minus_alphas_cumprod[timesteps].view(-1, 1, 1, 1)
        noisy = a * latents + s * input_noise
        target = noise if self.prediction_type == "epsilon" else a * noise - s * latents
        prediction = self.unet(noisy, timesteps, text_embeds.to(noisy.dtype)).sample
        return {"prediction": prediction, "target": target, "timesteps": timesteps, "noise": noise,
                "latents": latents}

    def loss(self, outputs: dict, batch: dict) -> torch.Tensor:
        per_sample = _per_sample_mse(outputs)
        if self.min_snr_gamma:
            snr = self.snr[outputs["timesteps"]]
            clipped = snr.clamp(max=self.min_snr_gamma)
            weight = clipped / (snr + 1) if self.prediction_type == "v_prediction" else clipped / snr.clamp(min=1e-8)
            per_sample = per_sample * weight
        return per_sample.mean()

    # ---- evaluation: pinned noise and timesteps per held-out sample ----------------------------------
    def eval_forward(self, batch: dict, outputs=None) -> dict:
        if outputs is not None:
            return outputs
        moments = batch[schema.BATCH_MOMENTS]
        indices = batch.get(schema.BATCH_SAMPLE_INDEX)
        if indices is None:  # a source without indices: pin by position in the batch
            indices = torch.arange(moments.shape[0])
        latents, noise, timesteps = [], [], []
        for i, index in enumerate(indices.tolist()):
            g = torch.Generator().manual_seed(self.eval_seed * 1_000_003 + int(index))
            latents.append(self.sample_latents(moments[i:i + 1], generator=g))
            noise.append(_randn(latents[-1].shape, g, moments.device))
            timesteps.append(torch.randint(0, self.num_timesteps, (1,), generator=g))
        latents, noise = torch.cat(latents), torch.cat(noise)
        timesteps = torch.cat(timesteps).to(moments.device)
        with torch.no_grad():
            return self._denoise(latents, noise, noise, timesteps, self.conditioning(batch))

    def get_metrics(self, is_train: bool = False) -> dict:
        return {} if is_train else {"loss": MeanMetric()}

    def update_metric(self, batch, outputs, metric) -> None:
        per_sample = _per_sample_mse(outputs)
        metric.update(per_sample.mean(), weight=per_sample.numel())

    # ---- throughput ------------------------------------------------------------------------------------
    def flops_per_batch(self, batch: dict) -> float:
        """UNet training FLOPs of ``batch``: forward + backward ≈ 3 × forward (for SpeedMonitor's MFU)."""
        per_image = unet_forward_flops(json.dumps(dict(self.unet.config), sort_keys=True, default=str),
                                       self.latent_size)
        return 3.0 * per_image * batch[schema.BATCH_MOMENTS].shape[0]

    # ---- self-description in checkpoints ---------------------------------------------------------------
    def get_extra_state(self) -> dict:
        """What sampling and export need to rebuild this model: ``noise_schedule`` is the training noise
        schedule (:func:`diffusion.models.loading.noise_schedule_of`, zero terminal SNR included), so
        samplers use the betas training used, not just the model reference's."""
        schedule = self.noise_schedule
        return {"model_ref": self.model_ref, "unet_config": dict(self.unet.config),
                "scaling_factor": self.scaling_factor, "prediction_type": self.prediction_type,
                "resolution": self.resolution, "text_dim": self.text_dim,
                "noise_schedule": dict(schedule) if schedule else None}

    def set_extra_state(self, state: dict) -> None:
        """Keep this model's settings (phase 2 loads phase-1 weights at a new resolution); check they fit."""
        self.loaded_extra_state = dict(state)
        if state.get("text_dim") not in (None, self.text_dim):
            raise ValueError(f"checkpoint was trained with text_dim {state['text_dim']}, this model has {self.text_dim}")
        for key in ("scaling_factor", "prediction_type", "noise_schedule"):
            if state.get(key) not in (None, getattr(self, key)):
                warnings.warn(f"checkpoint {key}={state[key]!r} differs from this run's {getattr(self, key)!r}")


def _is_block(module: torch.nn.Module) -> bool:
    return type(module).__name__ in _BLOCKS


def _drop_noise_step(state_dict, prefix, *args) -> None:
    state_dict.pop(prefix + "noise_step", None)


def _randn(shape, generator, device) -> torch.Tensor:
    if generator is None:
        return torch.randn(shape, device=device)
    # a CPU generator (eval) gives the same numbers on any device
    return torch.randn(shape, generator=generator, device=generator.device).to(device)


def _per_sample_mse(outputs: dict) -> torch.Tensor:
    return F.mse_loss(outputs["prediction"].float(), outputs["target"].float(), reduction="none").mean(dim=(1, 2, 3))


@functools.lru_cache(maxsize=16)
def unet_forward_flops(unet_config_json: str, latent_size: int) -> int:
    """FLOPs of one image's UNet forward, counted by torch on the meta device (no memory, no compute)."""
    from diffusers import UNet2DConditionModel
    from torch.utils.flop_counter import FlopCounterMode
    config = json.loads(unet_config_json)
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(config)
        sample = torch.empty(1, config["in_channels"], latent_size, latent_size)
        text = torch.empty(1, schema.MAX_TOKENS, config["cross_attention_dim"])
        timestep = torch.zeros(1, dtype=torch.long)
    with FlopCounterMode(display=False) as counter, torch.no_grad():
        unet(sample, timestep, text)
    return counter.get_total_flops()


# ---- building ---------------------------------------------------------------------------------------

def build_unet(model_ref: str, pretrained: str | None = None, seed: int = 0):
    """The UNet of ``model_ref``'s config with random init from ``seed``, or the weights of ``pretrained``."""
    from diffusers import UNet2DConditionModel
    if pretrained:
        path = pretrained
        if not os.path.isfile(os.path.join(path, "config.json")):
            path = os.path.join(loading.resolve_model(pretrained, components=("unet",)), "unet")
        return UNet2DConditionModel.from_pretrained(path)
    # The same seed gives the same initial weights on every rank and every run; the global RNG is
    # left as it was.
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        return UNet2DConditionModel.from_config(loading.load_unet_config(model_ref))


def build_noise_scheduler(model_ref: str, zero_terminal_snr: bool = False):
    scheduler = loading.load_scheduler(model_ref, "ddpm")
    if zero_terminal_snr:
        scheduler = type(scheduler).from_config(scheduler.config, rescale_betas_zero_snr=True)
    return scheduler


def build_model(model_cfg, info: schema.DatasetInfo, seed: int = 0,
                text_encoder: FrozenTextEncoder | None = None) -> StableDiffusion:
    """The ComposerModel for ``model_cfg`` (a :class:`diffusion.config.ModelConfig`) on data ``info``;
    ``text_encoder`` when it trains from token ids."""
    ref = model_cfg.ref
    if os.path.isdir(os.path.expanduser(ref)):  # checkpoints record a path that works from any directory
        ref = os.path.abspath(os.path.expanduser(ref))
    unet = build_unet(ref, model_cfg.pretrained, seed=seed)
    return StableDiffusion(
        unet, build_noise_scheduler(ref, model_cfg.zero_terminal_snr),
        scaling_factor=info.scaling_factor, model_ref=ref, resolution=model_cfg.resolution,
        downsample=info.downsample, prediction_type=model_cfg.prediction_type,
        offset_noise=model_cfg.offset_noise, min_snr_gamma=model_cfg.min_snr_gamma,
        input_perturbation=model_cfg.input_perturbation, eval_seed=model_cfg.eval_seed, text_encoder=text_encoder)
