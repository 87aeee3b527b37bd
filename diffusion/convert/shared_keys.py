"""Keys given by more than one input file, found before any row is read, whatever the files' layout.

A key is a row's identity: resume skips a key already written or rejected, and every per-sample draw
is seeded from it. Two files that give one key (two img2dataset runs merged into one input both number
their samples from ``000000000``, in parquet's key column, a tar's ``.json`` sidecars or a tfrecord's
``key`` feature) would put two images under one key, and a re-run would skip the second as done. So
the first file in input order whose row with that key is a sample keeps it; the other files' rows
with it are ``duplicate_key`` rejects (:func:`diffusion.convert.rows.row_batches`), on every run the
same, whichever read task runs first. A row that is not a sample (a bad, empty or too long caption, a
bad size or sidecar, no image bytes, a row ``--where`` removes) keeps no key from another file's sample,
and is recorded with its own reason under an id that carries its file, so each such row counts once in
"rows in". What only decoding tells (an image that does not decode, is too small or too many pixels) is
not known here, where no image is read: such a row keeps its key, and another file's row with it is a
``duplicate_key`` reject (finding it would decode every image with a shared key twice).

Keys derived from a file's name (rows without one) never collide and are left out.
"""

from __future__ import annotations

import collections
from typing import Iterator

from diffusion.convert.failed_inputs import file_errors
from diffusion.convert.files import TFRECORD_SUFFIX, _open, file_rows
from diffusion.convert.rows import REJECT, Rejected, derived_key, not_a_sample, row_key, valid_row
from diffusion import schema


def file_keys(uri: str, fmt: str, columns, name: str) -> Iterator[tuple[str, bool]]:
    """(key, whether the row is a sample) of each row of one file with a key of its own, in order,
    as :func:`~diffusion.convert.rows.row_batches` would judge it; read without the image bytes where
    the layout allows (parquet's other columns, a tar's sidecars). Folder images are keyed by their
    path: nothing to give."""
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
            reason = not_a_sample(valid_row(row, name, index, columns.max_caption_chars))
            yield key, reason is None
        except Rejected:
            yield key, False


def _key_column(uri: str, column: str, name: str) -> Iterator[str]:
    """The explicit keys in a parquet file's key column, of its sample rows (a ``status`` other than
    ``success`` is a failed download); the column only, cheap."""
    import pyarrow.parquet as pq
    with _open(uri) as f:
        pf = pq.ParquetFile(f)
        names = pf.schema_arrow.names
        if column not in names:
            return
        wanted = [column] + ([schema.RAW_STATUS] if schema.RAW_STATUS in names else [])
        index = 0
        for batch in pf.iter_batches(batch_size=1 << 16, columns=wanted):
            keys = batch.column(0).to_pylist()
            status = batch.column(1).to_pylist() if len(wanted) > 1 else [None] * len(keys)
            for value, state in zip(keys, status):
                index += 1
                if state not in (None, "success"):
                    continue
                try:
                    key = row_key(value, name, index - 1)
                except Rejected:
                    continue
                if key != derived_key(name, index - 1):
                    yield key


def candidate_keys(uri: str, fmt: str, columns, name: str) -> Iterator[str]:
    """A superset of the keys :func:`file_keys` gives, found cheaply: a parquet file's key column; for
    a tar or tfrecord, the key column of img2dataset's metadata parquet beside it (``X.parquet`` beside
    ``X.tar``: the same keys, without reading the shard), else the shard's own keys."""
    if fmt == "parquet":
        yield from _key_column(uri, columns.key, name)
        return
    if fmt in ("webdataset", "tfrecord"):
        from diffusion.storage import filesystem_for
        import pyarrow.fs as pafs
        metadata = uri[: -len(".tar" if fmt == "webdataset" else TFRECORD_SUFFIX)] + ".parquet"
        fs, path = filesystem_for(metadata)
        if fs.get_file_info(path).type == pafs.FileType.File:
            try:
                keys = list(_key_column(metadata, columns.key, name))
            except file_errors():
                keys = None  # unreadable metadata: read the shard itself
            if keys:
                yield from keys
                return
    yield from (key for key, _ in file_keys(uri, fmt, columns, name))


def keys_taken_by_earlier_files(formats: dict[str, str], names: dict[str, str], columns) -> dict[str, str | None]:
    """{key: name of the file that keeps it, or None if no file's row with it is a sample} for each
    key that more than one input file gives (module docstring). A file's claim to a key is its first
    row with it (a later row with that key in the same file is a duplicate of it).

    Two passes, without the images: the first over the key columns only (:func:`candidate_keys`; a
    tar's or tfrecord's metadata parquet stands in for it), keeping 64-bit hashes (8 bytes a row held
    at once) to find repeated ones; the second reads the rows of the files that hold such a hash (a
    tar's sidecars, a parquet's other columns: whether each row is a sample), keeping the keys
    themselves (so two keys that only share a hash stay two). An input whose keys never repeat reads
    no tar or tfrecord here. A file that cannot be read gives the keys of its rows before the damage,
    as its read does (its read task records it as a failed input)."""
    import numpy as np
    files = [uri for uri, fmt in formats.items() if fmt != "folder"]
    if len(files) < 2:
        return {}
    errors = file_errors()

    def keys_of(uri, keys=file_keys):
        try:
            yield from keys(uri, formats[uri], columns, names[uri])
        except errors:
            return

    hashed = [np.unique(np.fromiter((hash(k) for k in keys_of(uri, candidate_keys)), np.int64)) for uri in files]
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
