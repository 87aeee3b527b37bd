"""Loader throughput: StreamingDataset samples/s on one core against the rate training consumes.

    python bench/bench_loader.py DIR                  # converter output (index.json + dataset.json)
    python bench/bench_loader.py                      # synthetic MDS at SD2 shapes (256 px, D=1024)

Reads through the training path as training runs it (diffusion.loader.mds_source's LatentDataset and
the batch step of diffusion.loader.batches with each sample's draws: posterior draw, noise, offset and
timestep, in the main process, so one reading thread) with a StreamingDataLoader
collating batches, after one warm-up pass that fills the page cache. Baseline, in the same run:
streaming's own path, a plain StreamingDataset whose decoded samples the default collate stacks.
Training consumes 137.5 img/s per A100 at 256 px (MosaicML), 1,100 per 8-GPU node; the headline is
loader samples/s per core divided by the per-GPU rate (the reference claims >= 30x).

Ours runs three times: shard hash checks off and on, and on without the per-sample draws (what this
bench timed before issue 25, beside their cost). Shard hash checks off and on (sizes and MDS headers are checked either way). Before
every timed pass the dataset forgets which shards it checked, so every pass of the "on" row hashes
every shard (xxh3_64, the fastest the converter records) as a run's first epoch does; later epochs of a run hash
nothing (the check is once per node). The passes of the three loaders are interleaved and each figure is the median over passes (a
shared machine's load drifts); CPU time (process, all threads) is reported beside wall-clock
samples/s, since the hashing runs partly in streaming's prefetch thread, beside the reading thread.

Two more rows read the dataset as a remote through a local cache under ``data.train.cache_limit`` (streaming's
LRU limit; one that holds the whole dataset, so after the warm-up pass nothing is evicted and the rows time the
read path alone): ours as training runs it (zero-copy reads of the mapped shards, which keep streaming's
eviction bookkeeping), and the same loader forced through streaming's copy path, what a cache limit cost
before the mapped read kept that bookkeeping. Both with hash checks off: compare them with the "off" row.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import pathlib
import sys
import tempfile
import time
import uuid

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from diffusion import schema  # noqa: E402

CONSUMPTION_PER_GPU = {256: 137.5, 512: 36.25}  # MosaicML A100 training rates (DESIGN.md)


def write_synthetic(out: str, n: int, resolution: int = 256, text_dim: int = 1024, seed: int = 0,
                    hashes: tuple[str, ...] = ("sha1", "xxh3_64")) -> str:
    """MDS shards with the converter's columns, hashes (by default) and dataset.json, random contents."""
    from streaming import MDSWriter
    rng = np.random.default_rng(seed)
    h = resolution // 8
    columns = schema.mds_columns([resolution], text_dim, tokens=False)
    with MDSWriter(out=out, columns=columns, size_limit=1 << 26, hashes=sorted(hashes)) as writer:
        for i in range(n):
            writer.write({  # the converter's default columns (--text embeds: no token ids)
                schema.vae_moments_column(resolution): rng.standard_normal((8, h, h), dtype=np.float32).astype(np.float16),
                schema.TEXT_EMBEDS: rng.standard_normal((77, text_dim), dtype=np.float32).astype(np.float16),
                schema.CAPTION: f"synthetic caption {i}", schema.KEY: f"{i:09d}",
                schema.WIDTH: resolution, schema.HEIGHT: resolution,
            })
    schema.DatasetInfo(model="synthetic", scaling_factor=0.18215, resolutions=[resolution], text_dim=text_dim,
                         count=n, rows_in=n, text=schema.TEXT_EMBEDS_ONLY).save(out)
    np.save(os.path.join(out, schema.EMPTY_TEXT_EMBEDS), np.zeros((77, text_dim), np.float16))
    return out


class _PlainSamples:
    """The baseline: streaming's decoded sample, reduced to the batch columns, for the default collate."""

    def __init__(self, moments_column: str):
        self.columns = (moments_column, schema.TEXT_EMBEDS)

    def __call__(self, samples):
        import torch
        return {c: torch.stack([torch.from_numpy(np.array(s[c])) for s in samples]) for c in self.columns}


