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
