"""Readers: raw image-caption rows from parquet, webdataset tars, tfrecords or a folder of images with .txt sidecars.

Every reader is a plain generator of column batches (``dict[str, list]``) named by the data contract's
``RAW_*`` names, so the same code feeds Ray Data read tasks (:func:`read_raw`), the ``--visualize`` view
and the tests. Inputs may be local paths, directories, globs or ``s3://`` URIs (pyarrow's filesystems;
``AWS_ENDPOINT_URL`` points them at a local S3 server; see :mod:`diffusion.storage`).

A folder is read as img2dataset writes it, in each of its output formats that carries images:

- ``parquet``: ``00000.parquet`` with the image bytes in a ``jpg`` column (``--image-column``), caption,
  key, status (rows whose status is not ``success`` are failed downloads, not samples);
- ``webdataset``: ``00000.tar`` of ``KEY.jpg`` + ``KEY.txt`` (+ ``KEY.json``: key, status, width,
  height), beside ``00000.parquet``, the shard's metadata;
- ``files``: ``00000/KEY.jpg`` + ``KEY.txt`` (+ ``KEY.json``), beside ``00000.parquet``, the metadata;
- ``tfrecord``: ``00000.tfrecord`` of tf.train.Example records (features ``key``, ``jpg``, ``txt`` and
  the metadata), beside ``00000.parquet``; read without TensorFlow;

and any folder of images with ``.txt`` captions beside them. Each file is read by its own suffix, so
one input may mix formats (``.parquet``, ``.tar`` and ``.tfrecord`` files and images are all read). A
parquet file named like a tar, a tfrecord or a folder of images beside it (``X.parquet`` beside
``X.tar``, ``X.tfrecord`` or ``X/``) and without the image column is that shard's metadata and is not
read (:func:`data_files`); one with the image column is data and is read beside them. An input with
no data of a known layout stops at start with one line listing the layouts looked for
(:func:`no_data_error`).

Bad input, from the smallest unit up; one bad row or file never stops a conversion:

- A row whose values are of the wrong kind (an int or list caption, bytes that are not UTF-8, a key that
  is not text or a whole number, a width that is not a whole number >= 0, a tar sample whose .json
  sidecar is not a JSON object) is a rejected row, recorded by key with its reason (``bad_caption``,
  ``bad_key``, ``bad_size``, ``bad_metadata``; see :func:`diffusion.convert.rows.valid_row`) like the transform's rejects.
  Only well-typed rows reach Ray's fixed schema.
- Nothing larger than ``max_bytes`` is read: a tar member (a sparse or compressed one can claim
  gigabytes in a few KB), a tfrecord record or an image file over it is skipped unread, its sample a
  ``too_large`` reject; a caption over ``max_caption_chars`` is ``caption_too_long``.
- A file that cannot be read (zero bytes, not parquet under a ``.parquet`` name, a truncated or corrupt
  tar or tfrecord, an unreadable image file, a parquet lacking the asked-for columns) is skipped and recorded as a
  failed input file (``failed_inputs/`` beside ``rejects/``; the conversion summary lists it); the rows
  read before the damage stay. Why skip rather than stop at start: damage in a tar or a compressed
  file is only found by reading all of it, so a check at start could not find it without reading
  the whole input twice, and stopping hours into a conversion for one file wastes the rest. A re-run
  tries a failed file again (the record goes once it reads to its end).
- A key given to rows of two input files (parquet's key column, a tar's ``.json`` sidecar, a
  tfrecord's ``key`` feature, in any mix of layouts): the first file in input order whose row with it
  is a sample keeps it, the others' rows are ``duplicate_key`` rejects, as a key repeated within one
  file is (its first row kept). Which files share a key is found before any row is read, from the
  keys alone (:mod:`diffusion.convert.shared_keys`), so the choice does not depend on which read
  task runs first, and a re-run makes the same one. To keep both files' rows, name a key column the
  inputs lack (``--key-column none``): every key is then derived from its file and row.
- What stops at start (:func:`check_inputs`): inputs that do not exist, hold no file of a known format,
  or where no parquet file is readable; and asked-for columns missing from the first readable parquet
  file, which is the flags' fault rather than a file's.
"""

from __future__ import annotations

import json
import os
from typing import Callable, Iterator

