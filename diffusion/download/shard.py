"""Download one shard: its input rows → ``NNNNN.parquet`` (+ ``NNNNN.tar``) and ``NNNNN_stats.json``.

Each shard downloads with its own thread pool sharing one connection pool. Rows are written in the order
their downloads finish, as img2dataset writes them (``key`` gives each row's input position): a URL that
stalls holds one thread, never the rows behind it. At most ``2 * threads`` rows are in flight or waiting
to be written, and rows go out in row groups, so memory stays bounded by the threads, not the shard.

Every output file is written under a temporary name and renamed when complete, then the stats file is
written the same way: a shard is finished exactly when its stats file exists, which is what a re-run
checks. A shard a kill interrupted is downloaded again from its first row (its temporary files are
overwritten), so a re-run ends with the same rows as a run never interrupted.

Output formats (img2dataset's names, columns and values):

- ``parquet``: ``NNNNN.parquet`` with one row per input row: ``url, caption``, the kept input columns,
  ``key, status, error_message, width, height, original_width, original_height, exif, sha256, jpg``.
- ``webdataset``: ``NNNNN.tar`` holding ``KEY.jpg``, ``KEY.txt`` (the caption) and ``KEY.json`` (the
  row's metadata) for each downloaded image, beside ``NNNNN.parquet`` with every row's metadata (the
  same columns, less ``jpg``).
"""

from __future__ import annotations

import collections
import concurrent.futures
import dataclasses
import hashlib
import io
import json
import queue
import tarfile
import time
from typing import Callable, Iterable, Iterator

import pyarrow as pa
import pyarrow.fs as pa_fs
import pyarrow.parquet as pq

from diffusion import schema
from diffusion.download.http import FetchConfig, Fetcher, FetchError
from diffusion.download.image import CheckedImage, ImageRules, check_image
from diffusion.download.plan import InputColumns, ShardSpec, open_filesystem, read_shard

OUTPUT_FORMATS = ("parquet", "webdataset")
# Reasons found after the bytes arrived (img2dataset's "failed_to_resize"); the rest failed to download.
IMAGE_REASONS = frozenset({"not_image", "decode_error", "too_small", "too_many_pixels"})
ROW_GROUP = 256
STATUS_DICT_MAX = 1000  # distinct error messages a shard's status_dict holds; later ones count by reason
# The columns img2dataset writes, in its order: url and caption, then the input columns kept, then these.
INPUT_FIELDS = [(schema.RAW_URL, pa.string()), (schema.RAW_CAPTION, pa.string())]
META_FIELDS = [
    (schema.RAW_KEY, pa.string()), (schema.RAW_STATUS, pa.string()), (schema.RAW_ERROR, pa.string()),
    (schema.WIDTH, pa.int32()), (schema.HEIGHT, pa.int32()),
    (schema.RAW_ORIGINAL_WIDTH, pa.int32()), (schema.RAW_ORIGINAL_HEIGHT, pa.int32()),
    (schema.RAW_EXIF, pa.string()), (schema.RAW_SHA256, pa.string()),
]
IMAGE_FIELD = (schema.RAW_IMAGE, pa.binary())
OUTPUT_FIELDS = INPUT_FIELDS + META_FIELDS + [IMAGE_FIELD]  # names a kept input column may not take


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

    def tar(self, shard_id: int) -> str:
        return f"{shard_id:0{self.shard_digits}d}.tar"

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
    output_format: str = "parquet"  # parquet | webdataset


def is_finished(fs: pa_fs.FileSystem, root: str, naming: ShardNaming, shard_id: int) -> bool:
    return fs.get_file_info(f"{root}/{naming.stats(shard_id)}").type == pa_fs.FileType.File


def read_stats(fs: pa_fs.FileSystem, root: str, naming: ShardNaming, shard_id: int) -> dict:
    with fs.open_input_stream(f"{root}/{naming.stats(shard_id)}") as f:
        return json.loads(f.read())


@dataclasses.dataclass
class Downloaded:
    image: CheckedImage
    sha256: str  # of the bytes the server sent


def _fetch_one(fetcher: Fetcher, rules: ImageRules, url) -> Downloaded | FetchError:
    try:
        body = fetcher.fetch(url)
        return Downloaded(check_image(body, rules), hashlib.sha256(body).hexdigest())
    except FetchError as e:
        return e
    except Exception as e:  # a bug or an exotic failure costs one row, counted, never the shard
        return FetchError("unexpected_error", f"{type(e).__name__}: {e}")


