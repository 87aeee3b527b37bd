"""Input side of the downloader: list url+caption files (local or ``s3://``), plan shards, read a shard.

Shards are planned from the input alone, so a re-run produces the same shards with the same keys:
files in sorted order, each cut into ``rows_per_shard`` consecutive rows (a file's last shard may be
shorter; shards never span files, like img2dataset). Parquet row counts come from the footer; csv and
jsonl files are read once to count rows, and a parquet file's wanted columns are read once too (a
footer can be intact over damaged column data).

A file that cannot be read stops the job at start with one line naming the file: planning reads every
file before anything is downloaded, so damage (a corrupt parquet data page, a csv row with too many or
too few fields) costs no work, and a shard task never meets it. A row that holds a wrong kind of value
does not: URLs and captions that are numbers become their text (a caption "1984"), ones that cannot
be text (a list, bytes that are not UTF-8) become null, so the row fails as ``invalid_url`` or goes on
without a caption (the converter then rejects it as ``empty_caption``); a jsonl file whose rows
disagree on a column's type, or holding a line that is not a JSON object (a row with nothing in it),
is read line by line.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.fs as pa_fs
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from diffusion.errors import ConfigError, InputError
from diffusion.storage import filesystem_for

FORMATS = {".parquet": "parquet", ".csv": "csv", ".jsonl": "jsonl", ".json": "jsonl"}


@dataclasses.dataclass(frozen=True)
class InputColumns:
    url: str = "URL"  # LAION's names
    caption: str = "TEXT"
    keep: tuple[str, ...] = ()  # extra input columns carried into the output

    def names(self) -> list[str]:
        return [self.url, self.caption, *[c for c in self.keep if c not in (self.url, self.caption)]]


@dataclasses.dataclass(frozen=True)
class ShardSpec:
    shard_id: int
    path: str  # file path inside the input's filesystem
    start: int  # first row of the file in this shard
    stop: int  # one past the last row


def open_filesystem(uri: str) -> tuple[pa_fs.FileSystem, str]:
    """(filesystem, path) for a local path or a remote URI, the way every stage reaches storage."""
    return filesystem_for(uri)


def list_input_files(uri: str, input_format: str | None = None, output: str | None = None) -> list[tuple[str, str]]:
    """Sorted ``(path, format)`` of the input files at ``uri`` (one file or a directory tree), less those under
    ``output`` (the download's own folder inside the input's: its shards and records are no url lists, and
    the re-run that resumes must plan what the first run planned)."""
    fs, root = open_filesystem(uri)
    info = fs.get_file_info(root)
    if info.type == pa_fs.FileType.NotFound:
        raise InputError(f"input {uri!r} does not exist")
    infos = [info] if info.type == pa_fs.FileType.File else fs.get_file_info(pa_fs.FileSelector(root, recursive=True))
    output_fs, output_root = open_filesystem(output) if output else (None, None)
    files = []
    for entry in infos:
        if entry.type != pa_fs.FileType.File:
            continue
        if type(output_fs) is type(fs) and entry.path.startswith(output_root.rstrip("/") + "/"):
            continue
        fmt = input_format or FORMATS.get(os.path.splitext(entry.path)[1].lower())
        if fmt is None and info.type == pa_fs.FileType.File:
            raise InputError(f"{entry.path}: unknown input format; pass --input-format parquet|csv|jsonl")
        if fmt:
            files.append((entry.path, fmt))
    if not files:
        raise InputError(f"no parquet, csv or jsonl files under {uri!r}")
    return sorted(files)


def read_input(fs: pa_fs.FileSystem, path: str, fmt: str, columns: InputColumns) -> pa.Table:
    """The ``columns`` of one input file, url and caption as strings; a missing column is an error."""
    names = columns.names()
    text = {columns.url: pa.string(), columns.caption: pa.string()}
    if fmt == "parquet":
        with fs.open_input_file(path) as f:
            parquet = pq.ParquetFile(f)
            _require(path, names, parquet.schema_arrow.names)
            table = parquet.read(columns=names)
    elif fmt == "csv":
        with fs.open_input_stream(path) as f:
            table = pa_csv.read_csv(f, convert_options=pa_csv.ConvertOptions(column_types=text))
    elif fmt == "jsonl":
        with fs.open_input_stream(path) as f:
            data = f.read()
        try:
            table = pa_json.read_json(io.BytesIO(data))  # no explicit schema: it would hide a missing column as nulls
        except pa.ArrowInvalid:  # rows that disagree on a column's type, or a line that is not an object
            table = _jsonl_by_line(data, names)
    else:
        raise InputError(f"{path}: unknown input format {fmt!r} (parquet, csv or jsonl)")
    _require(path, names, table.column_names)
    return as_text(table.select(names), columns)


def _jsonl_by_line(data: bytes, names: list[str]) -> pa.Table:
    """A jsonl file pyarrow refuses, read line by line: every line (blank ones aside) is one row, a
    line that is not a JSON object an empty one; columns that mix types hold their values' text."""
    rows = []
    for line in data.splitlines():
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except ValueError:
            row = None
        rows.append(row if isinstance(row, dict) else {})
    present = {k for row in rows for k in row}
    columns = {}
    for name in [n for n in names if n in present]:
        values = [row.get(name) for row in rows]
        try:
            columns[name] = pa.array(values)
        except (pa.ArrowException, TypeError, ValueError, OverflowError):
            columns[name] = pa.array([_text_or_none(v) for v in values], pa.string())
    return pa.table(columns)  # a column no row has is missing, and named so by _require


