"""Download url+caption lists into img2dataset-compatible image shards, with Ray Data.

``download(DownloadConfig(input=..., output=...))`` plans shards from the input (see
:mod:`diffusion.download.plan`), skips the shards a previous run finished, and runs the rest as
one Ray Data ``map_batches`` with one shard per batch (:mod:`diffusion.download.shard`). Output,
beside each other in ``output``, named and laid out as img2dataset's:

- ``NNNNN.parquet`` (``--output-format parquet``, the default): ``url, caption``, the kept input
  columns, ``key, status, error_message, width, height, original_width, original_height, exif, sha256,
  jpg``, one row per input row, in the order downloads finished. ``status`` is ``success``,
  ``failed_to_download`` or ``failed_to_resize`` (bytes came back but are no usable image); a failed row
  has a null image and ``error_message`` ``"http_404: Not Found"``, ``"timeout: ReadTimeoutError"``, ...:
  the code before the colon is what the stats count by reason.
- ``--output-format webdataset``: ``NNNNN.tar`` with ``KEY.jpg``, ``KEY.txt`` (caption) and
  ``KEY.json`` (the row's metadata) per downloaded image, and ``NNNNN.parquet`` with every row's
  metadata (the columns above less ``jpg``).
- ``NNNNN_stats.json``: img2dataset's fields (count, successes, failed_to_download, failed_to_resize,
  duration, start_time, end_time, status_dict: rows by error message) plus ``failures`` by reason and
  ``dropped``: rows not fetched by reason (``filtered: <rule>`` for ``--where``, ``duplicate_url`` for
  ``--dedupe-urls``; see :mod:`diffusion.download.select`). Dropped rows are not written (img2dataset's
  statuses have no name for them) and not in ``count``; the others keep their key (input position).
- ``download_plan.json`` (what a re-run must match) and ``summary.json`` (the totals).

The converter reads either format directly and keeps ``status == "success"``.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import hashlib
import json
import os
import time

import pyarrow.fs as pa_fs

from diffusion.download.http import FetchConfig
from diffusion.errors import ConfigError, OutputMismatchError
from diffusion.download.image import MAX_SCANS, RESIZE_MODES, ImageRules
from diffusion.download.plan import InputColumns, ShardSpec, open_filesystem, plan_shards
from diffusion.where import parse_where
from diffusion.download.select import plan_drops
from diffusion.download.shard import (OUTPUT_FIELDS, OUTPUT_FORMATS, ShardJob, ShardNaming, download_shard,
                                      read_stats)

PLAN_JSON = "download_plan.json"
SUMMARY_JSON = "summary.json"


@dataclasses.dataclass(frozen=True)
class DownloadConfig:
    input: str  # a file or directory of parquet/csv/jsonl, local or s3://
    output: str  # directory (local or s3://) for the shards
    columns: InputColumns = InputColumns()
    input_format: str | None = None  # default: from each file's extension
    rows_per_shard: int = 10_000
    threads: int = 64  # concurrent requests per shard
    concurrency: int | None = None  # shards in flight; default: as many as the CPUs allow at num_cpus
    num_cpus: float = 0.25  # per shard task: downloading waits on the network, not the CPU
    fetch: FetchConfig = FetchConfig()
    image: ImageRules = ImageRules()
    output_format: str = "parquet"  # parquet | webdataset (tar + metadata parquet), as img2dataset writes them
    where: str | None = None  # --where: rows failing it are not fetched (diffusion.where' grammar)
    dedupe_urls: bool = False  # a URL seen earlier in input order is not fetched again
    exclude: tuple[str, ...] = ()  # --exclude: blocklists (diffusion.convert.exclude): listed URLs/keys not fetched


@dataclasses.dataclass
class DownloadSummary:
    shards: int
    skipped_shards: int  # finished by an earlier run
    count: int  # rows written in all shards (rows --where or --dedupe-urls dropped are in dropped, not here)
    successes: int
    failures: dict  # reason -> rows, over all shards
    downloaded: int  # rows fetched by this run
    duration: float  # seconds, this run
    output: str
    dropped: dict = dataclasses.field(default_factory=dict)  # reason -> rows not fetched (--where, --dedupe-urls)

    @property
    def images_per_s(self) -> float:
        return self.downloaded / self.duration if self.duration > 0 else 0.0

    def __str__(self) -> str:
        failures = ", ".join(f"{r} {n}" for r, n in sorted(self.failures.items(), key=lambda kv: -kv[1]))
        dropped = "".join(f"; not fetched: {r} {n}" for r, n in self.dropped.items())
        return (f"{self.successes}/{self.count} images downloaded into {self.shards} shards at {self.output} "
                f"({self.skipped_shards} shards already done); failures: {failures or 'none'}{dropped}; "
                f"this run: {self.downloaded} rows in {self.duration:.1f} s = {self.images_per_s:.1f} rows/s")


def _check_config(config: DownloadConfig) -> None:
    reserved = {name for name, _ in OUTPUT_FIELDS}
    clash = reserved.intersection(config.columns.keep)
    if clash:
        raise ConfigError(f"--keep-columns {sorted(clash)} would overwrite output columns {sorted(reserved)}")
    if config.output_format not in OUTPUT_FORMATS:
        raise ConfigError(f"output_format must be one of {OUTPUT_FORMATS}, got {config.output_format!r}")
    if config.threads < 1 or config.num_cpus <= 0:
        raise ConfigError(f"threads must be >= 1 and num_cpus > 0, got {config.threads}, {config.num_cpus}")
    if config.where is not None:
        parse_where(config.where)  # a malformed filter: one line showing it, before anything is read
    if (os.path.isdir(config.input) and os.path.realpath(config.input) == os.path.realpath(config.output)):
        # the shards landed among the url lists, and the re-run that resumes read them as url lists
        raise ConfigError(f"--output {config.output} is the --input folder: write the image shards to a folder of "
                          f"their own")


def _plan_fingerprint(config: DownloadConfig, shards: list[ShardSpec]) -> dict:
    """What a re-run into the same output must match for shard N to mean the same rows."""
    _, input_root = open_filesystem(config.input)
    ranges = [(os.path.relpath(s.path, input_root), s.start, s.stop) for s in shards]
    return {"rows_per_shard": config.rows_per_shard, "columns": config.columns.names(),
            "shards": len(shards), "shard_ranges_sha256": hashlib.sha256(json.dumps(ranges).encode()).hexdigest(),
            "image": dataclasses.asdict(config.image), "output_format": config.output_format,
            "where": parse_where(config.where).text if config.where else None, "dedupe_urls": config.dedupe_urls,
            "exclude": _blocklists_sha256(config.exclude)}


def _blocklists_sha256(paths) -> str | None:
    """Of the --exclude files' contents (None without any): other lists drop other rows."""
    if not paths:
        return None
    h = hashlib.sha256()
    for path in paths:
        with open(os.path.expanduser(path), "rb") as f:
            h.update(hashlib.sha256(f.read()).digest())
    return h.hexdigest()


