"""The ComposerModel: latents scaled once, targets, weighting, pinned eval, FLOPs, self-description."""

import pytest
import torch

from diffusion.config import ModelConfig
from diffusion import schema
from diffusion.models.stable_diffusion import build_model, unet_forward_flops
from train_fixtures import kit_text_dim

SF = 0.18215


def _model(kit, **options):
    info = schema.DatasetInfo(model=kit, scaling_factor=SF, resolutions=[64], text_dim=kit_text_dim(kit))
    return build_model(ModelConfig(ref=kit, resolution=64, **options), info)


def _batch(n=4, logvar=-30.0, seed=0, text_dim=64):
    g = torch.Generator().manual_seed(seed)
    mean = torch.randn(n, 4, 8, 8, generator=g) * 5
    return {schema.BATCH_MOMENTS: torch.cat([mean, torch.full_like(mean, logvar)], dim=1),
            schema.BATCH_TEXT_EMBEDS: torch.randn(n, 77, text_dim, generator=g),
            schema.BATCH_SAMPLE_INDEX: torch.arange(n)}


def _unet_inputs(model):
    seen = []
    model.unet.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    return seen


def test_latents_are_scaled_exactly_once(train_kit):
    """The UNet must see √ᾱ·(moments_mean·sf) + √(1-ᾱ)·noise: a second scaling anywhere breaks this."""
    model = _model(train_kit)
    seen = _unet_inputs(model)
    batch = _batch()
    out = model(batch)
    mean = batch[schema.BATCH_MOMENTS][:, :4]
    a = model.sqrt_alphas_cumprod[out["timesteps"]].view(-1, 1, 1, 1)
    s = model.sqrt_one_minus_alphas_cumprod[out["timesteps"]].view(-1, 1, 1, 1)
    torch.testing.assert_close(seen[0], a * mean * SF + s * out["noise"], rtol=1e-4, atol=1e-4)
    # and not unscaled: a model that forgot the factor would fail the line above just the same
    assert not torch.allclose(seen[0], a * mean * SF * SF + s * out["noise"], atol=1e-2)


def test_latents_are_fresh_draws_from_the_moments(train_kit):
    model = _model(train_kit)
    batch = _batch(n=256, logvar=0.0)  # σ = 1 in unscaled units
    first, second = model.sample_latents(batch[schema.BATCH_MOMENTS]), model.sample_latents(batch[schema.BATCH_MOMENTS])
    assert not torch.allclose(first, second)
    spread = (first / SF - batch[schema.BATCH_MOMENTS][:, :4]).std().item()
    assert 0.95 < spread < 1.05


def test_v_prediction_target_matches_diffusers(train_kit):
    model = _model(train_kit, prediction_type="v_prediction")
    from diffusion.models.stable_diffusion import build_noise_scheduler
    scheduler = build_noise_scheduler(train_kit)
    out = model(_batch())
    expected = scheduler.get_velocity(out["latents"], out["noise"], out["timesteps"])
    torch.testing.assert_close(out["target"], expected.float(), rtol=1e-4, atol=1e-4)


def test_min_snr_weighting_against_a_reference(train_kit):
    model = _model(train_kit, min_snr_gamma=5.0)
    batch = _batch()
    out = model(batch)
    mse = ((out["prediction"] - out["target"]) ** 2).mean(dim=(1, 2, 3))
    alphas = build_alphas(train_kit)[out["timesteps"]]
    snr = alphas / (1 - alphas)
    expected = (mse * torch.clamp(snr, max=5.0) / snr).mean()
    torch.testing.assert_close(model.loss(out, batch), expected.float(), rtol=1e-4, atol=1e-6)


def build_alphas(kit):
    from diffusion.models.stable_diffusion import build_noise_scheduler
    return build_noise_scheduler(kit).alphas_cumprod.double()


