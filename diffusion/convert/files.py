"""Input files, one at a time: which files an input holds, their format, and the raw rows of one file.

The lowest layer of reading (:mod:`diffusion.convert.readers` describes the layouts and what bad input
becomes): :func:`input_files` finds the data files of an input and their formats, and :func:`file_rows`
gives one file's rows (:func:`iter_file_batches`: as checked column batches). The key pass
(:mod:`diffusion.convert.shared_keys`) and the readers above it read files through here.
"""

from __future__ import annotations

import collections
import dataclasses
import fnmatch
import itertools
import json
import os
import posixpath
import tarfile
import zlib
from typing import Iterator

from diffusion import schema
from diffusion.convert import settings
from diffusion.convert.rows import REJECT, ROWS_PER_BATCH, row_batches
from diffusion.convert.transforms import BAD_METADATA
from diffusion.errors import InputError
from diffusion.rejects import TOO_LARGE
from diffusion.storage import filesystem_for
from diffusion.tfrecord import example_features

IMAGE_SUFFIXES = (".jpg", ".jpeg", ".png", ".webp", ".bmp", ".gif", ".tif", ".tiff")


@dataclasses.dataclass(frozen=True)
class RawColumns:
    """Which parquet columns hold the image bytes, the caption and the key."""

    image: str = schema.RAW_IMAGE
    caption: str = schema.RAW_CAPTION
    key: str = schema.RAW_KEY
    caption_required: bool = True  # False: a file without the caption column gives rows captioned None
    where: str | None = None  # --where: rows failing it are rejects, before anything is decoded (convert.filters)
    max_bytes: int = settings.MAX_BYTES  # a larger tar member, tfrecord record or image file is not read: too_large
    max_caption_chars: int = settings.MAX_CAPTION_CHARS  # a longer caption is a caption_too_long reject
    # --captions: further caption columns (parquet columns, webdataset .json fields, tfrecord features;
    # a folder's KEY.NAME.txt), each carried in the row under schema.caption_columns(name)[0]
    captions: tuple[str, ...] = ()
    # --exclude: SHA-256 digests of URLs; a row whose url (parquet column, tar .json field) is one is an
    # "excluded: url" reject, before its image is looked at (diffusion.convert.exclude)
    exclude_urls: frozenset = frozenset()
    column_flags: bool = True  # False: the command has no --image-column/--caption-column to suggest (evaluate)

    def url_excluded(self, url) -> bool:
        import hashlib
        return (bool(self.exclude_urls) and isinstance(url, str)
                and hashlib.sha256(url.encode("utf-8", "surrogatepass")).digest() in self.exclude_urls)

    def extra_captions(self, row_get) -> dict:
        """The further captions of one row, read with ``row_get(input name)``."""
        return {schema.caption_columns(n)[0]: row_get(n) for n in self.captions}


# ---- locating files ------------------------------------------------------------------------------

def _join_uri(uri: str, path: str) -> str:
    scheme = uri.split("://", 1)[0] + "://" if "://" in uri else ""
    return scheme + path


def list_input_files(inputs, columns: RawColumns = RawColumns()) -> list[str]:
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
        raise no_data_error(inputs, files, columns)
    return files


FORMATS = ("parquet", "webdataset", "tfrecord", "folder")
TFRECORD_SUFFIX = ".tfrecord"


def file_format(path: str) -> str | None:
    """``parquet``, ``webdataset``, ``tfrecord`` or ``folder`` (an image), from one file's suffix; None
    for others (manifests, stats, sidecars)."""
    if path.endswith(".parquet"):
        return "parquet"
    if path.endswith(".tar"):
        return "webdataset"
    if path.endswith(TFRECORD_SUFFIX):
        return "tfrecord"
    if path.lower().endswith(IMAGE_SUFFIXES):
        return "folder"
    return None