def _text_or_none(value) -> str | None:
    if value is None or isinstance(value, str):
        return value
    if isinstance(value, bytes):
        try:
            return value.decode("utf-8")
        except UnicodeDecodeError:
            return None
    if isinstance(value, (bool, int, float)):
        return json.dumps(value)
    return None  # a list or mapping is no URL and no caption


def as_text(table: pa.Table, columns: InputColumns) -> pa.Table:
    """URL and caption as strings (a csv caption "1984" would otherwise parse as a number); values that
    cannot be text (a list, bytes that are not UTF-8) are null, so one bad row does not fail the file."""
    for i, name in enumerate((columns.url, columns.caption)):
        try:
            column = table[name].cast(pa.string())
        except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
            column = pa.array([_text_or_none(v) for v in table[name].to_pylist()], pa.string())
        table = table.set_column(i, name, column)
    return table


def _require(path: str, wanted: list[str], present: list[str]) -> None:
    missing = [c for c in wanted if c not in present]
    if missing:
        raise InputError(f"{path}: no column {missing} (it has {present}); set --url-col/--caption-col/"
                         f"--keep-columns to the input's names")


def count_rows(fs: pa_fs.FileSystem, path: str, fmt: str, columns: InputColumns) -> int:
    if fmt == "parquet":
        with fs.open_input_file(path) as f:
            parquet = pq.ParquetFile(f)
            _require(path, columns.names(), parquet.schema_arrow.names)
            for _ in parquet.iter_batches(batch_size=1 << 16, columns=columns.names()):
                pass  # decodes every page of the wanted columns: damage past an intact footer shows here
            return parquet.metadata.num_rows
    return read_input(fs, path, fmt, columns).num_rows


def _one_line(error: BaseException) -> str:
    text = " ".join(str(error).split()) or type(error).__name__
    return text if len(text) <= 300 else text[:297] + "..."


def plan_shards(uri: str, columns: InputColumns, rows_per_shard: int, input_format: str | None = None,
                output: str | None = None) -> tuple[list[ShardSpec], dict[str, str]]:
    """Every shard of the input (less the ``output`` folder's files), in order, and each file's format."""
    if rows_per_shard <= 0:
        raise ConfigError(f"rows_per_shard must be positive, got {rows_per_shard}")
    fs, _ = open_filesystem(uri)
    files = list_input_files(uri, input_format, output)
    shards: list[ShardSpec] = []
    for path, fmt in files:
        try:
            n = count_rows(fs, path, fmt, columns)
        except (pa.ArrowException, OSError, UnicodeDecodeError) as e:  # damaged, or another format
            raise InputError(f"{path}: not a readable {fmt} file ({_one_line(e)}); repair or remove it "
                             f"and re-run") from None
        for start in range(0, n, rows_per_shard):
            shards.append(ShardSpec(len(shards), path, start, min(start + rows_per_shard, n)))
    return shards, dict(files)


def read_shard(uri: str, spec: ShardSpec, fmt: str, columns: InputColumns) -> pa.Table:
    """The input rows of one shard. Parquet reads only the row groups the shard overlaps. A file
    damaged since it was planned is an InputError naming it and the rows."""
    try:
        return _read_shard(uri, spec, fmt, columns)
    except InputError:
        raise
    except (pa.ArrowException, OSError, UnicodeDecodeError) as e:
        raise InputError(f"{spec.path}: rows {spec.start}-{spec.stop - 1} cannot be read as {fmt} "
                         f"({_one_line(e)}); repair or remove the file and re-run") from None


def _read_shard(uri: str, spec: ShardSpec, fmt: str, columns: InputColumns) -> pa.Table:
    fs, _ = open_filesystem(uri)
    if fmt != "parquet":
        return read_input(fs, spec.path, fmt, columns).slice(spec.start, spec.stop - spec.start)
    with fs.open_input_file(spec.path) as f:
        parquet = pq.ParquetFile(f)
        groups, first_row, offset = [], None, 0
        for g in range(parquet.metadata.num_row_groups):
            n = parquet.metadata.row_group(g).num_rows
            if offset < spec.stop and offset + n > spec.start:
                groups.append(g)
                first_row = offset if first_row is None else first_row
            offset += n
        table = parquet.read_row_groups(groups, columns=columns.names())
    return as_text(table.slice(spec.start - (first_row or 0), spec.stop - spec.start), columns)
