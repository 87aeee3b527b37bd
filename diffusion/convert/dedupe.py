"""``--dedupe bytes``: exact duplicates of an image are converted once; the other copies are rejects
(``duplicate_image``).

What is compared: a 128-bit BLAKE2b hash of the image bytes *as stored*, not of the decoded crop. It
needs no decode (the pass costs a read and a hash per row, not a JPEG decode), and it catches LAION's
common case, the same file served under several URLs. It does not catch a re-encode or a resize of
the same picture; a decoded-crop hash would, at the price of decoding every image twice.

Which copy wins: the first in input order (files in their sorted order, rows in file order), whatever
the number of workers or which task finishes first. The choice is made by a pass before the
conversion, with no process holding every hash:

1. one Ray task per input file reads its valid rows (after ``--where``, bad rows, repeated keys and
   ``--exclude``, as the conversion reads them) and emits (hash, file order, row position, key) per row;
2. Ray Data groups the rows by hash (a hash-partitioned shuffle); in each group every row but the
   one with the smallest (file order, position) is a later copy;
3. the later copies' keys are written per input file (``dedupe/<fingerprint>/file=<id>/``), so a read
   task loads only its own file's list and drops those rows, recording each as ``duplicate_image``.

Off by default (``--dedupe none``): the pass reads every input byte a second time before the
conversion starts, which an input deduplicated upstream pays for nothing, and an output converted
before the flag existed records no dedupe, so its re-runs keep resuming. Turn it on for LAION-style
web data, where the same file under several URLs is common and each copy would otherwise cost a
decode and a VAE encode and be trained on twice (duplicated images are what diffusion models
memorise). A row's copies are compared among the rows the conversion would read (after ``--where``,
bad rows and repeated keys); a first copy the transform later rejects (an empty caption) still
takes its copies with it, as they are the same image.

The choice depends only on the input and the read settings, so a run resumed after a kill makes the
same one: the lists are kept under a fingerprint of the input files (names, sizes, modification times)
and reused by a re-run that finds them complete; one whose input changed computes them again.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import uuid

import numpy as np

DEDUPE_DIR = "dedupe"  # in the output: the later copies' keys, per input file
MODES = ("none", "bytes", "near", "semantic")  # near, semantic: diffusion.convert.neardup
_DONE = "_done"


def image_hash(data: bytes) -> str:
    return hashlib.blake2b(data, digest_size=16).hexdigest()


def file_id(name: str) -> str:
    """A file's partition name in the duplicates folder (its name under the input root, hashed)."""
    return hashlib.sha1(name.encode()).hexdigest()[:16]


class _HashRows:
    """Ray ``map_batches`` callable: a batch of (path, order) in; (hash, order, pos, file, key) per valid row
    (``blocklist``: --exclude's keys and image hashes, left out as the conversion drops them; its URLs are
    ``columns``')."""

    def __init__(self, formats: dict, names: dict, columns, taken: dict, blocklist=None):
        self.formats, self.names, self.columns, self.taken = formats, names, columns, taken
        self.blocklist = blocklist

    def __call__(self, batch: dict):
        import pyarrow as pa
        from diffusion import schema
        from diffusion.convert.failed_inputs import file_errors
        from diffusion.convert.files import iter_file_batches
        errors = file_errors()
        for uri, order in zip(batch["path"], batch["order"]):
            uri, name, position = str(uri), self.names[str(uri)], 0
            out = {"hash": [], "order": [], "pos": [], "file": [], "key": []}
            try:  # a file that fails part-way: its rows before the damage, as the conversion reads them
                for rows in iter_file_batches(uri, self.formats[uri], self.columns, name, None, self.taken):
                    blocked = self.blocklist.reasons(rows) if self.blocklist is not None else {}
                    for key, image in zip(rows[schema.RAW_KEY], rows[schema.RAW_IMAGE]):
                        position += 1
                        if image and key not in blocked:  # an excluded row is no copy's original
                            out["hash"].append(image_hash(image))
                            out["order"].append(int(order))
                            out["pos"].append(position)
                            out["file"].append(file_id(name))
                            out["key"].append(key)
            except errors:
                pass
            yield pa.table({"hash": pa.array(out["hash"], pa.string()), "order": pa.array(out["order"], pa.int64()),
                            "pos": pa.array(out["pos"], pa.int64()), "file": pa.array(out["file"], pa.string()),
                            "key": pa.array(out["key"], pa.string())})


