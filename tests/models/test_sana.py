"""SANA's linear-attention DiT (``SanaTransformer2DModel``) as a denoiser on DC-AE latents (32 channels, /32):
it trains its loss down, is microbatch-invariant, resumes exactly, reads text masks, and refuses masking and
routing in one line naming the key."""

import os

import pytest
import torch

from diffusion.errors import ConfigError
from diffusion.models import denoisers, loading
from diffusion.train.config import load_config
from train_fixtures import fit_in_process, tiny_overrides, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "yamls", "tiny-mmdit-flow-cpu.yaml")


@pytest.fixture(scope="module")
def mds(tiny_sana_kit, tmp_path_factory):
    space = loading.latent_space_of(loading.load_vae_config(tiny_sana_kit))
    return write_latent_mds(str(tmp_path_factory.mktemp("sana_mds") / "mds"), kit=tiny_sana_kit, n=32,
                            latent_space=space)


def _cfg(kit, mds, *extra, batches=4):
    overrides = tiny_overrides(kit, mds, batches=batches, batch_size=8, extra=(
        "model.prediction_type=null", "data.train.num_workers=0", *extra))
    return load_config(TINY, overrides)


def test_the_tiny_sana_trains_its_loss_down_on_dcae_latents(tiny_sana_kit, mds):
    from composer.core import Callback
    losses = []

    class Losses(Callback):
        def after_train_batch(self, state, logger):
            losses.append(float(state.loss))

    cfg = _cfg(tiny_sana_kit, mds, "trainer.seed=3", "data.train.shuffle=false", "optimizer.lr=2e-3", batches=60)
    weights, _ = fit_in_process(cfg, callbacks=[Losses()])
    assert any(name.startswith("denoiser.transformer_blocks.") for name in weights)
    first, last = sum(losses[:8]) / 8, sum(losses[-8:]) / 8
    assert last < 0.8 * first, (first, last)


def test_sana_steps_are_the_same_whatever_the_microbatch(tiny_sana_kit, mds):
    common = ("optimizer.eps=1.0", "optimizer.lr=0.05", "trainer.grad_clip_norm=null", "algorithms={}",
              "data.train.shuffle=false")
    whole, _ = fit_in_process(_cfg(tiny_sana_kit, mds, *common, batches=3))
    split, _ = fit_in_process(_cfg(tiny_sana_kit, mds, *common, "trainer.device_train_microbatch_size=2", batches=3))
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-5, atol=1e-6, msg=name)


def test_sana_resume_is_exact(tiny_sana_kit, mds, tmp_path):
    common = ("data.train.shuffle=true", "trainer.save_interval=2ba")
    straight, _ = fit_in_process(_cfg(tiny_sana_kit, mds, *common, batches=4))
    folder = str(tmp_path / "ckpt")
    fit_in_process(_cfg(tiny_sana_kit, mds, *common, f"trainer.save_folder={folder}", batches=2))
    resumed, trained = fit_in_process(_cfg(tiny_sana_kit, mds, *common, f"trainer.save_folder={folder}",
                                           "trainer.autoresume=true", batches=4))
    assert len(trained) == 2
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=1e-5, atol=1e-6, msg=name)


def test_with_a_text_mask_the_padding_does_not_change_the_prediction(tiny_sana_kit):
    adapter = denoisers.adapter("SanaTransformer2DModel")
    module = adapter.build(adapter.load_config(tiny_sana_kit)).eval()
    latents, t = torch.randn(2, 32, 2, 2), torch.tensor([300.0, 700.0])
    text = torch.randn(2, 10, 64)
    mask = torch.arange(10)[None] < torch.tensor([[4], [7]])
    other = torch.where(mask[..., None], text, torch.randn(2, 10, 64))
    with torch.no_grad():
        a = adapter(module, latents, t, text, text_mask=mask)
        b = adapter(module, latents, t, other, text_mask=mask)
        c = adapter(module, latents, t, other)
    assert a.shape == latents.shape
    torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4)
    assert not torch.allclose(a, c, atol=1e-4)


@pytest.mark.parametrize("key, value", [("model.masking.ratio", "0.5"), ("model.routing.ratio", "0.5")])
def test_masking_and_routing_are_refused_naming_the_key(tiny_sana_kit, mds, key, value):
    from diffusion.train.trainer import build_trainer
    with pytest.raises(ConfigError) as error:
        build_trainer(_cfg(tiny_sana_kit, mds, f"{key}={value}"))
    assert key in str(error.value) and "\n" not in str(error.value)


def test_the_training_step_compiles_without_graph_breaks(tiny_sana_kit, mds):
    """``trainer.compile``: SANA's linear-attention transformer on DC-AE latents in one graph, as the UNet's and the MMDiT's steps are."""
    from train_fixtures import explain_config_step
    explanation = explain_config_step(_cfg(tiny_sana_kit, mds))
    assert explanation.graph_break_count == 0, [str(b.reason) for b in explanation.break_reasons]
    assert explanation.graph_count == 1
