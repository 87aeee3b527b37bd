"""Curation benchmarks (issue 51), side by side in one run:

- ``convert``: conversion CPU-seconds of the sample data with ``--embed`` + the three heads on vs off
  (the tiny kit and the tiny-clip kit on CPU; every process of the run's Ray instance summed, polled);
- ``semantic``: the semantic dedupe's decision (:func:`diffusion.convert.neardup.duplicate_groups`) on
  synthetic clustered unit embeddings at width 768: wall time and peak memory (each n in a fresh process);
- ``planted``: ``--dedupe near`` on the sample scenes with planted copies per transform: pairwise recall
  (a copy's similarity to its original >= T) and false-positive rate (pairs of different scenes >= T),
  and the decision's per-image rates.

    python bench/bench_curation.py planted --n 400
    python bench/bench_curation.py semantic --sizes 100000 300000
    python bench/bench_curation.py convert --n 96
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, ROOT)


# ---- semantic dedupe at scale ------------------------------------------------------------------------

def synthetic(n: int, width: int = 768, clusters: int = 2000, dup_share: float = 0.1, seed: int = 0) -> np.ndarray:
    """n unit vectors (float16) around ``clusters`` centres, a ``dup_share`` of them near-copies of another."""
    rng = np.random.default_rng(seed)
    centres = rng.standard_normal((clusters, width)).astype(np.float32)
    centres /= np.linalg.norm(centres, axis=1, keepdims=True)
    out = np.empty((n, width), np.float16)
    for start in range(0, n, 65536):
        m = min(65536, n - start)
        x = centres[rng.integers(0, clusters, m)] + 0.9 * rng.standard_normal((m, width)).astype(np.float32) / np.sqrt(width)
        out[start:start + m] = x / np.linalg.norm(x, axis=1, keepdims=True)
    dups = rng.choice(n, int(n * dup_share), replace=False)
    src = rng.integers(0, n, len(dups))
    for start in range(0, len(dups), 65536):
        d, s = dups[start:start + 65536], src[start:start + 65536]
        x = out[s].astype(np.float32) + 0.05 * rng.standard_normal((len(d), width)).astype(np.float32) / np.sqrt(width)
        out[d] = x / np.linalg.norm(x, axis=1, keepdims=True)
    return out


def _semantic_one(n: int) -> dict:
    import resource
    from diffusion.convert.neardup import duplicate_groups
    t = time.perf_counter()
    x = synthetic(n)
    made = time.perf_counter() - t
    t, cpu = time.perf_counter(), time.process_time()
    removed, _ = duplicate_groups(x, np.zeros(n, np.float32), 0.95)
    seconds, cpu = time.perf_counter() - t, time.process_time() - cpu
    return {"n": n, "width": x.shape[1], "decide_seconds": round(seconds, 1), "decide_cpu_seconds": round(cpu, 1),
            "load_average": round(os.getloadavg()[0], 1), "generate_seconds": round(made, 1),
            "removed": int(removed.sum()), "peak_rss_gb": round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20, 2)}


def semantic(sizes) -> list[dict]:
    rows = []
    for n in sizes:
        out = subprocess.run([sys.executable, __file__, "_semantic_one", str(n)], capture_output=True, text=True)
        if out.returncode:
            raise SystemExit(out.stderr[-2000:])
        rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
        print(json.dumps(rows[-1]), flush=True)
    return rows


# ---- planted near-duplicates ---------------------------------------------------------------------------

def planted(n: int, resolution: int = 64, thresholds=(0.85, 0.9, 0.95)) -> dict:
    from diffusion.convert.curate import perceptual_vectors
    from diffusion.convert.planted import TRANSFORMS, measure, planted_rows
    from diffusion.convert.readers import iter_rows
    from diffusion.convert.transforms import ImageChecks, center_square_crops, decode_image
    from diffusion.kit.sample import write_sample_data
    with tempfile.TemporaryDirectory() as d:
        write_sample_data(d, n=n, seed=0, rows_per_shard=256)
        good = []
        for r in iter_rows(d):
            try:
                if r["caption"]:
                    decode_image(r["jpg"], resolution, ImageChecks())
                    good.append(r)
            except Exception:
                pass
    rows, truth = planted_rows(good, max(1, len(good) // 10))
    keys = [r["key"] for r in rows]
    crops = [center_square_crops(decode_image(r["jpg"], resolution, ImageChecks())[0], [resolution])[resolution]
             for r in rows]
    v = perceptual_vectors(crops)
    index = {k: i for i, k in enumerate(keys)}
    originals = [i for i, k in enumerate(keys) if k not in truth]
    sims = v[originals] @ v[originals].T
    upper = sims[np.triu_indices(len(originals), 1)]
    result = {"originals": len(originals), "copies_per_transform": len(truth) // len(TRANSFORMS), "by_threshold": {}}
    for t in thresholds:
        pairwise = {name: float(np.mean([v[index[c]] @ v[index[o]] >= t for c, (o, tr) in truth.items() if tr == name]))
                    for name in TRANSFORMS}
        pairwise["false_positive_rate"] = float((upper >= t).mean())
        result["by_threshold"][t] = {"pairwise": {k: round(x, 4) for k, x in pairwise.items()},
                                     "per_image": {k: round(x, 4) if isinstance(x, float) else x
                                                   for k, x in measure(v, keys, truth, t).items()}}
    return result


# ---- conversion CPU-seconds ------------------------------------------------------------------------

def _tree_cpu(pid: int, seen: dict) -> None:
    import psutil
    try:
        procs = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            t = p.cpu_times()
            seen[p.pid] = max(seen.get(p.pid, 0.0), t.user + t.system)  # own time: a reaped child is counted as itself
        except psutil.Error:
            pass


def _converted_cpu(args: list[str]) -> dict:
    """CPU-seconds of one conversion command (its own local Ray), every process polled twice a second."""
    proc = subprocess.Popen([sys.executable, os.path.join(ROOT, "convert", "laion_to_mds.py"), *args],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, cwd=ROOT)
    seen: dict = {}
    done = threading.Event()

    def poll():
        while not done.is_set():
            _tree_cpu(proc.pid, seen)
            time.sleep(0.5)
    thread = threading.Thread(target=poll, daemon=True)
    start = time.perf_counter()
    thread.start()
    output = proc.communicate()[0]
    done.set()
    thread.join()
    if proc.returncode:
        raise SystemExit(output[-3000:])
    return {"cpu_seconds": round(sum(seen.values()), 1), "wall_seconds": round(time.perf_counter() - start, 1)}


def convert(n: int) -> dict:
    from diffusion.kit.build import ensure_kit
    from diffusion.kit.sample import write_sample_data
    cache = os.path.join(ROOT, ".cache", "kit")
    tiny = str(ensure_kit("tiny", os.path.join(cache, "tiny"), progress=False))
    clip = str(ensure_kit("tiny-clip", os.path.join(cache, "tiny-clip"), progress=False))
    heads = [f"--{k}-head={os.path.join(clip, 'heads', k + '.safetensors')}" for k in ("aesthetic", "nsfw", "watermark")]
    with tempfile.TemporaryDirectory() as d:
        write_sample_data(os.path.join(d, "raw"), n=n, seed=0, rows_per_shard=64)
        common = ["--input", os.path.join(d, "raw"), "--model", tiny, "--resolutions", "64", "--no-progress"]
        off = _converted_cpu([*common, "--output", os.path.join(d, "off")])
        on = _converted_cpu([*common, "--output", os.path.join(d, "on"), "--embed", clip, *heads])
    return {"rows": n, "off": off, "on": on, "ratio_cpu": round(on["cpu_seconds"] / off["cpu_seconds"], 3)}


def main(argv=None):
    if argv is None and len(sys.argv) > 2 and sys.argv[1] == "_semantic_one":
        print(json.dumps(_semantic_one(int(sys.argv[2]))))
        return
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("what", choices=("planted", "semantic", "convert"))
    p.add_argument("--n", type=int, default=400, help="sample rows (planted, convert)")
    p.add_argument("--sizes", type=int, nargs="+", default=[100_000, 300_000], help="semantic: embeddings")
    args = p.parse_args(argv)
    if args.what == "planted":
        print(json.dumps(planted(args.n), indent=1))
    elif args.what == "semantic":
        semantic(args.sizes)
    else:
        print(json.dumps(convert(args.n), indent=1))


if __name__ == "__main__":
    main()