from diffusion import schema
from diffusion.convert.failed_inputs import (FAILED_INPUTS_DIR, clear_failed_input, describe_error, file_errors,
                                             record_failed_input)
# the file layer (RawColumns, input_files, iter_file_batches: imported from here by callers too)
from diffusion.convert.files import (FORMATS, RawColumns, _parquet_columns, check_parquet_columns, file_names,
                                     input_files, iter_file_batches)
from diffusion.convert.rows import DUPLICATE_IMAGE
from diffusion.convert.shared_keys import keys_taken_by_earlier_files
from diffusion.convert.transforms import write_rejects
from diffusion.errors import InputError  # noqa: F401  (callers catch it from here)


def iter_rows(inputs, columns: RawColumns = RawColumns(), on_failed_file: Callable[[str, str], None] | None = None,
              on_reject=None) -> Iterator[dict]:
    """Every valid raw row of ``inputs``, in order, without Ray (for small jobs, previews and tests).

    A file that cannot be read raises (InputError names it) after its readable rows, unless
    ``on_failed_file(name, error)`` is given: then it is told and the file skipped, as the converter
    skips it. Rejected rows go to ``on_reject({id: reason})``."""
    formats = input_files(inputs, columns)
    names = file_names(formats)
    taken = keys_taken_by_earlier_files(formats, names, columns)
    errors = file_errors()
    for uri, fmt in formats.items():
        try:
            for batch in iter_file_batches(uri, fmt, columns, names[uri], on_reject, taken):
                yield from (dict(zip(batch, values)) for values in zip(*batch.values()))
        except errors as e:
            if on_failed_file is None:
                if isinstance(e, InputError):
                    raise
                raise InputError(f"cannot read {uri}: {describe_error(e)}") from e
            on_failed_file(names[uri], describe_error(e))


# ---- Ray Data ------------------------------------------------------------------------------------

class _ReadFiles:
    """Ray ``map_batches`` callable: a batch of file URIs in, their raw rows out (done keys dropped).

    Rejected rows are written to ``rejects_dir`` (once per file and batch, leaving out ids in
    ``recorded``, which an earlier run wrote); a file that fails is recorded in ``failed_dir`` and
    the next file read; a file read to its end has any earlier failure record removed."""

    def __init__(self, formats: dict, columns: RawColumns, names: dict, skip_keys: frozenset,
                 rejects_dir: str | None = None, failed_dir: str | None = None, recorded: frozenset = frozenset(),
                 taken: dict | None = None, duplicates: Callable[[str], frozenset] | None = None, blocklist=None,
                 mark: bool = False, positions: dict | None = None):
        self.formats, self.columns, self.names, self.skip_keys = formats, columns, names, skip_keys
        self.rejects_dir, self.failed_dir, self.recorded, self.taken = rejects_dir, failed_dir, recorded, taken
        self.duplicates = duplicates
        self.blocklist = blocklist  # --exclude: keys and image hashes (diffusion.convert.exclude.Blocklist)
        # --limit: duplicates and excluded rows are kept, their reason in DROP, so the limit counts them as
        # rows read and only those within it are recorded and dropped (_DropMarked, after the limit)
        self.mark = mark
        # {uri: its place in the input}: each row carries it (ORDER) and its place among the file's rows read
        # (POS), for --dedupe near/semantic's first pass over the rows --limit reads (diffusion.convert.neardup)
        self.positions = positions

    def _flush(self, pending: dict) -> None:
        new = {k: v for k, v in pending.items() if k not in self.recorded}
        pending.clear()
        if new and self.rejects_dir:
            write_rejects(self.rejects_dir, new)

    def __call__(self, files: dict) -> Iterator[dict]:
        errors = file_errors()
        for uri in files["path"]:
            uri = str(uri)
            name, pending, rows_read = self.names[uri], {}, 0
            copies = self.duplicates(name) if self.duplicates else frozenset()  # --dedupe: later copies of an image
            reasons = copies if isinstance(copies, dict) else {}  # --dedupe near/semantic: {key: reason}
            # --limit: each reject found while reading rides on the next row read (the file's last rejects on its
            # last row, the batch held back for them), so only those up to the limit's last row are recorded
            kept, before, held = [0], {}, None  # before: {valid row: the rejects read just before it}
            on_reject = (lambda r: before.setdefault(kept[0], []).append(r)) if self.mark else pending.update
            try:
                for batch in iter_file_batches(uri, self.formats[uri], self.columns, name, on_reject, self.taken,
                                               kept if self.mark else None):
                    dropped = {k: reasons.get(k, DUPLICATE_IMAGE) for k in batch[schema.RAW_KEY] if k in copies}
                    dropped.update(self.blocklist.reasons(batch) if self.blocklist is not None else {})
                    n = len(batch[schema.RAW_KEY])
                    if self.mark:
                        batch = {**batch, DROP: [dropped.get(k, "") for k in batch[schema.RAW_KEY]],
                                 BEFORE: [_merge("", before.pop(rows_read + i, [])) for i in range(n)]}
                        dropped = {}
                    if self.positions is not None:
                        batch = {**batch, ORDER: [self.positions[uri]] * n, POS: list(range(rows_read, rows_read + n))}
                    pending.update(dropped)
                    self._flush(pending)
                    rows_read += n
                    keep = [i for i, k in enumerate(batch[schema.RAW_KEY]) if k not in self.skip_keys and k not in dropped]
                    if held is not None:
                        yield _arrow_batch(held)
                    held = {c: [batch[c][i] for i in keep] for c in batch} if keep else None
            except errors as e:
                yield from self._last(held, before, pending)
                if self.failed_dir:
                    record_failed_input(self.failed_dir, name, uri, e, rows_read)
                continue
            yield from self._last(held, before, pending)
            if self.failed_dir:
                clear_failed_input(self.failed_dir, name)

    def _last(self, held: dict | None, before: dict, pending: dict) -> Iterator:
        """The file's last batch, its last row carrying the rejects read after it (--limit); without one,
        those rejects are recorded now."""
        rest = [r for row in sorted(before) for r in before[row]]
        if held is not None and rest:
            held[BEFORE][-1] = _merge(held[BEFORE][-1], rest)
        else:
            for r in rest:
                pending.update(r)
        before.clear()
        self._flush(pending)
        if held is not None:
            yield _arrow_batch(held)


