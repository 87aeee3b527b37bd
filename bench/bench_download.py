"""Downloads per second against a local HTTP server (loopback only) at several concurrency levels.

    python bench/bench_download.py [--requests 2000] [--seconds 10] [--levels 1,4,16,64] [--ray]

The server runs in its own process and serves one JPEG (a 512x384 sample scene) with keep-alive. Each
level runs the downloader's own fetch + validate path (one Fetcher, a thread pool of that size) for at
most ``--requests`` requests or ``--seconds`` seconds. ``--ray`` adds one end-to-end run of the Ray Data
job (parquet shards and stats included). Reference: img2dataset publishes ~1,300 images/s per 16-core
node on real LAION URLs, i.e. ~80 images/s per core; loopback has no network latency, so these numbers
bound the client-side cost (HTTP parsing, decoding, writing) rather than predict internet throughput.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import glob
import http.server
import io
import json
import multiprocessing
import os
import tempfile
import time

import numpy as np

from diffusion.download.http import FetchConfig, Fetcher
from diffusion.download.image import ImageRules, check_image

IMG2DATASET_PER_NODE = 1300  # images/s, 16-core node, published
IMG2DATASET_CORES = 16


def _scene_jpeg() -> bytes:
    from diffusion.kit.sample import render_scene
    image, _ = render_scene(np.random.default_rng(0), 512, 384)
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _serve(port_queue, body: bytes) -> None:
    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, so the client's connection pool matters
        disable_nagle_algorithm = True  # else headers and body in two writes cost a 40 ms delayed ACK

        def log_message(self, *args):
            pass

        def do_GET(self):
            self.send_response(200)
            self.send_header("Content-Type", "image/jpeg")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    port_queue.put(server.server_port)
    server.serve_forever()


def bench_level(url: str, threads: int, max_requests: int, max_seconds: float) -> tuple[int, float]:
    fetcher = Fetcher(FetchConfig(timeout=10, retries=0), pool_size=threads)
    rules = ImageRules(min_size=16)
    deadline = time.perf_counter() + max_seconds
    done = 0

    def worker(n: int) -> int:
        ok = 0
        for _ in range(n):
            if time.perf_counter() > deadline:
                break
            check_image(fetcher.fetch(url), rules)
            ok += 1
        return ok

    start = time.perf_counter()
    with concurrent.futures.ThreadPoolExecutor(threads) as pool:
        share = [max_requests // threads + (i < max_requests % threads) for i in range(threads)]
        done = sum(pool.map(worker, share))
    return done, time.perf_counter() - start


def bench_ray(url: str, rows: int) -> tuple[int, float]:
    import pyarrow as pa
    import pyarrow.parquet as pq
    import ray

    from diffusion.download.job import DownloadConfig, download
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, log_to_driver=False)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            src = os.path.join(tmp, "urls.parquet")
            pq.write_table(pa.table({"URL": [f"{url}?{i}" for i in range(rows)], "TEXT": ["x"] * rows}), src)
            out = os.path.join(tmp, "out")
            summary = download(DownloadConfig(input=src, output=out, rows_per_shard=500, threads=16,
                                              image=ImageRules(min_size=16)))
            stats = [json.load(open(f)) for f in glob.glob(os.path.join(out, "*_stats.json"))]
            # Time from the first shard's start to the last one's end: the job without Ray's start-up.
            shards_s = max(s["end_time"] for s in stats) - min(s["start_time"] for s in stats)
            return summary.successes, summary.duration, shards_s
    finally:
        ray.shutdown()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="at most this many requests per level")
    p.add_argument("--seconds", type=float, default=10.0, help="at most this long per level")
    p.add_argument("--levels", default="1,4,16,64")
    p.add_argument("--ray", action="store_true", help="also time the Ray Data job end to end")
    args = p.parse_args()

    body = _scene_jpeg()
    ports = multiprocessing.Queue()
    server = multiprocessing.Process(target=_serve, args=(ports, body), daemon=True)
    server.start()
    url = f"http://127.0.0.1:{ports.get(timeout=30)}/image.jpg"
    try:
        print(f"{os.cpu_count()} CPUs; image {len(body) / 1024:.0f} KiB; server on loopback (1 process)")
        print("| threads | images | seconds | images/s | images/s/core | img2dataset images/s/core |")
        print("|---:|---:|---:|---:|---:|---:|")
        per_core_ref = IMG2DATASET_PER_NODE / IMG2DATASET_CORES
        for threads in (int(t) for t in args.levels.split(",")):
            n, seconds = bench_level(url, threads, args.requests, args.seconds)
            rate = n / seconds
            print(f"| {threads} | {n} | {seconds:.2f} | {rate:.0f} | {rate / os.cpu_count():.0f} | {per_core_ref:.0f} |")
        if args.ray:
            n, seconds, shards_s = bench_ray(url, args.requests)
            for label, t in (("Ray job, end to end", seconds), ("Ray job, shard tasks only", shards_s)):
                print(f"| {label} (16 threads/shard) | {n} | {t:.2f} | {n / t:.0f} | "
                      f"{n / t / os.cpu_count():.0f} | {per_core_ref:.0f} |")
    finally:
        server.terminate()
        server.join()


if __name__ == "__main__":
    main()
