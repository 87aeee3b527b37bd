"""Which input rows a download fetches: ``--where`` (the converter's filter grammar,
:mod:`diffusion.where`) and ``--dedupe-urls``, decided once in the driver before any URL is fetched.

:func:`plan_drops` reads each input file's URL column (``--dedupe-urls``) and the columns ``--where`` names,
in the plan's order (files sorted, rows in file order), and returns for every shard the rows not to fetch
with their reason: ``filtered: <rule>`` (the first ``and`` rule the row fails, as the converter counts it)
or ``duplicate_url``. Workers only skip the rows they are given, so what is dropped does not depend on the
worker count, the order shards finish in, or which shards a resumed run still has to do; a resumed run
recomputes the same drops from the same input (the plan fingerprint holds the filter, so a run with another
filter is refused).

Duplicates are found in the driver, not by workers: "seen earlier in input order" spans shards and files,
so only a pass over the whole list in order can decide it deterministically; planning already reads every
file once. The driver keeps a 16-byte BLAKE2b digest per distinct URL rather than the URL (LAION URLs
average ~100 bytes), about 100 bytes a URL with the set's overhead: ~1 GB per 10M distinct URLs. A list
much larger than that is best downloaded in parts (each part is deduplicated within itself). A URL only
counts as seen once a row holding it passes ``--where``: a dropped row fetches nothing, so a later row
with the same URL that passes is fetched. Null URLs are never duplicates (they fail as ``invalid_url``).
"""

from __future__ import annotations

import hashlib
import io
import json

import pyarrow as pa
import pyarrow.csv as pa_csv
import pyarrow.fs as pa_fs
import pyarrow.json as pa_json
import pyarrow.parquet as pq

from diffusion.rejects import DUPLICATE_URL  # noqa: F401 (also for this module's importers)
from diffusion.where import RowFilter, parse_where
from diffusion.download.plan import InputColumns, ShardSpec, as_text, read_input
from diffusion.errors import ConfigError



def file_columns(fs: pa_fs.FileSystem, path: str, fmt: str) -> list[str]:
    """The column names of one input file (parquet: its footer; csv: its header; jsonl: its rows' keys)."""
    if fmt == "parquet":
        with fs.open_input_file(path) as f:
            return pq.ParquetFile(f).schema_arrow.names
    with fs.open_input_stream(path) as f:
        data = f.read()
    if fmt == "csv":
        # From an Arrow buffer, not a Python file: the streaming reader reads ahead on Arrow's threads,
        # which, if they still read from a Python object when the interpreter exits (a filter naming a
        # missing column stops right here), abort the process ("terminate called without an active exception").
        return pa_csv.open_csv(pa.BufferReader(data)).schema.names
    try:
        return pa_json.read_json(io.BytesIO(data)).column_names
    except pa.ArrowInvalid:  # rows pyarrow refuses: every key any JSON-object line has, first seen first
        names: dict[str, None] = {}
        for line in data.splitlines():
            try:
                row = json.loads(line)
            except ValueError:
                continue
            if isinstance(row, dict):
                names.update(dict.fromkeys(row))
        return list(names)


def _read_columns(fs: pa_fs.FileSystem, path: str, fmt: str, names: list[str]) -> pa.Table:
    """The ``names`` columns of one input file, the first two (url and caption) as text, as shards read them
    (a binary URL column is the URLs' text, for deduplication and the blocklist too)."""
    url, caption, *rest = names
    if fmt == "parquet":
        with fs.open_input_file(path) as f:
            return as_text(pq.ParquetFile(f).read(columns=names).select(names), InputColumns(url, caption))
    return read_input(fs, path, fmt, InputColumns(url, caption, tuple(rest)))


def plan_drops(fs: pa_fs.FileSystem, files: dict[str, str], shards: list[ShardSpec], columns: InputColumns,
               where: str | None, dedupe_urls: bool, blocklist=None) -> dict[int, dict[int, str]]:
    """``{shard_id: {row index within the shard: reason}}`` of the rows not to fetch (shards with none
    left out). ConfigError (one line) if ``where`` is malformed, names a column a file lacks (listing the
    file's columns), cannot be compared with a column's type, or keeps no row of the input. ``blocklist``
    (--exclude, :class:`diffusion.convert.exclude.Blocklist`): rows whose URL's SHA-256 (or whose ``key``
    column) it lists are ``excluded: url`` (``excluded: key``), never fetched."""
    row_filter: RowFilter | None = parse_where(where) if where else None
    if row_filter is None and not dedupe_urls and not blocklist:
        return {}
    drops: dict[int, dict[int, str]] = {}
    seen: set[bytes] = set()
    by_file: dict[str, list[ShardSpec]] = {}
    for spec in shards:
        by_file.setdefault(spec.path, []).append(spec)
    removed = [0] * (len(row_filter.rules) if row_filter else 0)
    total = kept = 0
    for path, fmt in sorted(files.items()):
        specs = by_file.get(path, [])
        if row_filter is not None:
            row_filter.check_columns(file_columns(fs, path, fmt), path)
        wanted = [columns.url, columns.caption] + [c for c in (row_filter.columns if row_filter else ())
                                                    if c not in (columns.url, columns.caption)]
        by_key = bool(blocklist and blocklist.keys) and "key" in file_columns(fs, path, fmt)
        if by_key and "key" not in wanted:
            wanted.append("key")
        table = _read_columns(fs, path, fmt, wanted)
        n = table.num_rows
        verdict: list[int | None] = [None] * n
        if row_filter is not None:
            row_filter.check_types(table.schema, path)
            verdict = row_filter.blame(table)
        urls = table[columns.url].to_pylist() if dedupe_urls or blocklist else None
        keys = table["key"].to_pylist() if by_key else None
        reasons: list[str | None] = [None] * n
        for row in range(n):
            if verdict[row] is not None:
                removed[verdict[row]] += 1
                reasons[row] = row_filter.reason(verdict[row])
            elif keys is not None and keys[row] is not None and str(keys[row]) in blocklist.keys:
                reasons[row] = "excluded: key"
            elif blocklist and blocklist.url_blocked(urls[row]):
                reasons[row] = "excluded: url"
            elif dedupe_urls and urls is not None and urls[row] is not None:
                digest = hashlib.blake2b(urls[row].encode("utf-8", "surrogatepass"), digest_size=16).digest()
                if digest in seen:
                    reasons[row] = DUPLICATE_URL
                else:
                    seen.add(digest)
        total += n
        kept += sum(1 for v in verdict if v is None)
        for spec in specs:
            shard = {i - spec.start: reasons[i] for i in range(spec.start, spec.stop) if reasons[i] is not None}
            if shard:
                drops[spec.shard_id] = shard
    if row_filter is not None and kept == 0:
        counts = ", ".join(f"{row_filter.rules[i][0]!r} removed {k}" for i, k in enumerate(removed) if k)
        raise ConfigError(f"--where {row_filter.text!r} keeps no row of the input: {counts or 'no row to filter'} "
                          f"(of {total} rows); nothing was downloaded")
    return drops
