"""Rows: what one raw input row must be to become a sample, and how rows become column batches.

Every reader yields plain row dicts; :func:`row_batches` checks each (:func:`valid_row`: the types
Ray's raw schema holds, else a :class:`~diffusion.convert.transforms.Rejected` with its reason), gives
rows without a key one derived from their file and row (:func:`derived_key`), turns a key seen before
into a ``duplicate_key`` reject, and groups the valid rows into small column batches.
"""

from __future__ import annotations

import math
from typing import Iterator

from diffusion import schema
from diffusion.rejects import (  # noqa: F401 (also for this module's importers)
    BAD_CAPTION, BAD_KEY, BAD_SIZE, CAPTION_TOO_LONG, DUPLICATE_IMAGE, DUPLICATE_KEY, REJECT, UNDECODABLE, Rejected)

RAW_COLUMNS = (schema.RAW_KEY, schema.RAW_CAPTION, schema.RAW_IMAGE, schema.WIDTH, schema.HEIGHT)
ROWS_PER_BATCH = 64  # rows per yielded batch: small, so one huge file never becomes one huge block
KEY_SCHEME = 2  # how rows without a key get one; an output made with another scheme is not resumed



def derived_key(name: str, index: int) -> str:
    """A stable key for a row without one: its file's name under the input root and its row index."""
    return f"{name}:{index:09d}"


def _reject_id(name: str, index: int, reason: str) -> str:
    """The id a row is recorded under when its key cannot be used (repeated, or not a key at all)."""
    return f"{derived_key(name, index)}#{reason}"


def _is_missing(value) -> bool:
    return value is None or (isinstance(value, float) and math.isnan(value))


def _text(value, reason: str, what: str) -> str:
    """``value`` as a str that UTF-8 can encode (what Arrow stores), or Rejected(reason)."""
    if isinstance(value, (bytes, bytearray, memoryview)):
        try:
            return bytes(value).decode("utf-8")
        except UnicodeDecodeError:
            raise Rejected(reason, f"{what} is bytes that are not UTF-8") from None
    if not isinstance(value, str):
        raise Rejected(reason, f"{what} must be text, got {type(value).__name__}")
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:  # a lone surrogate (from a JSON escape or an undecodable file name)
        raise Rejected(reason, f"{what} is not valid Unicode") from None
    return value


def row_key(value, name: str, index: int) -> str:
    """A row's key: text (or bytes in UTF-8) as it is, a whole number (LAION's int64 ids; 7.0 from a
    column pandas made float) as its digits; missing (None, NaN, "") -> derived from file and row."""
    if _is_missing(value) or value == "" or value == b"":
        return derived_key(name, index)
    if isinstance(value, bool):
        raise Rejected(BAD_KEY, "a key must be text or a whole number, got bool")
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if value.is_integer():
            return str(int(value))
        raise Rejected(BAD_KEY, f"a key must be text or a whole number, got {value!r}")
    return _text(value, BAD_KEY, "key")


def _size(value, what: str) -> int | None:
    """A width/height: a whole number >= 0 (7.0 and "7" too; 0 is "unknown", as in failed or
    placeholder rows); missing (None, NaN) or 0 -> None."""
    if _is_missing(value):
        return None
    if isinstance(value, str) and value.strip().isdigit():
        value = int(value)
    if isinstance(value, float) and value.is_integer():
        value = int(value)
    if isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2 ** 31:
        raise Rejected(BAD_SIZE, f"{what} {value!r} is not a whole number of pixels")
    return value or None


def _caption_text(caption, max_caption_chars: int | None, what: str) -> str | None:
    if max_caption_chars is not None and isinstance(caption, bytes) and len(caption) > 4 * max_caption_chars:
        # more bytes than the longest caption in UTF-8 can take: a huge caption is not even decoded
        raise Rejected(CAPTION_TOO_LONG, f"{what}: {len(caption)} bytes (at most {max_caption_chars} characters)")
    caption = None if _is_missing(caption) else _text(caption, BAD_CAPTION, what)
    if max_caption_chars is not None and len(caption or "") > max_caption_chars:
        raise Rejected(CAPTION_TOO_LONG, f"{what}: {len(caption)} characters (at most {max_caption_chars})")
    return caption


