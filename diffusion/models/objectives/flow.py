"""Rectified flow (Liu et al. 2022; SD3, Esser et al. 2024): x_σ = (1−σ)·x₀ + σ·ε, target ε − x₀.

σ is drawn as SD3's training does, with diffusers' own pieces: the loader turns each sample's generator
into a number u with ``compute_density_for_timestep_sampling`` (``logit_normal`` (mean, std), ``mode``
(scale) or ``uniform``), and u picks one of the discrete σ of a ``FlowMatchEulerDiscreteScheduler``
whose ``shift`` moves them toward noise. With ``shift_base_resolution`` the shift grows with the
resolution as SD3's paper proposes (α = √(m/n) for m pixels against the base's n: shift·R/R_base).
The loss is weighted by ``compute_loss_weighting_for_sd3`` (``none``, ``sigma_sqrt``, ``cosmap``), and
the denoiser sees the timestep σ·T. ``precondition_outputs`` trains the x₀-preconditioned loss of diffusers'
SD3 training scripts: the prediction v read as x̂₀ = x_σ − σ·v against x₀, i.e. σ²·(v − (ε − x₀))², so it is
the velocity loss weighted by σ² (times the weighting); the prediction, target and sampler stay the velocity's. Sampling uses the flow-matching Euler (or Heun) scheduler with the
same shift.
"""

from __future__ import annotations

import dataclasses

import torch

from diffusion.models.objectives.base import Objective

SAMPLERS = ("euler", "heun")


@dataclasses.dataclass(frozen=True)
class DensityDraw:
    """The loader's per-sample u for the σ density: picklable (DataLoader workers carry it)."""

    scheme: str = "logit_normal"
    logit_mean: float = 0.0
    logit_std: float = 1.0
    mode_scale: float = 1.29

    def __call__(self, generator: torch.Generator) -> torch.Tensor:
        from diffusers.training_utils import compute_density_for_timestep_sampling
        return compute_density_for_timestep_sampling(self.scheme, 1, self.logit_mean, self.logit_std,
                                                     self.mode_scale, generator=generator)


def effective_shift(shift: float, resolution: int, base_resolution: int | None) -> float:
    """SD3's resolution-dependent shift: ``shift`` at ``base_resolution``, times R/R_base elsewhere."""
    return float(shift) * (resolution / base_resolution if base_resolution else 1.0)


class FlowObjective(Objective):
    samplers = SAMPLERS
    reads = ("flow",)

    def __init__(self, name: str = "flow", *, shift: float = 1.0, num_train_timesteps: int = 1000,
                 density: DensityDraw = DensityDraw(), weighting: str = "none", precondition_outputs: bool = False):
        super().__init__()
        from diffusers import FlowMatchEulerDiscreteScheduler
        if weighting not in ("none", "sigma_sqrt", "cosmap"):
            raise ValueError(f"flow weighting {weighting!r}: none, sigma_sqrt or cosmap")
        self.name = name
        self.shift = float(shift)
        self.num_timesteps = int(num_train_timesteps)
        self.density = density
        self.weighting = weighting
        self.precondition_outputs = bool(precondition_outputs)
        scheduler = FlowMatchEulerDiscreteScheduler(num_train_timesteps=self.num_timesteps, shift=self.shift)
        # Descending, as the scheduler holds them: u near 0 picks σ near 1 (diffusers' SD3 training script).
        self.register_buffer("sigma_table", scheduler.sigmas[:self.num_timesteps].float(), persistent=False)
        self.register_buffer("timestep_table", scheduler.timesteps[:self.num_timesteps].float(), persistent=False)

    # ---- building ------------------------------------------------------------------------------------
    @classmethod
    def from_config(cls, name, model_cfg, model_ref):
        f = model_cfg.flow
        return cls(name, shift=effective_shift(f.shift, model_cfg.resolution, f.shift_base_resolution),
                   num_train_timesteps=f.num_train_timesteps, weighting=f.weighting,
                   density=DensityDraw(f.sigma_density, f.logit_mean, f.logit_std, f.mode_scale),
                   precondition_outputs=f.precondition_outputs)

    @classmethod
    def from_params(cls, name, params):
        return cls(name, shift=params["shift"], num_train_timesteps=params["num_train_timesteps"],
                   weighting=params.get("weighting", "none"), density=DensityDraw(**params.get("density", {})),
                   precondition_outputs=params.get("precondition_outputs", False))

    def settings(self) -> dict:
        settings = {"shift": self.shift, "num_train_timesteps": self.num_timesteps, "weighting": self.weighting,
                    "density": dataclasses.asdict(self.density)}
        if self.precondition_outputs:  # recorded only when on: other checkpoints describe themselves as before
            settings["precondition_outputs"] = True
        return settings

    # ---- training ------------------------------------------------------------------------------------
    def level_draw(self):
        return self.density

    def levels(self, u):
        return (u * self.num_timesteps).long().clamp(0, self.num_timesteps - 1)

    def sigmas(self, indices):
        # float levels are σ itself (MLPerf's eval levels σ = k/8, off the table: σ = 0 is on none)
        return indices if indices.is_floating_point() else self.sigma_table[indices]

    def noisy_and_target(self, latents, noise, input_noise, indices):
        sigma = self.sigmas(indices)
        timesteps = sigma * self.num_timesteps if indices.is_floating_point() else self.timestep_table[indices]
        sigma = sigma.view(-1, 1, 1, 1)
        noisy = (1.0 - sigma) * latents + sigma * input_noise
        return noisy, noise - latents, timesteps

    def weights(self, indices):
        sigma = self.sigma_table[indices]
        weights = None
        if self.weighting != "none":
            from diffusers.training_utils import compute_loss_weighting_for_sd3
            weights = compute_loss_weighting_for_sd3(self.weighting, sigma)
        if self.precondition_outputs:  # (x̂₀ − x₀)² = σ²·(v − target)²
            weights = sigma ** 2 if weights is None else weights * sigma ** 2
        return weights

    # ---- evaluation ----------------------------------------------------------------------------------
    def eval_level(self, generator):
        return torch.randint(0, self.num_timesteps, (1,), generator=generator)

    def equidistant_levels(self, bins):
        # MLPerf's σ = k/bins as σ itself (the table's timesteps are σ·T whatever the shift)
        return torch.arange(bins, dtype=torch.float32) / bins

    def bin_levels(self, bins):
        # σ at the bins' centres, low noise first: the table is descending.
        centres = (torch.arange(bins, dtype=torch.float64) + 0.5) / bins
        return (self.num_timesteps - 1 - (centres * self.num_timesteps).long()).clamp(0, self.num_timesteps - 1)

    # ---- sampling ------------------------------------------------------------------------------------
    def sampling_scheduler(self, model_ref, name=None):
        import diffusers
        name = self.check_sampler(name)
        cls = {"euler": diffusers.FlowMatchEulerDiscreteScheduler, "heun": diffusers.FlowMatchHeunDiscreteScheduler}
        return cls[name](num_train_timesteps=self.num_timesteps, shift=self.shift)


OBJECTIVES = {"flow": FlowObjective}
