import numpy as np
import pytest
import torch

from diffusion import schema
from diffusion.convert.encoders import LatentTextEncoder, TextEncoder, normalize_images, pick_device_and_dtype


@pytest.fixture(scope="module")
def encoder(tiny_kit):
    return LatentTextEncoder(tiny_kit, [32, 64], device="cpu")


def _batch(n, rng):
    out = {schema.KEY: np.array([str(i) for i in range(n)], dtype=object),
           schema.CAPTION: np.array(["a red square"] * n, dtype=object),
           schema.WIDTH: np.full(n, 100), schema.HEIGHT: np.full(n, 80),
           schema.INPUT_IDS: np.zeros((n, 77), np.int32)}
    for r in (32, 64):
        out[schema.image_column(r)] = rng.integers(0, 256, (n, r, r, 3), dtype=np.uint8)
    return out


def test_normalization_maps_uint8_to_minus_one_one():
    x = normalize_images(np.array([[[[0, 255, 127]]]], np.uint8), "cpu", torch.float32)
    assert x.shape == (1, 3, 1, 1)
    assert x.flatten().tolist() == pytest.approx([-1.0, 1.0, 127 / 127.5 - 1])


def test_cpu_runs_in_float32_on_any_machine():
    assert pick_device_and_dtype("cpu") == (torch.device("cpu"), torch.float32)


def test_output_columns_shapes_and_dtypes(encoder):
    out = encoder(_batch(3, np.random.default_rng(0)))
    f = encoder.vae.downsample
    assert out[schema.vae_moments_column(64)].shape == (3, 8, 64 // f, 64 // f)
    assert out[schema.vae_moments_column(32)].dtype == np.float16
    assert out[schema.TEXT_EMBEDS].shape == (3, 77, encoder.text.dim)
    assert out[schema.TEXT_EMBEDS].dtype == np.float16
    assert schema.INPUT_IDS not in out  # --text embeds, the default


def test_text_ids_passes_the_ids_through_and_runs_no_text_encoder(tiny_kit):
    # What --text ids, and online mode with model.text=ids, run in the encode stage.
    from diffusion.train.config import load_config
    from diffusion.stream.stream_source import convert_config
    encoder = LatentTextEncoder(tiny_kit, [32], device="cpu", text="ids")
    assert encoder.text is None
    batch = _batch(3, np.random.default_rng(0))
    batch[schema.INPUT_IDS][:, 0] = [5, 6, 7]
    out = encoder(batch)
    assert schema.TEXT_EMBEDS not in out and out[schema.INPUT_IDS][:, 0].tolist() == [5, 6, 7]
    both = LatentTextEncoder(tiny_kit, [32], device="cpu", text="both")(batch)
    assert {schema.TEXT_EMBEDS, schema.INPUT_IDS} <= set(both)
    for text, stored in (("ids", "ids"), ("auto", "embeds"), ("embeds", "embeds")):
        cfg = load_config("yamls/tiny-online-cpu.yaml", [f"model.ref={tiny_kit}", f"model.text={text}"])
        assert convert_config(cfg, "work").text == stored
    assert not any(c.startswith("image_") for c in out)  # images stop here


def test_moments_are_mean_then_logvar_of_the_posterior(encoder):
    batch = _batch(2, np.random.default_rng(1))
    moments = encoder(batch)[schema.vae_moments_column(64)].astype(np.float32)
    x = normalize_images(batch[schema.image_column(64)], "cpu", torch.float32)
    with torch.no_grad():
        posterior = encoder.vae.model.encode(x).latent_dist
    np.testing.assert_allclose(moments[:, :4], posterior.mean.numpy(), atol=2e-2, rtol=1e-2)
    np.testing.assert_allclose(moments[:, 4:], posterior.logvar.numpy(), atol=2e-2, rtol=1e-2)


def test_text_embeddings_differ_by_caption(tiny_kit):
    text = TextEncoder(tiny_kit, device="cpu")
    a, b, empty = text.encode_captions(["a red square", "a blue circle", ""])
    assert not np.allclose(a, b) and not np.allclose(a, empty)


def test_empty_batch_passes_through(encoder):
    out = encoder(_batch(0, np.random.default_rng(0)))
    assert out[schema.TEXT_EMBEDS].shape[0] == 0 and out[schema.vae_moments_column(32)].shape[0] == 0