def data_files(files: list[str], columns: RawColumns = RawColumns()) -> dict[str, str]:
    """{file: format} of the files a reader reads, in order: every file of a known format, except
    img2dataset's metadata of a shard whose data lies beside it: a parquet file named like a tar, a
    tfrecord or a folder of images (``X.parquet`` beside ``X.tar``, ``X.tfrecord`` or ``X/KEY.jpg``)
    that has no ``columns.image`` column (one that cannot be read is taken for metadata too: the
    shard's data is beside it). One with the image column is data, read beside the others."""
    shards = {f[: -len(suffix)] for f in files for suffix in (".tar", TFRECORD_SUFFIX) if f.endswith(suffix)}
    shards |= {posixpath.dirname(f) for f in files if file_format(f) == "folder"}
    metadata = _metadata_files([f for f in files if f.endswith(".parquet") and f[: -len(".parquet")] in shards],
                               columns.image)
    return {f: fmt for f in files if (fmt := file_format(f)) is not None and f not in metadata}


_METADATA: dict[tuple[str, str], bool] = {}  # (parquet file, image column) -> it has no such column


def _metadata_files(candidates: list[str], image: str) -> set[str]:
    """Those of ``candidates`` (parquet files beside a shard of the same name) without an ``image``
    column. Only their footers are read, many at once (a remote input has one per shard), once per
    process: the converter asks at start and again when it plans the read."""
    def check(uri: str) -> bool:
        if (uri, image) not in _METADATA:
            try:
                _METADATA[uri, image] = image not in _parquet_columns(uri)
            except InputError:
                _METADATA[uri, image] = True
        return _METADATA[uri, image]

    if len(candidates) <= 1:
        return {uri for uri in candidates if check(uri)}
    from concurrent.futures import ThreadPoolExecutor
    with ThreadPoolExecutor(min(32, len(candidates))) as pool:
        return {uri for uri, is_meta in zip(candidates, pool.map(check, candidates)) if is_meta}


LAYOUTS = ("img2dataset's parquet (NNNNN.parquet with a {image!r} column), webdataset (NNNNN.tar of "
           "KEY.jpg + KEY.txt [+ KEY.json], beside NNNNN.parquet), files (NNNNN/KEY.jpg + KEY.txt "
           "[+ KEY.json]) and tfrecord (NNNNN.tfrecord of tf.train.Example) layouts, and images with .txt captions")


def no_data_error(inputs, files: list[str], columns: RawColumns = RawColumns()) -> InputError:
    """The one line for an input that holds no data of a known layout: what was looked for, and
    what is there instead."""
    inputs = [inputs] if isinstance(inputs, (str, os.PathLike)) else list(inputs)
    where = ", ".join(map(os.fspath, inputs))
    if files:
        suffixes = collections.Counter(posixpath.splitext(f)[1].lower() or "(no suffix)" for f in files)
        held = ", ".join(f"{n} {suffix}" for suffix, n in sorted(suffixes.items(), key=lambda kv: (-kv[1], kv[0]))[:5])
        held = f"it holds {len(files)} file{'s' * (len(files) > 1)} ({held}{', ...' if len(suffixes) > 5 else ''})"
    else:
        held = "it holds no files"
    return InputError(f"no images to convert in {where}: looked for {LAYOUTS.format(image=columns.image)}; {held}")


def detect_format(files: list[str], columns: RawColumns = RawColumns()) -> str:
    """The formats of ``files``: ``parquet``, ``webdataset``, ``tfrecord``, ``folder``, or several joined by ``+``."""
    found = set(data_files(files, columns).values())
    if not found:
        raise no_data_error(files, files, columns)
    return "+".join(f for f in FORMATS if f in found)


def input_files(inputs, columns: RawColumns = RawColumns()) -> dict[str, str]:
    """{file: format} of every input file to read (see :func:`data_files`); InputError if none."""
    files = list_input_files(inputs, columns)
    found = data_files(files, columns)
    if not found:
        raise no_data_error(inputs, files, columns)
    return found


