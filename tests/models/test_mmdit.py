"""The MMDiT (SD3's transformer) as a denoiser: it trains with every objective, flow steps are the same
whatever the microbatching, the held-out loss is reported per noise-level bin, and resume is exact."""

import os

import pytest
import torch

from diffusion.train.config import load_config
from train_fixtures import fit_in_process, tiny_overrides, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "yamls", "tiny-mmdit-flow-cpu.yaml")


@pytest.fixture(scope="module")
def mds(mmdit_train_kit, tmp_path_factory):
    return write_latent_mds(str(tmp_path_factory.mktemp("mmdit_mds") / "mds"), kit=mmdit_train_kit, n=32)


def _cfg(kit, mds, *extra, batches=4, batch_size=8):
    overrides = tiny_overrides(kit, mds, batches=batches, batch_size=batch_size, extra=(
        "model.prediction_type=null", "data.train.num_workers=0", *extra))
    return load_config(TINY, overrides)


class _Losses:
    def __new__(cls):
        from composer.core import Callback

        class Losses(Callback):
            def __init__(self):
                self.train, self.eval = [], {}

            def after_train_batch(self, state, logger):
                self.train.append(float(state.loss))

            def eval_end(self, state, logger):
                self.eval.update({k: float(v) for k, v in state.eval_metric_values.items()})
        return Losses()


@pytest.mark.parametrize("objective", ["flow", "epsilon", "v_prediction"])
def test_the_tiny_mmdit_trains_its_loss_down(mmdit_train_kit, mds, objective):
    losses = _Losses()
    cfg = _cfg(mmdit_train_kit, mds, f"model.objective={objective}", "trainer.seed=3", "data.train.shuffle=false",
               "optimizer.lr=2e-3", batches=20)
    weights, _ = fit_in_process(cfg, callbacks=[losses])
    assert any(name.startswith("denoiser.transformer_blocks.") for name in weights)  # it was the MMDiT
    # last 8 over first 8 after 20 batches: about 0.55 (flow), 0.34 (epsilon), 0.65 (v); after 40: 0.44, 0.20, 0.51
    first, last = sum(losses.train[:8]) / 8, sum(losses.train[-8:]) / 8
    assert len(losses.train) == 20 and last < 0.8 * first, (objective, first, last)


def test_flow_steps_are_the_same_whatever_the_microbatch(mmdit_train_kit, mds):
    """Every flow draw (posterior, noise, σ) comes with the sample: one global batch gives one gradient."""
    common = ("model.objective=flow", "optimizer.eps=1.0", "optimizer.lr=0.05", "trainer.grad_clip_norm=null",
              "algorithms={}", "data.train.shuffle=false")
    whole, _ = fit_in_process(_cfg(mmdit_train_kit, mds, *common, batches=3))
    split, _ = fit_in_process(_cfg(mmdit_train_kit, mds, *common, "trainer.device_train_microbatch_size=2",
                                   batches=3))
    moved = [n for n in whole if not torch.equal(whole[n], _initial(mmdit_train_kit)[n])]
    assert moved  # training changed the weights
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-5, atol=1e-6, msg=name)


def _initial(kit):
    from diffusion.models import denoisers
    adapter = denoisers.adapter("SD3Transformer2DModel")
    return {"denoiser." + k: v for k, v in adapter.build(adapter.load_config(kit), seed=17).state_dict().items()}


class _EvalCalls:
    """The denoiser calls of each eval: (rows, levels) per call, from the model's own ``_denoise``."""

    def __new__(cls):
        from composer.core import Callback

        class EvalCalls(Callback):
            def __init__(self):
                self.calls = []

            def fit_start(self, state, logger):
                model, denoise = state.model, state.model._denoise

                def counted(latents, noise, input_noise, levels, *args, **kwargs):
                    if not model.training:
                        self.calls.append((len(latents), levels.tolist()))
                    return denoise(latents, noise, input_noise, levels, *args, **kwargs)
                model._denoise = counted
        return EvalCalls()