# What a plan written before the key existed meant.
_FINGERPRINT_DEFAULTS = {"output_format": "parquet", "where": None, "dedupe_urls": False, "exclude": None}
_IMAGE_DEFAULTS = {"max_scans": MAX_SCANS}  # image rules added since: a plan without one ran with its default


def _claim_output(fs: pa_fs.FileSystem, root: str, fingerprint: dict, output: str) -> None:
    path = f"{root}/{PLAN_JSON}"
    if fs.get_file_info(path).type == pa_fs.FileType.File:
        with fs.open_input_stream(path) as f:
            previous = json.loads(f.read())
        if isinstance(previous.get("image"), dict):
            previous["image"] = {**_IMAGE_DEFAULTS, **previous["image"]}
        changed = sorted(k for k in fingerprint if previous.get(k, _FINGERPRINT_DEFAULTS.get(k)) != fingerprint[k])
        changed = [_FLAGS.get(k, k) for k in changed]
        if changed:
            raise OutputMismatchError(f"{output} holds a download with a different plan ({', '.join(changed)} changed); "
                             f"resume with the same input and options, or choose a new --output")
        return
    with fs.open_output_stream(path) as f:
        f.write(json.dumps(fingerprint, indent=2).encode())


_FLAGS = {"where": "--where", "dedupe_urls": "--dedupe-urls", "exclude": "--exclude"}  # fingerprint keys shown as their flag


def _download_batch(batch: dict, job: ShardJob) -> dict:
    """Ray Data UDF: one shard spec in, one row of its stats out."""
    results = collections.defaultdict(list)
    for i in range(len(batch["shard_id"])):
        spec = ShardSpec(int(batch["shard_id"][i]), str(batch["path"][i]), int(batch["start"][i]),
                         int(batch["stop"][i]))
        drops = {int(k): v for k, v in json.loads(str(batch["drops"][i])).items()}
        stats = download_shard(job, spec, drops)
        for name in ("shard_id", "count", "successes", "skipped"):
            results[name].append(stats[name])
    return dict(results)


