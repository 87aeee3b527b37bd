"""Representation alignment (issue 41, ``model.repa``): the loss, where gradients go, the switch-off batch,
masked tokens, microbatch invariance, checkpoints with and without the projector, refusals."""

import os
import shutil

import pytest
import torch
import torch.nn.functional as F

from diffusion import schema
from diffusion.errors import ConfigError
from diffusion.kit.encoder_fit import TINY_ENCODER_ASSET
from diffusion.kit.vae_fit import TINY_VAE_ASSET
from diffusion.loader.batches import NoiseDraws
from diffusion.models.latent_diffusion import build_model
from diffusion.models.masking import PatchMask
from diffusion.train.config import FlowConfig, MaskingConfig, ModelConfig, RepaConfig, load_config
from train_fixtures import fit_in_process, kit_text_dim, tiny_overrides, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
YAML = os.path.join(ROOT, "yamls", "tiny-mmdit-flow-cpu.yaml")


@pytest.fixture(scope="module")
def repa_kit(mmdit_train_kit, tmp_path_factory):
    """The tiny MMDiT kit with the shipped fitted VAE's weights (REPA decodes latents with the data's VAE)."""
    kit = str(tmp_path_factory.mktemp("repa") / "kit")
    shutil.copytree(mmdit_train_kit, kit)
    shutil.rmtree(os.path.join(kit, "vae"), ignore_errors=True)
    shutil.copytree(TINY_VAE_ASSET, os.path.join(kit, "vae"))
    return kit


def _model(kit, block=2, until=None, ratio=0.0):
    info = schema.DatasetInfo(model=kit, scaling_factor=0.18215, resolutions=[64], text_dim=kit_text_dim(kit))
    repa = RepaConfig(encoder=str(TINY_ENCODER_ASSET), block=block, weight=0.5, until=until, projector_dim=32)
    return build_model(ModelConfig(ref=kit, resolution=64, objective="flow", flow=FlowConfig(), repa=repa,
                                   masking=MaskingConfig(ratio=ratio, mixer_blocks=1)), info)


def _batch(model, n=3, ratio=0.0):
    g = torch.Generator().manual_seed(0)
    batch = {schema.BATCH_MOMENTS: torch.cat([torch.randn(n, 4, 8, 8, generator=g), torch.full((n, 4, 8, 8), -8.0)], 1),
             schema.BATCH_TEXT_EMBEDS: torch.randn(n, 77, model.text_dim, generator=g)}
    batch.update(NoiseDraws(seed=1, mask=PatchMask(ratio, 2) if ratio else None)(
        [f"{i}" for i in range(n)], 0, (4, 8, 8)))
    return batch


def _features_by_hand(model, latents):
    """The encoder's patch features of the decoded latents on the 4×4 token grid, computed here: the image at
    4 tokens × the encoder's 8-pixel patches = 32 px, so its 4×4 patches are the tokens (REPA's rule)."""
    vae, encoder = model.repa.decoder.vae, model.repa.encoder.model
    images = vae.decode(latents / model.latent_space.scaling_factor).sample.clamp(-1, 1)
    x = F.interpolate(images, size=(32, 32), mode="bicubic", align_corners=False, antialias=True)
    x = ((x + 1) / 2 - 0.5) / 0.5  # the tiny encoder's preprocessor: mean 0.5, std 0.5
    return encoder(pixel_values=x, interpolate_pos_encoding=True).last_hidden_state[:, 1:]  # after the class token


def test_the_loss_is_the_denoising_loss_plus_weight_times_minus_the_cosine(repa_kit):
    model = _model(repa_kit).train()
    batch = _batch(model)
    hidden = {}
    handle = model.denoiser.transformer_blocks[1].register_forward_hook(lambda m, a, out: hidden.update(x=out[1]))
    outputs = model(batch)
    handle.remove()
    with torch.no_grad():
        projected = model.repa.projector(hidden["x"])
        features = _features_by_hand(model, outputs["latents"])
        cosine = (projected * features).sum(-1) / (projected.norm(dim=-1) * features.norm(dim=-1))
        mse = (outputs["prediction"] - outputs["target"]).pow(2).mean()
        expected = mse - 0.5 * cosine.mean()
    torch.testing.assert_close(model.loss(outputs, batch).detach(), expected, rtol=1e-4, atol=1e-5)
    assert outputs["repa"].shape == (3,)
    model.eval()  # evaluation never aligns
    assert "repa" not in model.eval_forward(batch)


