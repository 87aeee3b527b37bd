"""Run every benchmark this (CPU) machine can run in under 15 minutes; `make bench` calls this.

    python bench/run_all.py [--only loader cost ...] [--budget 900]

Each benchmark runs as its own process (so one crash or hang does not take the others down), prints
its own table, and gets a share of the budget as its timeout. A summary of status and time ends the
run; copy the numbers into BENCHMARKS.md with the machine, date and commit printed at the top.
"""

from __future__ import annotations

import argparse
import datetime
import os
import pathlib
import platform
import subprocess
import sys
import tempfile
import time

BENCH = pathlib.Path(__file__).resolve().parent
ROOT = BENCH.parent


def plan(tmp: str) -> list[tuple[str, list[str]]]:
    """(name, argv) of each benchmark, in order; scripts other engineers own are run only if present."""
    synthetic = os.path.join(tmp, "synthetic-mds")
    py = sys.executable
    return [
        ("transform", [py, str(BENCH / "bench_transform.py"), "--n", "300"]),
        ("filter", [py, str(BENCH / "bench_filter.py"), "--n", "256"]),
        ("buckets", [py, str(BENCH / "bench_buckets.py"), "--n", "256", "--resolution", "64"]),
        ("storage", [py, "-c", f"import sys; sys.path.insert(0, {str(BENCH)!r}); import bench_loader; "
                               f"bench_loader.write_synthetic({synthetic!r}, 256)",
                     "&&", py, str(BENCH / "bench_storage.py"), "--dataset", synthetic]),
        ("text-storage", [py, str(BENCH / "bench_storage.py"), "--only", "sd2"]),
        ("download", [py, str(BENCH / "bench_download.py"), "--seconds", "5", "--levels", "1,16"]),
        ("encode", [py, str(BENCH / "bench_encode.py"), "--kit", "tiny", "--resolutions", "64", "256",
                    "--batch-size", "8", "--batches", "3"]),
        ("loader", [py, str(BENCH / "bench_loader.py"), "--samples", "1024"]),
        ("cost", [py, "-m", "diffusion.cost"]),
        ("train", [py, str(BENCH / "bench_train.py"), "--tiny", "--device", "cpu", "--steps", "3", "--warmup", "1",
                   "--text", "embeds", "ids"]),
    ]


def _script(argv: list[str]) -> pathlib.Path | None:
    return next((pathlib.Path(a) for a in argv if a.endswith(".py")), None)


def run(name: str, argv: list[str], timeout: float) -> tuple[str, float]:
    script = _script(argv)
    if script is not None and not script.exists():
        return "skipped (script not present)", 0.0
    print(f"\n===== {name}: {' '.join(argv)}", flush=True)
    start = time.perf_counter()
    steps = [s.split("\x00") for s in "\x00".join(argv).split("\x00&&\x00")]  # "a && b": run in sequence
    try:
        for step in steps:
            rc = subprocess.run(step, cwd=ROOT, timeout=timeout).returncode
            if rc:
                return f"failed (exit {rc})", time.perf_counter() - start
    except subprocess.TimeoutExpired:
        return f"timed out after {timeout:.0f}s", time.perf_counter() - start
    return "ok", time.perf_counter() - start


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--only", nargs="+", help="run only these benchmarks")
    p.add_argument("--budget", type=float, default=900, help="seconds for the whole run")
    args = p.parse_args(argv)
    commit = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True).stdout.strip()
    print(f"machine: {platform.node()} {platform.machine()}, {os.cpu_count()} CPUs, python {platform.python_version()}; "
          f"date: {datetime.date.today()}; commit: {commit or 'unknown'} (+ working tree)")
    results = []
    deadline = time.monotonic() + args.budget
    with tempfile.TemporaryDirectory() as tmp:
        todo = [(n, a) for n, a in plan(tmp) if not args.only or n in args.only]
        for i, (name, command) in enumerate(todo):
            # what is left, less 30 s for each bench after this one: a long bench may run long, and
            # every later one still gets its 30 s
            share = max(30.0, deadline - time.monotonic() - 30.0 * (len(todo) - i - 1))
            results.append((name, *run(name, command, share)))
    print("\n===== summary")
    for name, status, seconds in results:
        print(f"{name:<10} {status:<32} {seconds:7.1f}s")
    return 0 if all(s.startswith(("ok", "skipped")) for _, s, _ in results) else 1


if __name__ == "__main__":
    sys.exit(main())
