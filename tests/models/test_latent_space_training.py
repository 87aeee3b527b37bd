"""Training in the latent space dataset.json records: a 16-channel AutoencoderKL's moments (with a shift
factor) and an AutoencoderDC's deterministic latents train the tiny MMDiT; an old dataset.json means SD's
VAE; a mix of two latent spaces and a denoiser of other channels are refused in one line."""

import json
import os

import pytest
import torch

from diffusion import schema
from diffusion.errors import ConfigError, DatasetMismatchError
from diffusion.models import loading
from diffusion.train.config import load_config
from train_fixtures import fit_in_process, tiny_overrides, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "yamls", "tiny-mmdit-flow-cpu.yaml")
FLOW = {"shift": 1.0, "num_train_timesteps": 1000}


def _space(kit) -> schema.LatentSpace:
    return loading.latent_space_of(loading.load_vae_config(kit))


def _cfg(kit, mds, *extra, batches=4):
    overrides = tiny_overrides(kit, mds, batches=batches, batch_size=8, extra=(
        "model.prediction_type=null", "data.train.num_workers=0", *extra))
    return load_config(TINY, overrides)


def test_an_old_dataset_json_is_sds_4_channel_vae_with_its_recorded_scaling():
    old = {"model": "m", "scaling_factor": 0.13025, "resolutions": [64], "text_dim": 64, "downsample": 8}
    space = schema.DatasetInfo.from_dict(old).latent_space
    assert space == schema.LatentSpace("AutoencoderKL", 4, 8, 0.13025, 0.0, schema.MOMENTS)
    assert space.column(64) == "vae_moments_64" and space.stored_channels == 8


def test_latents_are_shifted_then_scaled_once(tiny_vae16_kit, tiny_dcae_kit):
    from diffusion.models.latent_diffusion import LatentDiffusion
    from diffusion.models import denoisers, objectives
    for kit in (tiny_vae16_kit, tiny_dcae_kit):
        space = _space(kit)
        adapter = denoisers.adapter("SD3Transformer2DModel")
        model = LatentDiffusion(adapter.build(adapter.load_config(kit)), objectives.from_description("flow", FLOW),
                                model_ref=kit, resolution=64, latent_space=space)
        h = 64 // space.downsample
        mean = torch.randn(2, space.channels, h, h)
        stored = torch.cat([mean, torch.full_like(mean, -30.0)], 1) if space.stored == schema.MOMENTS else mean
        expected = (mean - space.shift_factor) * space.scaling_factor
        torch.testing.assert_close(model.sample_latents(stored, eps=torch.zeros_like(mean)), expected)
        assert model.description.latent_space == space.to_dict()


@pytest.mark.parametrize("kit_name", ["tiny_vae16_kit", "tiny_dcae_kit"])
def test_the_tiny_mmdit_trains_in_each_latent_space(kit_name, request, tmp_path):
    kit = request.getfixturevalue(kit_name)
    space = _space(kit)
    mds = write_latent_mds(str(tmp_path / "mds"), kit=kit, n=16, latent_space=space)
    losses = []
    from composer.core import Callback

    class Losses(Callback):
        def after_train_batch(self, state, logger):
            losses.append(float(state.loss))

    fit_in_process(_cfg(kit, mds, batches=3), callbacks=[Losses()])
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))


def test_a_mix_of_two_latent_spaces_is_refused_in_one_line(tiny_vae16_kit, mmdit_train_kit, tmp_path):
    from diffusion.train.trainer import build_trainer
    sixteen = write_latent_mds(str(tmp_path / "a"), kit=tiny_vae16_kit, n=16, latent_space=_space(tiny_vae16_kit))
    four = write_latent_mds(str(tmp_path / "b"), kit=tiny_vae16_kit, n=16)
    streams = f"[{{path: {sixteen}, proportion: 0.5}}, {{path: {four}, proportion: 0.5}}]"
    cfg = _cfg(tiny_vae16_kit, sixteen, f"data.train.streams={streams}", "data.train.path=null")
    with pytest.raises(DatasetMismatchError) as error:
        build_trainer(cfg)
    message = str(error.value)
    assert "\n" not in message and "streams[1]" in message and "16 channels" in message and "4 channels" in message


def test_a_denoiser_of_other_channels_is_refused_naming_in_channels(tiny_vae16_kit, mmdit_train_kit, tmp_path):
    from diffusion.train.trainer import build_trainer
    mds = write_latent_mds(str(tmp_path / "mds"), kit=tiny_vae16_kit, n=16, latent_space=_space(tiny_vae16_kit))
    with pytest.raises(ConfigError) as error:
        build_trainer(_cfg(mmdit_train_kit, mds))  # the 4-channel tiny MMDiT on 16-channel data
    message = str(error.value)
    assert "\n" not in message and "in_channels=4" in message and "16 channels" in message


def test_the_dataset_json_of_a_16_channel_mix_agrees(tiny_vae16_kit, tmp_path):
    from diffusion.loader.dataset_info import read_dataset_info
    mds = write_latent_mds(str(tmp_path / "mds"), kit=tiny_vae16_kit, n=8, latent_space=_space(tiny_vae16_kit))
    with open(os.path.join(mds, schema.DATASET_JSON)) as f:
        recorded = json.load(f)
    assert recorded["latent_channels"] == 16 and recorded["shift_factor"] == pytest.approx(0.1)
    assert read_dataset_info(mds).latent_space == _space(tiny_vae16_kit)


def test_a_later_phase_in_another_latent_space_is_refused(tiny_vae16_kit):
    import dataclasses
    from diffusion.models import objectives
    from diffusion.models.latent_diffusion import LatentDiffusion
    from diffusion.models import denoisers
    adapter = denoisers.adapter("SD3Transformer2DModel")
    space = _space(tiny_vae16_kit)

    def model(s):
        return LatentDiffusion(adapter.build(adapter.load_config(tiny_vae16_kit)),
                               objectives.from_description("flow", FLOW), model_ref=tiny_vae16_kit, resolution=64,
                               latent_space=s)
    state = model(space).get_extra_state()
    model(dataclasses.replace(space, scaling_factor=0.3)).set_extra_state(state)  # a new scale: warned, allowed
    with pytest.raises(ConfigError, match="latent space") as error:
        model(dataclasses.replace(space, shift_factor=0.0)).set_extra_state(state)
    assert "\n" not in str(error.value)
