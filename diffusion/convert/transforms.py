"""The transform stage: raw rows in, validated uint8 square crops at every resolution plus token ids out.

Each image is decoded once. JPEGs decode in draft mode at the smallest DCT scale (1/2, 1/4, 1/8) that
still covers the largest crop, which is most of the saving over a full decode. Then: EXIF orientation,
RGB (transparency composited on white), checks, the largest centre square, resized to each resolution,
largest first, each smaller one from the previous (cheaper and no worse).

:class:`ImageCaptionTransform` is a Ray Data ``map_batches`` callable (a class, so the tokenizer loads
once per actor); offline conversion and online training use it unchanged.
"""

from __future__ import annotations

import dataclasses
import io
import json
import math
import os
import time
import unicodedata
import uuid
import warnings

import numpy as np
from PIL import Image

from diffusion import schema
from diffusion.convert import settings
from diffusion.rejects import (  # noqa: F401 (the vocabulary, also for this module's importers)
    ASPECT_RATIO, BAD_CAPTION, BAD_KEY, BAD_METADATA, BAD_SIZE, EMPTY_CAPTION, LEGACY_RECORD_SUFFIX, RECORD_SUFFIX,
    TOO_MANY_PIXELS, TOO_MANY_SCANS, TOO_SMALL, UNDECODABLE, UNSUPPORTED_MODE, Rejected, write_rejects)

STAGE_SECONDS = "_transform_seconds"  # per-row share of the batch's wall time, when timing is on
_ORIENTATION = 0x0112
_TRANSPOSE = {2: Image.Transpose.FLIP_LEFT_RIGHT, 3: Image.Transpose.ROTATE_180, 4: Image.Transpose.FLIP_TOP_BOTTOM,
              5: Image.Transpose.TRANSPOSE, 6: Image.Transpose.ROTATE_270, 7: Image.Transpose.TRANSVERSE,
              8: Image.Transpose.ROTATE_90}


@dataclasses.dataclass(frozen=True)
class ImageChecks:
    min_size: int = settings.MIN_SIZE
    max_aspect: float = settings.MAX_ASPECT
    max_pixels: int = settings.MAX_PIXELS  # checked from the header, before decoding
    max_scans: int = settings.MAX_SCANS  # a JPEG's scans, counted in its bytes before decoding


def jpeg_scans(data: bytes) -> int:
    """How many scans (SOS markers) a JPEG's bytes hold: each is a pass over the whole image, so a
    progressive JPEG repeating a scan thousands of times is a decode-time bomb. Entropy-coded data
    cannot hold the marker (its 0xFF bytes are stuffed), so this counts scans, plus those of an
    embedded thumbnail."""
    return data.count(b"\xff\xda") if data[:2] == b"\xff\xd8" else 0


def check_scans(data: bytes, max_scans: int) -> None:
    """Raise ``too_many_scans`` for a JPEG of more than ``max_scans`` scans, before it is decoded."""
    scans = jpeg_scans(data)
    if scans > max_scans:
        raise Rejected(TOO_MANY_SCANS, f"a JPEG of {scans} scans (at most {max_scans})")


def _scaled_to_8bit(values: np.ndarray, full_scale: float | None) -> np.ndarray:
    """Grey values as uint8: divided by ``full_scale / 255`` when given, else stretched min..max."""
    finite = np.isfinite(values)
    if not finite.any():
        raise Rejected(UNSUPPORTED_MODE, "no finite pixel value")
    values = np.where(finite, values, 0.0)
    if full_scale is None:
        lo, hi = float(values[finite].min()), float(values[finite].max())
        scaled = (values - lo) * (255.0 / (hi - lo)) if hi > lo else np.zeros_like(values)
    else:
        scaled = values * (255.0 / full_scale)
    return np.rint(scaled).clip(0, 255).astype(np.uint8)


