"""Token routing (issue 28 item 2, TREAD): a share of each sample's image tokens skips a span of MMDiT
blocks and rejoins unchanged; every patch is predicted; eval never routes; FLOPs as spent; the draws
are keyed like every other, so microbatches do not change the step."""

import math
import os

import pytest
import torch

from diffusion import schema
from diffusion.errors import ConfigError
from diffusion.train.config import FlowConfig, ModelConfig, RoutingConfig, load_config
from diffusion.loader.batches import NoiseDraws
from diffusion.models.latent_diffusion import build_model
from diffusion.models.masking import PatchMask
from train_fixtures import fit_in_process, kit_text_dim, tiny_overrides, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _model(kit, ratio=0.5, start=1, end=-1):
    info = schema.DatasetInfo(model=kit, scaling_factor=0.18215, resolutions=[64], text_dim=kit_text_dim(kit))
    return build_model(ModelConfig(ref=kit, resolution=64, objective="flow", flow=FlowConfig(),
                                   routing=RoutingConfig(ratio=ratio, start=start, end=end)), info)


def _batch(model, keys, ratio=0.5):
    g = torch.Generator().manual_seed(0)
    n = len(keys)
    batch = {schema.BATCH_MOMENTS: torch.cat([torch.randn(n, 4, 8, 8, generator=g), torch.full((n, 4, 8, 8), -8.0)], 1),
             schema.BATCH_TEXT_EMBEDS: torch.randn(n, 77, model.text_dim, generator=g)}
    batch.update(NoiseDraws(seed=1, route=PatchMask(ratio, 2))(keys, 0, (4, 8, 8)))
    return batch


def test_routed_tokens_skip_the_span_unchanged_and_the_others_pass_it(mmdit_train_kit):
    model = _model(mmdit_train_kit, ratio=0.5, start=1, end=3).train()  # 4 blocks: 1 and 2 routed around
    batch = _batch(model, ["a", "b"])
    route = batch[schema.BATCH_ROUTE_KEEP]
    assert route.shape == (2, math.ceil(0.5 * 16)) and not torch.equal(route[0], route[1])
    blocks = model.denoiser.transformer_blocks
    seen = {}

    def keep_input(name):
        def hook(module, args, kwargs):
            seen.setdefault(name, kwargs["hidden_states"])
        return hook

    def keep_output(module, args, output):
        seen.setdefault("span_out", output[1])
    # registered before the forward registers the routing's own hooks, so they run first: block 1 sees
    # every token before the cut, block 2's output is seen before the rejoin
    handles = [blocks[1].register_forward_pre_hook(keep_input("before"), with_kwargs=True),
               blocks[2].register_forward_pre_hook(keep_input("inside"), with_kwargs=True),
               blocks[3].register_forward_pre_hook(keep_input("after"), with_kwargs=True),
               blocks[2].register_forward_hook(keep_output)]
    try:
        out = model(batch)
    finally:
        for h in handles:
            h.remove()
    before, inside, after, span_out = seen["before"], seen["inside"], seen["after"], seen["span_out"]
    assert before.shape[1] == after.shape[1] == 16 and inside.shape[1] == 8  # the span sees 8 of 16 patches
    for i in range(2):
        skipped = torch.ones(16, dtype=torch.bool)
        skipped[route[i]] = False
        torch.testing.assert_close(after[i, route[i]], span_out[i])  # through the span
        torch.testing.assert_close(after[i, skipped], before[i, skipped])  # around it, unchanged
        assert not torch.allclose(after[i, route[i]], before[i, route[i]])
    # every patch is predicted and in the loss (no mask)
    assert "loss_mask" not in out and (out["prediction"] != 0).all()


