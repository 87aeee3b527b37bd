"""The ComposerModel: latents scaled once, targets, weighting, pinned eval, FLOPs, self-description."""

import pytest
import torch

from diffusion.train.config import ModelConfig
from diffusion import schema
from diffusion.models.latent_diffusion import build_model
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
    model.denoiser.register_forward_pre_hook(lambda m, args: seen.append(args[0].detach().clone()))
    return seen


def test_latents_are_scaled_exactly_once(train_kit):
    """The UNet must see √ᾱ·(moments_mean·sf) + √(1-ᾱ)·noise: a second scaling anywhere breaks this."""
    model = _model(train_kit)
    seen = _unet_inputs(model)
    batch = _batch()
    out = model(batch)
    mean = batch[schema.BATCH_MOMENTS][:, :4]
    a = model.objective.sqrt_alphas_cumprod[out["levels"]].view(-1, 1, 1, 1)
    s = model.objective.sqrt_one_minus_alphas_cumprod[out["levels"]].view(-1, 1, 1, 1)
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
    from diffusion.models import loading
    scheduler = loading.load_scheduler(train_kit, "ddpm")
    out = model(_batch())
    expected = scheduler.get_velocity(out["latents"], out["noise"], out["levels"])
    torch.testing.assert_close(out["target"], expected.float(), rtol=1e-4, atol=1e-4)


def test_min_snr_weighting_against_a_reference(train_kit):
    model = _model(train_kit, min_snr_gamma=5.0)
    batch = _batch()
    out = model(batch)
    mse = ((out["prediction"] - out["target"]) ** 2).mean(dim=(1, 2, 3))
    alphas = build_alphas(train_kit)[out["levels"]]
    snr = alphas / (1 - alphas)
    expected = (mse * torch.clamp(snr, max=5.0) / snr).mean()
    torch.testing.assert_close(model.loss(out, batch), expected.float(), rtol=1e-4, atol=1e-6)


def build_alphas(kit):
    from diffusion.models import loading
    return loading.load_scheduler(kit, "ddpm").alphas_cumprod.double()


def test_zero_terminal_snr_ends_in_pure_noise(train_kit):
    plain, rescaled = _model(train_kit), _model(train_kit, zero_terminal_snr=True, prediction_type="v_prediction")
    assert plain.objective.sqrt_alphas_cumprod[-1] > 0.01
    assert rescaled.objective.sqrt_alphas_cumprod[-1].abs() < 1e-6


def test_input_perturbation_changes_the_input_not_the_target(train_kit):
    model = _model(train_kit, input_perturbation=0.5)
    seen = _unet_inputs(model)
    out = model(_batch())
    a = model.objective.sqrt_alphas_cumprod[out["levels"]].view(-1, 1, 1, 1)
    s = model.objective.sqrt_one_minus_alphas_cumprod[out["levels"]].view(-1, 1, 1, 1)
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
    assert torch.equal(flipped["levels"].flip(0), first["levels"])
    assert len(set(first["levels"].tolist())) > 1  # but different samples differ


def test_a_compiled_denoisers_partial_eval_batch_runs_padded_to_the_full_batch(train_kit):
    """With compiled blocks (``pad_eval_batches``, set by trainer.compile under FSDP) the eval's last, partial
    batch reaches the denoiser as many rows as the full batches before it (a graph set per batch shape
    otherwise), and its outputs are its own rows' as unpadded."""
    model = _model(train_kit, eval_bins=2, eval_protocol="all_levels").eval()
    seen = _unet_inputs(model)
    full, partial = _batch(n=4), _batch(n=3, seed=1)
    partial[schema.BATCH_SAMPLE_INDEX] += 4
    plain = model.eval_forward(partial)
    model.pad_eval_batches = True
    model.eval_forward(full)
    seen.clear()
    padded = model.eval_forward(partial)
    assert [len(x) for x in seen] == [4, 4, 4]  # the loss's call and each of the 2 bins' levels
    assert padded.keys() == plain.keys()
    for key in ("prediction", "target", "levels", "noise", "latents"):
        assert len(padded[key]) == 3
        torch.testing.assert_close(padded[key], plain[key], rtol=1e-5, atol=1e-6, msg=key)
    for with_pad, without in zip(padded["bins"], plain["bins"]):
        torch.testing.assert_close(with_pad, without, rtol=1e-5, atol=1e-6)


def test_checkpoint_state_describes_the_model(train_kit):
    from diffusion.models.description import ModelDescription
    model = _model(train_kit)
    extra = model.state_dict()["_extra_state"]
    dim = kit_text_dim(train_kit)
    description = ModelDescription.from_extra_state(extra)
    assert description.resolution == 64 and description.scaling_factor == SF and description.text_dim == dim
    assert description.objective == "epsilon" and description.denoiser == "UNet2DConditionModel"
    assert description.denoiser_config["cross_attention_dim"] == dim
    assert description.noise_schedule["rescale_betas_zero_snr"] is False
    wider = dict(description.to_dict(), text_dim=1024)
    with pytest.raises(ValueError, match="text_dim"):
        model.set_extra_state({"description": wider})


def test_a_checkpoint_written_before_the_description_is_read(train_kit):
    """SD2 checkpoints of earlier versions carry loose keys and the UNet under "unet.": both still load."""
    from diffusion.models.description import ModelDescription
    model = _model(train_kit)
    legacy_extra = {"model_ref": train_kit, "unet_config": dict(model.denoiser.config), "scaling_factor": SF,
                    "prediction_type": "epsilon", "resolution": 64, "text_dim": model.text_dim,
                    "noise_schedule": None}
    description = ModelDescription.from_extra_state(legacy_extra)
    assert description.objective == "epsilon" and description.denoiser == "UNet2DConditionModel"
    legacy = {"unet." + k: v + 1 for k, v in model.denoiser.state_dict().items()}
    fresh = _model(train_kit)
    fresh.load_state_dict({**legacy, "_extra_state": legacy_extra}, strict=True)
    torch.testing.assert_close(fresh.denoiser.conv_in.weight, model.denoiser.conv_in.weight + 1)


