"""Download throughput against a local HTTP server (loopback only): ours against img2dataset, same run.

    python bench/bench_download.py [--rows 6000] [--rows-per-shard 1000] [--timeout 2] [--threads 64]
                                   [--num-cpus 0.25,1] [--repeats 1] [--levels 1,16] [--seconds 5]
                                   [--no-img2dataset]

The server runs in its own process and serves a 512x384 sample-scene JPEG (36 KiB), with keep-alive.

1. Fetch path (``--levels``): the downloader's own fetch + validate path (one Fetcher, a thread pool
   of that size) for at most ``--seconds`` seconds per level: the client's cost per image, no network.
2. A realistic list (``--rows`` rows, shuffled with a fixed seed): 81% images served at once, 10%
   served after 0.1-1 s (slow servers), 8% 404s, 1% that stall (the server answers only after 30 s, so
   the client gives up at ``--timeout``). The same list without the stalls (those rows served at once)
   is the no-stall reference. Each list is downloaded by our Ray job (``download()``, a local Ray with
   this machine's CPUs, default concurrency, shard tasks of ``--num-cpus`` CPUs: 0.25, the job's
   default, and/or 1, one per CPU as img2dataset's processes) and by img2dataset
   (``processes_count`` = CPUs, the same threads per shard, rows per shard, timeout, no retries;
   ``resize_mode="no"`` with ``skip_reencode``: decode to validate, keep the bytes, as we do; its
   default exif and sha256 on, as ours are always), into fresh directories. Rates are successes over
   the time from the first shard's start to the last shard's end, from the ``*_stats.json`` both write
   (start-up excluded; end to end printed beside it); per core divides by this machine's CPUs, which
   the server shares. Client CPU seconds are each downloader's processes' user + system time, start-up
   included (for ours: the driver, Ray's own processes and its workers; for img2dataset: rusage of
   its process tree); on a machine other jobs share, they are the steadier measure of cost.
   ``--repeats`` runs everything again; ratios use each configuration's fastest run. Short lists are
   dominated by start-up (the default job starts 8 Ray workers, ~2 CPU-s each, while the first shards
   run): the default 6,000 rows fits ``make bench``'s time; BENCHMARKS.md records
   ``--rows 12000 --repeats 2 --num-cpus 0.25,1``.

img2dataset runs from its own virtualenv, ``.cache/img2dataset-venv`` (created here with ``pip install
img2dataset`` when missing: its pins clash with ours). If it cannot be installed the run says why and
still compares ours stalled against no-stall.
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
import pathlib
import subprocess
import sys
import tempfile
import time

import numpy as np

from diffusion.download.http import FetchConfig, Fetcher
from diffusion.download.image import ImageRules, check_image

ROOT = pathlib.Path(__file__).resolve().parents[1]
IMG2DATASET_VENV = ROOT / ".cache" / "img2dataset-venv"
IMG2DATASET_PER_NODE = 1300  # images/s, 16-core node, published
IMG2DATASET_CORES = 16
STALL_SERVER_S = 30.0  # a stalled URL answers after this long: every client has given up by then
MIX = (("ok", 0.81), ("slow", 0.10), ("missing", 0.08), ("stall", 0.01))


def _scene_jpeg() -> bytes:
    from diffusion.kit.sample import render_scene
    image, _ = render_scene(np.random.default_rng(0), 512, 384)
    buf = io.BytesIO()
    image.save(buf, "JPEG", quality=90)
    return buf.getvalue()


def _serve(port_queue, body: bytes) -> None:
    """/ok/I.jpg: the image; /slow/MS/I.jpg: the image after MS milliseconds; /missing/I: 404;
    /stall/I.jpg: the image after STALL_SERVER_S; anything else: the image."""

    class Handler(http.server.BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"  # keep-alive, so the client's connection pool matters
        disable_nagle_algorithm = True  # else headers and body in two writes cost a 40 ms delayed ACK

        def log_message(self, *args):
            pass

        def do_GET(self):
            parts = self.path.split("/")
            if len(parts) > 2 and parts[1] == "missing":
                return self._send(404, b"not here", "text/plain")
            if len(parts) > 3 and parts[1] == "slow":
                time.sleep(int(parts[2]) / 1000)
            elif len(parts) > 2 and parts[1] == "stall":
                time.sleep(STALL_SERVER_S)
            self._send(200, body, "image/jpeg")

        def _send(self, status: int, data: bytes, content_type: str) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
            except (BrokenPipeError, ConnectionResetError):  # the client gave up on a stall, as it should
                self.close_connection = True

    class Server(http.server.ThreadingHTTPServer):
        daemon_threads = True
        request_queue_size = 1024  # hundreds of clients connect at once; the default backlog of 5 drops them

        def handle_error(self, request, client_address):
            if not isinstance(sys.exc_info()[1], (ConnectionResetError, BrokenPipeError)):  # a client hung up
                super().handle_error(request, client_address)

    server = Server(("127.0.0.1", 0), Handler)
    port_queue.put(server.server_port)
    server.serve_forever()


# ---- 1. the fetch path at several thread counts --------------------------------------------------

def bench_level(url: str, threads: int, max_requests: int, max_seconds: float) -> tuple[int, float]:
    fetcher = Fetcher(FetchConfig(timeout=10, retries=0), pool_size=threads)
    rules = ImageRules(min_size=16)
    deadline = time.perf_counter() + max_seconds

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


# ---- 2. a realistic list, ours and img2dataset -----------------------------------------------------

def mix_urls(base: str, rows: int, stalls: bool) -> tuple[list[str], dict]:
    """The list's URLs and how many rows of each kind; without ``stalls`` the stalled rows are served at once."""
    rng = np.random.default_rng(0)
    kinds = rng.choice([k for k, _ in MIX], size=rows, p=[p for _, p in MIX])
    delays = rng.integers(100, 1001, size=rows)
    urls, counts = [], {k: 0 for k, _ in MIX}
    for i, (kind, ms) in enumerate(zip(kinds, delays)):
        kind = "ok" if kind == "stall" and not stalls else str(kind)
        counts[kind] += 1
        urls.append({"ok": f"{base}/ok/{i}.jpg", "slow": f"{base}/slow/{ms}/{i}.jpg", "missing": f"{base}/missing/{i}",
                     "stall": f"{base}/stall/{i}.jpg"}[kind])
    return urls, counts