# streaming's path; ours as training runs it (the per-sample draws made) without and with shard hash
# checks; ours with checks but without the draws (what this bench timed before issue 25); ours (checks off)
# through a cache under a limit, mapped, and forced through streaming's copy path
MODES = ("baseline", "off", "on", "nodraws", "limit", "limit_copy")
CACHED = ("limit", "limit_copy")


def cache_limit(directory: str) -> int:
    """A cache limit that holds the whole dataset (and streaming's minimum: four of its largest shard)."""
    with open(os.path.join(directory, "index.json")) as f:
        shards = json.load(f)["shards"]
    sizes = [s["raw_data"]["bytes"] + (s["zip_data"] or {}).get("bytes", 0) for s in shards]
    return max(sum(sizes), 4 * max(sizes)) + os.path.getsize(os.path.join(directory, "index.json")) + (1 << 20)


def _loader(directory: str, resolution: int, batch_size: int, mode: str, cache: str | None = None):
    from streaming import StreamingDataLoader, StreamingDataset

    from diffusion.loader.batches import CaptionDropout, NoiseDraws, StackSamples, ToModelBatch
    from diffusion.loader.mds_source import LatentDataset
    if mode == "baseline":
        dataset = StreamingDataset(local=directory, batch_size=batch_size, shuffle=True, shuffle_seed=0)
        collate_fn = _PlainSamples(schema.vae_moments_column(resolution))
    else:
        empty = np.load(os.path.join(directory, schema.EMPTY_TEXT_EMBEDS))
        where = ({"remote": directory, "local": cache, "cache_limit": cache_limit(directory)} if mode in CACHED
                 else {"remote": None, "local": directory})
        dataset = LatentDataset(**where, resolution=resolution, batch_size=batch_size,
                                shuffle=True, shuffle_seed=0, verify_hashes=mode not in ("off", *CACHED))
        if mode == "limit_copy":  # every shard through streaming's copy path
            dataset._layouts = {shard_id: None for shard_id in range(dataset.num_shards)}
        # as the trainer builds it for the SD2 recipe: each sample's posterior draw, noise, offset and
        # timestep draw (diffusion.train.trainer.noise_draws)
        noise = None if mode == "nodraws" else NoiseDraws(seed=0)
        collate_fn = StackSamples(ToModelBatch(resolution, empty, CaptionDropout(0.1, seed=0), noise))
    return StreamingDataLoader(dataset, batch_size=batch_size, num_workers=0, collate_fn=collate_fn)


