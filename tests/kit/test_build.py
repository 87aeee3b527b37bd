"""The offline model kit: SD2-base configs with SD2's sizes, a usable tiny pipeline with the shipped
fitted VAE, atomic builds that never delete what the kit did not write."""

import json
import os
import pathlib
import subprocess
import sys

import pytest
import torch

from diffusion.kit import build as kit
from diffusion.kit import vae_fit
from diffusion.models import loading
from diffusion.kit.build import KitError, ensure_kit

COMPONENTS = ("unet", "vae", "text_encoder", "tokenizer", "scheduler")
ROOT = pathlib.Path(__file__).resolve().parents[2]


def _meta_params(module_factory) -> int:
    with torch.device("meta"):  # sizes without allocating SD2's 3.5 GB
        return sum(p.numel() for p in module_factory().parameters())


def test_sd2_base_has_sd2_sizes_and_no_weights(sd2_kit):
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig, CLIPTextModel

    unet_config = loading.load_unet_config(sd2_kit)
    assert _meta_params(lambda: UNet2DConditionModel.from_config(unet_config)) == 865_910_724
    text_config = CLIPTextConfig.from_pretrained(f"{sd2_kit}/text_encoder")
    assert _meta_params(lambda: CLIPTextModel(text_config)) / 1e6 == pytest.approx(340.4, abs=0.05)
    assert text_config.hidden_size == 1024 and text_config.num_hidden_layers == 23

    vae_config = loading.load_vae_config(sd2_kit)
    assert vae_config["scaling_factor"] == 0.18215 and vae_config["latent_channels"] == 4
    assert loading.vae_downsample(vae_config) == 8
    for weightless in ("unet", "vae", "text_encoder"):
        assert sorted(p.name for p in (kit.pathlib.Path(sd2_kit) / weightless).iterdir()) == ["config.json"]


def test_model_index_lists_the_pipeline_components(sd2_kit):
    with open(f"{sd2_kit}/model_index.json") as f:
        index = json.load(f)
    assert index["_class_name"] == "StableDiffusionPipeline"
    assert index["safety_checker"] == [None, None] and index["feature_extractor"] == [None, None]
    assert index["requires_safety_checker"] is False
    for name in COMPONENTS:
        assert index[name][0] in ("diffusers", "transformers")
        assert (kit.pathlib.Path(sd2_kit) / name).is_dir()


def test_ensure_kit_is_idempotent(tmp_path, monkeypatch):
    out = ensure_kit("sd2-base", tmp_path / "kit")
    stamp = kit.read_stamp(out)
    assert stamp["preset"] == "sd2-base" and stamp["kit_version"] == kit.KIT_VERSION

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a complete kit was rebuilt")
    monkeypatch.setattr(kit, "build_kit", no_rebuild)
    assert ensure_kit("sd2-base", out) == out


def test_stale_kit_is_rebuilt(tmp_path):
    out = ensure_kit("sd2-base", tmp_path / "kit")
    (out / kit.STAMP).write_text(json.dumps({**kit.read_stamp(out), "kit_version": kit.KIT_VERSION - 1}))
    ensure_kit("sd2-base", out)
    assert kit.read_stamp(out)["kit_version"] == kit.KIT_VERSION


def test_a_kit_whose_weights_were_cut_short_is_built_again(tiny_kit, tmp_path):
    """`python -m diffusion.kit` again on a kit whose weights were damaged since (a copy cut short) builds it
    again: it reported the kit complete, and every loader then refused the file."""
    import shutil
    from diffusion.models.loading import check_weight_files
    out = shutil.copytree(tiny_kit, tmp_path / "kit")
    weights = out / "unet" / "diffusion_pytorch_model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[:len(whole) // 2])
    assert ensure_kit("tiny", out) == out
    check_weight_files(str(out / "unet"))
    assert weights.read_bytes() == whole  # seeded: the same weights again


def test_legacy_kit_without_a_file_list_is_replaced_only_if_it_holds_nothing_else(tmp_path):
    def make_legacy(out):  # what kit version 2 wrote: a stamp without "files"
        ensure_kit("sd2-base", out, force=True)
        stamp = kit.read_stamp(out)
        del stamp["files"]
        (out / kit.STAMP).write_text(json.dumps({**stamp, "kit_version": 2}))

    out = tmp_path / "kit"
    make_legacy(out)
    ensure_kit("sd2-base", out)
    assert kit.read_stamp(out)["kit_version"] == kit.KIT_VERSION and "files" in kit.read_stamp(out)

    make_legacy(out)
    (out / "notes.txt").write_text("mine")
    with pytest.raises(KitError, match=r"holds a sd2-base kit and files it did not write \(notes.txt\)"):
        ensure_kit("sd2-base", out)
    assert (out / "notes.txt").read_text() == "mine" and kit.read_stamp(out)["kit_version"] == 2