def test_the_projector_and_the_early_blocks_learn_the_encoder_does_not(repa_kit):
    model = _model(repa_kit, block=2).train()
    outputs = model(_batch(model))
    outputs["repa"].mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.repa.projector.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in model.denoiser.transformer_blocks[0].parameters())
    assert all(p.grad is None for p in model.denoiser.transformer_blocks[3].parameters())  # after block 2
    assert all(not p.requires_grad and p.grad is None for p in model.repa.encoder.model.parameters())
    assert all(p.grad is None for p in model.repa.decoder.vae.parameters())
    # frozen parts are not the model's: out of the optimizer, the EMA and checkpoints
    assert all(k.startswith(("denoiser.", "repa.projector.")) for k in model.state_dict() if k != "_extra_state")
    assert any(k.startswith("repa.projector.") for k in model.state_dict())


def test_only_the_kept_patches_are_aligned(repa_kit):
    model = _model(repa_kit, block=3, ratio=0.75).train()
    batch = _batch(model, ratio=0.75)
    keep = batch[schema.BATCH_PATCH_KEEP]
    hidden = {}
    handle = model.denoiser.transformer_blocks[2].register_forward_hook(lambda m, a, out: hidden.update(x=out[1]))
    outputs = model(batch)
    handle.remove()
    assert hidden["x"].shape[1] == keep.shape[1] == 4  # the block saw the kept quarter
    with torch.no_grad():
        features = _features_by_hand(model, outputs["latents"])
        kept = features.gather(1, keep[..., None].expand(-1, -1, features.shape[-1]))
        expected = -F.cosine_similarity(model.repa.projector(hidden["x"]), kept, dim=-1).mean(1)
    torch.testing.assert_close(outputs["repa"].detach(), expected, rtol=1e-4, atol=1e-5)