def test_routing_nothing_is_the_plain_forward_and_eval_never_routes(mmdit_train_kit):
    model = _model(mmdit_train_kit).train()
    batch = _batch(model, ["a", "b"])
    noisy, t, text = torch.randn(2, 4, 8, 8), torch.tensor([100.0, 700.0]), torch.randn(2, 77, model.text_dim)
    plain = model.adapter(model.denoiser, noisy, t, text)
    every = torch.arange(16).expand(2, 16)
    routed_all = model.adapter(model.denoiser, noisy, t, text, route=every, route_span=model.route_span)
    torch.testing.assert_close(routed_all, plain, rtol=1e-5, atol=1e-6)
    some = model.adapter(model.denoiser, noisy, t, text, route=batch[schema.BATCH_ROUTE_KEEP],
                         route_span=model.route_span)
    assert not torch.allclose(some, plain)
    model.eval()
    out = model.eval_forward(batch)  # the batch carries a route: eval ignores it
    model.eval_seed = 0
    unrouted = _model(mmdit_train_kit, ratio=0.0)
    unrouted.load_state_dict(model.state_dict())
    torch.testing.assert_close(out["prediction"], unrouted.eval().eval_forward(batch)["prediction"])


def test_a_routed_step_spends_the_span_on_the_routed_share_only(mmdit_train_kit):
    model = _model(mmdit_train_kit, ratio=0.5, start=1, end=3)
    config, adapter = dict(model.denoiser.config), model.adapter
    full = adapter.forward_flops(config, 8, 64, 77)
    routed = adapter.forward_flops(config, 8, 64, 77, route_ratio=0.5, route_span=(1, 3))
    blocks, image, text = config["num_layers"], 16, 77
    per_block = full / blocks
    expected = per_block * (2 + 2 * (text + 0.5 * image) / (text + image))  # blocks 0 and 3 whole
    assert routed < full and routed == pytest.approx(expected, rel=0.05)
    batch = _batch(model, ["a", "b"])
    assert model.flops_per_batch(batch) == pytest.approx(3 * routed * 2)
    del batch[schema.BATCH_ROUTE_KEEP]
    assert model.flops_per_batch(batch) == pytest.approx(3 * full * 2)


def test_routing_is_refused_where_it_cannot_run(train_kit, mmdit_train_kit):
    info = schema.DatasetInfo(model=train_kit, scaling_factor=0.18215, resolutions=[64], text_dim=kit_text_dim(train_kit))
    with pytest.raises(ConfigError, match="no tokens to route"):
        build_model(ModelConfig(ref=train_kit, resolution=64, routing=RoutingConfig(ratio=0.5)), info)
    with pytest.raises(ConfigError, match=r"model.routing.start=3, end=2: the MMDiT has 4 blocks"):
        _model(mmdit_train_kit, start=3, end=2)
    with pytest.raises(ConfigError, match="either masks patches or routes tokens"):
        load_config(os.path.join(ROOT, "yamls", "tiny-mmdit-flow-cpu.yaml"),
                    ["model.routing.ratio=0.5", "model.masking.ratio=0.5"])


@pytest.mark.slow
def test_routed_steps_are_the_same_whatever_the_microbatch(mmdit_train_kit, tmp_path):
    mds = write_latent_mds(str(tmp_path / "mds"), kit=mmdit_train_kit, n=16)
    common = ("model.prediction_type=null", "model.objective=flow", "model.routing.ratio=0.5",
              "optimizer.eps=1.0", "optimizer.lr=0.05", "trainer.grad_clip_norm=null",
              "algorithms={}", "data.train.shuffle=false", "data.train.num_workers=0")
    yaml = os.path.join(ROOT, "yamls", "tiny-mmdit-flow-cpu.yaml")
    whole, _ = fit_in_process(load_config(yaml, tiny_overrides(mmdit_train_kit, mds, batches=2, extra=common)))
    split, _ = fit_in_process(load_config(yaml, tiny_overrides(mmdit_train_kit, mds, batches=2, extra=(
        *common, "trainer.device_train_microbatch_size=2"))))
    unrouted, _ = fit_in_process(load_config(yaml, tiny_overrides(mmdit_train_kit, mds, batches=2, extra=(
        *common, "model.routing.ratio=0.0"))))
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-5, atol=1e-6, msg=name)
    assert any(not torch.allclose(unrouted[n], whole[n]) for n in whole)  # routing changed the steps