def test_stamp_lists_the_files_the_kit_wrote(tmp_path):
    out = ensure_kit("sd2-base", tmp_path / "kit")
    files = sorted(p.relative_to(out).as_posix() for p in out.rglob("*") if p.is_file())
    assert kit.read_stamp(out)["files"] == files
    assert "unet/config.json" in files and kit.STAMP in files


def test_folder_without_a_stamp_is_not_ours(tmp_path):
    out = tmp_path / "model"  # e.g. a diffusers model from elsewhere: same layout, no kit.json
    (out / "unet").mkdir(parents=True)
    (out / "unet" / "diffusion_pytorch_model.safetensors").write_bytes(b"weights")
    with pytest.raises(KitError, match="holds files that are not a model kit \\(unet\\)"):
        ensure_kit("sd2-base", out, force=True)
    assert (out / "unet" / "diffusion_pytorch_model.safetensors").read_bytes() == b"weights"


def test_empty_existing_folder_gets_a_kit(tmp_path):
    out = tmp_path / "kit"
    out.mkdir()
    assert ensure_kit("tiny-clip", out, progress=False) == out
    assert kit.is_complete("tiny-clip", out)


def test_another_presets_kit_is_replaced_only_with_force(tmp_path):
    out = ensure_kit("sd2-base", tmp_path / "kit")
    with pytest.raises(KitError, match="holds a sd2-base kit, not tiny-clip; use --force"):
        ensure_kit("tiny-clip", out)
    assert kit.is_complete("sd2-base", out)
    ensure_kit("tiny-clip", out, force=True)
    assert kit.is_complete("tiny-clip", out) and not (out / "unet").exists()


def _files_with_bytes(folder: pathlib.Path) -> dict:
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in folder.rglob("*") if p.is_file()}


def _run_kit_cli(*args):
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}
    return subprocess.run([sys.executable, "-m", "diffusion.kit.build", *args], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=300)


def _run_kit_here(capfd, *args):
    """``python -m diffusion.kit.build ARGS`` through its ``cli.run`` entry in this process (cli_helpers.run_entry):
    the refusals after the first, which _run_kit_cli runs as a user does, without ~3 s of imports each."""
    from cli_helpers import run_entry
    return run_entry(capfd, kit.main, "kit", *args, env={"HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"})


def _assert_one_line_error(result, *expected):
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("kit: error: "), result.stderr
    assert "Traceback" not in result.stderr
    for text in expected:
        assert text in lines[0]


@pytest.mark.parametrize("force", [False, True])
def test_cli_refuses_a_folder_of_user_files_and_leaves_them(tmp_path, force, capfd):
    out = tmp_path / "my project"
    out.mkdir()
    (out / "notes.txt").write_text("do not lose these notes\n")
    (out / "important.csv").write_bytes(b"id,value\n1,42\n")
    before = _files_with_bytes(out)
    args = ("--preset", "tiny-clip", "--out", str(out), *(["--force"] if force else []))
    result = _run_kit_here(capfd, *args) if force else _run_kit_cli(*args)  # without --force as a user runs it
    _assert_one_line_error(result, str(out), "not a model kit", "notes.txt", "important.csv")
    assert _files_with_bytes(out) == before
    assert sorted(p.name for p in out.iterdir()) == ["important.csv", "notes.txt"]


def test_cli_refuses_to_replace_a_kit_holding_a_user_file_even_with_force(tmp_path, capfd):
    out = ensure_kit("sd2-base", tmp_path / "kit")
    (out / "unet" / "my-notes.md").write_text("tried lr 1e-4")
    before = _files_with_bytes(out)
    result = _run_kit_here(capfd, "--preset", "sd2-base", "--out", str(out), "--force")
    _assert_one_line_error(result, str(out), "unet/my-notes.md", "did not write")
    assert _files_with_bytes(out) == before


