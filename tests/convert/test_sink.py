"""The MDS write stage on its own: parts named by their rows, committed once, merged in order."""

import json
import os

import numpy as np
import pandas as pd

from diffusion import schema
from diffusion.convert.sink import INDEX_JSON, KEYS_JSON, MDSPartSink, committed_parts, part_name

DIM = 8


def _block(keys):
    rng = np.random.default_rng(len(keys))
    return pd.DataFrame({
        schema.vae_moments_column(32): [rng.standard_normal((8, 4, 4)).astype(np.float16) for _ in keys],
        schema.TEXT_EMBEDS: [rng.standard_normal((77, DIM)).astype(np.float16) for _ in keys],
        schema.INPUT_IDS: [np.arange(77, dtype=np.int32) for _ in keys],
        schema.CAPTION: [f"caption {k}" for k in keys], schema.KEY: list(keys),
        schema.WIDTH: [32] * len(keys), schema.HEIGHT: [32] * len(keys),
        "_encode_seconds": [0.01] * len(keys),
    })


def _sink(out):
    return MDSPartSink(str(out), schema.mds_columns([32], DIM))


def test_a_part_is_named_by_its_keys_so_the_same_rows_make_the_same_part(tmp_path):
    first = _sink(tmp_path / "a").write([_block(["k1", "k2"]), _block(["k3"])], ctx=None)
    again = _sink(tmp_path / "b").write([_block(["k1", "k2", "k3"])], ctx=None)
    assert first == again == {"part": part_name(["k1", "k2", "k3"]), "count": 3}
    other = _sink(tmp_path / "a").write([_block(["k4"])], ctx=None)
    assert other["part"] != first["part"]
    stats = json.loads((tmp_path / "a" / first["part"] / "stats.json").read_text())
    assert stats["count"] == 3 and abs(stats["encode_seconds"] - 0.03) < 1e-9


def test_a_retried_write_task_does_not_duplicate_its_rows(tmp_path):
    sink = _sink(tmp_path)
    sink.write([_block(["k1", "k2"])], ctx=None)
    sink.write([_block(["k1", "k2"])], ctx=None)  # Ray re-ran a task whose first attempt had committed
    sink.write([_block(["k3"])], ctx=None)
    assert sink.finalize() == 3
    parts = committed_parts(str(tmp_path))
    assert len(parts) == 2 and not [d for d in os.listdir(tmp_path) if d.startswith(".tmp")]
    assert sorted(k for p in parts for k in json.loads((tmp_path / p / KEYS_JSON).read_text())) == ["k1", "k2", "k3"]
    index = json.loads((tmp_path / INDEX_JSON).read_text())
    assert [s["raw_data"]["basename"].split("/")[0] for s in index["shards"]] == sorted(parts)