def test_zero_terminal_snr_ends_in_pure_noise(train_kit):
    plain, rescaled = _model(train_kit), _model(train_kit, zero_terminal_snr=True, prediction_type="v_prediction")
    assert plain.sqrt_alphas_cumprod[-1] > 0.01
    assert rescaled.sqrt_alphas_cumprod[-1].abs() < 1e-6


def test_input_perturbation_changes_the_input_not_the_target(train_kit):
    model = _model(train_kit, input_perturbation=0.5)
    seen = _unet_inputs(model)
    out = model(_batch())
    a = model.sqrt_alphas_cumprod[out["timesteps"]].view(-1, 1, 1, 1)
    s = model.sqrt_one_minus_alphas_cumprod[out["timesteps"]].view(-1, 1, 1, 1)
    assert torch.equal(out["target"], out["noise"])
    assert not torch.allclose(seen[0], a * out["latents"] + s * out["noise"], atol=1e-3)


def test_eval_noise_is_pinned_per_sample(train_kit):
    model = _model(train_kit).eval()
    batch = _batch(n=4, logvar=-1.0)
    first, again = model.eval_forward(batch), model.eval_forward(batch)
    torch.testing.assert_close(first["prediction"], again["prediction"])
    # the same sample in another batch position (or batch) gets the same noise and timestep
    reordered = {k: v.flip(0) for k, v in batch.items()}
    flipped = model.eval_forward(reordered)
    torch.testing.assert_close(flipped["noise"].flip(0), first["noise"])
    assert torch.equal(flipped["timesteps"].flip(0), first["timesteps"])
    assert len(set(first["timesteps"].tolist())) > 1  # but different samples differ


def test_checkpoint_state_describes_the_model(train_kit):
    model = _model(train_kit)
    extra = model.state_dict()["_extra_state"]
    dim = kit_text_dim(train_kit)
    assert extra["resolution"] == 64 and extra["scaling_factor"] == SF and extra["text_dim"] == dim
    assert extra["prediction_type"] == "epsilon" and extra["unet_config"]["cross_attention_dim"] == dim
    assert extra["noise_schedule"]["rescale_betas_zero_snr"] is False
    with pytest.raises(ValueError, match="text_dim"):
        model.set_extra_state(dict(extra, text_dim=1024))


def test_checkpoint_state_carries_the_zero_terminal_snr_schedule_training_used(train_kit):
    """Samplers rebuild the schedule from the checkpoint: it must give exactly training's ᾱ, ending at 0."""
    from diffusers import DDIMScheduler
    model = _model(train_kit, zero_terminal_snr=True, prediction_type="v_prediction")
    schedule = model.state_dict()["_extra_state"]["noise_schedule"]
    assert schedule["rescale_betas_zero_snr"] is True
    rebuilt = DDIMScheduler(**schedule).alphas_cumprod
    torch.testing.assert_close(rebuilt.sqrt(), model.sqrt_alphas_cumprod, rtol=1e-5, atol=1e-6)
    assert rebuilt[-1] == 0
    with pytest.warns(UserWarning, match="noise_schedule"):  # phase 2 without ZTSNR on a ZTSNR phase 1
        _model(train_kit).set_extra_state(model.state_dict()["_extra_state"])


def test_sd2_unet_flops_match_the_reference(sd2_kit):
    """539 GFLOP per image (fwd+bwd) at 256 px for SD2-base: what SpeedMonitor's MFU is built on."""
    import json
    from diffusion.models import loading
    config = json.dumps(loading.load_unet_config(sd2_kit), sort_keys=True)
    training_flops = 3 * unet_forward_flops(config, 256 // 8)
    assert training_flops == pytest.approx(539e9, rel=0.05)


def test_flops_per_batch_scales_with_batch(train_kit):
    model = _model(train_kit)
    assert model.flops_per_batch(_batch(n=4)) == pytest.approx(2 * model.flops_per_batch(_batch(n=2)))
    assert model.flops_per_batch(_batch(n=1)) > 0