def test_cli_names_the_preset_found_and_force_says_what_it_replaces(tmp_path, capfd):
    out = ensure_kit("sd2-base", tmp_path / "kit")
    before = _files_with_bytes(out)
    result = _run_kit_here(capfd, "--preset", "tiny-clip", "--out", str(out))
    _assert_one_line_error(result, str(out), "holds a sd2-base kit", "--force")
    assert _files_with_bytes(out) == before
    help_text = " ".join(_run_kit_here(capfd, "--help").stdout.split())
    assert "replaces only the kit's own files" in help_text


def test_cli_builds_into_an_empty_folder(tmp_path, capfd):
    out = tmp_path / "kit"
    out.mkdir()
    result = _run_kit_here(capfd, "--preset", "sd2-base", "--out", str(out))
    assert result.returncode == 0, result.stderr
    assert json.loads(result.stdout)["preset"] == "sd2-base" and kit.is_complete("sd2-base", out)


def test_killed_build_leaves_nothing_that_looks_complete(tmp_path, monkeypatch):
    (tmp_path / ".kit.building-old").mkdir()  # a build killed with SIGKILL leaves its temp dir

    def dies_midway(out):
        (out / "unet").mkdir()
        raise KeyboardInterrupt
    monkeypatch.setattr(kit, "build_sd2_base", dies_midway)
    with pytest.raises(KeyboardInterrupt):
        ensure_kit("sd2-base", tmp_path / "kit")
    assert not (tmp_path / "kit").exists()
    assert [p.name for p in tmp_path.iterdir()] == [".kit.lock"]  # no temp build dirs left behind


def test_unknown_preset_is_named(tmp_path):
    with pytest.raises(ValueError, match="unknown kit preset 'sd3'"):
        ensure_kit("sd3", tmp_path / "kit")


def test_tiny_clip_loads_offline(tmp_path):
    from PIL import Image
    from transformers import CLIPImageProcessor, CLIPModel, CLIPTokenizer

    out = ensure_kit("tiny-clip", tmp_path / "clip", progress=False)
    model = CLIPModel.from_pretrained(out).eval()
    tokens = CLIPTokenizer.from_pretrained(out)(["a red circle", "a blue square"], padding=True, return_tensors="pt")
    pixels = CLIPImageProcessor.from_pretrained(out)(Image.new("RGB", (100, 80), "red"), return_tensors="pt")
    assert pixels.pixel_values.shape == (1, 3, 64, 64)
    with torch.no_grad():
        out = model(input_ids=tokens.input_ids, attention_mask=tokens.attention_mask, pixel_values=pixels.pixel_values)
    assert out.logits_per_image.shape == (1, 2) and torch.isfinite(out.logits_per_image).all()


def test_tiny_pipeline_generates_on_cpu(tiny_kit):
    from diffusers import StableDiffusionPipeline

    pipe = StableDiffusionPipeline.from_pretrained(tiny_kit, safety_checker=None)
    image = pipe("a red circle", num_inference_steps=2, generator=torch.Generator().manual_seed(0),
                 output_type="np").images[0]
    assert image.shape == (64, 64, 3)
    assert (image >= 0).all() and (image <= 1).all() and image.std() > 0


def test_tiny_kit_copies_the_shipped_vae_and_its_fit_info(tiny_kit):
    stamp = kit.read_stamp(tiny_kit)
    assert stamp["vae"] == "shipped"
    assert stamp["vae_fit"] == json.loads((kit.TINY_VAE_ASSET / kit.FIT_INFO).read_text())
    for name in ("config.json", "diffusion_pytorch_model.safetensors"):
        assert (pathlib.Path(tiny_kit) / "vae" / name).read_bytes() == (kit.TINY_VAE_ASSET / name).read_bytes()
    assert loading.load_vae_config(tiny_kit)["scaling_factor"] == stamp["vae_fit"]["scaling_factor"]


def test_shipped_vae_reconstructs_held_out_scenes():
    from diffusers import AutoencoderKL

    vae = AutoencoderKL.from_pretrained(kit.TINY_VAE_ASSET).eval()
    assert all(p.dtype == torch.float32 for p in vae.parameters())
    assert {k: vae.config[k] for k in kit.TINY_VAE if k != "scaling_factor"} == {
        k: list(v) if isinstance(v, tuple) else v for k, v in kit.TINY_VAE.items() if k != "scaling_factor"}
    held_out = vae_fit.sample_images(96, seed=98765)  # neither the fitting nor the fit's own check
    assert vae_fit.reconstruction_psnr(vae, held_out) >= 22.0
    # Latents are usable for training: scaled to about unit variance, log-variance not collapsed.
    with torch.no_grad():
        posterior = vae.encode(held_out).latent_dist
    scaled = posterior.mean * vae.config.scaling_factor
    assert 0.5 < scaled.std().item() < 2.0
    assert -15 < posterior.logvar.mean().item() < 0
    fit = json.loads((kit.TINY_VAE_ASSET / kit.FIT_INFO).read_text())
    assert fit["psnr_held_out"] >= 22.0 and fit["scaling_factor"] == vae.config.scaling_factor