def _grey_to_8bit(image: Image.Image) -> Image.Image:
    """A one-band image of 16-bit, 32-bit or float values as 8-bit grey, scaled rather than clipped
    (PIL's own convert clips: a float image in 0..1 becomes black, 16-bit grey mostly white).

    16-bit modes use their full range (0..65535). 32-bit integers and floats are read by their
    values: floats within 0..1 are the usual normalised convention (x 255); values within 0..255 are
    8-bit, within 0..65535 16-bit; anything else (negative, larger, HDR) is stretched from its minimum
    to its maximum. Non-finite floats (NaN, inf) become 0; an image with no finite value is rejected.
    """
    values = np.asarray(image, dtype=np.float64)
    if image.mode.startswith("I;16"):
        return Image.fromarray(_scaled_to_8bit(values, 65535.0))
    finite = values[np.isfinite(values)]
    lo, hi = (float(finite.min()), float(finite.max())) if finite.size else (0.0, 0.0)
    if lo < 0:
        full_scale = None
    elif image.mode == "F" and hi <= 1.0:
        full_scale = 1.0
    elif image.mode == "F" and hi <= 255.0:
        full_scale = 255.0
    elif hi <= 65535.0:
        full_scale = 65535.0  # a 16-bit PNG opens as "I"
    else:
        full_scale = None
    return Image.fromarray(_scaled_to_8bit(values, full_scale))


def to_rgb(image: Image.Image) -> Image.Image:
    """RGB, with any transparency composited on white (a black background would darken cut-outs).

    Grey images of more than 8 bits (16-bit, 32-bit, float) are scaled to 0..255 (:func:`_grey_to_8bit`);
    other modes go through PIL's conversion (L, 1, CMYK, YCbCr, LAB, HSV, ...). A mode PIL cannot turn
    into RGB raises :class:`Rejected` with ``unsupported_mode``.
    """
    if image.mode == "RGB":
        return image
    try:
        if image.mode == "P":
            image = image.convert("RGBA" if "transparency" in image.info else "RGB")
        if image.mode in ("RGBA", "LA", "PA", "RGBa", "La"):
            rgba = image.convert("RGBA")
            background = Image.new("RGBA", rgba.size, (255, 255, 255, 255))
            return Image.alpha_composite(background, rgba).convert("RGB")
        if image.mode in ("F", "I") or image.mode.startswith("I;16"):
            image = _grey_to_8bit(image)
        return image.convert("RGB")
    except Rejected:
        raise
    except Exception as e:  # a mode PIL decodes but cannot convert
        raise Rejected(UNSUPPORTED_MODE, f"mode {image.mode}: {type(e).__name__}: {e}") from e


# Invisible characters removed from captions: format characters (BOM U+FEFF, zero-width space U+200B,
# word joiner, soft hyphen, bidi marks...), except the two joiners that change how text renders
# (U+200C ZWNJ in Persian and Indic scripts, U+200D ZWJ in emoji sequences).
_KEPT_FORMAT = frozenset("\u200c\u200d")


def clean_caption(caption) -> str:
    """The caption as text a tokenizer can take, or :class:`Rejected`.

    Control characters are removed (tab, newline and the other whitespace controls become spaces),
    and so are invisible format characters (BOM, zero-width space, bidi marks; see ``_KEPT_FORMAT``);
    the result is stripped. A caption with nothing visible left (only spaces, controls or invisible
    characters) is ``empty_caption``, as is ``None`` or NaN (a missing value). Bytes are decoded as
    UTF-8; anything else (a number, a list, bytes that are not UTF-8) is ``bad_caption``.
    """
    if caption is None or (isinstance(caption, float) and math.isnan(caption)):
        raise Rejected(EMPTY_CAPTION)
    if isinstance(caption, (bytes, bytearray, memoryview)):
        try:
            caption = bytes(caption).decode("utf-8")
        except UnicodeDecodeError as e:
            raise Rejected(BAD_CAPTION, f"not UTF-8: {e}") from None
    if not isinstance(caption, str):
        raise Rejected(BAD_CAPTION, f"a caption must be text, got {type(caption).__name__}")
    if not caption.isprintable():  # fast path: printable text has no control or format characters
        kept = []
        for ch in caption:
            category = unicodedata.category(ch)
            if category == "Cc":
                if ch.isspace():
                    kept.append(" ")
            elif category == "Cs" or (category == "Cf" and ch not in _KEPT_FORMAT):
                continue
            else:
                kept.append(ch)
        caption = "".join(kept)
    caption = caption.strip()
    if not any(unicodedata.category(ch)[0] not in "CZ" for ch in caption):
        raise Rejected(EMPTY_CAPTION)
    return caption