@pytest.mark.parametrize("objective", ["flow", "v_prediction"])
def test_held_out_loss_is_reported_per_noise_level_bin(mmdit_train_kit, mds, objective):
    """``model.eval_bins``: MLPerf's protocol, each held-out sample at one of the fixed levels in turn
    (sample i at level i mod bins, sigma = k/bins), ONE denoiser call a sample, the same in any run,
    logged per bin; ``model.eval_protocol=all_levels``: every sample at every bin."""
    losses, calls = _Losses(), _EvalCalls()
    cfg = _cfg(mmdit_train_kit, mds, f"model.objective={objective}", "model.eval_bins=4", f"data.eval.path={mds}",
               "data.eval.batch_size=8", "data.eval.num_workers=0", "trainer.eval_interval=2ba", "algorithms={}",
               batches=2)
    fit_in_process(cfg, callbacks=[losses, calls])
    bins = [losses.eval[f"loss_bin{k}"] for k in range(4)]
    assert "loss" in losses.eval and len(set(bins)) == 4 and all(b > 0 for b in bins)
    # one eval of the 32 held-out samples: 4 batches, one call each, 8 levels in turn per batch
    assert [rows for rows, _ in calls.calls] == [8] * 4
    levels = [0.0, 0.25, 0.5, 0.75] if objective == "flow" else [0, 250, 500, 750]  # sigma = k/4, t = kT/4
    assert sorted({level for _, lv in calls.calls for level in lv}) == levels
    assert losses.eval["loss"] == pytest.approx(sum(bins) / 4, rel=1e-5)  # 8 samples a level
    again = _Losses()
    fit_in_process(cfg, callbacks=[again])
    assert [again.eval[f"loss_bin{k}"] for k in range(4)] == bins  # comparable across runs
    if objective == "flow":  # the earlier protocol, by name: a pinned random level and every bin's, 5 calls a batch
        every, calls = _Losses(), _EvalCalls()
        fit_in_process(_cfg(mmdit_train_kit, mds, "model.objective=flow", "model.eval_bins=4",
                            "model.eval_protocol=all_levels", f"data.eval.path={mds}", "data.eval.batch_size=8",
                            "data.eval.num_workers=0", "trainer.eval_interval=2ba", "algorithms={}", batches=2),
                       callbacks=[every, calls])
        assert [rows for rows, _ in calls.calls] == [8] * 20
        assert len({every.eval[f"loss_bin{k}"] for k in range(4)}) == 4 and every.eval["loss_bin0"] != bins[0]


def test_flow_resume_is_exact(mmdit_train_kit, mds, tmp_path):
    """Stop at batch 2, resume to 4: the weights and EMA of a straight 4-batch run."""
    common = ("model.objective=flow", "data.train.shuffle=true", "trainer.save_interval=2ba")
    straight, _ = fit_in_process(_cfg(mmdit_train_kit, mds, *common, batches=4))
    folder = str(tmp_path / "ckpt")
    fit_in_process(_cfg(mmdit_train_kit, mds, *common, f"trainer.save_folder={folder}", batches=2))
    resumed, trained = fit_in_process(_cfg(mmdit_train_kit, mds, *common, f"trainer.save_folder={folder}",
                                           "trainer.autoresume=true", batches=4))
    assert len(trained) == 2  # it resumed at batch 2: only batches 3 and 4 were trained here
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_mmdit_trains_from_token_ids_on_a_mix_of_datasets(mmdit_train_kit, tiny_mmdit_kit, tmp_path):
    """The frozen text encoder in the step and ``data.train.streams`` serve the MMDiT as they serve the UNet:
    from ids, the step conditions on the encoder's output (losses equal to training on its stored embeddings)."""
    ids = [write_latent_mds(str(tmp_path / f"ids{i}"), kit=mmdit_train_kit, n=16, seed=i, text="ids",
                            text_encoder=tiny_mmdit_kit) for i in range(2)]
    embeds = [write_latent_mds(str(tmp_path / f"embeds{i}"), kit=mmdit_train_kit, n=16, seed=i, text="embeds",
                               text_encoder=tiny_mmdit_kit) for i in range(2)]
    runs = {}
    for name, paths in (("ids", ids), ("embeds", embeds)):
        losses = _Losses()
        streams = "[" + ", ".join(f"{{path: {p}, proportion: 0.5}}" for p in paths) + "]"
        cfg = _cfg(mmdit_train_kit, paths[0], "model.objective=flow", "data.train.path=null",
                   f"data.train.streams={streams}", f"model.text={name}", "data.train.shuffle=false", batches=3)
        fit_in_process(cfg, callbacks=[losses])
        runs[name] = losses.train
    assert len(runs["ids"]) == 3
    assert runs["ids"] == pytest.approx(runs["embeds"], rel=1e-3)


