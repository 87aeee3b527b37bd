"""Conversion with each kind of autoencoder: a 16-channel AutoencoderKL with a shift factor stores 2C-channel
moments, an AutoencoderDC stores deterministic C-channel latents at /32, and dataset.json says which. The
16-channel one is the tiny-flux kit's, whose two text encoders (Flux's layout) store T5's sequence and CLIP's
pooled vector."""

import json
import os

import numpy as np
import pytest

from diffusion import schema

KITS = {  # kit fixture: (autoencoder, C, f, what is stored, its column at 64 px)
    "tiny_flux_kit": ("AutoencoderKL", 16, 8, schema.MOMENTS, "vae_moments_64"),
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
    if kit_name == "tiny_flux_kit":
        check_flux_text(kit, recorded, samples)
    else:
        assert recorded["pooled_text_dim"] is None and schema.POOLED_TEXT_EMBEDS not in samples[0]


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
    assert (info.pooled_text_dim, len(info.empty_pooled_text_embeds or ())) == (
        (64, 64) if kit_name == "tiny_flux_kit" else (None, 0))  # the stream carries CLIP's pooled vector too


def check_flux_text(tiny_flux_kit, recorded, samples):
    """The tiny-flux kit holds FluxPipeline's two text encoders: the shards hold T5's sequence (text_embeds) and
    CLIP's pooled vector (pooled_text_embeds), each what FluxPipeline's own prompt encoding computes."""
    import torch
    from diffusers import FluxPipeline

    from diffusion.models import loading
    assert recorded["pooled_text_dim"] == 64 and recorded["text_encoder_type"] == "t5"
    assert all(s[schema.POOLED_TEXT_EMBEDS].shape == (64,) for s in samples)

    clip, clip_tokenizer = loading.load_pooled_text_encoder(tiny_flux_kit)
    pipe = FluxPipeline(transformer=None, scheduler=None, vae=None, text_encoder=clip, tokenizer=clip_tokenizer,
                        text_encoder_2=loading.load_text_encoder(tiny_flux_kit),
                        tokenizer_2=loading.load_tokenizer(tiny_flux_kit))
    captions = [s[schema.CAPTION] for s in samples] + [""]
    with torch.no_grad():
        embeds, pooled, _ = pipe.encode_prompt(captions, None, device="cpu", max_sequence_length=schema.MAX_TOKENS)
    stored = np.stack([s[schema.POOLED_TEXT_EMBEDS] for s in samples]).astype(np.float32)
    np.testing.assert_allclose(stored, pooled[:-1].numpy(), atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(np.asarray(recorded["empty_pooled_text_embeds"]), pooled[-1].numpy(), atol=2e-3, rtol=2e-3)
    np.testing.assert_allclose(np.stack([s[schema.TEXT_EMBEDS] for s in samples]).astype(np.float32),
                               embeds[:-1].numpy(), atol=2e-3, rtol=2e-3)


def test_flux_two_text_encoders_refuse_token_ids_in_one_line(tiny_flux_kit, convert_config, tmp_path):
    from diffusion.convert.pipeline import run_conversion
    from diffusion.errors import ConfigError
    with pytest.raises(ConfigError) as error:
        run_conversion(convert_config(tmp_path / "out", model=tiny_flux_kit, resolutions=(64,), text="ids"))
    assert str(error.value).startswith("--text ids:") and "\n" not in str(error.value)
    assert not (tmp_path / "out").exists()


def test_the_description_records_a_local_model_by_its_absolute_path(tiny_kit, monkeypatch, tmp_path):
    """dataset.json names the model and text encoder as convert.json does: a model typed relative to the
    converter's directory is still found by training (--text ids) and REPA run from another one."""
    from diffusion.convert.encoders import describe_dataset
    monkeypatch.chdir(os.path.dirname(tiny_kit))
    relative = os.path.basename(tiny_kit)
    info, _ = describe_dataset(relative, [64], schema.TEXT_IDS_ONLY)
    monkeypatch.chdir(tmp_path)
    assert info.model == info.text_encoder == os.path.abspath(tiny_kit)
    assert os.path.isdir(info.text_encoder_ref)


def test_a_model_in_sd3s_three_text_encoder_layout_is_refused_in_one_line(tiny_mmdit_kit, convert_config, tmp_path):
    """SD3's layout (CLIP-L, CLIP-G and T5) converted silently with the first CLIP only and dataset.json naming the
    SD3 reference; the kit's one-encoder layout (StableDiffusion3Pipeline too) is still converted."""
    import shutil

    from diffusion.convert.pipeline import run_conversion
    from diffusion.errors import ConfigError
    sd3 = tmp_path / "sd3"
    shutil.copytree(tiny_mmdit_kit, sd3)
    with open(sd3 / "model_index.json") as f:
        index = json.load(f)
    index.update(text_encoder_2=["transformers", "CLIPTextModelWithProjection"], tokenizer_2=["transformers", "CLIPTokenizer"],
                 text_encoder_3=["transformers", "T5EncoderModel"], tokenizer_3=["transformers", "T5TokenizerFast"])
    with open(sd3 / "model_index.json", "w") as f:
        json.dump(index, f)
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=rf"^--model {sd3}: its model_index.json names 3 text encoders \(text_encoder, "
                                          rf"text_encoder_2, text_encoder_3: SD3's layout\), and the converter encodes one"):
        run_conversion(convert_config(out, model=str(sd3), resolutions=(64,)))
    assert not out.exists()
    from diffusion.convert.preflight import check_pooled_text
    assert check_pooled_text(convert_config(out, model=tiny_mmdit_kit, resolutions=(64,))) is None
