"""Conversion with each kind of autoencoder: a 16-channel AutoencoderKL with a shift factor stores 2C-channel
moments, an AutoencoderDC stores deterministic C-channel latents at /32, and dataset.json says which."""

import json
import os

import numpy as np
import pytest

from diffusion import schema

KITS = {  # kit fixture: (autoencoder, C, f, what is stored, its column at 64 px)
    "tiny_vae16_kit": ("AutoencoderKL", 16, 8, schema.MOMENTS, "vae_moments_64"),
    "tiny_dcae_kit": ("AutoencoderDC", 32, 32, schema.LATENTS, "vae_latents_64"),
}


@pytest.mark.slow
@pytest.mark.parametrize("kit_name", sorted(KITS))
def test_each_autoencoder_converts_and_reads_back(kit_name, request, convert_config, ray_local, tmp_path):
    from streaming import StreamingDataset

    from diffusion.convert.encoders import VaeEncoder
    from diffusion.convert.pipeline import run_conversion
    from diffusion.convert.preview import input_crops
    from diffusion.models import loading
    autoencoder, channels, f, stored, column = KITS[kit_name]
    kit = request.getfixturevalue(kit_name)
    out = tmp_path / "out"
    summary = run_conversion(convert_config(out, model=kit, resolutions=(64,), limit=12))
    assert summary.written > 0

    with open(out / schema.DATASET_JSON) as fh:
        recorded = json.load(fh)
    vae_config = loading.load_vae_config(kit)
    assert {k: recorded[k] for k in ("autoencoder", "latent_channels", "downsample", "latents")} == {
        "autoencoder": autoencoder, "latent_channels": channels, "downsample": f, "latents": stored}
    assert recorded["scaling_factor"] == pytest.approx(vae_config["scaling_factor"])
    assert recorded["shift_factor"] == pytest.approx(vae_config.get("shift_factor") or 0.0)

    ds = StreamingDataset(local=str(out), shuffle=False, batch_size=1)
    samples = [ds[i] for i in range(len(ds))]
    assert len(samples) == summary.written
    want_channels = 2 * channels if stored == schema.MOMENTS else channels
    assert all(s[column].shape == (want_channels, 64 // f, 64 // f) for s in samples)
    other = "vae_latents_64" if stored == schema.MOMENTS else "vae_moments_64"
    assert other not in samples[0]
    # what is stored is what the autoencoder computes on the crop
    crops = input_crops(convert_config(out, model=kit, resolutions=(64,)), [s[schema.KEY] for s in samples[:3]])
    direct = VaeEncoder(kit, device="cpu").moments(np.stack([crops[s[schema.KEY]][64] for s in samples[:3]]))
    np.testing.assert_allclose(np.stack([s[column] for s in samples[:3]]).astype(np.float32),
                               direct.astype(np.float32), atol=1e-2, rtol=1e-2)


def test_a_resolution_off_the_autoencoders_grid_is_refused():
    space = schema.LatentSpace("AutoencoderDC", 32, 32, 0.4, 0.0, schema.LATENTS)
    with pytest.raises(ValueError, match="multiple of the VAE downsampling factor 32"):
        schema.mds_columns([48], 64, latent_space=space)
    columns = schema.mds_columns([64], 64, latent_space=space)
    assert columns["vae_latents_64"] == "ndarray:float16:32,2,2" and "vae_moments_64" not in columns
    assert schema.resolutions_in(columns) == [64]


@pytest.mark.parametrize("kit_name", sorted(KITS))
def test_the_description_the_stream_shares_records_the_latent_space(kit_name, request):
    """Online mode trains from encoders.describe_dataset's description, as offline training reads dataset.json."""
    from diffusion.convert.encoders import describe_dataset
    autoencoder, channels, f, stored, column = KITS[kit_name]
    info, _ = describe_dataset(request.getfixturevalue(kit_name), [64])
    space = info.latent_space
    assert (space.autoencoder, space.channels, space.downsample, space.stored) == (autoencoder, channels, f, stored)
    assert space.column(64) == column
