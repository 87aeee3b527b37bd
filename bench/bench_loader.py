"""Loader throughput: StreamingDataset samples/s on one core against the rate training consumes.

    python bench/bench_loader.py DIR                  # converter output (index.json + dataset.json)
    python bench/bench_loader.py                      # synthetic MDS at SD2 shapes (256 px, D=1024)

Reads through the training path (diffusion.train.mds_source's LatentDataset and the batch step of
diffusion.train.batches, in the main process, so one core) with a StreamingDataLoader collating
batches, after one warm-up pass that
fills the page cache. Baseline, in the same run: streaming's own path, a plain StreamingDataset whose
decoded samples the default collate stacks. Training consumes 137.5 img/s per A100 at 256 px
(MosaicML), 1,100 per 8-GPU node; the headline is loader samples/s per core divided by the per-GPU
rate (the reference claims >= 30x).
"""

from __future__ import annotations

import argparse
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


def write_synthetic(out: str, n: int, resolution: int = 256, text_dim: int = 1024, seed: int = 0) -> str:
    """MDS shards with the converter's columns and dataset.json, random contents."""
    from streaming import MDSWriter
    rng = np.random.default_rng(seed)
    h = resolution // 8
    columns = schema.mds_columns([resolution], text_dim)
    with MDSWriter(out=out, columns=columns, size_limit=1 << 26) as writer:
        for i in range(n):
            writer.write({
                schema.vae_moments_column(resolution): rng.standard_normal((8, h, h), dtype=np.float32).astype(np.float16),
                schema.TEXT_EMBEDS: rng.standard_normal((77, text_dim), dtype=np.float32).astype(np.float16),
                schema.INPUT_IDS: rng.integers(0, 49408, 77, dtype=np.int32),
                schema.CAPTION: f"synthetic caption {i}", schema.KEY: f"{i:09d}",
                schema.WIDTH: resolution, schema.HEIGHT: resolution,
            })
    schema.DatasetInfo(model="synthetic", scaling_factor=0.18215, resolutions=[resolution], text_dim=text_dim,
                         count=n, rows_in=n).save(out)
    np.save(os.path.join(out, schema.EMPTY_TEXT_EMBEDS), np.zeros((77, text_dim), np.float16))
    return out


class _PlainSamples:
    """The baseline: streaming's decoded sample, reduced to the batch columns, for the default collate."""

    def __init__(self, moments_column: str):
        self.columns = (moments_column, schema.TEXT_EMBEDS, schema.INPUT_IDS)

    def __call__(self, samples):
        import torch
        return {c: torch.stack([torch.from_numpy(np.array(s[c])) for s in samples]) for c in self.columns}


def measure(directory: str, resolution: int, batch_size: int, passes: int, baseline: bool) -> tuple[float, int]:
    """Samples/s of one process reading every sample ``passes`` times (after a warm-up pass)."""
    from streaming import StreamingDataLoader, StreamingDataset
    from streaming.base.util import clean_stale_shared_memory

    from diffusion.train.batches import CaptionDropout, StackSamples, ToModelBatch
    from diffusion.train.mds_source import LatentDataset
    clean_stale_shared_memory()
    if baseline:
        dataset = StreamingDataset(local=directory, batch_size=batch_size, shuffle=True, shuffle_seed=0)
        collate_fn = _PlainSamples(schema.vae_moments_column(resolution))
    else:
        empty = np.load(os.path.join(directory, schema.EMPTY_TEXT_EMBEDS))
        dataset = LatentDataset(remote=None, local=directory, resolution=resolution, batch_size=batch_size,
                                shuffle=True, shuffle_seed=0)
        collate_fn = StackSamples(ToModelBatch(resolution, empty, CaptionDropout(0.1, seed=0)))
    loader = StreamingDataLoader(dataset, batch_size=batch_size, num_workers=0, collate_fn=collate_fn)
    for _ in loader:  # warm-up: page cache, index, shuffle
        pass
    samples, start = 0, time.perf_counter()
    for _ in range(passes):
        for batch in loader:
            samples += len(batch[next(iter(batch))])
    rate = samples / (time.perf_counter() - start)
    del loader, dataset
    return rate, samples


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("dir", nargs="?", help="converter output; default: write synthetic MDS to a temp dir")
    p.add_argument("--resolution", type=int, help="default: the dataset's first resolution")
    p.add_argument("--samples", type=int, default=2048, help="synthetic samples to write")
    p.add_argument("--batch-size", type=int, default=32)
    p.add_argument("--passes", type=int, default=2)
    p.add_argument("--gpus-per-node", type=int, default=8)
    args = p.parse_args(argv)

    with tempfile.TemporaryDirectory() as tmp:
        directory = args.dir or write_synthetic(os.path.join(tmp, f"mds-{uuid.uuid4().hex[:8]}"), args.samples,
                                                args.resolution or 256)
        info = schema.DatasetInfo.load(directory)
        resolution = args.resolution or info.resolutions[0]
        base, _ = measure(directory, resolution, args.batch_size, args.passes, baseline=True)
        rate, samples = measure(directory, resolution, args.batch_size, args.passes, baseline=False)
    need = CONSUMPTION_PER_GPU.get(resolution, CONSUMPTION_PER_GPU[256])
    per_node = need * args.gpus_per_node
    print(f"data: {args.dir or 'synthetic'} ({info.count} samples, {resolution}px, D={info.text_dim}), "
          f"batch {args.batch_size}, {samples} samples timed per loader, 1 process")
    print(f"{'loader':<28} {'samples/s/core':>15} {'need/GPU':>9} {'x per GPU':>10} {'cores/node':>11}")
    for name, r in (("streaming's path (baseline)", base), ("LatentDataset + StackSamples", rate)):
        print(f"{name:<28} {r:>15,.0f} {need:>9.1f} {r / need:>10.1f} {per_node / r:>11.2f}")
    print(f"ours / baseline: {rate / base:.2f}x")
    print(f"headline: one loader core feeds {rate / need:.1f}x the {resolution}px consumption of one A100 "
          f"(reference claims >= 30x)")
    return rate


if __name__ == "__main__":
    main()
