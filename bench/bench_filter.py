"""Conversion throughput with a --where filter that drops about half the rows vs no filter, same input.

    python bench/bench_filter.py [--n 512] [--kit tiny] [--resolution 256]

Writes ``n`` rows of procedural LAION-style sample data (diffusion.kit.sample: its ``aesthetic`` column is
~N(5, 1), so ``aesthetic >= 5`` keeps about half), then converts it in the same run, each into a fresh
output: once without a filter (the baseline) and once with ``--where "aesthetic >= 5"``. A small warm-up
conversion first starts Ray's workers and loads the encoders. A conversion also pays a fixed cost per
run (pipeline and actor start-up, encoder loading, the input checks) that no filter can remove, so a
third run with a filter keeping ~2% (``aesthetic >= 7``) measures that floor, and the headline gives the
raw time ratio, the ratio above that floor, (filtered - floor) / (baseline - floor), and the ratio of
CPU-seconds in the per-row stages (decode+transform, encode, write; summed over workers). Goal: ≈ the
share of rows kept (~0.5), i.e. a dropped row costs nothing (no image decoded, nothing encoded).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from diffusion.convert.pipeline import ConvertConfig, run_conversion  # noqa: E402
from diffusion.kit.build import ensure_kit  # noqa: E402
from diffusion.kit.sample import write_sample_data  # noqa: E402

WHERE = "aesthetic >= 5"
FLOOR = "aesthetic >= 7"


def convert(raw: str, out: str, model: str, resolution: int, where: str | None, limit: int | None = None):
    cfg = ConvertConfig(input=raw, output=out, model=model, resolutions=(resolution,), where=where, limit=limit,
                        progress=False)
    return run_conversion(cfg)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=512, help="sample rows to convert (default: 512)")
    p.add_argument("--kit", default="tiny", choices=["tiny", "sd2-base"], help="model kit whose encoders run")
    p.add_argument("--resolution", type=int, default=256,
                   help="crop size encoded (default: 256; at 64 the tiny kit's per-row work is a few seconds, "
                        "hidden by the fixed per-run cost)")
    a = p.parse_args(argv)
    model = str(ensure_kit(a.kit, ROOT / ".cache" / "kit" / a.kit, progress=False))
    with tempfile.TemporaryDirectory() as tmp:
        raw = os.path.join(tmp, "raw")
        manifest = write_sample_data(raw, n=a.n, seed=0, rows_per_shard=128)
        convert(raw, os.path.join(tmp, "warmup"), model, a.resolution, None, limit=32)
        runs = {"no filter (baseline)": convert(raw, os.path.join(tmp, "all"), model, a.resolution, None),
                f"--where \"{WHERE}\"": convert(raw, os.path.join(tmp, "filtered"), model, a.resolution, WHERE),
                f"--where \"{FLOOR}\" (floor)": convert(raw, os.path.join(tmp, "floor"), model, a.resolution, FLOOR)}
    base = runs["no filter (baseline)"]
    print(f"{a.n} sample rows ({manifest['good']} good), {a.kit} kit, crop {a.resolution}, "
          f"{os.cpu_count()} CPUs")
    print(f"{'run':<34}{'rows in':>9}{'written':>9}{'filtered':>10}{'wall s':>9}{'rows in/s':>11}"
          f"{'written/s':>11}{'time vs baseline':>18}")
    for name, s in runs.items():
        filtered = sum(n for r, n in s.rejects.items() if r.startswith("filtered"))
        print(f"{name:<34}{s.rows_in:>9}{s.written:>9}{filtered:>10}{s.wall_seconds:>9.1f}"
              f"{s.rows_in / s.wall_seconds:>11.1f}{s.written / s.wall_seconds:>11.1f}"
              f"{s.wall_seconds / base.wall_seconds:>17.2f}x")
    stages = sorted(set().union(*(s.stage_seconds for s in runs.values())))
    if stages:
        print(f"{'CPU s by stage (all workers)':<34}" + "".join(f"{st.replace('_seconds', ''):>11}" for st in stages))
        for name, s in runs.items():
            print(f"{name:<34}" + "".join(f"{s.stage_seconds.get(st, 0.0):>11.1f}" for st in stages))
    filt, floor = runs[f"--where \"{WHERE}\""], runs[f"--where \"{FLOOR}\" (floor)"]
    kept = filt.written / base.written if base.written else 0.0
    per_row = (filt.wall_seconds - floor.wall_seconds) / max(base.wall_seconds - floor.wall_seconds, 1e-9)
    cpu = sum(filt.stage_seconds.values()) / max(sum(base.stage_seconds.values()), 1e-9)
    print(f"headline: the filter keeps {kept:.0%} of the baseline's samples; filtered run = "
          f"{filt.wall_seconds / base.wall_seconds:.2f}x the baseline's time, {per_row:.2f}x above the fixed "
          f"per-run floor, {cpu:.2f}x its stage CPU-seconds (goal: ~ the kept share: dropped rows cost nothing)")
    return {name: s.wall_seconds for name, s in runs.items()}


if __name__ == "__main__":
    main()
