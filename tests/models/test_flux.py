"""Flux.1's transformer (``FluxTransformer2DModel``) as a denoiser: it trains its loss down on 16-channel
latents packed 2x2, is microbatch-invariant, resumes exactly, reads text masks, refuses masking and
routing in one line, and its FLOPs at 256 px match MLPerf's count for Flux.1-schnell."""

import os

import pytest
import torch

from diffusion import schema
from diffusion.errors import ConfigError
from diffusion.models import denoisers, loading
from diffusion.train.config import load_config
from train_fixtures import fit_in_process, tiny_overrides, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "yamls", "tiny-mmdit-flow-cpu.yaml")


@pytest.fixture(scope="module")
def mds(tiny_flux_kit, tmp_path_factory):
    space = loading.latent_space_of(loading.load_vae_config(tiny_flux_kit))
    return write_latent_mds(str(tmp_path_factory.mktemp("flux_mds") / "mds"), kit=tiny_flux_kit, n=32,
                            latent_space=space)


def _cfg(kit, mds, *extra, batches=4):
    overrides = tiny_overrides(kit, mds, batches=batches, batch_size=8, extra=(
        "model.prediction_type=null", "data.train.num_workers=0", *extra))
    return load_config(TINY, overrides)


def _losses():
    from composer.core import Callback

    class Losses(Callback):
        def __init__(self):
            self.train = []

        def after_train_batch(self, state, logger):
            self.train.append(float(state.loss))
    return Losses()


def test_the_tiny_flux_trains_its_loss_down(tiny_flux_kit, mds):
    losses = _losses()
    cfg = _cfg(tiny_flux_kit, mds, "trainer.seed=3", "data.train.shuffle=false", "optimizer.lr=2e-3", batches=40)
    weights, _ = fit_in_process(cfg, callbacks=[losses])
    assert any(name.startswith("denoiser.single_transformer_blocks.") for name in weights)  # it was Flux
    first, last = sum(losses.train[:8]) / 8, sum(losses.train[-8:]) / 8
    assert last < 0.8 * first, (first, last)


def test_flux_steps_are_the_same_whatever_the_microbatch(tiny_flux_kit, mds):
    common = ("optimizer.eps=1.0", "optimizer.lr=0.05", "trainer.grad_clip_norm=null", "algorithms={}",
              "data.train.shuffle=false")
    whole, _ = fit_in_process(_cfg(tiny_flux_kit, mds, *common, batches=3))
    split, _ = fit_in_process(_cfg(tiny_flux_kit, mds, *common, "trainer.device_train_microbatch_size=2", batches=3))
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-5, atol=1e-6, msg=name)


def test_flux_resume_is_exact(tiny_flux_kit, mds, tmp_path):
    common = ("data.train.shuffle=true", "trainer.save_interval=2ba")
    straight, _ = fit_in_process(_cfg(tiny_flux_kit, mds, *common, batches=4))
    folder = str(tmp_path / "ckpt")
    fit_in_process(_cfg(tiny_flux_kit, mds, *common, f"trainer.save_folder={folder}", batches=2))
    resumed, trained = fit_in_process(_cfg(tiny_flux_kit, mds, *common, f"trainer.save_folder={folder}",
                                           "trainer.autoresume=true", batches=4))
    assert len(trained) == 2
    for name in straight:
        torch.testing.assert_close(resumed[name], straight[name], rtol=1e-5, atol=1e-6, msg=name)


def test_packing_round_trips_and_the_prediction_has_the_latents_shape(tiny_flux_kit):
    from diffusion.models.denoisers.flux_transformer import pack, unpack
    latents = torch.randn(2, 16, 8, 6)
    tokens, ids = pack(latents)
    assert tokens.shape == (2, 12, 64) and ids.shape == (12, 3) and ids[-1].tolist() == [0, 3, 2]
    torch.testing.assert_close(unpack(tokens, 8, 6), latents)
    adapter = denoisers.adapter("FluxTransformer2DModel")
    module = adapter.build(adapter.load_config(tiny_flux_kit))
    out = adapter(module, latents, torch.tensor([500.0, 10.0]), torch.randn(2, 7, 64))
    assert out.shape == latents.shape and adapter.latent_channels(dict(module.config)) == 16


