"""diffusion.export: a diffusers pipeline directory that StableDiffusionPipeline.from_pretrained runs."""

import json
import os

import numpy as np
import pytest
import torch

from diffusion.sample import export, generate
from diffusion.models import checkpoint as checkpoints, loading, sampling
from sampling_helpers import PROMPTS, kit_unet as _kit_unet, pixels as _pixels, train_tiny_checkpoint


def _load(directory):
    from diffusers import StableDiffusionPipeline
    return StableDiffusionPipeline.from_pretrained(directory)


def test_exported_pipeline_loads_and_draws_what_our_sampler_draws(tiny_kit, tmp_path):
    out = tmp_path / "pipe"
    export.main(["--checkpoint", tiny_kit, "--out", str(out), "--scheduler", "ddim"])
    assert {"unet", "vae", "text_encoder", "tokenizer", "scheduler", "model_index.json"} <= set(os.listdir(out))
    pipe = _load(str(out))
    assert pipe.safety_checker is None
    image = pipe([PROMPTS[0]], num_inference_steps=3, generator=[torch.Generator("cpu").manual_seed(4)]).images[0]
    ours = sampling.sample_images(_kit_unet(tiny_kit), tiny_kit, PROMPTS[:1], scheduler="ddim", steps=3, seed=4)[0]
    assert image.size == ours.size
    assert np.abs(_pixels(image) - _pixels(ours)).max() <= 1


def test_default_keeps_the_reference_scheduler_class(tiny_kit, tmp_path):
    export.export_pipeline(tiny_kit, str(tmp_path / "pipe"))
    with open(tmp_path / "pipe" / "model_index.json") as f:
        exported = json.load(f)["scheduler"][1]
    with open(os.path.join(tiny_kit, "scheduler", "scheduler_config.json")) as f:
        assert exported == json.load(f)["_class_name"]


def test_checkpoint_export_has_ema_unet_and_training_settings(fake_checkpoint, tiny_kit, tmp_path):
    out = str(tmp_path / "pipe")
    export.export_pipeline(fake_checkpoint, out, dtype="float16")
    pipe = _load(out)
    assert pipe.scheduler.config.prediction_type == "v_prediction"
    assert pipe.vae.config.scaling_factor == 0.5
    # pipe("a prompt") draws at the trained size (32 px), not the kit's config's (64)
    assert pipe.unet.config.sample_size * pipe.vae_scale_factor == 32
    from safetensors import safe_open
    with safe_open(os.path.join(out, "unet", "diffusion_pytorch_model.safetensors"), "pt") as f:
        assert all(f.get_tensor(k).dtype == torch.float16 for k in f.keys())
    kit = _kit_unet(tiny_kit).state_dict()
    for name, tensor in pipe.unet.state_dict().items():
        torch.testing.assert_close(tensor.float(), kit[name].half().float())


def test_refuses_to_overwrite_its_source(tiny_kit):
    with pytest.raises(ValueError, match="where the model comes from"):
        export.export_pipeline(tiny_kit, tiny_kit)


# ---- zero terminal SNR: the schedule training used reaches sampling and the exported pipeline ------------

@pytest.fixture(scope="module")
def ztsnr_checkpoint(tiny_kit, tmp_path_factory):
    """A tiny v-prediction model trained a few batches with model.zero_terminal_snr (EMA on)."""
    return train_tiny_checkpoint(tiny_kit, str(tmp_path_factory.mktemp("ztsnr")),
                                 "model.zero_terminal_snr=true", "model.prediction_type=v_prediction")


@pytest.fixture(scope="module")
def ztsnr_export(ztsnr_checkpoint, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("ztsnr-export") / "pipe")
    export.main(["--checkpoint", ztsnr_checkpoint, "--out", out])
    return out


def _scheduler_config(directory):
    with open(os.path.join(directory, "scheduler", "scheduler_config.json")) as f:
        return json.load(f)


def test_a_checkpoint_carries_its_noise_schedule(ztsnr_checkpoint, tiny_kit):
    schedule = checkpoints.read_state(ztsnr_checkpoint)["model"]["_extra_state"]["description"]["objective_params"][
        "noise_schedule"]
    reference = _scheduler_config(tiny_kit)
    assert schedule == {"num_train_timesteps": 1000, "beta_schedule": reference["beta_schedule"],
                        "beta_start": reference["beta_start"], "beta_end": reference["beta_end"],
                        "trained_betas": None, "rescale_betas_zero_snr": True}