def _write_list(path: str, urls: list[str]) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq
    pq.write_table(pa.table({"URL": urls, "TEXT": [f"caption {i}" for i in range(len(urls))]}), path)


def _shard_window(out: str) -> tuple[float, int, int]:
    """(seconds from the first shard's start to the last one's end, successes, rows) from *_stats.json."""
    stats = [json.load(open(f)) for f in glob.glob(os.path.join(out, "*_stats.json"))]
    if not stats:
        return float("nan"), 0, 0
    window = max(s["end_time"] for s in stats) - min(s["start_time"] for s in stats)
    return window, sum(s["successes"] for s in stats), sum(s["count"] for s in stats)


class TreeCpu:
    """CPU seconds (user + system) used by this process and its descendants (the driver, Ray's
    processes, its workers), the server's process tree left out. A thread samples every process every
    0.2 s, so one that starts and ends during the run counts with the time it used until its last sample."""

    def __init__(self, exclude_pid: int):
        import psutil
        import threading
        self.psutil, self.exclude = psutil, exclude_pid
        self.first, self.last = self._sample(), {}
        self.last.update(self.first)
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _sample(self) -> dict:
        me = self.psutil.Process()
        skip = {self.exclude} | {c.pid for c in self.psutil.Process(self.exclude).children(recursive=True)}
        seen = {}
        for proc in [me] + me.children(recursive=True):
            if proc.pid in skip:
                continue
            try:
                times = proc.cpu_times()
                seen[(proc.pid, proc.create_time())] = times.user + times.system
            except self.psutil.Error:  # ended meanwhile
                pass
        return seen

    def _run(self) -> None:
        while not self.stop.wait(0.2):
            self.last.update(self._sample())

    def seconds(self) -> float:
        self.stop.set()
        self.thread.join()
        self.last.update(self._sample())
        return sum(t - self.first.get(p, 0.0) for p, t in self.last.items())


def _server_cpu_s(pid: int) -> float:
    import psutil
    times = psutil.Process(pid).cpu_times()
    return times.user + times.system


def run_ours(src: str, out: str, args, num_cpus: float) -> dict:
    from diffusion.download.job import DownloadConfig, download
    cpu, server_cpu = TreeCpu(args.server_pid), _server_cpu_s(args.server_pid)
    start = time.perf_counter()
    summary = download(DownloadConfig(input=src, output=out, rows_per_shard=args.rows_per_shard,
                                      threads=args.threads, num_cpus=num_cpus,
                                      fetch=FetchConfig(timeout=args.timeout, retries=0)))
    wall = time.perf_counter() - start
    cpu = cpu.seconds()
    window, successes, rows = _shard_window(out)
    return {"window": window, "wall": wall, "successes": successes, "rows": rows, "failures": summary.failures,
            "cpu": cpu, "server_cpu": _server_cpu_s(args.server_pid) - server_cpu}


IMG2DATASET_RUN = """
import json, sys
from img2dataset import download
kw = json.loads(sys.argv[1])
download(input_format="parquet", url_col="URL", caption_col="TEXT", output_format="parquet", resize_mode="no",
         skip_reencode=True, retries=0, distributor="multiprocessing", enable_wandb=False, **kw)
"""


