"""Validate downloaded bytes as an image (it decodes, is big enough, not too big) and optionally resize.

The default keeps the original bytes: the converter crops and resizes for each training resolution,
so re-encoding here would only lose quality. Resizing at download time trades that for disk space.
"""

from __future__ import annotations

import dataclasses
import io
import warnings

from PIL import Image, ImageOps

from diffusion.download.http import FetchError
from diffusion.errors import ConfigError

RESIZE_MODES = ("no", "center_crop", "keep_ratio")


@dataclasses.dataclass(frozen=True)
class ImageRules:
    min_size: int = 64  # shorter side, in pixels, of the original image
    max_pixels: int = 2**25  # about 33 megapixels; bigger images are refused before decoding
    resize_mode: str = "no"  # no | center_crop (image_size square) | keep_ratio (shorter side = image_size)
    image_size: int = 512
    jpeg_quality: int = 95

    def __post_init__(self):
        if self.resize_mode not in RESIZE_MODES:
            raise ConfigError(f"resize_mode must be one of {RESIZE_MODES}, got {self.resize_mode!r}")
        if self.image_size <= 0 or self.min_size < 0 or self.max_pixels <= 0:
            raise ConfigError(f"image_size, min_size and max_pixels must be positive: {self}")


@dataclasses.dataclass
class CheckedImage:
    data: bytes  # what is stored: the original bytes, or the resized JPEG
    width: int  # size of ``data``
    height: int
    original_width: int
    original_height: int


def check_image(data: bytes, rules: ImageRules) -> CheckedImage:
    """Decode ``data`` fully and apply ``rules``; raises FetchError with the reason on failure."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(data))
            width, height = image.size  # from the header: refuse giants before decoding them
            if width * height > rules.max_pixels:
                raise FetchError("too_many_pixels", f"{width}x{height} > {rules.max_pixels} pixels")
            image.load()
    except FetchError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning) as e:
        raise FetchError("too_many_pixels", str(e)) from None
    except Image.UnidentifiedImageError:
        raise FetchError("not_image", f"{len(data)} bytes starting {data[:16]!r}") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # truncated or corrupt
        raise FetchError("decode_error", str(e)) from None
    if min(width, height) < rules.min_size:
        raise FetchError("too_small", f"{width}x{height}, shorter side < {rules.min_size}")
    if rules.resize_mode == "no":
        return CheckedImage(data, width, height, width, height)
    resized = _resize(ImageOps.exif_transpose(image).convert("RGB"), rules)
    buf = io.BytesIO()
    resized.save(buf, "JPEG", quality=rules.jpeg_quality)
    return CheckedImage(buf.getvalue(), resized.width, resized.height, width, height)


def _resize(image: Image.Image, rules: ImageRules) -> Image.Image:
    size = rules.image_size
    if rules.resize_mode == "center_crop":
        return ImageOps.fit(image, (size, size), Image.Resampling.LANCZOS)
    # keep_ratio: the shorter side becomes image_size; never upsample, which only adds bytes.
    scale = size / min(image.size)
    if scale >= 1:
        return image
    return image.resize((max(1, round(image.width * scale)), max(1, round(image.height * scale))),
                        Image.Resampling.LANCZOS)