def clean_extra_caption(caption) -> str:
    """A further caption (``--captions``): cleaned as the first one, but an empty one is kept as ""
    (counted, and left out of the training draw) rather than rejecting the image."""
    try:
        return clean_caption(caption)
    except Rejected as e:
        if e.reason == EMPTY_CAPTION:
            return ""
        raise


def open_within(data: bytes, max_pixels: int) -> Image.Image:
    """``Image.open`` of ``data`` (the header read, nothing decoded) with Pillow's decompression-bomb guard at
    ``max_pixels`` (raising its warning as an error above it), not at Pillow's own 89.5 MP, which rejected
    images under a larger ``--max-pixels``; Pillow's setting is restored after."""
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        pillows, Image.MAX_IMAGE_PIXELS = Image.MAX_IMAGE_PIXELS, max_pixels
        try:
            return Image.open(io.BytesIO(data))
        finally:
            Image.MAX_IMAGE_PIXELS = pillows


def decode_image(data: bytes, largest: int, checks: ImageChecks = ImageChecks()) -> tuple[Image.Image, int, int]:
    """Decode ``data`` once, as small as covering a ``largest``-pixel square crop allows.

    Returns the upright RGB image and the original (upright) width and height; raises
    :class:`Rejected` for anything that must be skipped.
    """
    if not data:
        raise Rejected(UNDECODABLE, "no image bytes")
    try:
        image = open_within(data, checks.max_pixels)
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise Rejected(TOO_MANY_PIXELS, str(e)) from e
    except Exception as e:  # PIL raises many types for garbage bytes
        raise Rejected(UNDECODABLE, f"{type(e).__name__}: {e}") from e
    width, height = image.size
    if width * height > checks.max_pixels:
        raise Rejected(TOO_MANY_PIXELS, f"{width}x{height}")
    if image.format == "JPEG":
        check_scans(data, checks.max_scans)
    try:
        orientation = image.getexif().get(_ORIENTATION, 1)
    except Exception:  # a broken EXIF block is not a broken image
        orientation = 1
    if orientation in (5, 6, 7, 8):
        width, height = height, width
    short, long = min(width, height), max(width, height)
    if short < checks.min_size:
        raise Rejected(TOO_SMALL, f"{width}x{height}")
    if long / short > checks.max_aspect:
        raise Rejected(ASPECT_RATIO, f"{width}x{height}")
    try:
        if image.format == "JPEG":
            # Both sides stay >= largest, so the centre square still covers the largest crop.
            image.draft(image.mode if image.mode in ("L", "CMYK") else "RGB", (largest, largest))
        image.load()
    except Exception as e:  # truncated data, corrupt streams
        raise Rejected(UNDECODABLE, f"{type(e).__name__}: {e}") from e
    if orientation in _TRANSPOSE:
        image = image.transpose(_TRANSPOSE[orientation])
    return to_rgb(image), width, height


