"""Readers: raw image-caption rows from parquet, webdataset tars or a folder of images with .txt sidecars.

Every reader is a plain generator of column batches (``dict[str, list]``) named by the data contract's
``RAW_*`` names, so the same code feeds Ray Data read tasks (:func:`read_raw`), the ``--visualize`` view
and the tests. Inputs may be local paths, directories, globs or ``s3://`` URIs (pyarrow's filesystems;
``AWS_ENDPOINT_URL`` points them at a local S3 server).
"""

from __future__ import annotations

import dataclasses
import fnmatch
import json
import os
import posixpath
import tarfile
from typing import Iterator

from diffusion import schema
from diffusion.errors import InputError

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")
RAW_COLUMNS = (schema.RAW_KEY, schema.RAW_CAPTION, schema.RAW_IMAGE, schema.WIDTH, schema.HEIGHT)
ROWS_PER_BATCH = 64  # rows per yielded batch: small, so one huge file never becomes one huge block


@dataclasses.dataclass(frozen=True)
class RawColumns:
    """Which parquet columns hold the image bytes, the caption and the key."""

    image: str = schema.RAW_IMAGE
    caption: str = schema.RAW_CAPTION
    key: str = schema.RAW_KEY
    caption_required: bool = True  # False: a file without the caption column gives rows captioned None


# ---- locating files ------------------------------------------------------------------------------

def filesystem_for(uri: str):
    """(pyarrow filesystem, path inside it) for a local path or a URI such as ``s3://bucket/x``."""
    import pyarrow.fs as pafs
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    if uri.startswith("s3://"):
        endpoint = os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("S3_ENDPOINT_URL")
        kwargs = {"endpoint_override": endpoint} if endpoint else {}
        if endpoint and endpoint.startswith("http://"):
            kwargs["scheme"] = "http"
        return pafs.S3FileSystem(**kwargs), uri[len("s3://"):]
    return pafs.FileSystem.from_uri(uri)


def _join_uri(uri: str, path: str) -> str:
    scheme = uri.split("://", 1)[0] + "://" if "://" in uri else ""
    return scheme + path


def list_input_files(inputs) -> list[str]:
    """Expand paths, directories and globs into a sorted list of input files (URIs kept as URIs)."""
    import pyarrow.fs as pafs
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    files = []
    for spec in map(os.fspath, inputs):
        fs, path = filesystem_for(spec)
        has_glob = any(ch in path for ch in "*?[")
        base = path if not has_glob else path[: min(path.find(ch) for ch in "*?[" if ch in path)].rsplit("/", 1)[0]
        info = fs.get_file_info(base)
        if info.type == pafs.FileType.NotFound:
            raise InputError(f"input {spec!r}: no such file or directory")
        if info.type == pafs.FileType.File and not has_glob:
            files.append(spec)
            continue
        found = fs.get_file_info(pafs.FileSelector(base, recursive=True))
        names = sorted(i.path for i in found if i.type == pafs.FileType.File)
        names = [n for n in names if not posixpath.basename(n).startswith((".", "_"))]
        if has_glob:
            names = [n for n in names if fnmatch.fnmatch(n, path)]
        files.extend(_join_uri(spec, n) for n in names)
    if not files:
        raise InputError(f"no input files found in {inputs}")
    return files


def detect_format(files: list[str]) -> str:
    """``parquet``, ``webdataset`` or ``folder``, from the files' suffixes."""
    if any(f.endswith(".parquet") for f in files):
        return "parquet"
    if any(f.endswith(".tar") for f in files):
        return "webdataset"
    if any(f.lower().endswith(IMAGE_SUFFIXES) for f in files):
        return "folder"
    raise InputError(f"cannot tell the input format of {files[:3]}...: expected .parquet, .tar or images")


def data_files(files: list[str], fmt: str) -> list[str]:
    """The files a reader of ``fmt`` reads (manifests, stats and sidecars left out)."""
    if fmt == "parquet":
        return [f for f in files if f.endswith(".parquet")]
    if fmt == "webdataset":
        return [f for f in files if f.endswith(".tar")]
    return [f for f in files if f.lower().endswith(IMAGE_SUFFIXES)]


def _open(uri: str):
    fs, path = filesystem_for(uri)
    try:
        return fs.open_input_file(path)
    except OSError as e:
        raise InputError(f"cannot open input {uri}: {e}") from e


KEY_SCHEME = 2  # how rows without a key get one; an output made with another scheme is not resumed
DUPLICATE_KEY = "duplicate_key"  # reject reason: a key already given to an earlier row of the same file


def input_names(files: list[str]) -> dict[str, str]:
    """Each input file's name relative to the inputs' common folder (``en/part-00000.parquet``): unique
    per file, and the same on every run with the same inputs, so keys derived from it never collide."""
    paths = [filesystem_for(f)[1] for f in files]
    root = posixpath.commonpath(paths) if len(paths) > 1 else posixpath.dirname(paths[0])
    if root in paths:  # one file given twice, or a single file: its own folder
        root = posixpath.dirname(root)
    return {f: posixpath.relpath(p, root) if root else p for f, p in zip(files, paths)}