def ensure_img2dataset(venv: pathlib.Path) -> tuple[str | None, str]:
    """(python of a virtualenv with img2dataset, its version) or (None, why not)."""
    python = venv / "bin" / "python"
    check = [str(python), "-c", "import importlib.metadata as m; print(m.version('img2dataset'))"]
    if python.exists():
        done = subprocess.run(check, capture_output=True, text=True)
        if done.returncode == 0:
            return str(python), done.stdout.strip()
    print(f"installing img2dataset into {venv} (its own virtualenv: its pins clash with ours) ...", flush=True)
    steps = [[sys.executable, "-m", "venv", str(venv)],
             [str(python), "-m", "pip", "install", "--quiet", "--disable-pip-version-check", "img2dataset"]]
    for step in steps:
        try:
            done = subprocess.run(step, capture_output=True, text=True, timeout=900)
        except (OSError, subprocess.TimeoutExpired) as e:
            return None, f"{' '.join(step[-3:])} failed: {e}"
        if done.returncode:
            lines = [l for l in (done.stderr or done.stdout).splitlines() if l.strip() and "WARNING" not in l]
            return None, f"{' '.join(step[-3:])} failed: {lines[-1] if lines else f'exit {done.returncode}'}"
    done = subprocess.run(check, capture_output=True, text=True)
    return (str(python), done.stdout.strip()) if done.returncode == 0 else (None, done.stderr.strip()[-300:])


def run_img2dataset(python: str, src: str, out: str, args) -> dict:
    kw = {"url_list": src, "output_folder": out, "processes_count": os.cpu_count(), "thread_count": args.threads,
          "number_sample_per_shard": args.rows_per_shard, "timeout": args.timeout}
    import resource
    env = dict(os.environ, NO_ALBUMENTATIONS_UPDATE="1", PYTHONWARNINGS="ignore")
    before, server_cpu = resource.getrusage(resource.RUSAGE_CHILDREN), _server_cpu_s(args.server_pid)
    start = time.perf_counter()
    done = subprocess.run([python, "-c", IMG2DATASET_RUN, json.dumps(kw)], capture_output=True, text=True, env=env)
    wall = time.perf_counter() - start
    after = resource.getrusage(resource.RUSAGE_CHILDREN)  # the run and every process it waited for
    if done.returncode:
        raise RuntimeError(f"img2dataset exited {done.returncode}: {done.stderr.strip()[-500:]}")
    window, successes, rows = _shard_window(out)
    return {"window": window, "wall": wall, "successes": successes, "rows": rows,
            "cpu": after.ru_utime + after.ru_stime - before.ru_utime - before.ru_stime,
            "server_cpu": _server_cpu_s(args.server_pid) - server_cpu}