def center_square_crops(image: Image.Image, resolutions) -> dict[int, np.ndarray]:
    """The largest centre square of ``image`` at each resolution, uint8 HWC, largest first."""
    w, h = image.size
    side = min(w, h)
    box = ((w - side) / 2, (h - side) / 2, (w + side) / 2, (h + side) / 2)
    crops, source = {}, image
    for r in sorted(resolutions, reverse=True):
        # Shrinking: PIL's antialiased bilinear (a triangle filter), which after a draft decode only has
        # < 2x left to do and costs far less than bicubic; reducing_gap shrinks by whole factors first
        # when more is left. Enlarging small images: bicubic.
        shrinking = min(source.size) >= r
        resample = Image.Resampling.BILINEAR if shrinking else Image.Resampling.BICUBIC
        source = source.resize((r, r), resample, box=box, reducing_gap=3.0 if shrinking else None)
        box = None
        crops[r] = np.asarray(source, dtype=np.uint8)
    return crops


class ImageCaptionTransform:
    """Ray ``map_batches`` callable: raw columns in; key, caption, size, token ids and crops out.

    Output columns: ``KEY, CAPTION, WIDTH, HEIGHT, INPUT_IDS`` (int32, ``text_length``), ``TEXT_TOKENS``
    (the token counts) and, per resolution R,
    ``schema.image_column(R)`` (uint8 R x R x 3); per further caption (``captions``), its text and
    token ids columns (:func:`diffusion.schema.caption_columns`). Rejected rows are dropped; ``self.rejects`` counts
    them by reason, and ``rejects_dir`` (when given) receives one file of ``{key: reason}`` per batch.
    """

    def __init__(self, model: str, resolutions, checks: ImageChecks = ImageChecks(),
                 rejects_dir: str | None = None, record_timing: bool = False, buckets=None, captions=(),
                 text_length: int = schema.MAX_TOKENS):
        from diffusion.models.tokens import load_tokenizer_without_torch
        self.tokenizer = load_tokenizer_without_torch(model)  # in a Ray actor: transformers without torch
        self.text_length = int(text_length)
        self.resolutions = sorted({int(r) for r in resolutions}, reverse=True)
        # Aspect-ratio buckets [(w, h)]: each image is cropped to its nearest one (one resolution only).
        self.buckets = [tuple(int(v) for v in b) for b in buckets] if buckets else None
        self.checks = checks
        self.rejects_dir = rejects_dir
        self.record_timing = record_timing
        self.rejects: dict[str, int] = {}
        self.captions = tuple(captions)

    def extra_captions(self, batch: dict, i: int) -> dict:
        """Row ``i``'s further captions, cleaned (a bad one rejects the row, an empty one is "")."""
        return {c: clean_extra_caption(batch[c][i]) for c in (schema.caption_columns(n)[0] for n in self.captions)}

    def add_extra_captions(self, result: dict, extras: list[dict]) -> None:
        """The further captions' text and token ids columns, from each kept row's :meth:`extra_captions`."""
        for name in self.captions:
            text, _, ids = schema.caption_columns(name)
            values = [e[text] for e in extras]
            result[text] = np.array(values, dtype=object)
            result[ids], result[schema.tokens_column(name)] = self.tokenize(values)

    def tokenize(self, captions: list[str]) -> tuple[np.ndarray, np.ndarray]:
        """(token ids, token counts) of ``captions`` (:func:`diffusion.models.tokens.tokenize`)."""
        from diffusion.models.tokens import tokenize
        return tokenize(self.tokenizer, captions, self.text_length)

    def transform_one(self, data: bytes, caption) -> tuple[dict[int, np.ndarray], int, int]:
        clean_caption(caption)
        image, width, height = decode_image(data, self.resolutions[0], self.checks)
        return center_square_crops(image, self.resolutions), width, height

    def bucket_one(self, data: bytes) -> tuple[np.ndarray, int, int, tuple[int, int], int, int]:
        """(crop, width, height, bucket, crop top, crop left) of one image with buckets."""
        from diffusion.convert.buckets import bucket_crop, nearest_bucket
        image, width, height = decode_image(data, max(max(b) for b in self.buckets), self.checks)
        bucket = nearest_bucket(width, height, self.buckets)
        crop, top, left = bucket_crop(image, bucket)
        return crop, width, height, bucket, top, left

    def _call_buckets(self, batch: dict, start: float) -> dict:
        """Bucketed rows: the crop travels as its uint8 HWC bytes (shapes differ between rows), with the
        bucket's name and the crop's corner."""
        names = (schema.KEY, schema.CAPTION, schema.WIDTH, schema.HEIGHT, schema.BUCKET, schema.CROP_TOP,
                 schema.CROP_LEFT, schema.image_column(self.resolutions[0]))
        out, rejected, extras = {c: [] for c in names}, {}, []
        for i, (key, caption, data) in enumerate(zip(batch[schema.RAW_KEY], batch[schema.RAW_CAPTION],
                                                     batch[schema.RAW_IMAGE])):
            key = str(key)
            try:
                caption = clean_caption(caption)
                extra = self.extra_captions(batch, i)
                crop, width, height, bucket, top, left = self.bucket_one(data)
            except Rejected as e:
                rejected[key] = e.reason
                self.rejects[e.reason] = self.rejects.get(e.reason, 0) + 1
                continue
            for c, v in zip(names, (key, caption, width, height, schema.bucket_name(*bucket), top, left,
                                    crop.tobytes())):
                out[c].append(v)
            extras.append(extra)
        if rejected and self.rejects_dir:
            write_rejects(self.rejects_dir, rejected)
        n = len(out[schema.KEY])
        result = {c: np.array(out[c], dtype=object) for c in names}
        for c in (schema.WIDTH, schema.HEIGHT, schema.CROP_TOP, schema.CROP_LEFT):
            result[c] = np.array(out[c], dtype=np.int64)
        result[schema.INPUT_IDS], result[schema.TEXT_TOKENS] = self.tokenize(out[schema.CAPTION])
        self.add_extra_captions(result, extras)
        if self.record_timing:
            result[STAGE_SECONDS] = np.full(n, (time.perf_counter() - start) / max(n, 1))
        return result

    def __call__(self, batch: dict) -> dict:
        start = time.perf_counter()
        if self.buckets:
            return self._call_buckets(batch, start)
        out = {c: [] for c in (schema.KEY, schema.CAPTION, schema.WIDTH, schema.HEIGHT)}
        crops = {r: [] for r in self.resolutions}
        rejected, extras = {}, []
        for i, (key, caption, data) in enumerate(zip(batch[schema.RAW_KEY], batch[schema.RAW_CAPTION],
                                                     batch[schema.RAW_IMAGE])):
            key = str(key)
            try:
                caption = clean_caption(caption)
                extra = self.extra_captions(batch, i)
                images, width, height = self.transform_one(data, caption)
            except Rejected as e:
                rejected[key] = e.reason
                self.rejects[e.reason] = self.rejects.get(e.reason, 0) + 1
                continue
            out[schema.KEY].append(key)
            out[schema.CAPTION].append(caption)
            out[schema.WIDTH].append(width)
            out[schema.HEIGHT].append(height)
            for r in self.resolutions:
                crops[r].append(images[r])
            extras.append(extra)
        if rejected and self.rejects_dir:
            write_rejects(self.rejects_dir, rejected)
        n = len(out[schema.KEY])
        result = {schema.KEY: np.array(out[schema.KEY], dtype=object),
                  schema.CAPTION: np.array(out[schema.CAPTION], dtype=object),
                  schema.WIDTH: np.array(out[schema.WIDTH], dtype=np.int64),
                  schema.HEIGHT: np.array(out[schema.HEIGHT], dtype=np.int64)}
        result[schema.INPUT_IDS], result[schema.TEXT_TOKENS] = self.tokenize(out[schema.CAPTION])
        for r in self.resolutions:
            result[schema.image_column(r)] = np.stack(crops[r]) if n else np.zeros((0, r, r, 3), np.uint8)
        self.add_extra_captions(result, extras)
        if self.record_timing:
            result[STAGE_SECONDS] = np.full(n, (time.perf_counter() - start) / max(n, 1))
        return result
