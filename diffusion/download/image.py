"""Validate downloaded bytes as an image (it decodes, is big enough, not too big) and optionally resize.

The default keeps the original bytes: the converter crops and resizes for each training resolution,
so re-encoding here would only lose quality. Resizing at download time trades that for disk space.
Each valid image also gives its EXIF tags (img2dataset's ``exif`` column, see :func:`exif_json`).
"""

from __future__ import annotations

import dataclasses
import io
import json
import warnings

from PIL import ExifTags, Image, ImageOps, TiffImagePlugin

from diffusion.convert.settings import MAX_SCANS
from diffusion.convert.transforms import jpeg_scans, open_within
from diffusion.download.http import FetchError
from diffusion.rejects import TOO_MANY_SCANS
from diffusion.errors import ConfigError

RESIZE_MODES = ("no", "center_crop", "keep_ratio")


@dataclasses.dataclass(frozen=True)
class ImageRules:
    min_size: int = 64  # shorter side, in pixels, of the original image
    max_pixels: int = 2**25  # about 33 megapixels; bigger images are refused before decoding
    max_scans: int = MAX_SCANS  # a JPEG of more scans is refused before decoding (a decode-time bomb)
    resize_mode: str = "no"  # no | center_crop (image_size square) | keep_ratio (shorter side = image_size)
    image_size: int = 512
    jpeg_quality: int = 95

    def __post_init__(self):
        if self.resize_mode not in RESIZE_MODES:
            raise ConfigError(f"resize_mode must be one of {RESIZE_MODES}, got {self.resize_mode!r}")
        if self.image_size <= 0 or self.min_size < 0 or self.max_pixels <= 0 or self.max_scans <= 0:
            raise ConfigError(f"image_size, min_size, max_pixels and max_scans must be positive: {self}")


@dataclasses.dataclass
class CheckedImage:
    data: bytes  # what is stored: the original bytes, or the resized JPEG
    width: int  # size of ``data``
    height: int
    original_width: int
    original_height: int
    exif: str | None = None  # JSON object of the original's EXIF tags (exif_json)


def check_image(data: bytes, rules: ImageRules) -> CheckedImage:
    """Decode all of ``data`` and apply ``rules``; raises FetchError with the reason on failure.

    A JPEG decodes in draft mode, at the smallest scale the rules allow (1/8 when the bytes are kept):
    every coefficient of the stream is still decoded, so damage is found as in a full decode, but most
    of the inverse DCT is skipped, which makes validation about 4x cheaper."""
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            image = open_within(data, rules.max_pixels)  # Pillow's guard at --max-pixels, not its own 89.5 MP
            width, height = image.size  # from the header: refuse giants before decoding them
            if width * height > rules.max_pixels:
                raise FetchError("too_many_pixels", f"more than {rules.max_pixels} pixels")
            if image.format == "JPEG" and (scans := jpeg_scans(data)) > rules.max_scans:
                raise FetchError(TOO_MANY_SCANS, f"a JPEG of {scans} scans (at most {rules.max_scans})")
            keep_size = 1 if rules.resize_mode == "no" else rules.image_size  # both sides stay >= this
            image.draft(None, (keep_size, keep_size))  # a no-op for formats other than JPEG
            image.load()
    except FetchError:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise FetchError("too_many_pixels", f"more than {rules.max_pixels} pixels") from None
    except Image.UnidentifiedImageError:
        raise FetchError("not_image", "cannot identify image file") from None
    except (OSError, SyntaxError, ValueError, EOFError) as e:  # truncated or corrupt
        raise FetchError("decode_error", str(e)) from None
    if min(width, height) < rules.min_size:
        raise FetchError("too_small", f"shorter side < {rules.min_size} px")
    exif = exif_json(image)
    if rules.resize_mode == "no":
        return CheckedImage(data, width, height, width, height, exif)
    resized = _resize(ImageOps.exif_transpose(image).convert("RGB"), rules)
    buf = io.BytesIO()
    resized.save(buf, "JPEG", quality=rules.jpeg_quality)
    return CheckedImage(buf.getvalue(), resized.width, resized.height, width, height, exif)


# IFDs as img2dataset's EXIF reader (exifread) prefixes their tags; MakerNote and the thumbnail are left out.
_SUB_IFDS = (("EXIF", ExifTags.IFD.Exif, ExifTags.TAGS), ("GPS", ExifTags.IFD.GPSInfo, ExifTags.GPSTAGS),
             ("Interoperability", ExifTags.IFD.Interop, ExifTags.TAGS))
_SKIPPED_TAGS = {int(ExifTags.IFD.MakerNote)}


def exif_json(image: Image.Image) -> str | None:
    """The image's EXIF tags as a JSON object of strings, keyed as img2dataset keys them ("Image Make",
    "EXIF DateTimeOriginal", "GPS GPSLatitude"); "{}" when it has none, None when they cannot be read.
    Values are text: a rational as "1/100", a sequence as "[1, 2]"; binary values are left out."""
    try:
        exif = image.getexif()
        tags = {}
        for prefix, ifd, names in (("Image", None, ExifTags.TAGS),) + _SUB_IFDS:
            try:
                entries = exif if ifd is None else exif.get_ifd(ifd)
            except KeyError:  # Pillow's answer for an Interop IFD that the Exif IFD does not point to
                continue
            for tag, value in entries.items():
                text = None if tag in _SKIPPED_TAGS else _exif_text(value)
                if text is not None:
                    tags[f"{prefix} {names.get(tag, f'Tag 0x{tag:04X}')}"] = text
        return json.dumps(tags)
    except Exception:  # a damaged EXIF block loses the tags, never the image
        return None


def _exif_text(value) -> str | None:
    if isinstance(value, TiffImagePlugin.IFDRational):
        num, den = value.numerator, value.denominator
        return str(num) if den == 1 else f"{num}/{den}"
    if isinstance(value, bytes):
        text = value.rstrip(b"\0").decode("ascii", "replace")
        return text.strip() if text.isprintable() and len(text) <= 256 else None
    if isinstance(value, (tuple, list)):
        items = [_exif_text(v) for v in value]
        return None if None in items else "[" + ", ".join(items) + "]"
    if isinstance(value, str):
        return value.rstrip("\0").strip()
    if isinstance(value, (int, float)):
        return str(value)
    return None


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
