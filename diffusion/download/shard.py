"""Download one shard: its input rows → ``NNNNN.parquet`` and ``NNNNN_stats.json``, written atomically.

Each shard downloads with its own thread pool sharing one connection pool. Rows are written in input
order, in row groups, as they complete (memory stays bounded by the in-flight window, not the shard).
The parquet file is written under a temporary name and renamed, then the stats file is written the
same way: a shard is finished exactly when its stats file exists, which is what a re-run checks.
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import json
import time

import pyarrow as pa
import pyarrow.fs as pa_fs
import pyarrow.parquet as pq

from diffusion import schema
from diffusion.download.http import FetchConfig, Fetcher, FetchError
from diffusion.download.image import CheckedImage, ImageRules, check_image
from diffusion.download.plan import InputColumns, ShardSpec, open_filesystem, read_shard

# Reasons found after the bytes arrived (img2dataset's "failed_to_resize"); the rest failed to download.
IMAGE_REASONS = frozenset({"not_image", "decode_error", "too_small", "too_many_pixels"})
ROW_GROUP = 256
OUTPUT_FIELDS = [
    (schema.RAW_KEY, pa.string()), (schema.RAW_URL, pa.string()), (schema.RAW_CAPTION, pa.string()),
    (schema.RAW_IMAGE, pa.binary()), (schema.WIDTH, pa.int32()), (schema.HEIGHT, pa.int32()),
    (schema.RAW_ORIGINAL_WIDTH, pa.int32()), (schema.RAW_ORIGINAL_HEIGHT, pa.int32()),
    (schema.RAW_STATUS, pa.string()), (schema.RAW_ERROR, pa.string()),
]


@dataclasses.dataclass(frozen=True)
class ShardNaming:
    """img2dataset-style names: key = zero-padded shard id + zero-padded index within the shard."""

    shard_digits: int = 5
    index_digits: int = 4

    @classmethod
    def for_plan(cls, num_shards: int, rows_per_shard: int) -> "ShardNaming":
        return cls(max(5, len(str(max(num_shards - 1, 0)))), len(str(max(rows_per_shard - 1, 0))))

    def key(self, shard_id: int, index: int) -> str:
        return f"{shard_id:0{self.shard_digits}d}{index:0{self.index_digits}d}"

    def parquet(self, shard_id: int) -> str:
        return f"{shard_id:0{self.shard_digits}d}.parquet"

    def stats(self, shard_id: int) -> str:
        return f"{shard_id:0{self.shard_digits}d}_stats.json"


@dataclasses.dataclass(frozen=True)
class ShardJob:
    """Everything a worker needs to download any shard of one plan."""

    input: str
    output: str
    formats: dict  # input file path -> parquet | csv | jsonl
    columns: InputColumns
    naming: ShardNaming
    fetch: FetchConfig = FetchConfig()
    image: ImageRules = ImageRules()
    threads: int = 64  # concurrent requests per shard


def is_finished(fs: pa_fs.FileSystem, root: str, naming: ShardNaming, shard_id: int) -> bool:
    return fs.get_file_info(f"{root}/{naming.stats(shard_id)}").type == pa_fs.FileType.File


def read_stats(fs: pa_fs.FileSystem, root: str, naming: ShardNaming, shard_id: int) -> dict:
    with fs.open_input_stream(f"{root}/{naming.stats(shard_id)}") as f:
        return json.loads(f.read())


def _fetch_one(fetcher: Fetcher, rules: ImageRules, url) -> CheckedImage | FetchError:
    try:
        return check_image(fetcher.fetch(url), rules)
    except FetchError as e:
        return e
    except Exception as e:  # a bug or an exotic failure costs one row, counted, never the shard
        return FetchError("unexpected_error", f"{type(e).__name__}: {e}")


def download_shard(job: ShardJob, spec: ShardSpec) -> dict:
    """Download one shard unless it is finished; returns its stats (``skipped`` says which)."""
    fs, root = open_filesystem(job.output)
    if is_finished(fs, root, job.naming, spec.shard_id):
        return {**read_stats(fs, root, job.naming, spec.shard_id), "skipped": True}
    start = time.time()
    rows = read_shard(job.input, spec, job.formats[spec.path], job.columns)
    keep = rows.select(list(job.columns.keep))
    arrow_schema = pa.schema(OUTPUT_FIELDS + [keep.schema.field(c) for c in keep.column_names])
    urls = rows[job.columns.url].to_pylist()
    captions = rows[job.columns.caption].to_pylist()
    status = collections.Counter()
    buffer = {name: [] for name in arrow_schema.names}
    path = f"{root}/{job.naming.parquet(spec.shard_id)}"

    def add(index: int, result: CheckedImage | FetchError, writer: pq.ParquetWriter) -> None:
        ok = isinstance(result, CheckedImage)
        status[schema.RAW_STATUS_SUCCESS if ok else result.reason] += 1
        for name, value in (
                (schema.RAW_KEY, job.naming.key(spec.shard_id, index)), (schema.RAW_URL, urls[index]),
                (schema.RAW_CAPTION, captions[index]), (schema.RAW_IMAGE, result.data if ok else b""),
                (schema.WIDTH, result.width if ok else None), (schema.HEIGHT, result.height if ok else None),
                (schema.RAW_ORIGINAL_WIDTH, result.original_width if ok else None),
                (schema.RAW_ORIGINAL_HEIGHT, result.original_height if ok else None),
                (schema.RAW_STATUS, schema.RAW_STATUS_SUCCESS if ok else schema.RAW_STATUS_FAILED),
                (schema.RAW_ERROR, None if ok else str(result))):
            buffer[name].append(value)
        for name in keep.column_names:
            buffer[name].append(keep[name][index].as_py())
        if len(buffer[schema.RAW_KEY]) >= ROW_GROUP or index == len(urls) - 1:
            writer.write_table(pa.table(buffer, schema=arrow_schema))
            for column in buffer.values():
                column.clear()

    fetcher = Fetcher(job.fetch, pool_size=job.threads)
    window = 4 * job.threads  # in flight; results leave in input order
    with fs.open_output_stream(path + ".tmp") as sink, pq.ParquetWriter(sink, arrow_schema) as writer, \
            concurrent.futures.ThreadPoolExecutor(job.threads) as pool:
        pending = collections.deque()
        for index, url in enumerate(urls):
            pending.append((index, pool.submit(_fetch_one, fetcher, job.image, url)))
            if len(pending) >= window:
                done_index, future = pending.popleft()
                add(done_index, future.result(), writer)
        while pending:
            done_index, future = pending.popleft()
            add(done_index, future.result(), writer)
        if not urls:
            writer.write_table(pa.table({name: [] for name in arrow_schema.names}, schema=arrow_schema))
    fetcher.http.clear()
    fs.move(path + ".tmp", path)

    end = time.time()
    failures = {reason: n for reason, n in sorted(status.items()) if reason != schema.RAW_STATUS_SUCCESS}
    stats = {
        "shard_id": spec.shard_id, "count": len(urls), "successes": status[schema.RAW_STATUS_SUCCESS],
        "failed_to_download": sum(n for r, n in failures.items() if r not in IMAGE_REASONS),
        "failed_to_resize": sum(n for r, n in failures.items() if r in IMAGE_REASONS),
        "failures": failures, "status_dict": dict(status), "duration": end - start,
        "start_time": start, "end_time": end, "input": spec.path, "input_rows": [spec.start, spec.stop],
    }
    stats_path = f"{root}/{job.naming.stats(spec.shard_id)}"
    with fs.open_output_stream(stats_path + ".tmp") as f:
        f.write(json.dumps(stats, indent=2).encode())
    fs.move(stats_path + ".tmp", stats_path)
    return {**stats, "skipped": False}