def download(config: DownloadConfig, start_ray=None) -> DownloadSummary:
    """Run (or resume) the download; returns the totals, also written to ``summary.json``. ``start_ray``
    (the CLI's cluster start) is called only once the plan and the filters are checked and there is work."""
    _check_config(config)
    shards, formats = plan_shards(config.input, config.columns, config.rows_per_shard, config.input_format,
                                  config.output)
    in_fs, _ = open_filesystem(config.input)
    blocklist = None
    if config.exclude:
        from diffusion.convert.exclude import load_blocklists
        blocklist = load_blocklists(config.exclude)
    drops = plan_drops(in_fs, formats, shards, config.columns, config.where, config.dedupe_urls, blocklist)
    fs, root = open_filesystem(config.output)
    try:
        fs.create_dir(root, recursive=True)
    except (FileExistsError, NotADirectoryError):  # pyarrow's own words name no flag ("[Errno 17] ... Detail: ...")
        raise ConfigError(f"--output {config.output}: not a folder (it, or a folder above it, is a file); give the "
                          f"folder to write the image shards in") from None
    _claim_output(fs, root, _plan_fingerprint(config, shards), config.output)
    naming = ShardNaming.for_plan(len(shards), config.rows_per_shard)
    job = ShardJob(config.input, config.output, formats, config.columns, naming, config.fetch, config.image,
                   config.threads, config.output_format)
    todo = [s for s in shards if fs.get_file_info(f"{root}/{naming.stats(s.shard_id)}").type
            != pa_fs.FileType.File]

    start = time.time()
    if todo:
        if start_ray is not None:
            start_ray()
        import ray
        items = [{**dataclasses.asdict(s), "drops": json.dumps(drops.get(s.shard_id, {}))} for s in todo]
        ds = ray.data.from_items(items, override_num_blocks=len(items))  # one shard per task
        ds = ds.map_batches(_download_batch, batch_size=1, batch_format="numpy", fn_kwargs={"job": job},
                            num_cpus=config.num_cpus, concurrency=config.concurrency)
        ds.take_all()
    duration = time.time() - start

    stats = [read_stats(fs, root, naming, s.shard_id) for s in shards]
    failures, dropped = collections.Counter(), collections.Counter()
    for s in stats:
        failures.update(s["failures"])
        dropped.update(s.get("dropped", {}))
    summary = DownloadSummary(
        shards=len(shards), skipped_shards=len(shards) - len(todo), count=sum(s["count"] for s in stats),
        successes=sum(s["successes"] for s in stats), failures=dict(sorted(failures.items())),
        downloaded=sum(s.stop - s.start - len(drops.get(s.shard_id, {})) for s in todo), duration=duration, output=config.output,
        dropped=dict(sorted(dropped.items())))
    with fs.open_output_stream(f"{root}/{SUMMARY_JSON}") as f:
        f.write(json.dumps({**dataclasses.asdict(summary), "images_per_s": summary.images_per_s},
                           indent=2).encode())
    return summary


