"""Model references: a local kit directory, a directory that is not a diffusers layout, a hub id offline."""

import pytest

from diffusion.models import loading
from diffusion.models.loading import ModelReferenceError


def test_local_kit_resolves_and_its_components_load(sd2_kit):
    assert loading.resolve_model(sd2_kit) == sd2_kit
    assert loading.load_unet_config(sd2_kit)["cross_attention_dim"] == 1024
    assert loading.vae_downsample(loading.load_vae_config(sd2_kit)) == 8
    assert loading.load_tokenizer(sd2_kit)("a cat").input_ids == [49406, 320, 2368, 49407]
    ddpm = loading.load_scheduler(sd2_kit, "ddpm")
    assert type(ddpm).__name__ == "DDPMScheduler"
    assert (ddpm.config.num_train_timesteps, ddpm.config.prediction_type) == (1000, "epsilon")
    assert ddpm.betas[0].item() == pytest.approx(0.00085) and ddpm.betas[-1].item() == pytest.approx(0.012)


def test_config_only_components_say_weights_are_missing(sd2_kit):
    with pytest.raises(ModelReferenceError, match="no weights"):
        loading.load_vae(sd2_kit)
    with pytest.raises(ModelReferenceError, match="no weights"):
        loading.load_text_encoder(sd2_kit)


@pytest.mark.parametrize("damage", ["cut in half", "a junk header"])
def test_weights_cut_short_or_damaged_are_one_line_naming_the_file(tiny_kit, tmp_path, damage):
    """The converter's start checks (``require_weights``), the VAE's and text encoder's loads, and a denoiser's
    (generate, export): one line naming the file, where diffusers and transformers raised chained tracebacks
    (the converter's from a Ray actor, after the cluster had started)."""
    import shutil
    from diffusion.models import denoisers
    kit = shutil.copytree(tiny_kit, tmp_path / "kit")
    for component in ("vae", "unet"):
        weights = kit / component / "diffusion_pytorch_model.safetensors"
        data = weights.read_bytes()
        weights.write_bytes(data[:len(data) // 2] if damage == "cut in half" else b"junk" * 10 + data[40:])
    message = rf"^{kit}/vae/diffusion_pytorch_model.safetensors does not read as a whole safetensors file .*copy"
    with pytest.raises(ModelReferenceError, match=message):
        loading.require_weights(str(kit), ("text_encoder", "vae"))
    with pytest.raises(ModelReferenceError, match=message):
        loading.load_vae(str(kit))
    adapter = denoisers.adapter("UNet2DConditionModel")
    with pytest.raises(ModelReferenceError, match=rf"^{kit}/unet/diffusion_pytorch_model.safetensors does not read"):
        adapter.from_pretrained(str(kit))


def test_unknown_sampler_is_named(sd2_kit):
    with pytest.raises(ValueError, match="unknown scheduler 'heun'"):
        loading.load_scheduler(sd2_kit, "heun")


def test_directory_that_is_not_a_diffusers_layout(tmp_path):
    (tmp_path / "unet").mkdir()
    (tmp_path / "notes.txt").write_text("not a model")
    with pytest.raises(ModelReferenceError) as err:
        loading.resolve_model(str(tmp_path))
    message = str(err.value)
    assert "not a diffusers layout" in message
    assert all(name in message.split("(expected")[0] for name in ("vae", "text_encoder", "tokenizer", "scheduler"))
    assert "unet" not in message.split("(expected")[0]  # present, so not reported as missing


def test_missing_path_is_not_mistaken_for_a_hub_id(tmp_path):
    with pytest.raises(ModelReferenceError, match="no such directory"):
        loading.resolve_model(str(tmp_path / "no-such-kit"))


def test_hub_id_offline_fails_with_a_helpful_message(tmp_path, monkeypatch):
    import huggingface_hub.constants as hub_constants
    monkeypatch.setattr(hub_constants, "HF_HUB_OFFLINE", True)  # never touch the network
    monkeypatch.setattr(hub_constants, "HF_HUB_CACHE", str(tmp_path))  # and find nothing cached
    with pytest.raises(ModelReferenceError) as err:
        loading.resolve_model("stabilityai/stable-diffusion-2-base")
    assert "stabilityai/stable-diffusion-2-base" in str(err.value)
    assert "python -m diffusion.kit" in str(err.value)


def test_noise_schedule_of_a_scheduler_config(sd2_kit):
    config = dict(loading.load_scheduler(sd2_kit, "ddpm").config)
    schedule = loading.noise_schedule_of(config)
    assert schedule == {"num_train_timesteps": 1000, "beta_schedule": "scaled_linear", "beta_start": 0.00085,
                        "beta_end": 0.012, "trained_betas": None, "rescale_betas_zero_snr": False}
    del config["rescale_betas_zero_snr"]  # configs written by older diffusers lack the key: not rescaled
    assert loading.noise_schedule_of(config)["rescale_betas_zero_snr"] is False