def derived_key(name: str, index: int) -> str:
    """A stable key for a row without one: its file's name under the input root and its row index."""
    return f"{name}:{index:09d}"


def _batches(rows: Iterator[dict], name: str, on_duplicate=None) -> Iterator[dict]:
    """Rows → column batches; a key seen before in this file is not a row but a ``duplicate_key``
    reject, reported to ``on_duplicate({reject id: reason})`` (the converter records it for counting)."""
    batch = {c: [] for c in RAW_COLUMNS}
    seen: set[str] = set()
    for index, row in enumerate(rows):
        key = row[schema.RAW_KEY]
        if key in seen:
            if on_duplicate is not None:
                on_duplicate({f"{key}#{name}:{index}": DUPLICATE_KEY})
            continue
        seen.add(key)
        for c in RAW_COLUMNS:
            batch[c].append(row.get(c))
        if len(batch[schema.RAW_KEY]) == ROWS_PER_BATCH:
            yield batch
            batch = {c: [] for c in RAW_COLUMNS}
    if batch[schema.RAW_KEY]:
        yield batch


# ---- parquet -------------------------------------------------------------------------------------

def check_parquet_columns(uri: str, columns: RawColumns) -> None:
    """Raise a clear error naming the file and its columns if an asked-for column is missing."""
    import pyarrow.parquet as pq
    try:
        with _open(uri) as f:
            names = pq.read_schema(f).names
    except InputError:
        raise
    except Exception as e:
        raise InputError(f"cannot read {uri} as parquet: {e}") from e
    required = (columns.image, columns.caption) if columns.caption_required else (columns.image,)
    missing = [c for c in required if c not in names]
    if missing:
        raise InputError(f"{uri} has no column {', '.join(map(repr, missing))}; its columns are "
                         f"{', '.join(names)} (choose with --image-column/--caption-column)")


def _parquet_rows(uri: str, columns: RawColumns, name: str) -> Iterator[dict]:
    import pyarrow.parquet as pq
    check_parquet_columns(uri, columns)
    with _open(uri) as f:
        pf = pq.ParquetFile(f)
        names = set(pf.schema_arrow.names)
        wanted = [c for c in {columns.image, columns.caption, columns.key, schema.WIDTH, schema.HEIGHT,
                              schema.RAW_STATUS} if c in names]
        index = 0
        for record_batch in pf.iter_batches(batch_size=ROWS_PER_BATCH, columns=wanted):
            for row in record_batch.to_pylist():
                i, index = index, index + 1
                # img2dataset/download output: failed rows have no image, so only successes are rows.
                if schema.RAW_STATUS in row and row[schema.RAW_STATUS] != "success":
                    continue
                yield {schema.RAW_KEY: row.get(columns.key) or derived_key(name, i),
                       schema.RAW_CAPTION: row.get(columns.caption), schema.RAW_IMAGE: row[columns.image],
                       schema.WIDTH: row.get(schema.WIDTH), schema.HEIGHT: row.get(schema.HEIGHT)}


# ---- webdataset ----------------------------------------------------------------------------------

def _webdataset_rows(uri: str, name: str) -> Iterator[dict]:
    """Samples of an img2dataset tar: ``KEY.jpg`` + ``KEY.txt`` (+ ``KEY.json``), consecutive members."""
    def sample(key, parts, index):
        image = next((parts[s] for s in IMAGE_SUFFIXES if s in parts), None)
        if image is None:
            return None
        meta = json.loads(parts[".json"]) if ".json" in parts else {}
        if meta.get(schema.RAW_STATUS, "success") != "success":
            return None
        caption = parts[".txt"].decode("utf-8", "replace") if ".txt" in parts else meta.get(schema.RAW_CAPTION)
        return {schema.RAW_KEY: meta.get(schema.RAW_KEY) or (f"{name}/{key}" if key else derived_key(name, index)),
                schema.RAW_CAPTION: caption, schema.RAW_IMAGE: image,
                schema.WIDTH: meta.get(schema.WIDTH), schema.HEIGHT: meta.get(schema.HEIGHT)}

    with _open(uri) as f:
        try:
            tar = tarfile.open(fileobj=f, mode="r|*")
            key, parts, index = None, {}, 0
            for member in tar:
                if not member.isfile():
                    continue
                stem, ext = posixpath.splitext(member.name)
                if stem != key and parts:
                    row = sample(key, parts, index)
                    index += 1
                    if row:
                        yield row
                    parts = {}
                key = stem
                parts[ext.lower()] = tar.extractfile(member).read()
            if parts:
                row = sample(key, parts, index)
                if row:
                    yield row
        except tarfile.TarError as e:
            raise InputError(f"cannot read {uri} as a tar file: {e}") from e


# ---- folder of images ----------------------------------------------------------------------------