def _later_copies(group):
    """One hash's rows (a pyarrow table) -> all but the first in input order."""
    import pyarrow as pa
    if group.num_rows <= 1:
        return group.slice(0, 0).select(["file", "key"])
    first = np.lexsort((group.column("pos").to_numpy(), group.column("order").to_numpy()))[0]
    keep = np.ones(group.num_rows, bool)
    keep[first] = False
    return group.filter(pa.array(keep)).select(["file", "key"])


def _fingerprint(formats: dict, columns, exclude=None) -> str:
    """Of the input files (name, size, modification time) and the settings that decide which rows are
    read: what the duplicate lists are a function of (``exclude``: the blocklists' settings,
    :meth:`~diffusion.convert.config.ConvertConfig.exclude_settings`)."""
    from diffusion.storage import filesystem_for
    read = [columns.image, columns.caption, columns.key, columns.where]
    h = hashlib.sha1(json.dumps(read + [exclude] if exclude else read).encode())
    for uri in formats:
        fs, path = filesystem_for(uri)
        info = fs.get_file_info(path)
        h.update(json.dumps([uri, info.size, info.mtime_ns]).encode())
    return h.hexdigest()[:16]


def _partitions(files: list[str]) -> int:
    """Hash partitions of the shuffle: one per input file, up to 256 (the choice does not depend on it)."""
    return max(1, min(len(files), 256))


def find_duplicates(inputs, columns, out: str, blocklist=None, exclude=None) -> str:
    """Run the pass (module docstring) unless an earlier run finished it for this input; returns the
    folder of per-file lists that :func:`later_copies` reads. ``blocklist``: --exclude's
    (:class:`diffusion.convert.exclude.Blocklist`), whose rows take no part; ``exclude``: its settings
    (files, sizes, times), part of the fingerprint, so another blocklist decides again."""
    import ray
    from diffusion.convert.files import file_names, input_files
    from diffusion.convert.shared_keys import keys_taken_by_earlier_files
    formats = input_files(inputs, columns)
    root = os.path.join(out, DEDUPE_DIR)
    final = os.path.join(root, _fingerprint(formats, columns, exclude))
    if os.path.exists(os.path.join(final, _DONE)):
        _remove_others(root, keep=final)
        return final
    names = file_names(formats)
    taken = keys_taken_by_earlier_files(formats, names, columns)
    files = list(formats)
    tmp = f"{final}.tmp-{uuid.uuid4().hex[:8]}"
    ds = ray.data.from_items([{"path": f, "order": i} for i, f in enumerate(files)],
                             override_num_blocks=min(len(files), 1024))
    hashes = ds.map_batches(_HashRows(formats, names, columns, taken, blocklist), batch_size=1, batch_format="numpy")
    later = hashes.groupby("hash", num_partitions=_partitions(files)).map_groups(_later_copies, batch_format="pyarrow")
    later.write_parquet(tmp, partition_cols=["file"], min_rows_per_file=1 << 20)
    os.makedirs(tmp, exist_ok=True)
    with open(os.path.join(tmp, _DONE), "w") as f:
        f.write("")
    _remove_others(root, keep=tmp)
    os.rename(tmp, final)
    return final


def _remove_others(root: str, keep: str) -> None:
    """Remove what ``root`` holds besides ``keep``: lists of another input, or a killed pass's."""
    for stale in os.listdir(root):
        if os.path.join(root, stale) != keep:
            shutil.rmtree(os.path.join(root, stale), ignore_errors=True)


def later_copies(folder: str | None, name: str) -> frozenset[str]:
    """The keys of the input file ``name`` that are later copies of an earlier row's image."""
    if not folder:
        return frozenset()
    part = os.path.join(folder, f"file={file_id(name)}")
    if not os.path.isdir(part):
        return frozenset()
    import pyarrow.parquet as pq
    keys = set()
    for entry in sorted(os.listdir(part)):
        if entry.endswith(".parquet"):
            keys.update(pq.read_table(os.path.join(part, entry), columns=["key"]).column("key").to_pylist())
    return frozenset(keys)
