"""The flow objective (rectified flow, as SD3 trains): noisy input, target, σ density, shift and weighting,
each against an independent computation; and the per-sample draws it takes from the loader."""

import math

import pytest
import torch

from diffusion import schema
from diffusion.train.config import FlowConfig, ModelConfig
from diffusion.models.objectives.flow import DensityDraw, FlowObjective, effective_shift
from diffusion.loader.batches import NoiseDraws


def _independent_sigma(u: torch.Tensor, shift: float, n: int = 1000) -> torch.Tensor:
    """σ as SD3's training script picks it, written out: index ⌊u·n⌋ into n σ's descending from 1 to 1/n,
    each shifted by s·σ / (1 + (s − 1)·σ)."""
    index = (u * n).long().clamp(0, n - 1)
    sigma = (n - index).double() / n
    return (shift * sigma / (1 + (shift - 1) * sigma)).float()


@pytest.mark.parametrize("shift", [1.0, 3.0])
def test_noisy_input_target_and_sigma_against_an_independent_computation(shift):
    objective = FlowObjective(shift=shift)
    g = torch.Generator().manual_seed(0)
    latents, noise, u = torch.randn(6, 4, 8, 8, generator=g), torch.randn(6, 4, 8, 8, generator=g), torch.rand(6, generator=g)
    levels = objective.levels(u)
    noisy, target, timesteps = objective.noisy_and_target(latents, noise, noise, levels)
    sigma = _independent_sigma(u, shift)
    torch.testing.assert_close(objective.sigmas(levels), sigma, rtol=1e-5, atol=1e-6)
    s = sigma.view(-1, 1, 1, 1)
    torch.testing.assert_close(noisy, (1 - s) * latents + s * noise, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(target, noise - latents)
    torch.testing.assert_close(timesteps, sigma * 1000, rtol=1e-4, atol=1e-3)  # the denoiser's timestep is σ·T


def test_shift_moves_sigma_toward_noise_and_grows_with_resolution():
    u = torch.linspace(0.01, 0.99, 50)
    plain, shifted = FlowObjective(shift=1.0), FlowObjective(shift=3.0)
    assert (shifted.sigmas(shifted.levels(u)) >= plain.sigmas(plain.levels(u)) - 1e-6).all()
    # SD3's α = √(m/n): at twice the side (4× the pixels) twice the shift
    assert effective_shift(3.0, 512, 256) == pytest.approx(6.0)
    assert effective_shift(3.0, 512, None) == pytest.approx(3.0)
    cfg = ModelConfig(objective="flow", resolution=512, flow=FlowConfig(shift=1.5, shift_base_resolution=256))
    assert FlowObjective.from_config("flow", cfg, "unused").shift == pytest.approx(3.0)


def test_logit_normal_density_drawn_per_sample_by_the_loader():
    """The loader's level draw for flow is diffusers' logit-normal sampler, one generator per sample:
    logit(u) has the configured mean and std, and a sample's u does not depend on its batch."""
    density = DensityDraw("logit_normal", logit_mean=0.5, logit_std=0.8)
    draws = NoiseDraws(seed=3, level=density)
    keys = [f"{i:06d}" for i in range(4000)]
    u = draws(keys, epoch=0, latent_shape=(4, 2, 2))[schema.BATCH_TIMESTEP_DRAW]
    logit = torch.log(u / (1 - u))
    assert logit.mean().item() == pytest.approx(0.5, abs=0.05)  # 4,000 draws: standard error 0.013
    assert logit.std().item() == pytest.approx(0.8, abs=0.05)
    alone = draws(keys[7:8], epoch=0, latent_shape=(4, 2, 2))[schema.BATCH_TIMESTEP_DRAW]
    assert alone[0] == u[7]
    uniform = NoiseDraws(seed=3)(keys[:500], epoch=0, latent_shape=(4, 2, 2))[schema.BATCH_TIMESTEP_DRAW]
    assert abs(uniform.mean().item() - 0.5) < 0.05 and uniform.min() >= 0 and uniform.max() < 1


@pytest.mark.parametrize("weighting", ["none", "sigma_sqrt", "cosmap"])
def test_loss_weighting_against_a_direct_computation(weighting):
    objective = FlowObjective(shift=3.0, weighting=weighting)
    levels = objective.levels(torch.tensor([0.05, 0.3, 0.6, 0.95]))
    sigma = objective.sigmas(levels).double()
    expected = {"none": None, "sigma_sqrt": sigma ** -2,
                "cosmap": 2 / (math.pi * (1 - 2 * sigma + 2 * sigma ** 2))}[weighting]
    weights = objective.weights(levels)
    if expected is None:
        assert weights is None
    else:
        torch.testing.assert_close(weights.double(), expected, rtol=1e-5, atol=1e-6)


def test_bins_run_from_low_to_high_noise():
    objective = FlowObjective(shift=3.0)
    sigma = objective.sigmas(objective.bin_levels(8))
    assert (sigma.diff() > 0).all() and 0 < sigma[0] < 0.2 and 0.9 < sigma[-1] <= 1


@pytest.mark.parametrize("weighting", ["none", "cosmap"])
def test_preconditioned_outputs_give_the_loss_of_diffusers_sd3_script(weighting):
    """diffusers' SD3 training scripts with --precondition_outputs: model_pred·(−σ) + noisy against the
    clean latents, weighted by compute_loss_weighting_for_sd3, mean over each sample then the batch."""
    from diffusers.training_utils import compute_loss_weighting_for_sd3
    from diffusion.models.latent_diffusion import _per_sample_mse
    g = torch.Generator().manual_seed(2)
    latents, noise = torch.randn(6, 4, 8, 8, generator=g), torch.randn(6, 4, 8, 8, generator=g)
    model_pred = torch.randn(6, 4, 8, 8, generator=g)
    objective = FlowObjective(shift=3.0, weighting=weighting, precondition_outputs=True)
    levels = objective.levels(torch.rand(6, generator=g))
    noisy, target, _ = objective.noisy_and_target(latents, noise, noise, levels)
    ours = (_per_sample_mse({"prediction": model_pred, "target": target}) * objective.weights(levels)).mean()
    sigmas = objective.sigmas(levels).view(-1, 1, 1, 1)
    x0_pred = model_pred * (-sigmas) + noisy
    weighting_ = compute_loss_weighting_for_sd3(weighting_scheme=weighting, sigmas=sigmas)
    theirs = torch.mean((weighting_.float() * (x0_pred.float() - latents.float()) ** 2).reshape(6, -1), 1).mean()
    torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-6)
    # off by default, recorded only when on, and rebuilt from the checkpoint's settings
    assert FlowObjective().weights(levels) is None and "precondition_outputs" not in FlowObjective().settings()
    rebuilt = FlowObjective.from_params("flow", objective.settings())
    torch.testing.assert_close(rebuilt.weights(levels), objective.weights(levels))
    config = ModelConfig(objective="flow", flow=FlowConfig(precondition_outputs=True))
    assert FlowObjective.from_config("flow", config, "unused").precondition_outputs