def test_the_encoder_sees_the_denoisers_token_grid_in_the_run_precision(repa_kit, tmp_path):
    """Issue 47, item 6: the encoder's input makes its patch grid the denoiser's tokens (REPA's 224·R/256 for
    DINOv2: 224 px at 256, 896 at 1024), not its config's image_size (DINOv2's hub configs: 518 px, 37×37
    patches resampled down, 6.5× the FLOPs); the old size behind model.repa.encoder_input=encoder_config.
    Under amp_bf16 the frozen encoder and VAE run in bf16 from fit start."""
    from composer.core import Event, Precision
    from transformers import Dinov2Config, Dinov2Model
    from diffusion.models.repa import FrozenVisionEncoder, RepaSwitch, _encoder_flops
    stats = {"image_mean": [0.5] * 3, "image_std": [0.5] * 3}
    dinov2 = Dinov2Config(image_size=518, patch_size=14, hidden_size=768, num_hidden_layers=1, num_attention_heads=12)
    with torch.device("meta"):
        base = FrozenVisionEncoder(Dinov2Model(dinov2), stats)
    # SD3's MMDiT on an f8 VAE, 2×2 patches: 16 tokens a side at 256 px, 64 at 1024
    assert [base.input_size(r // 16, r // 16) for r in (256, 512, 1024)] == [(224, 224), (448, 448), (896, 896)]
    assert FrozenVisionEncoder(base.model, stats, "encoder_config").input_size(16, 16) == (518, 518)
    ratio = _encoder_flops(base.model, (518, 518)) / _encoder_flops(base.model, (224, 224))
    assert 6.0 < ratio < 7.0, ratio  # ViT-B/14 (one of its 12 layers here): 46 GFLOP at 224 px, 6.5× at 518
    model = _model(repa_kit).train()
    assert model.repa.encoder.input_size(4, 4) == (32, 32)  # the tiny kit: 4×4 tokens, 8-pixel patches
    flops = model.repa.flops_per_image((4, 8, 8), 16) - 3 * sum(
        2 * 16 * m.in_features * m.out_features for m in model.repa.projector if isinstance(m, torch.nn.Linear))
    from diffusion.models.repa import _decode_flops
    assert flops - _decode_flops(model.repa.decoder, 4, 8, 8) == _encoder_flops(model.repa.encoder.model, (32, 32))

    class State:
        precision, timestamp = Precision.AMP_BF16, type("T", (), {"batch": 0})()
    RepaSwitch(model.repa).apply(Event.FIT_START, State(), None)
    assert next(model.repa.encoder.model.parameters()).dtype == torch.bfloat16
    assert next(model.repa.decoder.vae.parameters()).dtype == torch.bfloat16
    with torch.autocast("cpu", dtype=torch.bfloat16):
        outputs = model(_batch(model))
    assert outputs["repa"].dtype == torch.float32 and torch.isfinite(outputs["repa"]).all()


def test_unet_and_a_block_out_of_range_are_refused(repa_kit, train_kit):
    with pytest.raises(ConfigError, match="model.repa.block=5: the SD3Transformer2DModel has 4 blocks"):
        _model(repa_kit, block=5)
    info = schema.DatasetInfo(model=repa_kit, scaling_factor=0.18215, resolutions=[64],
                              text_dim=kit_text_dim(train_kit))
    with pytest.raises(ConfigError, match="model.repa: UNet2DConditionModel has no image tokens to align"):
        build_model(ModelConfig(ref=train_kit, resolution=64, repa=RepaConfig(encoder=str(TINY_ENCODER_ASSET))), info)
    with pytest.raises(ConfigError, match="model.repa.encoder is empty"):
        load_config(YAML, ["model.repa.block=2"])


def test_checkpoints_with_and_without_the_projector_load_both_ways(repa_kit, tmp_path):
    from diffusion.models import checkpoint
    with_repa = _model(repa_kit)
    info = schema.DatasetInfo(model=repa_kit, scaling_factor=0.18215, resolutions=[64], text_dim=kit_text_dim(repa_kit))
    plain = build_model(ModelConfig(ref=repa_kit, resolution=64, objective="flow"), info)
    plain.load_state_dict(with_repa.state_dict())  # strict: the projector's tensors are dropped
    before = {k: v.clone() for k, v in with_repa.repa.state_dict().items()}
    with_repa.load_state_dict(plain.state_dict())  # strict: a fresh projector stays as it was
    assert all(torch.equal(before[k], v) for k, v in with_repa.repa.state_dict().items())
    partial = {k: v for k, v in _model(repa_kit).state_dict().items() if not k.endswith("0.weight")}
    with pytest.raises(RuntimeError, match="repa.projector.0.weight"):
        with_repa.load_state_dict(partial)
    # sampling and export read the denoiser alone, projector or not
    path = tmp_path / "ckpt.pt"
    torch.save({"state": {"model": with_repa.state_dict()}}, path)
    denoiser, description, _ = checkpoint.load_denoiser(str(path))
    assert description.denoiser == "SD3Transformer2DModel"
    assert torch.equal(denoiser.proj_out.weight, with_repa.denoiser.proj_out.weight)


def _training(kit, tmp_path, *extra, batches=3):
    mds = str(tmp_path / "mds")
    if not os.path.exists(os.path.join(mds, "dataset.json")):
        write_latent_mds(mds, kit=kit, n=16)
    common = ("model.prediction_type=null", "model.objective=flow", f"model.repa.encoder={TINY_ENCODER_ASSET}",
              "model.repa.block=2", "model.repa.projector_dim=16", "optimizer.eps=1.0", "optimizer.lr=0.05",
              "trainer.grad_clip_norm=null", "algorithms={}", "data.train.shuffle=false", "data.train.num_workers=0")
    return load_config(YAML, tiny_overrides(kit, mds, batches=batches, batch_size=4, extra=(*common, *extra)))


def test_the_alignment_switches_off_at_until(repa_kit, tmp_path):
    """Before batch ``until`` the projector learns; from it on it has no gradient, and AdamW leaves it."""
    from composer.core import Callback

    class Record(Callback):
        def __init__(self):
            self.weights = []

        def batch_end(self, state, logger):
            self.weights.append(state.model.repa.projector[0].weight.detach().clone())

    record = Record()
    fit_in_process(_training(repa_kit, tmp_path, "model.repa.until=2", batches=4), callbacks=[record])
    moved = [not torch.equal(a, b) for a, b in zip(record.weights, record.weights[1:])]
    assert moved == [True, False, False]  # batch 2 (the 2nd) changes it, 3 and 4 do not


def test_aligned_steps_are_the_same_whatever_the_microbatch(repa_kit, tmp_path):
    whole, _ = fit_in_process(_training(repa_kit, tmp_path, batches=2))
    split, _ = fit_in_process(_training(repa_kit, tmp_path, "trainer.device_train_microbatch_size=2", batches=2))
    assert any(k.startswith("repa.projector.") for k in whole)
    for name in whole:
        torch.testing.assert_close(split[name], whole[name], rtol=1e-5, atol=1e-6, msg=name)


def test_the_aligned_training_step_compiles_without_graph_breaks(repa_kit):
    """``trainer.compile`` with ``model.repa``: the decode, the frozen encoder, the block's captured tokens and
    the projector compile with the step, in one graph."""
    from train_fixtures import explain_training_step
    model = _model(repa_kit)
    explanation = explain_training_step(model, _batch(model))
    assert explanation.graph_break_count == 0, [str(b.reason) for b in explanation.break_reasons]
    assert explanation.graph_count == 1


@pytest.mark.parametrize("kit_name, block, grid", [("tiny_flux_kit", 2, 4), ("tiny_sana_kit", 1, 2)])
def test_flux_and_sana_train_with_the_alignment(kit_name, block, grid, request, tmp_path):
    """``model.repa`` on Flux (block 2: its first single-stream block, after the double-stream one) and on
    SANA: the loss is REPA-off's plus weight × minus the cosine of the projected image tokens of that block
    with the encoder's features of the decoded latents on the token grid (Flux packs 2×2 latent pixels a
    token: 4×4; SANA's DC-AE latents: 2×2), the projector and the earlier blocks learn from it, the encoder
    and the autoencoder do not, and a run trains the projector. Neither transformer takes masking or
    routing (refused in test_flux.py and test_sana.py), so every image token is aligned."""
    from diffusion.loader import dataset_info, mds_source
    from diffusion.models import loading
    kit = request.getfixturevalue(kit_name)
    space = loading.latent_space_of(loading.load_vae_config(kit))
    mds = write_latent_mds(str(tmp_path / "mds"), kit=kit, n=8, latent_space=space)
    cfg = load_config(YAML, tiny_overrides(kit, mds, batches=2, batch_size=4, extra=(
        "model.prediction_type=null", "model.objective=flow", f"model.repa.encoder={TINY_ENCODER_ASSET}",
        f"model.repa.block={block}", "model.repa.projector_dim=16", "algorithms={}", "data.train.shuffle=false",
        "data.train.num_workers=0")))
    info = dataset_info.read_loader_info(cfg.data.train, cfg.model.resolution)
    model = build_model(cfg.model, info).train()
    batch = next(iter(mds_source.build_dataloader(cfg.data.train, resolution=64, text_dim=model.text_dim)))
    blocks = model.repa._blocks(model.denoiser)
    hidden = {}
    handle = blocks[block - 1].register_forward_hook(
        lambda m, a, out: hidden.update(x=out[1] if isinstance(out, tuple) else out))
    torch.manual_seed(0)
    outputs = model(batch)
    handle.remove()
    model.repa.active = False
    torch.manual_seed(0)
    plain = model(batch)
    model.repa.active = True
    assert "repa" not in plain and hidden["x"].shape[1] == grid * grid
    assert model.repa.encoder.input_size(grid, grid) == (8 * grid, 8 * grid)
    with torch.no_grad():
        # the encoder at grid × its 8-pixel patches: its grid × grid patches are the tokens
        features = model.repa.encoder.features(model.repa.decoder(outputs["latents"]), (8 * grid, 8 * grid))
        expected = -F.cosine_similarity(model.repa.projector(hidden["x"]), features, dim=-1).mean(1)
    torch.testing.assert_close(outputs["repa"].detach(), expected, rtol=1e-4, atol=1e-5)
    torch.testing.assert_close((model.loss(outputs, batch) - model.loss(plain, batch)).detach(),
                               0.5 * expected.mean(), rtol=1e-4, atol=1e-5)
    outputs["repa"].mean().backward()
    assert all(p.grad is not None and p.grad.abs().sum() > 0 for p in model.repa.projector.parameters())
    assert any(p.grad is not None and p.grad.abs().sum() > 0 for p in blocks[0].parameters())
    assert all(p.grad is None for p in blocks[-1].parameters())  # after the aligned block
    assert all(p.grad is None for p in model.repa.encoder.model.parameters())
    assert all(p.grad is None for p in model.repa.decoder.vae.parameters())

    from composer.core import Callback

    class First(Callback):
        def fit_start(self, state, logger):
            self.weight = state.model.repa.projector[0].weight.detach().clone()

    first = First()
    weights, _ = fit_in_process(cfg, callbacks=[first])
    assert not torch.equal(weights["repa.projector.0.weight"], first.weight)
    assert all(torch.isfinite(v).all() for v in weights.values())