def test_with_a_text_mask_the_padding_does_not_change_the_prediction(tiny_flux_kit):
    adapter = denoisers.adapter("FluxTransformer2DModel")
    module = adapter.build(adapter.load_config(tiny_flux_kit))
    adapter.enable_text_mask(module)
    latents, t = torch.randn(2, 16, 8, 8), torch.tensor([300.0, 700.0])
    text = torch.randn(2, 10, 64)
    mask = torch.arange(10)[None] < torch.tensor([[4], [7]])
    other = torch.where(mask[..., None], text, torch.randn(2, 10, 64))  # the same captions, other padding
    with torch.no_grad():
        a = adapter(module, latents, t, text, text_mask=mask)
        b = adapter(module, latents, t, other, text_mask=mask)
        c = adapter(module, latents, t, other)  # unmasked, the padding is read
    torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5)
    assert not torch.allclose(a, c, atol=1e-4)


@pytest.mark.parametrize("key, value", [("model.masking.ratio", "0.5"), ("model.routing.ratio", "0.5")])
def test_masking_and_routing_are_refused_naming_the_key(tiny_flux_kit, mds, key, value):
    from diffusion.train.trainer import build_trainer
    with pytest.raises(ConfigError) as error:
        build_trainer(_cfg(tiny_flux_kit, mds, f"{key}={value}"))
    assert key in str(error.value) and "\n" not in str(error.value)


def test_flux_schnell_flops_at_256_px_match_mlperfs_count():
    from diffusion import cost
    tflop = cost.recipe_gflop_per_image("flux-schnell", 256) / 1000
    assert tflop == pytest.approx(20.3, rel=0.01)  # MLPerf Training v5.1 counts 20.3 TFLOP per sample
    assert schema.LatentSpace(channels=16).stored_channels == 32


def test_the_pooled_column_is_what_the_flux_step_reads(tiny_flux_kit, mds):
    """With the kit's two text encoders the batch carries CLIP's pooled vector (the empty caption's where the
    caption is dropped) and the transformer reads it: another pooled column gives another loss."""
    from diffusion.loader import dataset_info, mds_source
    from diffusion.models.latent_diffusion import build_model
    cfg = _cfg(tiny_flux_kit, mds, "data.train.shuffle=false", "data.train.caption_dropout=0.5")
    info = dataset_info.read_loader_info(cfg.data.train, cfg.model.resolution)
    model = build_model(cfg.model, info).eval()
    assert model.pooled_text and model.description.pooled_text
    loader = mds_source.build_dataloader(cfg.data.train, resolution=64, text_dim=model.text_dim)
    batch = next(iter(loader))
    pooled = batch[schema.BATCH_POOLED_TEXT_EMBEDS]
    dropped = (batch[schema.BATCH_TEXT_EMBEDS] == -1).flatten(1).all(dim=1)  # the stand-in empty caption: all -1
    assert pooled.shape == (8, 64) and 0 < int(dropped.sum()) < 8
    assert bool((pooled[dropped] == -1).all()) and not bool((pooled[~dropped] == -1).any())
    with torch.no_grad():
        loss = model.loss(model.eval_forward(batch), batch)
        again = model.loss(model.eval_forward(batch), batch)
        other = dict(batch, **{schema.BATCH_POOLED_TEXT_EMBEDS: torch.flip(pooled, dims=[0])})
        changed = model.loss(model.eval_forward(other), other)
    assert float(loss) == float(again) and abs(float(changed) - float(loss)) > 1e-6


def test_data_without_the_pooled_column_or_token_ids_are_refused_in_one_line(tiny_flux_kit, mds, tmp_path):
    """Data of one text encoder (or converted before tiny-flux had two) does not train the two-encoder kit; nor
    does model.text=ids, which would encode one encoder's ids in the step."""
    from diffusion.train.trainer import build_trainer
    one = write_latent_mds(str(tmp_path / "one"), kit=tiny_flux_kit, n=8, pooled=False,
                           latent_space=loading.latent_space_of(loading.load_vae_config(tiny_flux_kit)))
    with pytest.raises(ConfigError) as error:
        build_trainer(_cfg(tiny_flux_kit, one))
    assert "pooled_text_embeds" in str(error.value) and "\n" not in str(error.value)
    with pytest.raises(ConfigError) as error:
        build_trainer(_cfg(tiny_flux_kit, mds, "model.text=ids"))
    assert str(error.value).startswith("model.text=ids:") and "\n" not in str(error.value)


def test_the_flux_schnell_kit_holds_fluxs_two_text_encoders(tmp_path):
    """MLPerf's Flux kit (configs only) in FluxPipeline's layout: CLIP-L's 768-wide pooled vector is what its
    transformer's pooled projection reads, T5-XXL's 4096-wide sequence what its joint attention reads."""
    from diffusion.kit.build import build_kit
    kit = str(build_kit("flux-schnell", tmp_path / "kit"))
    config = denoisers.adapter("FluxTransformer2DModel").load_config(kit)
    assert loading.pooled_text_slots(kit) == ("text_encoder", "tokenizer")
    assert loading.pooled_text_width(kit) == config["pooled_projection_dim"] == 768
    assert loading.text_encoder_width(loading.load_text_encoder_config(kit)) == config["joint_attention_dim"] == 4096


