"""Aspect-ratio buckets: which (width, height) crops a dataset holds, and how one image becomes one.

``--buckets preset`` lists, at a fixed pixel budget R x R (the one ``--resolutions`` value), every width
that is a multiple of :data:`STEP` with the height nearest R²/width (also a multiple), within the
converter's ``--max-aspect`` (as SDXL's and PixArt's bucket tables are made); ``--buckets 320x192,256x256``
names them. An image goes to the bucket nearest its aspect ratio (in log ratio, so 2:1 and 1:2 are as
far from square), is resized to just cover the bucket and centre-cropped, which crops as little as the
bucket allows. The crop's top-left in the resized image is stored (SDXL's crop conditioning).
"""

from __future__ import annotations

import math

import numpy as np
from PIL import Image

from diffusion.errors import ConfigError

STEP = 64  # bucket sides are multiples of this (8 latent pixels at /8: what the UNet's downsampling needs)
PRESET = "preset"


def preset_buckets(resolution: int, max_aspect: float, step: int | None = None) -> list[tuple[int, int]]:
    """(width, height) pairs near ``resolution``² pixels, sides multiples of ``step`` (:data:`STEP`; a
    quarter of the resolution below 256 px), aspect ≤ ``max_aspect``."""
    step = step or (STEP if resolution >= 4 * STEP else max(8, resolution // 4 // 8 * 8))
    area, best = resolution * resolution, {}  # landscape height -> the width nearest the budget
    for w in range(resolution - resolution % step, 4 * resolution + 1, step):
        h = max(step, int(round(area / w / step)) * step)
        if w >= h and w / h <= max_aspect and abs(w * h - area) <= abs(best.get(h, (0, 0))[0] * h - area):
            best[h] = (w, h)
    found = set(best.values()) | {(h, w) for w, h in best.values()}  # portrait buckets mirror landscape ones
    return sorted(found, key=lambda b: b[0] / b[1])


def parse_buckets(spec: str, resolutions, max_aspect: float, downsample: int = 8) -> list[tuple[int, int]]:
    """``--buckets``: 'preset' or a comma list of WxH, checked; sorted by aspect ratio."""
    if len(resolutions) != 1:
        raise ConfigError(f"--buckets needs one --resolutions value (the pixel budget), got {list(resolutions)}")
    if spec == PRESET:
        return preset_buckets(resolutions[0], max_aspect)
    buckets = set()
    for item in spec.split(","):
        try:
            w, h = (int(v) for v in item.strip().lower().split("x"))
        except ValueError:
            raise ConfigError(f"--buckets {spec!r}: {item.strip()!r} is not WIDTHxHEIGHT (e.g. 320x192), "
                              f"nor is the list '{PRESET}'") from None
        if w <= 0 or h <= 0 or w % downsample or h % downsample:
            raise ConfigError(f"--buckets: {w}x{h} must have positive sides that are multiples of {downsample}")
        buckets.add((w, h))
    return sorted(buckets, key=lambda b: b[0] / b[1])


def nearest_bucket(width: int, height: int, buckets) -> tuple[int, int]:
    """The bucket whose aspect ratio is nearest ``width/height`` in log ratio (ties: the first listed)."""
    ratio = math.log(width / height)
    return min(buckets, key=lambda b: abs(math.log(b[0] / b[1]) - ratio))


def bucket_crop(image: Image.Image, bucket: tuple[int, int]) -> tuple[np.ndarray, int, int]:
    """``image`` resized to just cover ``bucket`` and centre-cropped to it: (uint8 HWC, crop top, crop left),
    the crop's corner in the resized image's pixels. One resample from the source box."""
    bw, bh = bucket
    w, h = image.size
    scale = max(bw / w, bh / h)
    rw, rh = max(bw, round(w * scale)), max(bh, round(h * scale))
    left, top = (rw - bw) // 2, (rh - bh) // 2
    box = (left / scale, top / scale, (left + bw) / scale, (top + bh) / scale)
    shrinking = scale <= 1
    resample = Image.Resampling.BILINEAR if shrinking else Image.Resampling.BICUBIC
    out = image.resize((bw, bh), resample, box=box, reducing_gap=3.0 if shrinking else None)
    return np.asarray(out, dtype=np.uint8), top, left
