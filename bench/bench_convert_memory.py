"""Converter memory over a long run: does each Ray worker's resident memory level off? (issue 24 item 10)

    python bench/bench_convert_memory.py [--rows 50000] [--resolution 64] [--kit DIR] [--interval 5]

Writes ``--rows`` rows of the procedurally generated sample data (``diffusion.kit.sample``), converts
them with ``convert/laion_to_mds.py`` (tiny kit by default) and samples, every ``--interval`` seconds,
the private memory (USS: resident pages not shared; a worker's RSS also counts the object store's
shared pages it touched) of every Ray worker process of the run, grouped by what it runs (its process
title: ``ray::MapWorker(MapBatches(ImageCaptionTransform))``, ``ray::Write`` ...), with the rows the
output holds so far. Prints, per kind of worker, the largest USS of one process at each tenth of the
run and the high-water mark, and the growth over the second half of the run against the first: a
leak keeps growing with rows; a worker that levels off grows in the first half (imports, model,
buffers) and not after.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import pathlib
import re
import subprocess
import sys
import tempfile
import time

import psutil

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))


def _kind(process: psutil.Process) -> str | None:
    try:
        title = " ".join(process.cmdline()) or process.name()
    except (psutil.NoSuchProcess, psutil.AccessDenied):
        return None
    if not title.startswith("ray::") or title.startswith("ray::IDLE"):
        return None
    # an actor's title names the method it runs now (".submit", ".__init__"): the actor is the kind
    return re.sub(r"(\))\.[A-Za-z_]+$", r"\1", title.split()[0][len("ray::"):])


def _rows_written(out: str) -> int:
    """Rows in the parts the output holds so far (each part's index.json counts its samples)."""
    total = 0
    for index in pathlib.Path(out).rglob("index.json"):
        if index.parent == pathlib.Path(out):
            continue
        try:
            total += sum(s.get("samples", 0) for s in json.loads(index.read_text()).get("shards", []))
        except (OSError, ValueError):
            pass
    return total


def watch(command: list[str], out: str, interval: float) -> tuple[int, list[tuple[float, int, dict[str, float]]]]:
    """Run ``command``; every ``interval`` s: (seconds, rows written, {worker kind: largest USS MB})."""
    samples = []
    start = time.time()
    with tempfile.TemporaryFile("w+") as log:
        run = subprocess.Popen(command, cwd=ROOT, stdout=subprocess.DEVNULL, stderr=log, text=True)
        try:
            while run.poll() is None:
                samples.append((time.time() - start, _rows_written(out), _largest_rss(run.pid)))
                time.sleep(interval)
        except KeyboardInterrupt:  # stopped early (Ctrl-C, timeout -s INT): report what was seen
            run.send_signal(subprocess.signal.SIGINT)
            run.wait()
        if run.returncode:
            log.seek(0)
            print(log.read()[-3000:], file=sys.stderr)
    return run.returncode, samples


def _largest_rss(root: int) -> dict[str, float]:
    """{worker kind: private memory (USS) in MB of its largest process} over the Ray workers of the
    conversion ``root`` started (its local Ray instance's processes descend from it; other Ray instances
    on the machine do not count). USS, not RSS: a Ray worker's RSS also counts the pages of the shared
    object store it has read or written, which grow with the store's use, not with the worker."""
    by_kind: dict[str, float] = collections.defaultdict(float)
    try:
        processes = psutil.Process(root).children(recursive=True)
    except psutil.NoSuchProcess:
        return {}
    for process in processes:
        kind = _kind(process)
        if kind is None:
            continue
        try:
            by_kind[kind] = max(by_kind[kind], process.memory_full_info().uss / 2 ** 20)
        except psutil.NoSuchProcess:
            pass
    return dict(by_kind)


def _write_part(raw: str, part: int, rows: int) -> None:
    """Sample rows into ``raw/part``; keys carry the part (each part numbers its rows from 0)."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from diffusion import schema
    from diffusion.kit.sample import write_sample_data
    folder = os.path.join(raw, f"{part:02d}")
    write_sample_data(folder, n=rows, seed=part, rows_per_shard=1000)
    for name in sorted(os.listdir(folder)):
        if name.endswith(".parquet"):
            table = pq.read_table(os.path.join(folder, name))
            keys = pa.array([f"{part:02d}-{k}" for k in table.column(schema.RAW_KEY).to_pylist()])
            pq.write_table(table.set_column(table.schema.get_field_index(schema.RAW_KEY), schema.RAW_KEY, keys),
                           os.path.join(folder, name))
    os.remove(os.path.join(folder, "manifest.json"))


def write_input(raw: str, rows: int, processes: int) -> None:
    """``rows`` sample rows under ``raw``, written by ``processes`` processes side by side."""
    import multiprocessing
    os.makedirs(raw, exist_ok=True)
    share = [rows // processes + (i < rows % processes) for i in range(processes)]
    with multiprocessing.get_context("spawn").Pool(processes) as pool:
        pool.starmap(_write_part, [(raw, i, n) for i, n in enumerate(share)])
    open(os.path.join(raw, "done"), "w").close()


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rows", type=int, default=50_000)
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--kit", default=str(ROOT / ".cache" / "kit" / "tiny"))
    p.add_argument("--interval", type=float, default=5.0)
    p.add_argument("--work", help="folder for the output (default: a temporary one)")
    p.add_argument("--raw", help="keep the input here and reuse it when it is already there (default: temporary)")
    p.add_argument("--processes", type=int, default=2, help="processes writing the input")
    args = p.parse_args(argv)
    from diffusion.kit.build import ensure_kit
    ensure_kit("tiny", args.kit) if args.kit == str(ROOT / ".cache" / "kit" / "tiny") else None
    with tempfile.TemporaryDirectory(dir=args.work) as work:
        raw, out = args.raw or os.path.join(work, "raw"), os.path.join(work, "mds")
        if not os.path.exists(os.path.join(raw, "done")):
            started = time.time()
            write_input(raw, args.rows, args.processes)
            print(f"input: {args.rows:,} sample rows written in {time.time() - started:.0f} s")
        command = [sys.executable, "convert/laion_to_mds.py", "--input", raw, "--output", out, "--model", args.kit,
                   "--resolutions", str(args.resolution), "--no-progress"]
        code, samples = watch(command, out, args.interval)
        seconds = samples[-1][0] if samples else 0.0
        print(f"conversion: exit {code}, {seconds:.0f} s, {_rows_written(out):,} rows written; command: "
              f"{' '.join(command[1:])}")
    kinds = sorted({k for _, _, by_kind in samples for k in by_kind})
    tenths = [samples[min(len(samples) - 1, int(len(samples) * i / 10))] for i in range(1, 11)]
    print(f"{'worker: USS MB of its largest process':<58} " + " ".join(f"{int(100 * i / 10):>6}%" for i in range(1, 11))
          + f" {'peak MB':>8} {'1st half':>9} {'2nd half':>9}")
    half = len(samples) // 2
    for kind in kinds:
        series = [by_kind.get(kind, 0.0) for _, _, by_kind in samples]
        present = [v for v in series if v]
        first = [v for v in series[:half] if v]
        second = [v for v in series[half:] if v]
        growth_first = (max(first) - min(first)) if first else 0.0
        growth_second = (second[-1] - second[0]) if len(second) > 1 else 0.0
        print(f"{kind[:58]:<58} " + " ".join(f"{t[2].get(kind, 0.0):>7.0f}" for t in tenths)
              + f" {max(present or [0]):>8.0f} {growth_first:>+9.0f} {growth_second:>+9.0f}")
    print("rows written at each tenth: " + ", ".join(f"{t[1]:,}" for t in tenths))


if __name__ == "__main__":
    main()