def valid_row(row: dict, name: str, index: int, max_caption_chars: int | None = None, captions=()) -> dict:
    """``row`` with every value of the type Ray's raw schema holds, or :class:`Rejected` with a reason.

    The key must be text or a whole number (else ``bad_key``); the caption text, bytes in UTF-8 or
    missing (else ``bad_caption``; whether it says anything is the transform's ``empty_caption``), of
    at most ``max_caption_chars`` characters (else ``caption_too_long``, before it is tokenized);
    width and height whole numbers >= 0 or missing (else ``bad_size``; they are the input's word
    only, the transform measures the image); the image bytes or missing (else ``undecodable``).
    ``captions``: the names of further captions (``--captions``), each checked as the caption is, in
    the row under its text column (:func:`diffusion.schema.caption_columns`).
    """
    key = row_key(row.get(schema.RAW_KEY), name, index)
    caption = _caption_text(row.get(schema.RAW_CAPTION), max_caption_chars, "caption")
    extra = {}
    for extra_name in captions:
        column = schema.caption_columns(extra_name)[0]
        extra[column] = _caption_text(row.get(column), max_caption_chars, f"caption {extra_name!r}")
    image = row.get(schema.RAW_IMAGE)
    if isinstance(image, (bytearray, memoryview)):
        image = bytes(image)
    if image is not None and not isinstance(image, bytes):
        raise Rejected(UNDECODABLE, f"image must be bytes, got {type(image).__name__}")
    return {schema.RAW_KEY: key, schema.RAW_CAPTION: caption, schema.RAW_IMAGE: image,
            schema.WIDTH: _size(row.get(schema.WIDTH), "width"), schema.HEIGHT: _size(row.get(schema.HEIGHT), "height"),
            **extra}




def not_a_sample(row: dict) -> Rejected | None:
    """Why a valid row (:func:`valid_row`) can be known not to become a sample before its image is
    decoded, as the transform will judge it: no visible caption (``empty_caption``), no image bytes
    (``undecodable``); None where only decoding can tell. The key pass (:mod:`~diffusion.convert.shared_keys`)
    lets another file's row take the key of such a row."""
    from diffusion.convert.transforms import clean_caption  # the transform's judgement, not a copy of it
    try:
        clean_caption(row[schema.RAW_CAPTION])
    except Rejected as e:
        return e
    if not row[schema.RAW_IMAGE]:
        return Rejected(UNDECODABLE, "no image bytes")
    return None


def row_batches(rows: Iterator[dict | None], name: str, on_reject=None, taken=None,
                max_caption_chars: int | None = None, captions=(), kept: list | None = None) -> Iterator[dict]:
    """Rows → column batches of valid rows (:func:`valid_row`). A row that is not valid, or whose key
    was seen before in this file or is ``taken`` ({key: the file that keeps it, or None}) by another
    file (``duplicate_key``; :mod:`diffusion.convert.shared_keys`), is not a row but a reject, reported to
    ``on_reject({reject id: reason})`` (the converter records it for counting): by its key, or by
    file and row where the key is unusable or taken. ``None`` stands for a row that is not a sample
    (a failed download): skipped, but counted in the row numbers of derived keys. If reading fails
    part-way, the rows before the failure are still yielded, then the error is raised. ``kept``: ``[n]``, counted
    up with each valid row (so ``on_reject`` can tell which valid row a reject came before)."""
    columns = RAW_COLUMNS + tuple(schema.caption_columns(n)[0] for n in captions)
    batch = {c: [] for c in columns}
    seen: set[str] = set()
    position = -1  # among the rows that are not None: what duplicate ids have always been numbered by
    rows = enumerate(rows)
    while True:
        try:
            index, row = next(rows)
        except StopIteration:
            break
        except Exception:
            if batch[schema.RAW_KEY]:
                yield batch
            raise
        if row is None:
            continue
        position += 1
        key = None
        try:
            key = row_key(row.get(schema.RAW_KEY), name, index)
            if REJECT in row:
                raise Rejected(row[REJECT])
            row = valid_row(row, name, index, max_caption_chars, captions)
        except Rejected as e:
            if on_reject is not None:  # a key other files give too is theirs to record: this row's id names its file
                usable = key is not None and key not in seen and not (taken and key in taken)
                on_reject({key if usable else _reject_id(name, index, e.reason): e.reason})
            if key is not None:
                seen.add(key)
            continue
        if key in seen or (taken and taken.get(key, name) != name):
            unused = key not in seen and not_a_sample(row)  # another file's row keeps the key this one cannot
            if on_reject is not None:
                on_reject({_reject_id(name, index, unused.reason): unused.reason} if unused
                          else {f"{key}#{name}:{position}": DUPLICATE_KEY})
            seen.add(key)
            continue
        seen.add(key)
        for c in columns:
            batch[c].append(row[c])
        if kept is not None:
            kept[0] += 1
        if len(batch[schema.RAW_KEY]) == ROWS_PER_BATCH:
            yield batch
            batch = {c: [] for c in columns}
    if batch[schema.RAW_KEY]:
        yield batch