def _open(uri: str):
    fs, path = filesystem_for(uri)
    try:
        return fs.open_input_file(path)
    except OSError as e:
        raise InputError(f"cannot open input {uri}: {e}") from e


def input_names(files: list[str]) -> dict[str, str]:
    """Each input file's name relative to the inputs' common folder (``en/part-00000.parquet``): unique
    per file, and the same on every run with the same inputs, so keys derived from it never collide."""
    paths = [filesystem_for(f)[1] for f in files]
    root = posixpath.commonpath(paths) if len(paths) > 1 else posixpath.dirname(paths[0])
    if root in paths:  # one file given twice, or a single file: its own folder
        root = posixpath.dirname(root)
    return {f: posixpath.relpath(p, root) if root else p for f, p in zip(files, paths)}


def file_names(formats: dict[str, str]) -> dict[str, str]:
    """:func:`input_names` of ``{file: format}``, taken per format: a directory that holds one format
    names its files as it always has (so keys derived from them, and a resume, stay the same whatever
    else lies beside them). Names of two formats cannot clash: a file's name keeps its suffix."""
    names = {}
    for fmt in FORMATS:
        group = [f for f, f_fmt in formats.items() if f_fmt == fmt]
        if group:
            names.update(input_names(group))
    return names


# ---- parquet -------------------------------------------------------------------------------------

def _parquet_columns(uri: str) -> list[str]:
    return _parquet_schema(uri).names


def _parquet_schema(uri: str):
    import pyarrow.parquet as pq
    try:
        with _open(uri) as f:
            return pq.read_schema(f)
    except InputError:
        raise
    except Exception as e:
        raise InputError(f"cannot read {uri} as parquet: {e}") from e


def check_parquet_columns(uri: str, columns: RawColumns) -> None:
    """Raise a clear error naming the file and its columns if an asked-for column is missing (or one
    ``columns.where`` names, or compares with a value of another type)."""
    arrow_schema = _parquet_schema(uri)
    names = arrow_schema.names
    if columns.where:
        from diffusion.where import parse_where
        row_filter = parse_where(columns.where)
        row_filter.check_columns(names, uri)
        row_filter.check_types(arrow_schema, uri)
    required = (columns.image, columns.caption) if columns.caption_required else (columns.image,)
    required = (*required, *columns.captions)
    missing = [c for c in required if c not in names]
    if missing:
        hint = ("choose with --image-column/--caption-column" + ("/--captions" if columns.captions else "")
                if columns.column_flags else f"raw data holds its image bytes in {columns.image!r}, as img2dataset "
                                             f"writes them")
        if columns.image in missing and schema.RAW_URL in names:
            hint += ("; a parquet of URLs without images (a URL list, or img2dataset's metadata of a shard "
                     "whose .tar or folder is missing) is downloaded first: convert/download_laion.py")
        raise InputError(f"{uri} has no column {', '.join(map(repr, missing))}; its columns are "
                         f"{', '.join(names)} ({hint})")


# What stands in for image bytes the key pass does not read: not empty, so the row check takes the row
# for a sample as far as its image goes (whether the bytes decode is found only by the transform).
NOT_READ = b"(image not read)"


def _groups_with_missing_images(pf, column: str) -> set[int]:
    """The row groups of a parquet file whose statistics do not rule out a missing (null) image."""
    index = pf.schema_arrow.get_field_index(column)
    unsure = set()
    for group in range(pf.metadata.num_row_groups):
        stats = pf.metadata.row_group(group).column(index).statistics
        if stats is None or not stats.has_null_count or stats.null_count:
            unsure.add(group)
    return unsure