def test_vae_fit_improves_reconstruction():
    from diffusers import AutoencoderKL

    images = vae_fit.sample_images(16, seed=4321)
    torch.manual_seed(kit.VAE_SEED)
    vae = AutoencoderKL(**kit.TINY_VAE).eval()
    before = vae_fit.reconstruction_psnr(vae, images)
    info = vae_fit.fit_vae(vae, vae_fit.FitConfig(steps=20, train_images=64), progress=False)
    assert info["steps"] == 20 and info["seconds"] > 0  # how long it takes is for a benchmark, not a test
    assert vae_fit.reconstruction_psnr(vae, images) > before + 1.0  # about 10.6 -> 12.3 dB


def _few_held_out_scenes(monkeypatch):
    """The fit's held-out PSNR and latent statistics read 16 scenes, not 64 and 256 (~7 CPU-s of encoding a
    fit): these tests check what is written and recorded, not the numbers (the shipped asset's are checked above)."""
    real = vae_fit.sample_images
    monkeypatch.setattr(vae_fit, "sample_images", lambda n, seed, **kwargs: real(min(n, 16), seed, **kwargs))


def test_refit_vae_writes_a_fitted_vae_and_its_info(tmp_path, monkeypatch):
    real = vae_fit.fit_tiny_vae
    monkeypatch.setattr(vae_fit, "fit_tiny_vae",  # a few steps: the full fit is the asset's (minutes)
                        lambda out, progress=True: real(out, vae_fit.FitConfig(steps=3, train_images=16), progress))
    _few_held_out_scenes(monkeypatch)
    out = ensure_kit("tiny", tmp_path / "kit", progress=False, refit_vae=True)
    stamp = kit.read_stamp(out)
    assert stamp["vae"] == "fitted" and stamp["vae_fit"]["steps"] == 3
    assert {"psnr_held_out", "scaling_factor", "loss", "seconds"} <= set(stamp["vae_fit"])
    assert (out / "vae" / "diffusion_pytorch_model.safetensors").read_bytes() != (
        kit.TINY_VAE_ASSET / "diffusion_pytorch_model.safetensors").read_bytes()
    with pytest.raises(ValueError, match="tiny preset only"):
        ensure_kit("sd2-base", tmp_path / "sd2", refit_vae=True)


def test_vae_fit_cli_writes_the_asset_layout(tmp_path, monkeypatch):
    import dataclasses
    out = tmp_path / "tiny-vae"

    @dataclasses.dataclass
    class FewScenes(vae_fit.FitConfig):  # 2 steps of batch 8 read 16 scenes, not the default 2,048
        train_images: int = 16
    monkeypatch.setattr(vae_fit, "FitConfig", FewScenes)
    _few_held_out_scenes(monkeypatch)
    vae_fit.main(["--out", str(out), "--steps", "2", "--quiet"])
    assert sorted(p.name for p in out.iterdir()) == sorted(
        p.name for p in kit.TINY_VAE_ASSET.iterdir())  # config.json, weights, fit.json
    fit = json.loads((out / kit.FIT_INFO).read_text())
    assert fit["steps"] == 2 and set(fit) == set(json.loads((kit.TINY_VAE_ASSET / kit.FIT_INFO).read_text()))


def test_the_micro_budget_kit_normalises_queries_and_keys_and_the_tiny_mmdit_stays_as_recorded():
    from diffusers import SD3Transformer2DModel
    from diffusion.kit.build import MMDIT_BASE, TINY_MMDIT
    assert MMDIT_BASE["qk_norm"] == "rms_norm" and "qk_norm" not in TINY_MMDIT
    # the same key on a small transformer: each joint block's attention normalises its queries and keys
    small = SD3Transformer2DModel(**{**TINY_MMDIT, "qk_norm": MMDIT_BASE["qk_norm"]})
    attention = small.transformer_blocks[0].attn
    assert all(type(getattr(attention, n)).__name__ == "RMSNorm" for n in ("norm_q", "norm_k", "norm_added_q"))
    assert SD3Transformer2DModel(**TINY_MMDIT).transformer_blocks[0].attn.norm_q is None