def measure(directory: str, resolution: int, batch_size: int, passes: int,
            baseline_passes: int, cache_root: str) -> dict[str, list[tuple[float, float, int]]]:
    """(samples/s, CPU microseconds per sample, samples) of each pass of each of MODES: ``passes`` rounds
    of one pass per loader (the baseline in the first ``baseline_passes`` only), each pass reading every
    sample once and checking every shard again, after a warm-up pass."""
    from diffusion.loader.shared_memory import clean_shared_memory
    clean_shared_memory()
    for _ in _loader(directory, resolution, batch_size, "off"):  # warm-up: page cache
        pass
    runs = {mode: [] for mode in MODES}  # (samples/s, CPU us/sample, samples) per pass
    loaders = {mode: _loader(directory, resolution, batch_size, mode, os.path.join(cache_root, mode)) for mode in MODES}
    for mode in CACHED:  # warm-up: download every shard into the cache
        for _ in loaders[mode]:
            pass
    for p in range(passes):
        order = MODES if p < baseline_passes else MODES[1:]
        for mode in order[p % len(order):] + order[:p % len(order)]:  # interleaved, each first in turn
            loader = loaders[mode]
            if mode != "baseline":  # every pass checks every shard again (and maps it again), as a first epoch
                loader.dataset.forget_checks()
            gc.collect()
            samples, wall, cpu = 0, time.perf_counter(), time.process_time()
            for batch in loader:
                samples += len(batch[next(iter(batch))])
            wall, cpu = time.perf_counter() - wall, time.process_time() - cpu
            runs[mode].append((samples / wall, 1e6 * cpu / samples, samples))
    del loaders
    return runs


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir", nargs="?", help="converter output; default: write synthetic MDS to a temp dir")
    p.add_argument("--resolution", type=int, help="default: the dataset's first resolution")
    p.add_argument("--samples", type=int, default=2048, help="synthetic samples to write")
    p.add_argument("--hashes", nargs="+", default=["sha1", "xxh3_64"],
                   help="hashes the synthetic shards record (the converter's by default); the loader checks "
                        "the fastest (e.g. --hashes sha1 xxh64 for outputs of converters before xxh3_64)")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--passes", type=int, default=30, help="timed passes of ours, checks on and off (interleaved)")
    p.add_argument("--baseline-passes", type=int, default=3, help="timed passes of the baseline (slow)")
    p.add_argument("--gpus-per-node", type=int, default=8)
    args = p.parse_args(argv)

    from diffusion.loader.shard_checks import pick_hash
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.dir or write_synthetic(os.path.join(tmp, f"mds-{uuid.uuid4().hex[:8]}"), args.samples,
                                                args.resolution or 256, hashes=tuple(args.hashes))
        info = schema.DatasetInfo.load(directory)
        resolution = args.resolution or info.resolutions[0]
        with open(os.path.join(directory, "index.json")) as f:
            algo = pick_hash(json.load(f)["shards"][0]["raw_data"]["hashes"]) or "no hash recorded"
        runs = measure(directory, resolution, args.batch_size, args.passes,
                       max(1, min(args.baseline_passes, args.passes)), tmp)
    rates = {mode: tuple(float(np.median(column)) for column in zip(*r)) for mode, r in runs.items()}
    best = {mode: (max(r[0] for r in runs[mode]), min(r[1] for r in runs[mode])) for mode in ("off", "on")}
    need = CONSUMPTION_PER_GPU.get(resolution, CONSUMPTION_PER_GPU[256])
    per_node = need * args.gpus_per_node
    base, off, on, nodraws, limit, limit_copy = (rates[mode][0] for mode in MODES)
    print(f"data: {args.dir or 'synthetic'} ({info.count} samples, {resolution}px, D={info.text_dim}; checked with "
          f"{algo}), "
          f"batch {args.batch_size}, medians of {args.passes} passes of {rates['on'][2]:.0f} samples "
          f"({len(runs['baseline'])} of the baseline), 1 process")
    print(f"{'loader':<36} {'samples/s/core':>15} {'CPU us/sample':>14} {'need/GPU':>9} {'x per GPU':>10} "
          f"{'cores/node':>11}")
    names = {"baseline": "streaming's path (baseline)", "off": "training's loader, hash checks off",
             "on": "training's loader, hash checks on", "nodraws": "checks on, no per-sample draws",
             "limit": "off, cache limit, mapped", "limit_copy": "off, cache limit, streaming's copy"}
    for mode in MODES:
        r, cpu, _ = rates[mode]
        print(f"{names[mode]:<36} {r:>15,.0f} {cpu:>14,.1f} {need:>9.1f} {r / need:>10.1f} {per_node / r:>11.2f}")
    print(f"ours / baseline: {on / base:.2f}x (checks on), {off / base:.2f}x (off)")
    print(f"hash checks ({algo}) cost {100 * (1 - on / off):.1f}% of loader throughput and "
          f"{100 * (rates['on'][1] / rates['off'][1] - 1):.1f}% more CPU time (medians; best passes: "
          f"{100 * (1 - best['on'][0] / best['off'][0]):.1f}% and {100 * (best['on'][1] / best['off'][1] - 1):.1f}%) "
          f"in a pass that hashes every shard, as a first epoch does; nothing once each shard was checked")
    print(f"the per-sample draws (posterior draw, noise, offset, timestep) cost "
          f"{rates['on'][1] - rates['nodraws'][1]:,.1f} CPU us/sample, {100 * (1 - on / nodraws):.1f}% of loader "
          f"throughput (medians)")
    print(f"under a cache limit (checks off): mapped {limit / off:.2f}x the uncached read, streaming's copy path "
          f"{limit_copy / off:.2f}x; mapped / copy {limit / limit_copy:.2f}x throughput, "
          f"{rates['limit_copy'][1] / rates['limit'][1]:.2f}x less CPU time (medians)")
    print(f"headline: one loader core feeds {on / need:.1f}x the {resolution}px consumption of one A100 "
          f"(reference claims >= 30x)")
    return on


if __name__ == "__main__":
    main()
