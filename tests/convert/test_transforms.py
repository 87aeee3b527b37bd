import io
import json
import os

import numpy as np
import pytest
from PIL import Image

from diffusion import schema
from diffusion.convert.readers import iter_rows
from diffusion.convert.transforms import (ASPECT_RATIO, BAD_CAPTION, EMPTY_CAPTION, TOO_MANY_PIXELS, TOO_SMALL,
                                       UNDECODABLE, UNSUPPORTED_MODE, ImageCaptionTransform, ImageChecks, Rejected,
                                       center_square_crops, clean_caption, decode_image)


def _bytes(image: Image.Image, fmt="JPEG", **kw) -> bytes:
    buf = io.BytesIO()
    image.save(buf, fmt, **kw)
    return buf.getvalue()


def _halves(size=(200, 100)) -> Image.Image:
    """Left half red, right half blue."""
    a = np.zeros((size[1], size[0], 3), np.uint8)
    a[:, : size[0] // 2] = (255, 0, 0)
    a[:, size[0] // 2:] = (0, 0, 255)
    return Image.fromarray(a)


@pytest.fixture(scope="module")
def transform(tiny_kit, tmp_path_factory):
    rejects = tmp_path_factory.mktemp("rejects")
    return ImageCaptionTransform(tiny_kit, [64, 32], rejects_dir=str(rejects), record_timing=False)


def test_sample_bad_rows_get_their_reasons(sample_data, manifest, transform):
    expected = {"truncated": UNDECODABLE, "not_image": UNDECODABLE, "tiny": TOO_SMALL, "empty_caption": EMPTY_CAPTION}
    for row in iter_rows(sample_data):
        kind = manifest["bad_keys"].get(row[schema.RAW_KEY])
        if kind is None:
            crops, w, h = transform.transform_one(row[schema.RAW_IMAGE], row[schema.RAW_CAPTION])
            assert (w, h) == (row[schema.WIDTH], row[schema.HEIGHT])
            assert crops[64].shape == (64, 64, 3) and crops[32].shape == (32, 32, 3)
        else:
            with pytest.raises(Rejected) as e:
                transform.transform_one(row[schema.RAW_IMAGE], row[schema.RAW_CAPTION])
            assert e.value.reason == expected[kind], row[schema.RAW_KEY]


def test_batch_output_columns_and_rejects_file(sample_data, manifest, transform):
    rows = list(iter_rows(sample_data))
    batch = {c: [r[c] for r in rows] for c in (schema.RAW_KEY, schema.RAW_CAPTION, schema.RAW_IMAGE)}
    before = set(os.listdir(transform.rejects_dir))
    out = transform(batch)
    assert len(out[schema.KEY]) == manifest["good"]
    assert out[schema.INPUT_IDS].dtype == np.int32 and out[schema.INPUT_IDS].shape == (manifest["good"], 77)
    assert out[schema.image_column(64)].dtype == np.uint8
    assert out[schema.image_column(32)].shape == (manifest["good"], 32, 32, 3)
    new = set(os.listdir(transform.rejects_dir)) - before
    assert len(new) == 1
    with open(os.path.join(transform.rejects_dir, new.pop())) as f:
        assert set(json.load(f)) == set(manifest["bad_keys"])


def test_exif_orientation_is_applied():
    image = _halves((200, 100))
    exif = Image.Exif()
    exif[0x0112] = 6  # stored sideways: displayed after rotating 90 degrees clockwise
    decoded, w, h = decode_image(_bytes(image, exif=exif, quality=95), 64)
    assert (w, h) == (100, 200) and decoded.size[0] < decoded.size[1]
    top, bottom = np.asarray(decoded)[10, 50], np.asarray(decoded)[-10, 50]
    assert top[0] > 200 and bottom[2] > 200  # red went to the top, blue to the bottom


@pytest.mark.parametrize("mode", ["RGBA", "LA", "P"])
def test_transparency_is_composited_on_white(mode):
    image = Image.new("RGBA", (80, 80), (0, 0, 0, 0))
    if mode == "P":
        image = Image.new("P", (80, 80), 0)
        image.putpalette([0, 0, 0] * 256)
        image.info["transparency"] = 0
        data = _bytes(image, "PNG", transparency=0)
    else:
        data = _bytes(image.convert(mode), "PNG")
    decoded, _, _ = decode_image(data, 64)
    assert decoded.mode == "RGB" and np.asarray(decoded).min() == 255


@pytest.mark.parametrize("mode", ["L", "CMYK"])
def test_grayscale_and_cmyk_become_rgb(mode):
    decoded, _, _ = decode_image(_bytes(Image.new("RGB", (80, 80), (120, 120, 120)).convert(mode)), 64)
    assert decoded.mode == "RGB" and abs(float(np.asarray(decoded).mean()) - 120) < 12


def test_checks_reject_bombs_small_and_extreme_aspect():
    checks = ImageChecks(min_size=64, max_aspect=3.0, max_pixels=1000 * 1000)
    cases = {(2000, 1000): TOO_MANY_PIXELS, (63, 100): TOO_SMALL, (400, 100): ASPECT_RATIO}
    for size, reason in cases.items():
        with pytest.raises(Rejected) as e:
            decode_image(_bytes(Image.new("RGB", size)), 64, checks)
        assert e.value.reason == reason, size
    decode_image(_bytes(Image.new("RGB", (300, 100))), 64, checks)  # 3:1 exactly is allowed


def test_draft_decode_is_small_and_matches_full_decode():
    rng = np.random.default_rng(0)
    base = rng.integers(0, 255, (12, 16, 3), dtype=np.uint8)
    image = Image.fromarray(base).resize((1600, 1200), Image.Resampling.BICUBIC)  # smooth, like photos
    data = _bytes(image, quality=92)
    decoded, w, h = decode_image(data, 256)
    assert (w, h) == (1600, 1200)
    assert 256 <= min(decoded.size) <= 600  # 1/2 or 1/4 DCT scale, not the full 1200
    fast = center_square_crops(decoded, [256])[256].astype(np.float32)
    full = center_square_crops(Image.open(io.BytesIO(data)).convert("RGB"), [256])[256].astype(np.float32)
    assert np.abs(fast - full).mean() < 3.0


def test_crops_are_the_centre_square_largest_first():
    crops = center_square_crops(_halves((300, 100)), [32, 64])
    assert list(crops) == [64, 32]
    # the centre square of a 300x100 red|blue image straddles the boundary at its middle
    assert crops[64][:, 5, 0] .min() > 200 and crops[64][:, -5, 2].min() > 200


# ---- unusual pixel formats and invisible captions (issue 17) ------------------------------------

def _gradient(low: float, high: float, dtype) -> np.ndarray:
    """A 96x96 left-to-right ramp from ``low`` to ``high``."""
    return np.tile(np.linspace(low, high, 96), (96, 1)).astype(dtype)


@pytest.mark.parametrize("values, fmt, expected_max", [
    (_gradient(0.0, 1.0, np.float32), "TIFF", 255),  # float in 0..1: the usual convention, x 255
    (_gradient(0.0, 255.0, np.float32), "TIFF", 255),  # float holding 8-bit values
    (_gradient(-3.0, 40.0, np.float32), "TIFF", 255),  # anything else: stretched min..max
    (_gradient(0, 65535, np.uint16), "TIFF", 255),  # I;16
    (_gradient(0, 65535, np.uint16), "PNG", 255),
])
def test_float_and_16_bit_images_are_scaled_not_clipped(values, fmt, expected_max):
    decoded, w, h = decode_image(_bytes(Image.fromarray(values), fmt), 64)
    pixels = np.asarray(decoded)
    assert decoded.mode == "RGB" and (w, h) == (96, 96)
    assert pixels[:, 0].max() <= 2 and pixels[:, -1].min() >= expected_max - 2  # the whole ramp, not black
    assert 100 < pixels.mean() < 155


def test_float_image_with_nan_pixels_and_one_with_nothing_finite():
    values = _gradient(0.0, 1.0, np.float32)
    values[:10] = np.nan
    decoded, _, _ = decode_image(_bytes(Image.fromarray(values), "TIFF"), 64)
    assert np.asarray(decoded)[50, -1].min() >= 250 and np.asarray(decoded)[:10].max() == 0
    with pytest.raises(Rejected) as e:
        decode_image(_bytes(Image.fromarray(np.full((80, 80), np.nan, np.float32)), "TIFF"), 64)
    assert e.value.reason == UNSUPPORTED_MODE


@pytest.mark.parametrize("caption", ["\ufeff", "\x00", "\u200b", " \u200b\u2060\u00ad\t\n ", "\u200d", None,
                                     float("nan"), ""])
def test_invisible_captions_are_empty(caption, transform):
    with pytest.raises(Rejected) as e:
        transform.transform_one(_bytes(_halves((100, 100))), caption)
    assert e.value.reason == EMPTY_CAPTION


@pytest.mark.parametrize("caption", [7, ["a", "list"], {"a": 1}, b"\xff\xfe not utf-8", True])
def test_captions_that_are_not_text_are_bad_captions(caption):
    with pytest.raises(Rejected) as e:
        clean_caption(caption)
    assert e.value.reason == BAD_CAPTION


def test_captions_lose_invisible_characters_and_keep_the_rest():
    assert clean_caption("\ufeffa red\u200b square\x00\r\n") == "a red square"
    assert clean_caption("a\tblue\ncircle") == "a blue circle"
    assert clean_caption(b"caf\xc3\xa9") == "café"
    assert clean_caption("family \U0001F468\u200d\U0001F469") == "family \U0001F468\u200d\U0001F469"  # ZWJ kept


def test_batch_stores_the_cleaned_caption_and_counts_each_reason(transform):
    image = _bytes(_halves((100, 100)))
    before = set(os.listdir(transform.rejects_dir))
    out = transform({schema.RAW_KEY: ["a", "b", "c", "d"], schema.RAW_CAPTION: ["\ufeffa red\u200b square", "\u200b",
                                                                                 12, "ok"],
                     schema.RAW_IMAGE: [image, image, image, b"not an image"]})
    assert list(out[schema.KEY]) == ["a"] and list(out[schema.CAPTION]) == ["a red square"]
    (new,) = set(os.listdir(transform.rejects_dir)) - before
    with open(os.path.join(transform.rejects_dir, new)) as f:
        assert json.load(f) == {"b": EMPTY_CAPTION, "c": BAD_CAPTION, "d": UNDECODABLE}