def _parquet_batches(pf, wanted: list[str], image: str, find_missing: bool):
    """(record batch, whether it holds the image column) over the file; ``find_missing`` (the key pass,
    ``image`` not in ``wanted``): the image column is read too in the row groups that may hold a
    missing image."""
    unsure = _groups_with_missing_images(pf, image) if find_missing else set()
    if not unsure:
        for record_batch in pf.iter_batches(batch_size=ROWS_PER_BATCH, columns=wanted):
            yield record_batch, image in wanted
        return
    for group in range(pf.metadata.num_row_groups):
        with_image = group in unsure
        for record_batch in pf.iter_batches(batch_size=ROWS_PER_BATCH, row_groups=[group],
                                            columns=wanted + ([image] if with_image else [])):
            yield record_batch, with_image


def _parquet_rows(uri: str, columns: RawColumns, name: str, images: bool = True) -> Iterator[dict]:
    """The rows of a parquet file; ``images=False``: without reading the image column, for the key pass
    (:mod:`diffusion.convert.shared_keys`): its values stand in as :data:`NOT_READ` (``""`` if the column
    is not binary, which the row check rejects as it would the real values), and where the row group's
    statistics do not rule out a missing image, the column is read there, so a row without one is known."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    check_parquet_columns(uri, columns)
    with _open(uri) as f:
        pf = pq.ParquetFile(f)
        names = set(pf.schema_arrow.names)
        row_filter = None
        if columns.where:
            from diffusion.where import parse_where
            row_filter = parse_where(columns.where)
        stand_in, binary = None, True
        if not images:
            kind = pf.schema_arrow.field(columns.image).type
            binary = pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
            stand_in = NOT_READ if binary else ""
        wanted = [c for c in {columns.image if images else None, columns.caption, columns.key, schema.WIDTH,
                              schema.HEIGHT, schema.RAW_STATUS, *columns.captions,
                              *(row_filter.columns if row_filter else ()),
                              schema.RAW_URL if columns.exclude_urls else None}
                  if c in names]
        for record_batch, with_image in _parquet_batches(pf, wanted, columns.image, not images and binary):
            blame = row_filter.blame(record_batch) if row_filter else itertools.repeat(None)
            for row, failed in zip(record_batch.to_pylist(), blame):
                # img2dataset/download output: failed rows have no image, so only successes are rows.
                if schema.RAW_STATUS in row and row[schema.RAW_STATUS] != "success":
                    yield None  # keeps the row numbers of derived keys those of the file
                    continue
                if failed is not None:  # --where: a reject by its rule, before the image is looked at
                    yield {REJECT: row_filter.reason(failed), schema.RAW_KEY: row.get(columns.key)}
                    continue
                if columns.exclude_urls and columns.url_excluded(row.get(schema.RAW_URL)):  # --exclude
                    yield {REJECT: "excluded: url", schema.RAW_KEY: row.get(columns.key)}
                    continue
                yield {schema.RAW_KEY: row.get(columns.key), schema.RAW_CAPTION: row.get(columns.caption),
                       schema.RAW_IMAGE: row[columns.image] if images else (
                           row[columns.image] if with_image and not row[columns.image] else stand_in),
                       schema.WIDTH: row.get(schema.WIDTH),
                       schema.HEIGHT: row.get(schema.HEIGHT), **columns.extra_captions(row.get)}


# ---- webdataset ----------------------------------------------------------------------------------

def _webdataset_rows(uri: str, name: str, columns: RawColumns = RawColumns(), images: bool = True) -> Iterator[dict]:
    """Samples of an img2dataset tar: ``KEY.jpg`` + ``KEY.txt`` (+ ``KEY.json``), consecutive members;
    the key is the ``.json``'s ``columns.key``, else the file's name and the member's stem.

    A sample whose ``.json`` is not a JSON object is a ``bad_metadata`` reject; a tar that cannot be
    read on (truncated, corrupt) raises InputError after the samples before the damage. ``images=False``
    (the key pass): image members are not read, :data:`NOT_READ` stands in (``b""`` for an empty one)."""
    def sample(key, parts):
        image = next((parts[s] for s in IMAGE_SUFFIXES if s in parts), None)
        if image is None:
            return None
        row_key = f"{name}/{key}" if key else None
        meta = {}
        if ".json" in parts and parts[".json"] is not _UNREAD:
            try:
                meta = json.loads(parts[".json"])
            except ValueError:  # not JSON, or not UTF-8
                meta = None
            if not isinstance(meta, dict):
                return {REJECT: BAD_METADATA, schema.RAW_KEY: row_key}
        if meta.get(schema.RAW_STATUS, "success") != "success":
            return None
        row_key = meta.get(columns.key) or row_key
        if columns.exclude_urls and columns.url_excluded(meta.get(schema.RAW_URL)):  # --exclude
            return {REJECT: "excluded: url", schema.RAW_KEY: row_key}
        if any(part is _UNREAD for part in parts.values()):
            return {REJECT: TOO_LARGE, schema.RAW_KEY: row_key}
        caption = parts[".txt"] if ".txt" in parts else meta.get(schema.RAW_CAPTION)
        return {schema.RAW_KEY: row_key, schema.RAW_CAPTION: caption,
                schema.RAW_IMAGE: image, schema.WIDTH: meta.get(schema.WIDTH), schema.HEIGHT: meta.get(schema.HEIGHT),
                **columns.extra_captions(meta.get)}

    with _open(uri) as f:
        try:
            tar = tarfile.open(fileobj=f, mode="r|*")
            key, parts = None, {}
            for member in tar:
                if not member.isfile():
                    continue
                stem, ext = posixpath.splitext(member.name)
                if stem != key and parts:
                    yield sample(key, parts)
                    parts = {}
                key = stem
                ext = ext.lower()
                if member.size > columns.max_bytes:  # a sparse or compressed member can claim gigabytes
                    parts[ext] = _UNREAD  # skipped, not read: the tar reads past it
                elif images or ext not in IMAGE_SUFFIXES:
                    parts[ext] = tar.extractfile(member).read()
                else:
                    parts[ext] = NOT_READ if member.size else b""
            if parts:
                yield sample(key, parts)
        except (tarfile.TarError, EOFError, zlib.error, OSError) as e:
            raise InputError(f"cannot read {uri} as a tar file: {type(e).__name__}: {e}") from e


_UNREAD = object()  # a tar member over the byte limit


# ---- folder of images ----------------------------------------------------------------------------

def _folder_rows(uri: str, name: str, columns: RawColumns = RawColumns()) -> Iterator[dict]:
    """One image; its caption from the ``.txt`` beside it (missing sidecar -> missing caption). An
    image or caption file over ``columns.max_bytes`` is not read: a ``too_large`` reject."""
    fs, path = filesystem_for(uri)
    with _open(uri) as f:
        if f.size() > columns.max_bytes:
            yield {REJECT: TOO_LARGE, schema.RAW_KEY: name}
            return
        image = f.read()
    caption = None  # bytes: decoded (or rejected as bad_caption) with the row's other values
    try:
        with fs.open_input_file(posixpath.splitext(path)[0] + ".txt") as f:
            if f.size() > columns.max_bytes:
                yield {REJECT: TOO_LARGE, schema.RAW_KEY: name}
                return
            caption = f.read().strip()
    except (FileNotFoundError, OSError):
        pass
    extra = {}  # --captions: NAME's caption from IMAGE.NAME.txt beside the image
    for caption_name in columns.captions:
        extra[schema.caption_columns(caption_name)[0]] = None
        try:
            with fs.open_input_file(f"{posixpath.splitext(path)[0]}.{caption_name}.txt") as f:
                if f.size() > columns.max_bytes:
                    yield {REJECT: TOO_LARGE, schema.RAW_KEY: name}
                    return
                extra[schema.caption_columns(caption_name)[0]] = f.read().strip()
        except (FileNotFoundError, OSError):
            pass
    # the name keeps the suffix: img0.jpg and img0.png are two samples
    yield {schema.RAW_KEY: name, schema.RAW_CAPTION: caption, schema.RAW_IMAGE: image, **extra}


# ---- tfrecord (the wire format: diffusion.tfrecord) ------------------------------------

def _tfrecord_rows(uri: str, name: str, columns: RawColumns = RawColumns()) -> Iterator[dict | None]:
    """Samples of an img2dataset tfrecord file; a record cut short, or one that is not a
    tf.train.Example, raises InputError after the samples before it."""
    import struct

    def first(features, feature):
        values = features.get(feature)
        value = values[0] if values else None
        return None if value == b"" else value  # img2dataset stores a missing value as b""

    with _open(uri) as f:
        size = f.size()
        for index in itertools.count():
            header = f.read(12)
            if not header:
                return
            (length,) = struct.unpack("<Q", header[:8]) if len(header) == 12 else (None,)
            if length is None or length + 4 > size - f.tell():
                raise InputError(f"cannot read {uri} as a tfrecord file: record {index} is cut short")
            if length > columns.max_bytes + _RECORD_SLACK:  # not read: its key is inside, so it is keyed by row
                f.seek(length + 4, 1)
                yield {REJECT: TOO_LARGE, schema.RAW_KEY: None}
                continue
            data = f.read(length)
            f.read(4)
            try:
                features = example_features(data)
            except ValueError as e:
                raise InputError(f"cannot read {uri} as a tfrecord file: record {index} is not a "
                                 f"tf.train.Example ({e})") from None
            status = first(features, schema.RAW_STATUS)
            if status not in (None, b"success"):
                yield None
                continue
            caption = features["txt"][0] if features.get("txt") else first(features, schema.RAW_CAPTION)
            yield {schema.RAW_KEY: first(features, columns.key), schema.RAW_CAPTION: caption,
                   schema.RAW_IMAGE: first(features, schema.RAW_IMAGE),
                   **{side: _sized(first(features, side)) for side in (schema.WIDTH, schema.HEIGHT)},
                   **columns.extra_captions(lambda n: first(features, n))}


_RECORD_SLACK = 2**20  # a tfrecord record holds the image and its caption and metadata


def _sized(value):
    """A width/height feature: an int, or text (bytes) the row check reads as one."""
    return value.decode("utf-8", "replace") if isinstance(value, bytes) else value


def iter_file_batches(uri: str, fmt: str, columns: RawColumns = RawColumns(), name: str | None = None,
                      on_reject=None, taken=None, kept: list | None = None) -> Iterator[dict]:
    """Column batches of the valid raw rows in one input file; ``name`` is the file's name under the
    input root (:func:`input_names`), which keys rows that have none. Rejected rows go to
    ``on_reject({id: reason})`` (:func:`~diffusion.convert.rows.row_batches`); a file that cannot be
    read raises (see :func:`file_errors`) after the rows before the damage. ``taken``: {key: the file that keeps it}
    for keys several files give (:func:`keys_taken_by_earlier_files`); ``kept``: :func:`row_batches`'."""
    name = name or posixpath.basename(uri)
    yield from row_batches(file_rows(uri, fmt, columns, name), name, on_reject, taken, columns.max_caption_chars,
                           columns.captions, kept)


def file_rows(uri: str, fmt: str, columns: RawColumns, name: str, images: bool = True) -> Iterator[dict | None]:
    """The raw rows of one input file, unchecked (``None`` for a row that is not a sample);
    ``images=False``: without reading image bytes where the format allows (parquet, tar), for the key
    pass (:mod:`diffusion.convert.shared_keys`)."""
    if fmt == "parquet":
        return _parquet_rows(uri, columns, name, images)
    if fmt == "webdataset":
        return _webdataset_rows(uri, name, columns, images)
    if fmt == "tfrecord":
        return _tfrecord_rows(uri, name, columns)
    if fmt == "folder":
        return _folder_rows(uri, name, columns)
    raise ValueError(f"unknown input format {fmt!r}")