@pytest.mark.parametrize("kit_name", ["train_kit", "mmdit_train_kit"])
def test_both_denoisers_train_on_an_aspect_ratio_bucket(kit_name, request):
    """A bucket's latents are H/8 x W/8 at about the model's pixel count (issue 27): the UNet and the MMDiT
    (masked too) take them, and the FLOPs counted are the bucket's."""
    from diffusion import schema
    from diffusion.train.config import MaskingConfig, ModelConfig
    from diffusion.loader.batches import NoiseDraws
    from diffusion.models.latent_diffusion import build_model
    from diffusion.models.masking import PatchMask
    from train_fixtures import kit_text_dim
    kit = request.getfixturevalue(kit_name)
    mmdit = kit_name == "mmdit_train_kit"
    info = schema.DatasetInfo(model=kit, scaling_factor=0.18215, resolutions=[64], text_dim=kit_text_dim(kit))
    model = build_model(ModelConfig(ref=kit, resolution=64, objective="flow" if mmdit else "epsilon",
                                    masking=MaskingConfig(ratio=0.5 if mmdit else 0.0)), info).train()
    keys = ["a", "b"]
    moments = torch.cat([torch.randn(2, 4, 6, 10), torch.full((2, 4, 6, 10), -8.0)], dim=1)  # a 48x80 bucket
    batch = {schema.BATCH_MOMENTS: moments, schema.BATCH_TEXT_EMBEDS: torch.randn(2, 77, model.text_dim),
             **NoiseDraws(seed=0, mask=PatchMask(0.5, 2) if mmdit else None)(keys, 0, (4, 6, 10))}
    out = model(batch)
    assert out["prediction"].shape == (2, 4, 6, 10)
    loss = model.loss(out, batch)
    loss.backward()
    assert torch.isfinite(loss) and any(p.grad is not None for p in model.denoiser.parameters())
    square = {**batch, schema.BATCH_MOMENTS: torch.cat([torch.randn(2, 4, 8, 8), torch.full((2, 4, 8, 8), -8.0)], 1)}
    square.pop(schema.BATCH_PATCH_KEEP, None)
    assert model.flops_per_batch(batch) < model.flops_per_batch(square)  # 60 latent pixels, not 64


def test_a_t5_is_unmasked_by_default_under_the_mmdit_as_sd3_trains_it():
    """Issue 47, item 14: SD3 (and Flux) train T5's sequence unmasked, and any attention mask keeps SDPA off
    its flash kernel; the UNet (and a T5 asked for with model.text_mask) keeps the mask, CLIP never had one."""
    from diffusion import schema
    from diffusion.models.latent_diffusion import text_mask_of
    from diffusion.train.config import ModelConfig
    t5 = schema.DatasetInfo(model="kit", scaling_factor=0.18215, resolutions=[64], text_dim=64, text_encoder_type="t5")
    clip = schema.DatasetInfo(model="kit", scaling_factor=0.18215, resolutions=[64], text_dim=64)
    assert not text_mask_of(ModelConfig(), t5, "SD3Transformer2DModel")
    assert not text_mask_of(ModelConfig(), t5, "FluxTransformer2DModel")  # one T5 under Flux: as FluxPipeline
    assert text_mask_of(ModelConfig(), t5, "UNet2DConditionModel")
    assert text_mask_of(ModelConfig(text_mask=True), t5, "SD3Transformer2DModel")
    assert not text_mask_of(ModelConfig(), clip, "SD3Transformer2DModel")


def test_the_adapter_is_found_through_fsdp1_checkpoint_compile_and_ddp_wrappers():
    """The sampler (the image logger's grid, generate) looks the adapter up from the module it is handed; under
    FSDP1 (the SD2 YAMLs) that is FSDP's wrapper, with checkpointing and compile inside it (it used to fail at
    the first grid: "model.denoiser='FullyShardedDataParallel': no adapter for it")."""
    from diffusers import SD3Transformer2DModel
    from torch.distributed.algorithms._checkpoint.checkpoint_wrapper import checkpoint_wrapper
    from diffusion.models import denoisers

    class Wrapper(torch.nn.Module):  # FSDP1 keeps the wrapped module in _fsdp_wrapped_module, DDP in module
        def __init__(self, name, inner):
            super().__init__()
            setattr(self, name, inner)

    with torch.device("meta"):
        model = SD3Transformer2DModel(sample_size=8, patch_size=2, in_channels=4, out_channels=4, num_layers=1,
                                      attention_head_dim=8, num_attention_heads=2, joint_attention_dim=16,
                                      caption_projection_dim=16, pooled_projection_dim=16)
    mmdit = denoisers.adapter("SD3Transformer2DModel")
    assert denoisers.adapter_for(Wrapper("_fsdp_wrapped_module", checkpoint_wrapper(torch.compile(model)))) is mmdit
    assert denoisers.adapter_for(Wrapper("module", model)) is mmdit
    with pytest.raises(ValueError, match="model.denoiser='Wrapper': no adapter for it"):
        denoisers.adapter_for(Wrapper("module", torch.nn.Linear(1, 1)))
