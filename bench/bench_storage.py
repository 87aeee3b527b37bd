"""Bytes per sample of a converted dataset vs the same arrays stored as float32 in parquet.

    python bench/bench_storage.py --dataset OUT   (a directory written by convert/laion_to_mds.py)
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile

import numpy as np

from diffusion import schema


def mds_bytes(dataset: str) -> int:
    """Stored shard bytes from the index (a local read also leaves decompressed copies beside them)."""
    with open(os.path.join(dataset, "index.json")) as f:
        shards = json.load(f)["shards"]
    return sum((s.get("zip_data") or s["raw_data"])["bytes"] for s in shards)


def float32_parquet_bytes(samples: list[dict], resolutions) -> int:
    """The straightforward layout: every array as a flat float32 list column, parquet's default codec."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    arrays = [schema.vae_moments_column(r) for r in resolutions] + [schema.TEXT_EMBEDS]
    table = {name: [np.asarray(s[name], np.float32).ravel() for s in samples] for name in arrays}
    table[schema.INPUT_IDS] = [np.asarray(s[schema.INPUT_IDS], np.int64) for s in samples]
    for name in (schema.CAPTION, schema.KEY, schema.WIDTH, schema.HEIGHT):
        table[name] = [s[name] for s in samples]
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "float32.parquet")
        pq.write_table(pa.table(table), path)
        return os.path.getsize(path)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--dataset", required=True)
    a = p.parse_args(argv)
    from streaming import StreamingDataset
    info = schema.DatasetInfo.load(a.dataset)
    ds = StreamingDataset(local=a.dataset, shuffle=False, batch_size=1)
    samples = [ds[i] for i in range(len(ds))]
    ours = mds_bytes(a.dataset) / len(samples)
    baseline = float32_parquet_bytes(samples, info.resolutions) / len(samples)
    print(f"{len(samples)} samples, resolutions {info.resolutions}, text dim {info.text_dim}")
    print(f"{'layout':<36}{'bytes/sample':>14}")
    print(f"{'MDS float16 + zstd (converter)':<36}{ours:>14,.0f}")
    print(f"{'parquet float32 (baseline)':<36}{baseline:>14,.0f}")
    print(f"headline: converter output is {baseline / ours:.2f}x smaller")
    return {"mds": ours, "parquet_float32": baseline}


if __name__ == "__main__":
    main()