def completion_order(fn: Callable, items: Iterable, threads: int) -> Iterator[tuple[int, object]]:
    """``(index, fn(item))`` for every item, in the order the calls finish, on ``threads`` threads.

    Up to ``2 * threads`` calls are submitted and not yet consumed: each result taken lets one more call
    start, so a slow call holds its own thread and nothing else, and results never pile up faster than
    the consumer takes them."""
    done: queue.SimpleQueue = queue.SimpleQueue()
    todo = iter(enumerate(items))
    pool = concurrent.futures.ThreadPoolExecutor(threads)

    def submit_next() -> int:
        for index, item in todo:
            pool.submit(fn, item).add_done_callback(lambda future, i=index: done.put((i, future)))
            return 1
        return 0

    try:
        pending = sum(submit_next() for _ in range(2 * threads))
        while pending:
            index, future = done.get()
            pending += submit_next() - 1
            yield index, future.result()
    finally:  # also when the consumer fails: do not wait for calls whose results nobody will read
        pool.shutdown(wait=False, cancel_futures=True)


class _ParquetRows:
    """Rows buffered into row groups of one parquet file, written under ``path + ".tmp"``."""

    def __init__(self, fs: pa_fs.FileSystem, path: str, arrow_schema: pa.Schema):
        self.fs, self.path, self.schema = fs, path, arrow_schema
        self.sink = fs.open_output_stream(path + ".tmp")
        self.writer = pq.ParquetWriter(self.sink, arrow_schema)
        self.buffer = {name: [] for name in arrow_schema.names}
        self.rows = 0

    def add(self, row: dict) -> None:
        for name, column in self.buffer.items():
            column.append(row[name])
        self.rows += 1
        if len(self.buffer[schema.RAW_KEY]) >= ROW_GROUP:
            self.flush()

    def flush(self) -> None:
        if self.buffer[schema.RAW_KEY] or not self.rows:  # an empty shard still gets its (empty) table
            self.writer.write_table(pa.table(self.buffer, schema=self.schema))
            for column in self.buffer.values():
                column.clear()

    def close(self) -> None:
        self.flush()
        self.writer.close()
        self.sink.close()

    def abandon(self) -> None:
        for closing in (self.writer.close, self.sink.close):
            try:
                closing()
            except Exception:
                pass


class _TarSamples:
    """A webdataset tar: ``KEY.jpg``, ``KEY.txt``, ``KEY.json`` per sample, under ``path + ".tmp"``."""

    def __init__(self, fs: pa_fs.FileSystem, path: str, mtime: float):
        self.path, self.mtime = path, int(mtime)
        self.sink = fs.open_output_stream(path + ".tmp")
        self.tar = tarfile.open(fileobj=self.sink, mode="w|", format=tarfile.PAX_FORMAT)

    def add(self, key: str, image: bytes, caption: str, meta: dict) -> None:
        for suffix, data in ((".jpg", image), (".txt", caption.encode("utf-8")),
                             (".json", json.dumps(meta, indent=4, default=str).encode("utf-8"))):
            info = tarfile.TarInfo(key + suffix)
            info.size, info.mtime, info.mode = len(data), self.mtime, 0o644
            self.tar.addfile(info, io.BytesIO(data))

    def close(self) -> None:
        self.tar.close()
        self.sink.close()

    def abandon(self) -> None:
        try:
            self.sink.close()
        except Exception:
            pass


class _StatusDict:
    """img2dataset's ``status_dict``: rows by error message (``success`` for the downloaded ones). A
    shard whose failures give more than STATUS_DICT_MAX distinct messages counts the rest by reason."""

    def __init__(self):
        self.counts = collections.Counter()

    def add(self, message: str, reason: str) -> None:
        if message in self.counts or len(self.counts) < STATUS_DICT_MAX:
            self.counts[message] += 1
        else:
            self.counts[reason] += 1