def test_the_training_step_compiles_without_graph_breaks(tiny_flux_kit, mds):
    """``trainer.compile``: Flux's transformer (packed latents, position ids, T5 sequence and CLIP's pooled vector) in one graph, as the UNet's and the MMDiT's steps are."""
    from train_fixtures import explain_config_step
    explanation = explain_config_step(_cfg(tiny_flux_kit, mds))
    assert explanation.graph_break_count == 0, [str(b.reason) for b in explanation.break_reasons]
    assert explanation.graph_count == 1


def test_flux_dev_shapes_train_with_one_embedded_guidance_and_sample(tiny_flux_kit, tmp_path, capsys, monkeypatch):
    """Issue 47, item 12: a Flux.1-dev-shaped transformer (``guidance_embeds: true``) crashed in diffusers with a
    TypeError (no guidance given). It trains with ``model.embedded_guidance`` in its guidance embedding (1.0 by
    default) and samples with that value in FluxPipeline's (not the pipeline's default 3.5, which the model never
    read: review of 16ede1b, defect 1); a transformer without the embedding refuses the key in one line."""
    import json
    import shutil

    from diffusion.models import sampling
    from diffusion.models.latent_diffusion import set_embedded_guidance
    from diffusion.sample import generate
    from sampling_helpers import PROMPTS, train_tiny_checkpoint
    kit = str(tmp_path / "kit")
    shutil.copytree(tiny_flux_kit, kit)
    path = os.path.join(kit, "transformer", "config.json")
    with open(path) as f:
        config = json.load(f)
    with open(path, "w") as f:
        json.dump(dict(config, guidance_embeds=True), f)
    adapter = denoisers.adapter("FluxTransformer2DModel")
    module = adapter.build(adapter.load_config(kit))
    set_embedded_guidance(module, None)
    latents, t, text = torch.randn(2, 16, 8, 8), torch.tensor([300.0, 700.0]), torch.randn(2, 7, 64)
    with torch.no_grad():
        default = adapter(module, latents, t, text)
        module.embedded_guidance = 3.5
        other = adapter(module, latents, t, text)
    assert module.embedded_guidance == 3.5 and not torch.allclose(default, other, atol=1e-4)  # the value is read
    space = loading.latent_space_of(loading.load_vae_config(kit))
    checkpoint = train_tiny_checkpoint(kit, str(tmp_path / "run"), "model.objective=flow", "model.prediction_type=null",
                                       "model.embedded_guidance=2.5", batches=1, latent_space=space)
    trained = sampling.load_trained(checkpoint)
    # sampled at the value it was trained with (not the module default 1.0, nor FluxPipeline's 3.5): recorded
    assert trained.denoiser.config.guidance_embeds and trained.denoiser.embedded_guidance == 2.5
    from diffusion.sample import export
    capsys.readouterr()
    export.main(["--checkpoint", checkpoint, "--out", str(tmp_path / "export")])
    assert ", guidance_scale=2.5" in capsys.readouterr().out  # the export's call names it too
    from diffusers import FluxTransformer2DModel
    received, forward = [], FluxTransformer2DModel.forward

    def spy(self, *args, **kwargs):
        received.append(sorted(set(kwargs["guidance"].tolist())))
        return forward(self, *args, **kwargs)
    monkeypatch.setattr(FluxTransformer2DModel, "forward", spy)
    (image,) = generate.generate_images(checkpoint, PROMPTS[:1], steps=2, guidance_scale=2.0, seed=0)
    assert image.size == (64, 64)
    assert received and all(values == [2.5] for values in received)  # every denoiser call read the trained value
    received.clear()  # and so does the export sampled by diffusion.generate (its text_conditioning.json records it)
    generate.generate_images(str(tmp_path / "export"), PROMPTS[:1], steps=2, guidance_scale=2.0, seed=0)
    assert received and all(values == [2.5] for values in received)
    plain = adapter.build(adapter.load_config(tiny_flux_kit))
    with pytest.raises(ConfigError, match=r"^model.embedded_guidance=2.0: the FluxTransformer2DModel has no guidance "
                                          r"embedding .*remove the key$"):
        set_embedded_guidance(plain, 2.0)
