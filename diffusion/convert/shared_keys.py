"""Keys given by more than one input file, found before any row is read, whatever the files' layout.

A key is a row's identity: resume skips a key already written or rejected, and every per-sample draw
is seeded from it. Two files that give one key (two img2dataset runs merged into one input both number
their samples from ``000000000``, in parquet's key column, a tar's ``.json`` sidecars or a tfrecord's
``key`` feature) would put two images under one key, and a re-run would skip the second as done. So
the first file in input order whose row with that key is a sample keeps it; the other files' rows
with it are ``duplicate_key`` rejects (:func:`diffusion.convert.rows.row_batches`), on every run the
same, whichever read task runs first. A row that is not a sample (a bad caption, size or sidecar, a
row ``--where`` removes) keeps no key from another file's sample, and is recorded under an id that
carries its file, so each such row counts once in "rows in".

Keys derived from a file's name (rows without one) never collide and are left out.
"""

from __future__ import annotations

import collections
from typing import Iterator

from diffusion.convert.failed_inputs import file_errors
from diffusion.convert.rows import REJECT, Rejected, derived_key, row_key, valid_row
from diffusion import schema


def file_keys(uri: str, fmt: str, columns, name: str) -> Iterator[tuple[str, bool]]:
    """(key, whether the row is a sample) of each row of one file with a key of its own, in order,
    as :func:`~diffusion.convert.rows.row_batches` would judge it; read without the image bytes where
    the layout allows (parquet's other columns, a tar's sidecars). Folder images are keyed by their
    path: nothing to give."""
    from diffusion.convert.readers import file_rows
    if fmt == "folder":
        return
    for index, row in enumerate(file_rows(uri, fmt, columns, name, images=False)):
        if row is None:
            continue
        try:
            key = row_key(row.get(schema.RAW_KEY), name, index)
        except Rejected:
            continue
        if key == derived_key(name, index):  # derived keys name their file: never shared
            continue
        try:
            if REJECT in row:
                raise Rejected(row[REJECT])
            valid_row(row, name, index, columns.max_caption_chars)
            yield key, True
        except Rejected:
            yield key, False


def keys_taken_by_earlier_files(formats: dict[str, str], names: dict[str, str], columns) -> dict[str, str | None]:
    """{key: name of the file that keeps it, or None if no file's row with it is a sample} for each
    key that more than one input file gives (module docstring). A file's claim to a key is its first
    row with it (a later row with that key in the same file is a duplicate of it).

    Two passes over the keys, without the images: the first keeps only 64-bit hashes (8 bytes a row
    held at once) to find repeated ones; the second, over the files that hold such a hash, the keys
    themselves (so two keys that only share a hash stay two). A file that cannot be read gives the keys
    of its rows before the damage, as its read does (its read task records it as a failed input)."""
    import numpy as np
    files = [uri for uri, fmt in formats.items() if fmt != "folder"]
    if len(files) < 2:
        return {}
    errors = file_errors()

    def keys_of(uri):
        try:
            yield from file_keys(uri, formats[uri], columns, names[uri])
        except errors:
            return

    hashed = [np.unique(np.fromiter((hash(k) for k, _ in keys_of(uri)), np.int64)) for uri in files]
    values, counts = np.unique(np.concatenate(hashed), return_counts=True)
    shared = values[counts > 1]
    if not len(shared):
        return {}
    shared_set = set(shared.tolist())
    owner: dict[str, str | None] = {}
    holders: dict[str, int] = collections.Counter()
    for uri, hashes in zip(files, hashed):
        if not np.isin(hashes, shared).any():
            continue
        first: dict[str, bool] = {}
        for key, is_sample in keys_of(uri):
            if hash(key) in shared_set:
                first.setdefault(key, is_sample)
        for key, is_sample in first.items():
            holders[key] += 1
            if owner.get(key) is None:
                owner[key] = names[uri] if is_sample else None
    return {key: owner[key] for key in owner if holders[key] > 1}
