"""Fitting the other latent spaces' tiny autoencoders: the 16-channel KL records the shift and scale that make
its latents zero-mean with unit variance, the DC-AE its scale, and the converter reads them back."""

import json

import pytest
import torch

from diffusion import schema
from diffusion.kit import vae_fit
from diffusion.models import loading


@pytest.mark.parametrize("kind, autoencoder, stored", [("vae16", "AutoencoderKL", schema.MOMENTS),
                                                       ("dcae", "AutoencoderDC", schema.LATENTS)])
def test_a_short_fit_records_the_latent_statistics(kind, autoencoder, stored, tmp_path, monkeypatch):
    monkeypatch.setattr(vae_fit, "sample_images", lambda n, seed, size=64: _scenes(min(n, 16), seed))
    fit = vae_fit.fit_tiny_vae(tmp_path, vae_fit.FitConfig(steps=2, batch_size=2), progress=False, kind=kind)
    with open(tmp_path / "config.json") as f:
        config = json.load(f)
    space = loading.latent_space_of(config)
    assert (space.autoencoder, space.stored) == (autoencoder, stored)
    assert space.scaling_factor == pytest.approx(fit["scaling_factor"]) and space.scaling_factor > 0
    assert space.shift_factor == pytest.approx(fit.get("shift_factor", 0.0))
    assert (kind == "vae16") == ("shift_factor" in fit)


def _scenes(n, seed):
    generator = torch.Generator().manual_seed(seed)
    return torch.rand(n, 3, 64, 64, generator=generator) * 2 - 1


@pytest.mark.parametrize("kind, fixture", [("vae16", "tiny_flux_kit"), ("dcae", "tiny_sana_kit")])
def test_the_flux_and_sana_kits_decode_scenes_legibly_with_the_shipped_fitted_autoencoders(kind, fixture, request):
    import diffusers
    from diffusion.kit import build

    kit = request.getfixturevalue(fixture)
    class_name, _, asset, _ = vae_fit.KINDS[kind]
    stamp = build.read_stamp(kit)
    assert stamp["vae"] == "shipped" and stamp["vae_fit"] == json.loads((asset / vae_fit.FIT_INFO).read_text())
    for name in ("config.json", "diffusion_pytorch_model.safetensors"):
        assert (build.pathlib.Path(kit) / "vae" / name).read_bytes() == (asset / name).read_bytes()
    vae = getattr(diffusers, class_name).from_pretrained(f"{kit}/vae").eval()
    held_out = vae_fit.sample_images(32, seed=98765)  # neither the fitting nor the fit's own check
    assert vae_fit.reconstruction_psnr(vae, held_out) >= 20.0  # a random autoencoder decodes noise: ~5 dB
    assert loading.latent_space_of(loading.load_vae_config(kit)).scaling_factor == stamp["vae_fit"]["scaling_factor"]
