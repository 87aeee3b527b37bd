"""Deferred patch masking (issue 28): the per-sample mask, the routing through the MMDiT's own forward,
the loss over kept patches, unmasked eval, FLOPs actually spent, microbatch invariance."""

import math
import os

import pytest
import torch

from diffusion import schema
from diffusion.train.config import FlowConfig, MaskingConfig, ModelConfig, load_config
from diffusion.loader.batches import NoiseDraws
from diffusion.models.latent_diffusion import build_model
from diffusion.models.masking import PatchMask
from train_fixtures import fit_in_process, kit_text_dim, tiny_overrides, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model(kit, ratio=0.75, mixer_blocks=1):
    info = schema.DatasetInfo(model=kit, scaling_factor=0.18215, resolutions=[64], text_dim=kit_text_dim(kit))
    return build_model(ModelConfig(ref=kit, resolution=64, objective="flow", flow=FlowConfig(),
                                   masking=MaskingConfig(ratio=ratio, mixer_blocks=mixer_blocks)), info)


def _batch(model, keys, ratio=0.75, epoch=0):
    g = torch.Generator().manual_seed(0)
    n = len(keys)
    batch = {schema.BATCH_MOMENTS: torch.cat([torch.randn(n, 4, 8, 8, generator=g), torch.full((n, 4, 8, 8), -8.0)], 1),
             schema.BATCH_TEXT_EMBEDS: torch.randn(n, 77, model.text_dim, generator=g)}
    batch.update(NoiseDraws(seed=1, mask=PatchMask(ratio, 2))(keys, epoch, (4, 8, 8)))
    return batch


def test_the_mask_keeps_the_ceiling_share_differs_per_sample_and_epoch():
    mask = PatchMask(0.75, 2)
    keys = [f"{i:04d}" for i in range(64)]
    first = NoiseDraws(seed=3, mask=mask)(keys, 0, (4, 8, 10))[schema.BATCH_PATCH_KEEP]  # 4 x 5 = 20 patches
    assert first.shape == (64, math.ceil(0.25 * 20)) == (64, 5)
    assert all(len(set(row.tolist())) == 5 and row.tolist() == sorted(row.tolist()) for row in first)
    assert len({tuple(row.tolist()) for row in first}) > 50  # samples differ
    again = NoiseDraws(seed=3, mask=mask)(keys, 0, (4, 8, 10))[schema.BATCH_PATCH_KEEP]
    later = NoiseDraws(seed=3, mask=mask)(keys, 1, (4, 8, 10))[schema.BATCH_PATCH_KEEP]
    assert torch.equal(first, again) and not torch.equal(first, later)
    # drawn last: switching masking on changes none of the other draws
    plain = NoiseDraws(seed=3)(keys, 0, (4, 8, 10))
    masked = NoiseDraws(seed=3, mask=mask)(keys, 0, (4, 8, 10))
    assert all(torch.equal(plain[k], masked[k]) for k in plain)


def test_keeping_every_patch_is_the_plain_forward(mmdit_train_kit):
    """The routing is hooks on the model's own forward: keep = all patches gives the plain prediction."""
    model = _model(mmdit_train_kit).train()
    batch = _batch(model, ["a", "b"])
    noisy, text, t = torch.randn(2, 4, 8, 8), batch[schema.BATCH_TEXT_EMBEDS], torch.tensor([300.0, 700.0])
    every = torch.arange(16).repeat(2, 1)
    plain = model.adapter(model.denoiser, noisy, t, text)
    routed = model.adapter(model.denoiser, noisy, t, text, keep=every, mixer_blocks=1)
    torch.testing.assert_close(routed, plain, rtol=1e-5, atol=1e-5)
    some = model.adapter(model.denoiser, noisy, t, text, keep=every[:, :4], mixer_blocks=1)
    assert (some[:, :, 4:, :] == 0).all() and not torch.allclose(some[:, :, :4, :4], plain[:, :, :4, :4])