def bench_mix(base: str, args) -> None:
    import ray

    from diffusion.cluster import init_ray
    cpus = os.cpu_count()
    ours_configs = [float(n) for n in args.num_cpus.split(",")]
    load_before = os.getloadavg()[0]
    python, about = (None, "--no-img2dataset given") if args.no_img2dataset else ensure_img2dataset(IMG2DATASET_VENV)
    runs = []  # (tool, list, repeat, result)
    with tempfile.TemporaryDirectory() as tmp:
        lists = {}
        for label, stalls in (("no stalls", False), ("stalls", True)):
            urls, counts = mix_urls(base, args.rows, stalls)
            lists[label] = (os.path.join(tmp, f"{label.replace(' ', '-')}.parquet"), counts)
            _write_list(lists[label][0], urls)
        for repeat in range(args.repeats):
            init_ray()  # a local Ray with this machine's CPUs, quiet, as the download command starts it
            try:
                for num_cpus in ours_configs:
                    for label, (src, _) in lists.items():
                        out = os.path.join(tmp, f"ours-{num_cpus}-{label}-{repeat}")
                        runs.append((f"ours --num-cpus {num_cpus:g}", label, repeat, run_ours(src, out, args, num_cpus)))
            finally:
                ray.shutdown()  # its idle workers would take the CPUs from img2dataset
            if python:
                for label, (src, _) in lists.items():
                    out = os.path.join(tmp, f"i2d-{label}-{repeat}")
                    runs.append(("img2dataset", label, repeat, run_img2dataset(python, src, out, args)))

    counts = lists["stalls"][1]
    print(f"\nRealistic list: {args.rows} rows ({counts['ok']} at once, {counts['slow']} after 0.1-1 s, "
          f"{counts['missing']} 404s, {counts['stall']} stalling past the {args.timeout:g} s timeout); "
          f"{args.rows_per_shard} rows per shard, {args.threads} threads per shard, no retries; {cpus} CPUs. "
          f"Ours: a local Ray, shard tasks of --num-cpus CPUs each (0.25, the default: {int(cpus / 0.25)} "
          f"in flight; 1: {cpus}, as img2dataset's processes); img2dataset: processes_count={cpus}. "
          f"Load average (other jobs on this machine) before: {load_before:.1f}, after: {os.getloadavg()[0]:.1f}")
    print(f"img2dataset: {about if python is None else f'{about} from {IMG2DATASET_VENV}'}")
    print("| downloader | list | run | rows | images | shard window s | end to end s | images/s | images/s/core | "
          "client CPU s | images per client CPU s | server CPU s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    for tool, label, repeat, r in runs:
        rate = r["successes"] / r["window"]
        print(f"| {tool} | {label} | {repeat + 1} | {r['rows']} | {r['successes']} | {r['window']:.1f} | "
              f"{r['wall']:.1f} | {rate:.0f} | {rate / cpus:.0f} | {r['cpu']:.1f} | {r['successes'] / r['cpu']:.0f} | "
              f"{r['server_cpu']:.1f} |")
    expected = {"no stalls": counts["ok"] + counts["slow"] + counts["stall"], "stalls": counts["ok"] + counts["slow"]}
    for tool, label, repeat, r in runs:
        if r["successes"] != expected[label]:
            print(f"note: {tool}, {label}, run {repeat + 1}: {r['successes']} images of {expected[label]} servable"
                  + (f" (failures {r['failures']}: on a loaded machine a 1 s response can pass the "
                     f"{args.timeout:g} s timeout)" if "failures" in r else ""))

    def best(tool, label):  # the fastest run: other jobs on the machine only ever slow a run down
        return max(r["successes"] / r["window"] for t, l, _, r in runs if (t, l) == (tool, label))

    print(f"best of {args.repeats} run(s) each:")
    tools = [f"ours --num-cpus {n:g}" for n in ours_configs] + (["img2dataset"] if python else [])
    for tool in tools:
        print(f"{tool}, no-stall rate / stalled rate: {best(tool, 'no stalls') / best(tool, 'stalls'):.2f}x"
              + (" (goal <= 1.2x)" if tool.startswith("ours") else ""))
    if python:
        for tool in tools[:-1]:
            for label in lists:
                print(f"{tool} / img2dataset images/s per core, {label}: "
                      f"{best(tool, label) / best('img2dataset', label):.2f}x (goal >= 1.0x)")
    else:
        print(f"img2dataset not compared: {about}")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--requests", type=int, default=2000, help="fetch path: at most this many requests per level")
    p.add_argument("--seconds", type=float, default=5.0, help="fetch path: at most this long per level")
    p.add_argument("--levels", default="1,16", help="fetch path: thread counts ('' skips the table)")
    p.add_argument("--rows", type=int, default=6000, help="rows of the realistic list (0 skips it)")
    p.add_argument("--rows-per-shard", type=int, default=1000)
    p.add_argument("--threads", type=int, default=64, help="threads per shard, both downloaders")
    p.add_argument("--timeout", type=float, default=2.0, help="seconds per request, both downloaders")
    p.add_argument("--repeats", type=int, default=1, help="runs of each downloader and list (the best counts)")
    p.add_argument("--num-cpus", default="0.25", help="ours: CPUs per shard task (the job's --num-cpus), comma-separated")
    p.add_argument("--no-img2dataset", action="store_true", help="compare ours stalled against no-stall only")
    args = p.parse_args()

    body = _scene_jpeg()
    ports = multiprocessing.Queue()
    server = multiprocessing.Process(target=_serve, args=(ports, body), daemon=True)
    server.start()
    base = f"http://127.0.0.1:{ports.get(timeout=30)}"
    args.server_pid = server.pid
    try:
        print(f"{os.cpu_count()} CPUs; image {len(body) / 1024:.0f} KiB; server on loopback (1 process)")
        if args.levels:
            print("| threads | images | seconds | images/s | images/s/core | img2dataset images/s/core (published) |")
            print("|---:|---:|---:|---:|---:|---:|")
            per_core_ref = IMG2DATASET_PER_NODE / IMG2DATASET_CORES
            for threads in (int(t) for t in args.levels.split(",")):
                n, seconds = bench_level(f"{base}/ok/0.jpg", threads, args.requests, args.seconds)
                rate = n / seconds
                print(f"| {threads} | {n} | {seconds:.2f} | {rate:.0f} | {rate / os.cpu_count():.0f} | {per_core_ref:.0f} |")
        if args.rows:
            bench_mix(base, args)
    finally:
        server.terminate()
        server.join()


if __name__ == "__main__":
    main()