def test_checkpoint_state_carries_the_zero_terminal_snr_schedule_training_used(train_kit):
    """Samplers rebuild the schedule from the checkpoint: it must give exactly training's ᾱ, ending at 0."""
    from diffusers import DDIMScheduler
    model = _model(train_kit, zero_terminal_snr=True, prediction_type="v_prediction")
    schedule = model.state_dict()["_extra_state"]["description"]["objective_params"]["noise_schedule"]
    assert schedule["rescale_betas_zero_snr"] is True
    rebuilt = DDIMScheduler(**schedule).alphas_cumprod
    torch.testing.assert_close(rebuilt.sqrt(), model.objective.sqrt_alphas_cumprod, rtol=1e-5, atol=1e-6)
    assert rebuilt[-1] == 0
    with pytest.warns(UserWarning, match="noise_schedule"):  # phase 2 without ZTSNR on a ZTSNR phase 1
        _model(train_kit, prediction_type="v_prediction").set_extra_state(model.state_dict()["_extra_state"])


def test_sd2_unet_flops_match_the_reference(sd2_kit):
    """539 GFLOP per image (fwd+bwd) at 256 px for SD2-base: what SpeedMonitor's MFU is built on."""
    from diffusion.models import denoisers, loading
    unet = denoisers.adapter("UNet2DConditionModel")
    training_flops = 3 * unet.forward_flops(loading.load_unet_config(sd2_kit), 256 // 8, 1024, 77)
    assert training_flops == pytest.approx(539e9, rel=0.05)


def test_flops_per_batch_scales_with_batch(train_kit):
    model = _model(train_kit)
    assert model.flops_per_batch(_batch(n=4)) == pytest.approx(2 * model.flops_per_batch(_batch(n=2)))
    assert model.flops_per_batch(_batch(n=1)) > 0


def test_min_snr_with_zero_terminal_snr_keeps_the_terminal_step_trained_with_a_floor(train_kit, capsys):
    """min(SNR, γ)/(SNR+1) is 0 at the zero-terminal-SNR step: said when the config is read, and
    ``model.min_snr_floor`` keeps that step's weight at the floor (issue 25, item 5)."""
    from diffusion.train.config import load_config
    import os
    yaml = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(__file__))), "yamls", "tiny-cpu.yaml")
    load_config(yaml, ["model.zero_terminal_snr=true", "model.min_snr_gamma=5.0"])
    assert "terminal step (SNR = 0) loss weight 0" in capsys.readouterr().out
    load_config(yaml, ["model.zero_terminal_snr=true", "model.min_snr_gamma=5.0", "model.min_snr_floor=0.1"])
    assert "terminal step" not in capsys.readouterr().out
    last = torch.tensor([999])
    plain = _model(train_kit, zero_terminal_snr=True, prediction_type="v_prediction", min_snr_gamma=5.0)
    floored = _model(train_kit, zero_terminal_snr=True, prediction_type="v_prediction", min_snr_gamma=5.0,
                     min_snr_floor=0.1)
    assert plain.objective.weights(last).item() == 0.0
    assert floored.objective.weights(last).item() == pytest.approx(0.1)
    middle = torch.tensor([500])  # elsewhere the floor changes nothing
    assert floored.objective.weights(middle).item() == plain.objective.weights(middle).item() > 0.1


def test_zero_terminal_snr_without_a_prediction_type_trains_when_the_reference_predicts_v(train_kit, tmp_path):
    """``prediction_type: null`` means the reference scheduler's: v there is accepted with zero terminal
    SNR; epsilon there is refused in one line naming the fix."""
    import json
    import shutil
    from diffusion.errors import ConfigError
    kit = tmp_path / "kit"
    shutil.copytree(train_kit, kit)
    config_path = kit / "scheduler" / "scheduler_config.json"
    config = json.loads(config_path.read_text())
    config_path.write_text(json.dumps(dict(config, prediction_type="v_prediction")))
    model = _model(str(kit), zero_terminal_snr=True)
    assert model.objective.name == "v_prediction" and model.objective.zero_terminal_snr
    with pytest.raises(ConfigError, match="needs v-prediction"):
        _model(train_kit, zero_terminal_snr=True)


def test_a_later_phase_must_continue_the_same_network_and_objective(train_kit):
    """Staged recipes hand weights from phase to phase: another objective or another network is refused
    in one line (a ConfigError), another resolution is not."""
    from diffusion.errors import ConfigError
    from diffusion.models.description import ModelDescription
    epsilon = _model(train_kit)
    saved = epsilon.state_dict()["_extra_state"]
    with pytest.raises(ConfigError, match="epsilon objective, this run trains v_prediction"):
        _model(train_kit, prediction_type="v_prediction").set_extra_state(saved)
    other = ModelDescription.from_extra_state(saved).to_dict()
    other["denoiser_config"] = dict(other["denoiser_config"], layers_per_block=3)
    with pytest.raises(ConfigError, match="layers_per_block=3"):
        _model(train_kit).set_extra_state({"description": other})
    other = dict(ModelDescription.from_extra_state(saved).to_dict(), resolution=128)
    _model(train_kit).set_extra_state({"description": other})  # phase 2 at another resolution: fine