def test_the_loss_is_taken_over_the_kept_patches_only(mmdit_train_kit):
    model = _model(mmdit_train_kit).train()
    batch = _batch(model, ["a", "b", "c"])
    out = model(batch)
    keep = batch[schema.BATCH_PATCH_KEEP]
    expected = []
    for i in range(3):  # a direct computation: patchify, take the kept patches, mean square
        diff = (out["prediction"][i] - out["target"][i]) ** 2  # (4, 8, 8)
        patches = diff.reshape(4, 4, 2, 4, 2).permute(1, 3, 0, 2, 4).reshape(16, -1)
        expected.append(patches[keep[i]].mean())
    torch.testing.assert_close(model.loss(out, batch), torch.stack(expected).mean(), rtol=1e-5, atol=1e-7)
    dropped = torch.ones(16, dtype=torch.bool)
    dropped[keep[0]] = False
    pred = out["prediction"][0].reshape(4, 4, 2, 4, 2).permute(1, 3, 0, 2, 4).reshape(16, -1)
    assert (pred[dropped] == 0).all()  # the backbone never computed the dropped patches


def test_eval_and_sampling_never_mask(mmdit_train_kit):
    model = _model(mmdit_train_kit).eval()
    batch = _batch(model, ["a", "b"])
    out = model.eval_forward(batch)
    assert "loss_mask" not in out and (out["prediction"] != 0).all()


def test_a_masked_step_spends_mixer_plus_kept_share_of_the_backbone(mmdit_train_kit):
    """FLOPs counted on the real shapes: masked ≈ mixer + (1 − r)·backbone of the unmasked forward."""
    model = _model(mmdit_train_kit, ratio=0.75, mixer_blocks=1)
    config, adapter = dict(model.denoiser.config), model.adapter
    full = adapter.forward_flops(config, 8, 64, 77)
    masked = adapter.forward_flops(config, 8, 64, 77, mask_ratio=0.75, mixer_blocks=1)
    blocks, image, text = config["num_layers"], 16, 77
    per_block = full / blocks  # the embedders and the output layer are a few percent
    # the mixer block sees every token; the others the 77 text tokens and a quarter of the 16 patches
    expected = per_block * (1 + (blocks - 1) * (text + 0.25 * image) / (text + image))
    assert masked < full
    assert masked == pytest.approx(expected, rel=0.05)
    batch = _batch(model, ["a", "b"])
    assert model.flops_per_batch(batch) == pytest.approx(3 * masked * 2)
    del batch[schema.BATCH_PATCH_KEEP]
    assert model.flops_per_batch(batch) == pytest.approx(3 * full * 2)


def test_unet_refuses_masking(train_kit):
    from diffusion.errors import ConfigError
    info = schema.DatasetInfo(model=train_kit, scaling_factor=0.18215, resolutions=[64], text_dim=kit_text_dim(train_kit))
    with pytest.raises(ConfigError, match="no patches to mask"):
        build_model(ModelConfig(ref=train_kit, resolution=64, masking=MaskingConfig(ratio=0.5)), info)


def test_masked_steps_are_the_same_whatever_the_microbatch(mmdit_train_kit, tmp_path):
    mds = write_latent_mds(str(tmp_path / "mds"), kit=mmdit_train_kit, n=16)
    common = ("model.prediction_type=null", "model.objective=flow", "model.masking.ratio=0.75",
              "model.masking.mixer_blocks=1", "optimizer.eps=1.0", "optimizer.lr=0.05", "trainer.grad_clip_norm=null",
              "algorithms={}", "data.train.shuffle=false", "data.train.num_workers=0")
    yaml = os.path.join(ROOT, "yamls", "tiny-mmdit-flow-cpu.yaml")
    whole, _ = fit_in_process(load_config(yaml, tiny_overrides(mmdit_train_kit, mds, batches=2, extra=common)))
    split, _ = fit_in_process(load_config(yaml, tiny_overrides(mmdit_train_kit, mds, batches=2, extra=(
        *common, "trainer.device_train_microbatch_size=2"))))
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-5, atol=1e-6, msg=name)