def _merge(carried: str, rejects: list) -> str:
    out = {**(json.loads(carried) if carried else {}), **{k: v for r in rejects for k, v in r.items()}}
    return json.dumps(out) if out else ""


DROP = "_drop"  # with --limit: a read row's reason to be dropped after the limit ("" to keep it)
BEFORE = "_rejects_before"  # with --limit: the rejects read just before a row, JSON ("" for none)
ORDER, POS = "_order", "_pos"  # read_raw(positions=True): a row's file (its place in the input), its place in it


class _DropMarked:
    """Ray ``map_batches`` callable after ``--limit``: the rows marked in :data:`DROP` (duplicates, excluded)
    recorded in ``rejects_dir`` (leaving out ``recorded``) and dropped; the column removed."""

    def __init__(self, rejects_dir: str | None, recorded: frozenset):
        self.rejects_dir, self.recorded = rejects_dir, recorded

    def __call__(self, batch):
        import pyarrow as pa
        reasons = batch.column(DROP).to_pylist()
        new = {}
        for carried in batch.column(BEFORE).to_pylist():  # the rows read before these, removed while reading
            new.update(json.loads(carried) if carried else {})
        new.update({k: r for k, r in zip(batch.column(schema.RAW_KEY).to_pylist(), reasons) if r})
        new = {k: r for k, r in new.items() if k not in self.recorded}
        if new and self.rejects_dir:
            write_rejects(self.rejects_dir, new)
        return batch.filter(pa.array([not r for r in reasons])).drop_columns([DROP, BEFORE])


def _arrow_batch(batch: dict):
    """A pyarrow table with a fixed schema, so blocks from different files always concatenate."""
    import pyarrow as pa
    arrow_schema = pa.schema([(schema.RAW_KEY, pa.string()), (schema.RAW_CAPTION, pa.string()),
                              (schema.RAW_IMAGE, pa.binary()), (schema.WIDTH, pa.int64()),
                              (schema.HEIGHT, pa.int64()),
                              *((c, pa.string()) for c in batch if c.startswith(schema.EXTRA_CAPTION_PREFIX)),
                              *((c, pa.string()) for c in batch if c in (DROP, BEFORE)),
                              *((c, pa.int64()) for c in (ORDER, POS) if c in batch)])
    return pa.table({c: batch[c] for c in arrow_schema.names}, schema=arrow_schema)



