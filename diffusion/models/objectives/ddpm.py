"""The DDPM objectives of SD2's recipe: ε- and v-prediction on a discrete noise schedule.

Per sample: t = ⌊u·T⌋, x_t = √ᾱ_t·x₀ + √(1-ᾱ_t)·ε, target ε (``epsilon``) or v = √ᾱ_t·ε − √(1-ᾱ_t)·x₀
(``v_prediction``), optionally weighted by min-SNR-γ (Hang et al. 2023): min(SNR, γ)/SNR for ε and
min(SNR, γ)/(SNR+1) for v. The schedule is the model reference's DDPM scheduler config, with zero
terminal SNR (Lin et al. 2023) when asked. At zero terminal SNR the last step's SNR is 0, so min-SNR
gives it weight 0; ``min_snr_floor`` keeps such steps trained (weight ≥ the floor).

Sampling uses the diffusers scheduler of the same noise schedule (DDIM, Euler or DPM-Solver++);
a zero-terminal-SNR schedule is sampled with "trailing" spacing and guidance rescale 0.7.
"""

from __future__ import annotations

import inspect

import torch

from diffusion.models import loading
from diffusion.models.objectives.base import Objective

SCHEDULERS = ("ddim", "euler", "dpm++")
ZTSNR_GUIDANCE_RESCALE = 0.7  # the paper's φ for zero-terminal-SNR models


class DDPMObjective(Objective):
    samplers = SCHEDULERS
    reads = ("min_snr_gamma", "min_snr_floor", "zero_terminal_snr")

    def __init__(self, name: str, noise_schedule: dict, *, min_snr_gamma: float | None = None,
                 min_snr_floor: float = 0.0):
        super().__init__()
        self.name = name
        self.prediction_type = name
        self.noise_schedule = dict(noise_schedule)
        self.min_snr_gamma = min_snr_gamma
        self.min_snr_floor = float(min_snr_floor or 0.0)
        import diffusers
        scheduler = diffusers.DDPMScheduler(**{k: v for k, v in self.noise_schedule.items() if v is not None})
        self.num_timesteps = int(scheduler.config.num_train_timesteps)
        alphas_cumprod = scheduler.alphas_cumprod.to(torch.float64)
        self.register_buffer("sqrt_alphas_cumprod", alphas_cumprod.sqrt().float(), persistent=False)
        self.register_buffer("sqrt_one_minus_alphas_cumprod", (1 - alphas_cumprod).sqrt().float(), persistent=False)
        self.register_buffer("snr", (alphas_cumprod / (1 - alphas_cumprod)).float(), persistent=False)

    @property
    def zero_terminal_snr(self) -> bool:
        return bool(self.noise_schedule.get("rescale_betas_zero_snr"))

    # ---- building ------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, name, model_cfg, model_ref):
        scheduler = loading.load_scheduler(model_ref, "ddpm")
        if model_cfg.zero_terminal_snr:
            scheduler = type(scheduler).from_config(scheduler.config, rescale_betas_zero_snr=True)
        return cls(name, loading.noise_schedule_of(scheduler.config), min_snr_gamma=model_cfg.min_snr_gamma,
                   min_snr_floor=model_cfg.min_snr_floor)

    @classmethod
    def from_params(cls, name, params):
        return cls(name, params["noise_schedule"], min_snr_gamma=params.get("min_snr_gamma"),
                   min_snr_floor=params.get("min_snr_floor") or 0.0)

    def settings(self) -> dict:
        return {"noise_schedule": dict(self.noise_schedule), "min_snr_gamma": self.min_snr_gamma,
                "min_snr_floor": self.min_snr_floor}

    # ---- training ------------------------------------------------------------------------------------
    def levels(self, u):
        return (u * self.num_timesteps).long().clamp(0, self.num_timesteps - 1)

    def noisy_and_target(self, latents, noise, input_noise, timesteps):
        a = self.sqrt_alphas_cumprod[timesteps].view(-1, 1, 1, 1)
        s = self.sqrt_one_minus_alphas_cumprod[timesteps].view(-1, 1, 1, 1)
        noisy = a * latents + s * input_noise
        target = noise if self.prediction_type == "epsilon" else a * noise - s * latents
        return noisy, target, timesteps

    def weights(self, timesteps):
        if not self.min_snr_gamma:
            return None
        snr = self.snr[timesteps]
        clipped = snr.clamp(max=self.min_snr_gamma)
        weight = clipped / (snr + 1) if self.prediction_type == "v_prediction" else clipped / snr.clamp(min=1e-8)
        return weight.clamp(min=self.min_snr_floor) if self.min_snr_floor else weight

    # ---- evaluation ----------------------------------------------------------------------------------
    def eval_level(self, generator):
        return torch.randint(0, self.num_timesteps, (1,), generator=generator)

    def equidistant_levels(self, bins):
        return (torch.arange(bins, dtype=torch.float64) * self.num_timesteps / bins).long()

    def bin_levels(self, bins):
        centres = (torch.arange(bins, dtype=torch.float64) + 0.5) / bins
        return (centres * self.num_timesteps).long().clamp(0, self.num_timesteps - 1)

    # ---- sampling ------------------------------------------------------------------------------------
    def sampling_scheduler(self, model_ref, name=None):
        name = self.check_sampler(name)
        return load_sampling_scheduler(model_ref, name, self.prediction_type, self.noise_schedule)


OBJECTIVES = {"epsilon": DDPMObjective, "v_prediction": DDPMObjective}


def default_guidance_rescale(zero_terminal_snr: bool) -> float:
    """``guidance_rescale`` when none is given: 0.7 for a zero-terminal-SNR model, else 0 (off)."""
    return ZTSNR_GUIDANCE_RESCALE if zero_terminal_snr else 0.0


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