DOWNLOAD_EXAMPLES = """examples:
  python convert/download_laion.py --input laion/part-00000.parquet --output out/raw
  python convert/download_laion.py --input s3://bucket/urls/ --output out/raw --resize-mode center_crop \\
      --image-size 512 --address auto
  python convert/download_laion.py --input urls.parquet --output out/wds --output-format webdataset
  python convert/download_laion.py --input laion/part-00000.parquet --output out/raw \\
      --where "aesthetic >= 5 and punsafe < 0.1 and LANGUAGE == 'en'" --dedupe-urls

Re-running the same command resumes: finished shards are skipped, a shard a kill interrupted is
downloaded again from its first row."""


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        prog="python convert/download_laion.py", epilog=DOWNLOAD_EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Download a LAION-style url+caption list into image shards with Ray Data, in img2dataset's "
                    "layout and schema (NNNNN.parquet, or NNNNN.tar + NNNNN.parquet, and NNNNN_stats.json); "
                    "the converter reads them directly.")
    p.add_argument("--input", required=True, help="parquet/csv/jsonl file or directory, local or s3://")
    p.add_argument("--output", required=True, help="output directory for the shards and their stats")
    p.add_argument("--output-format", choices=OUTPUT_FORMATS, default="parquet",
                   help="parquet: images in NNNNN.parquet (default); webdataset: NNNNN.tar of KEY.jpg, KEY.txt, "
                        "KEY.json per image, plus NNNNN.parquet of every row's metadata (what most LAION "
                        "tooling reads)")
    p.add_argument("--input-format", choices=("parquet", "csv", "jsonl"), help="default: from the extension")
    p.add_argument("--url-col", default="URL", help="input column holding the image URL (default: URL)")
    p.add_argument("--caption-col", default="TEXT", help="input column holding the caption (default: TEXT)")
    p.add_argument("--keep-columns", default="", help="comma-separated input columns to carry over")
    p.add_argument("--rows-per-shard", type=int, default=10_000, help="rows per output shard (default: 10000)")
    p.add_argument("--threads", type=int, default=64, help="concurrent requests per shard")
    p.add_argument("--concurrency", type=int, help="shards in flight (default: from the cluster's CPUs)")
    p.add_argument("--num-cpus", type=float, default=0.25, help="CPUs reserved per shard task")
    p.add_argument("--timeout", type=float, default=10.0, help="seconds per request attempt")
    p.add_argument("--retries", type=int, default=2, help="retries on timeouts and 5xx")
    p.add_argument("--max-bytes", type=int, default=20 * 2**20, help="largest body fetched (default: 20 MiB)")
    p.add_argument("--max-redirects", type=int, default=5, help="redirects followed per URL (default: 5)")
    p.add_argument("--min-size", type=int, default=64, help="minimum shorter side, pixels")
    p.add_argument("--max-pixels", type=int, default=2**25, help="decompression-bomb guard (default: 2**25)")
    p.add_argument("--max-scans", type=int, default=MAX_SCANS,
                   help=f"decode-time-bomb guard: refuse JPEGs of more scans, before decoding (default: {MAX_SCANS})")
    p.add_argument("--resize-mode", choices=RESIZE_MODES, default="no", help="resize on download (default: no)")
    p.add_argument("--image-size", type=int, default=512, help="target size with --resize-mode (default: 512)")
    p.add_argument("--where", help="download only the rows whose url-list metadata passes this filter, "
                        "e.g. \"aesthetic >= 5 and punsafe < 0.1\" (the converter's --where grammar: comparisons, "
                        "and, or, not, parentheses, in [...], is null); decided before any URL is fetched, rows "
                        "dropped are counted per rule as 'filtered: <rule>' in the stats")
    p.add_argument("--dedupe-urls", action="store_true",
                   help="fetch each URL once: a row whose URL an earlier row (in input order, over all files) "
                        "already has is not fetched and is counted as duplicate_url in the stats")
    p.add_argument("--exclude", nargs="+", default=(), metavar="FILE",
                   help="blocklists (one entry a line: a URL's SHA-256 as Re-LAION publishes them, url_sha256:HEX, "
                        "url:URL, key:KEY for an input with a key column): listed rows are not fetched, counted as "
                        "'excluded: url' / 'excluded: key' in the stats")
    p.add_argument("--address", help="Ray cluster address (default: RAY_ADDRESS or a local instance)")
    return p.parse_args(argv)


def main(argv=None) -> DownloadSummary:
    args = parse_args(argv)
    keep = tuple(c.strip() for c in args.keep_columns.split(",") if c.strip())
    config = DownloadConfig(
        input=args.input, output=args.output, input_format=args.input_format,
        columns=InputColumns(args.url_col, args.caption_col, keep), rows_per_shard=args.rows_per_shard,
        threads=args.threads, concurrency=args.concurrency, num_cpus=args.num_cpus, output_format=args.output_format,
        where=args.where, dedupe_urls=args.dedupe_urls, exclude=tuple(args.exclude),
        fetch=FetchConfig(timeout=args.timeout, retries=args.retries, max_bytes=args.max_bytes,
                          max_redirects=args.max_redirects),
        image=ImageRules(min_size=args.min_size, max_pixels=args.max_pixels, max_scans=args.max_scans,
                         resize_mode=args.resize_mode,
                         image_size=args.image_size))
    from diffusion.cluster import init_ray
    # quietly; RAY_ADDRESS or a new local cluster without --address; after the checks at start
    summary = download(config, start_ray=lambda: init_ray(args.address))
    print(summary)
    return summary