def check_inputs(inputs, columns: RawColumns = RawColumns()) -> tuple[str, int]:
    """Fail fast, before any cluster work: the inputs exist, hold files of a known format, and the first
    readable parquet file has the named columns. Unreadable files are left to the run, which skips and
    records them (see the module's docstring); only if no parquet file is readable and there is
    nothing else to read does this stop.

    Returns (format, or formats joined by ``+``; number of data files).
    """
    formats = input_files(inputs, columns)
    parquet = [f for f, fmt in formats.items() if fmt == "parquet"]
    first_error = None
    for uri in parquet:
        try:
            _parquet_columns(uri)
        except InputError as e:
            first_error = first_error or e
            continue
        check_parquet_columns(uri, columns)
        break
    else:
        if first_error is not None and len(parquet) == len(formats):
            unreadable = f" (and the other {len(parquet) - 1} parquet files)" if len(parquet) > 1 else ""
            raise InputError(f"{first_error}{unreadable}: no input file can be read")
    return "+".join(f for f in FORMATS if f in set(formats.values())), len(formats)


def read_raw(inputs, columns: RawColumns = RawColumns(), skip_keys=frozenset(), limit: int | None = None,
             rejects_dir: str | None = None, failed_inputs_dir: str | None = None,
             duplicates: Callable[[str], frozenset] | None = None, blocklist=None, num_cpus: float | None = None,
             positions: bool = False):
    """A Ray Dataset of raw rows (``RAW_*`` columns), one read task per input file, each asking for
    ``num_cpus`` (None: Ray's whole CPU).

    ``skip_keys`` (rows already written or rejected by an earlier run) are dropped before anything is
    decoded; ``limit`` caps the rows read (counted before skipping, so a re-run with the same limit
    resumes the same rows; and before dropping duplicates and excluded rows, which are recorded only
    within it). Rows rejected while reading go to ``rejects_dir``; files that cannot be
    read are recorded in ``failed_inputs_dir`` (default: ``failed_inputs/`` beside ``rejects_dir``).
    ``duplicates(file name)``: that file's keys to drop as ``duplicate_image`` (--dedupe: the later
    copies of an image, found by :func:`diffusion.convert.dedupe.find_duplicates`; or ``{key: reason}``, the
    rows --dedupe near/semantic removed). ``blocklist``: --exclude's keys and image hashes, dropped unread
    (:class:`diffusion.convert.exclude.Blocklist`). ``positions``: each row also carries its file's place
    in the input (column :data:`ORDER`) and its place among that file's rows read (:data:`POS`).
    """
    import ray
    formats = input_files(inputs, columns)
    names = file_names(formats)
    if failed_inputs_dir is None and rejects_dir:
        failed_inputs_dir = os.path.join(os.path.dirname(os.path.normpath(rejects_dir)), FAILED_INPUTS_DIR)
    skip = frozenset(skip_keys)
    taken = keys_taken_by_earlier_files(formats, names, columns)
    files = list(formats)
    cpus = {} if num_cpus is None else {"num_cpus": num_cpus}
    places = {f: i for i, f in enumerate(files)} if positions else None
    ds = ray.data.from_items([{"path": f} for f in files], override_num_blocks=min(len(files), 1024))
    if limit is None:
        return ds.map_batches(_ReadFiles(formats, columns, names, skip, rejects_dir, failed_inputs_dir, skip, taken,
                                         duplicates, blocklist, positions=places), batch_size=1, batch_format="numpy",
                              zero_copy_batch=True, **cpus)
    ds = ds.map_batches(_ReadFiles(formats, columns, names, frozenset(), rejects_dir, failed_inputs_dir, skip, taken,
                                   duplicates, blocklist, mark=True, positions=places), batch_size=1,
                        batch_format="numpy", **cpus)
    ds = ds.limit(limit).map_batches(_DropMarked(rejects_dir, skip), batch_format="pyarrow", **cpus)
    return ds.filter(lambda row: row[schema.RAW_KEY] not in skip, **cpus)