def _folder_rows(uri: str, name: str) -> Iterator[dict]:
    """One image; its caption from the ``.txt`` beside it (missing sidecar -> missing caption)."""
    fs, path = filesystem_for(uri)
    with _open(uri) as f:
        image = f.read()
    caption = None
    try:
        with fs.open_input_file(posixpath.splitext(path)[0] + ".txt") as f:
            caption = f.read().decode("utf-8", "replace").strip()
    except (FileNotFoundError, OSError):
        pass
    # the name keeps the suffix: img0.jpg and img0.png are two samples
    yield {schema.RAW_KEY: name, schema.RAW_CAPTION: caption, schema.RAW_IMAGE: image}


def iter_file_batches(uri: str, fmt: str, columns: RawColumns = RawColumns(), name: str | None = None,
                      on_duplicate=None) -> Iterator[dict]:
    """Column batches of the raw rows in one input file; ``name`` is the file's name under the input
    root (:func:`input_names`), which keys rows that have none."""
    name = name or posixpath.basename(uri)
    if fmt == "parquet":
        rows = _parquet_rows(uri, columns, name)
    elif fmt == "webdataset":
        rows = _webdataset_rows(uri, name)
    elif fmt == "folder":
        rows = _folder_rows(uri, name)
    else:
        raise ValueError(f"unknown input format {fmt!r}")
    yield from _batches(rows, name, on_duplicate)


def iter_rows(inputs, columns: RawColumns = RawColumns()) -> Iterator[dict]:
    """Every raw row of ``inputs``, in order, without Ray (for small jobs, previews and tests)."""
    files = list_input_files(inputs)
    fmt = detect_format(files)
    files = data_files(files, fmt)
    names = input_names(files)
    for uri in files:
        for batch in iter_file_batches(uri, fmt, columns, names[uri]):
            yield from (dict(zip(batch, values)) for values in zip(*batch.values()))


# ---- Ray Data ------------------------------------------------------------------------------------

class _ReadFiles:
    """Ray ``map_batches`` callable: a batch of file URIs in, their raw rows out (done keys dropped)."""

    def __init__(self, fmt: str, columns: RawColumns, names: dict, skip_keys: frozenset,
                 rejects_dir: str | None = None):
        self.fmt, self.columns, self.names, self.skip_keys = fmt, columns, names, skip_keys
        self.rejects_dir = rejects_dir

    def _record(self, rejects: dict) -> None:
        if self.rejects_dir:
            from diffusion.convert.transforms import write_rejects
            write_rejects(self.rejects_dir, rejects)

    def __call__(self, files: dict) -> Iterator[dict]:
        for uri in files["path"]:
            uri = str(uri)
            for batch in iter_file_batches(uri, self.fmt, self.columns, self.names[uri], self._record):
                keep = [i for i, k in enumerate(batch[schema.RAW_KEY]) if k not in self.skip_keys]
                if keep:
                    yield _arrow_batch({c: [batch[c][i] for i in keep] for c in batch})


def _arrow_batch(batch: dict):
    """A pyarrow table with a fixed schema, so blocks from different files always concatenate."""
    import pyarrow as pa
    arrow_schema = pa.schema([(schema.RAW_KEY, pa.string()), (schema.RAW_CAPTION, pa.string()),
                              (schema.RAW_IMAGE, pa.binary()), (schema.WIDTH, pa.int64()),
                              (schema.HEIGHT, pa.int64())])
    return pa.table({c: batch[c] for c in arrow_schema.names}, schema=arrow_schema)


def check_inputs(inputs, columns: RawColumns = RawColumns()) -> tuple[str, int]:
    """Fail fast, before any cluster work: the inputs exist, have a known format and the named columns.

    Returns (format, number of data files).
    """
    files = list_input_files(inputs)
    fmt = detect_format(files)
    files = data_files(files, fmt)
    if fmt == "parquet":
        check_parquet_columns(files[0], columns)
    return fmt, len(files)


def read_raw(inputs, columns: RawColumns = RawColumns(), skip_keys=frozenset(), limit: int | None = None,
             rejects_dir: str | None = None):
    """A Ray Dataset of raw rows (``RAW_*`` columns), one read task per input file.

    ``skip_keys`` (rows already written or rejected by an earlier run) are dropped before anything is
    decoded; ``limit`` caps the rows read (counted before skipping, so a re-run with the same limit
    resumes the same rows).
    """
    import ray
    files = list_input_files(inputs)
    fmt = detect_format(files)
    files = data_files(files, fmt)
    names = input_names(files)
    ds = ray.data.from_items([{"path": f} for f in files], override_num_blocks=min(len(files), 1024))
    if limit is None:
        return ds.map_batches(_ReadFiles(fmt, columns, names, frozenset(skip_keys), rejects_dir), batch_size=1,
                              batch_format="numpy", zero_copy_batch=True)
    ds = ds.map_batches(_ReadFiles(fmt, columns, names, frozenset(), rejects_dir), batch_size=1,
                        batch_format="numpy")
    skip = frozenset(skip_keys)
    return ds.limit(limit).filter(lambda row: row[schema.RAW_KEY] not in skip)