def test_zero_terminal_snr_export_has_the_schedule_in_its_scheduler_config(ztsnr_export):
    config = _scheduler_config(ztsnr_export)
    assert config["rescale_betas_zero_snr"] is True
    assert config["timestep_spacing"] == "trailing"
    assert config["prediction_type"] == "v_prediction"
    scheduler = _load(ztsnr_export).scheduler
    scheduler.set_timesteps(25)
    assert int(scheduler.timesteps[0]) == 999 and float(scheduler.alphas_cumprod[999]) == 0.0


def test_diffusers_pipeline_draws_what_generate_draws_for_a_zero_terminal_snr_model(ztsnr_checkpoint,
                                                                                   ztsnr_export):
    kwargs = dict(steps=4, guidance_scale=5.0, seed=11)
    ours = generate.generate_images(ztsnr_checkpoint, PROMPTS[:1], **kwargs)[0]
    assert ours.size == (64, 64) and _pixels(ours).std() > 1  # a picture, not a blank from NaNs
    pipe = _load(ztsnr_export)
    call = dict(num_inference_steps=4, guidance_scale=5.0, height=ours.height, width=ours.width)
    theirs = pipe(PROMPTS[:1], guidance_rescale=sampling.ZTSNR_GUIDANCE_RESCALE,
                  generator=[torch.Generator("cpu").manual_seed(11)], **call).images[0]
    assert np.allclose(_pixels(theirs), _pixels(ours), atol=1)
    # The exported directory sampled by our own generate (its scheduler config) draws the same too.
    from_export = generate.generate_images(ztsnr_export, PROMPTS[:1], size=ours.height, **kwargs)[0]
    assert np.allclose(_pixels(from_export), _pixels(ours), atol=1)
    # The schedule matters: the reference's (leading spacing, betas not rescaled) draws another picture.
    pipe.scheduler = sampling.load_sampling_scheduler(loading.resolve_model(_reference(ztsnr_checkpoint)), "ddim",
                                                      "v_prediction")
    old = pipe(PROMPTS[:1], guidance_rescale=sampling.ZTSNR_GUIDANCE_RESCALE,
               generator=[torch.Generator("cpu").manual_seed(11)], **call).images[0]
    assert np.abs(_pixels(old) - _pixels(ours)).mean() > 1


def _reference(checkpoint_path):
    return checkpoints.read_state(checkpoint_path)["model"]["_extra_state"]["description"]["model_ref"]


def test_a_model_without_zero_terminal_snr_exports_the_reference_schedule_as_before(fake_checkpoint, tiny_kit,
                                                                                     tmp_path):
    """Both an old checkpoint (no schedule recorded) and a new one trained without ZTSNR."""
    state = torch.load(fake_checkpoint, weights_only=False)
    state["state"]["model"]["_extra_state"]["noise_schedule"] = loading.noise_schedule_of(
        _scheduler_config(tiny_kit))
    recorded = str(tmp_path / "recorded.pt")
    torch.save(state, recorded)
    expected = dict(_scheduler_config(tiny_kit), prediction_type="v_prediction")
    for i, ckpt in enumerate((fake_checkpoint, recorded)):
        out = str(tmp_path / f"pipe{i}")
        export.export_pipeline(ckpt, out)
        assert _scheduler_config(out) == expected
        assert sampling.Sampler(out).zero_terminal_snr is False


@pytest.mark.parametrize("kit", ["tiny_mmdit_kit", "tiny_flux_kit"])
def test_an_exported_transformer_draws_at_its_trained_size_without_one_given(kit, request, tmp_path):
    """A transformer's export sampled by our generate with no size drew at its config's default (64 px for these
    kits; 1,024 for Flux.1), not the size it was trained at: a UNet's export records it in sample_size, an MMDiT's
    or Flux's nowhere. Trained here at 32 px."""
    ref = request.getfixturevalue(kit)
    space = loading.latent_space_of(loading.load_vae_config(ref))
    checkpoint = train_tiny_checkpoint(ref, str(tmp_path / "ckpt"), "model.objective=flow", "model.prediction_type=null",
                                       batches=2, latent_space=space, resolution=32,
                                       text_encoder_type="clip_text_model" if kit == "tiny_mmdit_kit" else None)
    out = str(tmp_path / "pipe")
    export.main(["--checkpoint", checkpoint, "--out", out])
    ours = generate.generate_images(checkpoint, PROMPTS[:1], steps=2, guidance_scale=4.0, seed=3)[0]
    exported = generate.generate_images(out, PROMPTS[:1], steps=2, guidance_scale=4.0, seed=3)[0]
    assert ours.size == exported.size == (32, 32)
    assert np.abs(_pixels(exported) - _pixels(ours)).max() <= 1