def download_shard(job: ShardJob, spec: ShardSpec, drops: dict[int, str] | None = None) -> dict:
    """Download one shard unless it is finished; returns its stats (``skipped`` says which). ``drops``:
    rows (index within the shard) not to fetch or write, with the reason counted in ``dropped``."""
    fs, root = open_filesystem(job.output)
    if is_finished(fs, root, job.naming, spec.shard_id):
        return {**read_stats(fs, root, job.naming, spec.shard_id), "skipped": True}
    start = time.time()
    rows = read_shard(job.input, spec, job.formats[spec.path], job.columns)
    keep = rows.select(list(job.columns.keep))
    kept_fields = [keep.schema.field(c) for c in keep.column_names]
    webdataset = job.output_format == "webdataset"
    arrow_schema = pa.schema(INPUT_FIELDS + kept_fields + META_FIELDS + ([] if webdataset else [IMAGE_FIELD]))
    urls = rows[job.columns.url].to_pylist()
    captions = rows[job.columns.caption].to_pylist()
    kept = {name: keep[name].to_pylist() for name in keep.column_names}
    drops = drops or {}
    fetched = [i for i in range(len(urls)) if i not in drops]
    reasons = collections.Counter()
    status_dict = _StatusDict()
    parquet_path = f"{root}/{job.naming.parquet(spec.shard_id)}"
    tar_path = f"{root}/{job.naming.tar(spec.shard_id)}"

    fetcher = Fetcher(job.fetch, pool_size=job.threads)
    writers = [_ParquetRows(fs, parquet_path, arrow_schema)]
    if webdataset:
        writers.append(_TarSamples(fs, tar_path, start))
    try:
        for position, result in completion_order(lambda url: _fetch_one(fetcher, job.image, url),
                                                 [urls[i] for i in fetched], job.threads):
            index = fetched[position]
            row = {schema.RAW_URL: urls[index], schema.RAW_CAPTION: captions[index],
                   **{name: values[index] for name, values in kept.items()},
                   schema.RAW_KEY: job.naming.key(spec.shard_id, index)}
            if isinstance(result, Downloaded):
                image = result.image
                reasons[schema.RAW_STATUS_SUCCESS] += 1
                status_dict.add(schema.RAW_STATUS_SUCCESS, schema.RAW_STATUS_SUCCESS)
                row.update({schema.RAW_STATUS: schema.RAW_STATUS_SUCCESS, schema.RAW_ERROR: None,
                            schema.WIDTH: image.width, schema.HEIGHT: image.height,
                            schema.RAW_ORIGINAL_WIDTH: image.original_width,
                            schema.RAW_ORIGINAL_HEIGHT: image.original_height,
                            schema.RAW_EXIF: image.exif, schema.RAW_SHA256: result.sha256})
            else:
                reasons[result.reason] += 1
                status_dict.add(str(result), result.reason)
                row.update({schema.RAW_STATUS: schema.RAW_STATUS_FAILED_TO_RESIZE if result.reason in IMAGE_REASONS
                            else schema.RAW_STATUS_FAILED_TO_DOWNLOAD, schema.RAW_ERROR: str(result),
                            schema.WIDTH: None, schema.HEIGHT: None, schema.RAW_ORIGINAL_WIDTH: None,
                            schema.RAW_ORIGINAL_HEIGHT: None, schema.RAW_EXIF: None, schema.RAW_SHA256: None})
            if webdataset:
                if isinstance(result, Downloaded):
                    caption = captions[index]
                    writers[1].add(row[schema.RAW_KEY], result.image.data, "" if caption is None else str(caption), row)
            else:
                row[schema.RAW_IMAGE] = result.image.data if isinstance(result, Downloaded) else None
            writers[0].add(row)
        for writer in writers:
            writer.close()
    except BaseException:
        for writer in writers:
            writer.abandon()
        raise
    finally:
        fetcher.http.clear()
    for path in (tar_path, parquet_path)[0 if webdataset else 1:]:
        fs.move(path + ".tmp", path)

    end = time.time()
    failures = {reason: n for reason, n in sorted(reasons.items()) if reason != schema.RAW_STATUS_SUCCESS}
    stats = {
        "shard_id": spec.shard_id, "count": len(fetched), "successes": reasons[schema.RAW_STATUS_SUCCESS],
        "failed_to_download": sum(n for r, n in failures.items() if r not in IMAGE_REASONS),
        "failed_to_resize": sum(n for r, n in failures.items() if r in IMAGE_REASONS),
        "duration": end - start, "start_time": start, "end_time": end,
        "status_dict": dict(status_dict.counts.most_common()), "failures": failures,
        "dropped": dict(sorted(collections.Counter(drops.values()).items())),
        "output_format": job.output_format, "input": spec.path, "input_rows": [spec.start, spec.stop],
    }
    stats_path = f"{root}/{job.naming.stats(spec.shard_id)}"
    with fs.open_output_stream(stats_path + ".tmp") as f:
        f.write(json.dumps(stats, indent=2).encode())
    fs.move(stats_path + ".tmp", stats_path)
    return {**stats, "skipped": False}
