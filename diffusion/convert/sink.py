"""The write stage: a Ray ``Datasink`` where every write task writes its own MDS part.

Layout of an output directory::

    index.json              merged index of every committed part (what StreamingDataset reads)
    dataset.json            schema.DatasetInfo
    empty_text_embeds.npy   the text embedding of ""
    part-<id>/              one per write task: index.json, shard.*.mds.zstd, keys.json, stats.json;
                            <id> is a hash of the part's keys, so the same rows make the same part
    rejects/<id>.json       {key: reason} per transformed batch with rejects

A part is written under a temporary name and renamed to ``part-<id>`` once complete, so a killed run
leaves only whole parts (plus temporary ones, removed on the next run); a retried write task whose
first attempt already committed finds its part there and discards the copy. ``keys.json`` lists the
keys a part holds: together with ``rejects/`` it is what a re-run skips.
"""

from __future__ import annotations

import json
import os
import shutil
import hashlib
import time
import uuid
from typing import Callable, Iterable

import numpy as np
from ray.data import Datasink

from diffusion import schema

INDEX_JSON = "index.json"
PART_PREFIX = "part-"
TMP_PREFIX = ".tmp-"
KEYS_JSON = "keys.json"
STATS_JSON = "stats.json"
REJECTS_DIR = "rejects"
SHARD_SIZE = 1 << 26  # bytes of an MDS shard (streaming's default size limit)


def write_json_atomic(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def committed_parts(out: str) -> list[str]:
    """Names of the complete parts under ``out``, sorted (so the merged index is deterministic)."""
    if not os.path.isdir(out):
        return []
    return sorted(d for d in os.listdir(out)
                  if d.startswith(PART_PREFIX) and os.path.exists(os.path.join(out, d, KEYS_JSON)))


def remove_temporary_parts(out: str) -> list[str]:
    """Delete parts a killed run left half-written; returns their names."""
    stale = [d for d in os.listdir(out) if d.startswith(TMP_PREFIX + PART_PREFIX)] if os.path.isdir(out) else []
    for d in stale:
        shutil.rmtree(os.path.join(out, d), ignore_errors=True)
    return stale


def merge_index(out: str) -> int:
    """Write ``out/index.json`` listing every committed part's shards; returns the sample count.

    Equivalent to ``streaming.base.util.merge_index`` for a local root, but only over committed parts
    (a temporary part must never enter the index).
    """
    shards = []
    for part in committed_parts(out):
        with open(os.path.join(out, part, INDEX_JSON)) as f:
            for shard in json.load(f)["shards"]:
                for name in ("raw_data", "zip_data", "raw_meta", "zip_meta"):
                    if shard.get(name):
                        shard[name]["basename"] = f"{part}/{shard[name]['basename']}"
                shards.append(shard)
    write_json_atomic(os.path.join(out, INDEX_JSON), {"version": 2, "shards": shards})
    return sum(s["samples"] for s in shards)


def part_name(keys: list[str]) -> str:
    """A part's directory name: a hash of its keys in order (so parts sort the same on every run)."""
    digest = hashlib.sha1("\n".join(keys).encode()).hexdigest()[:16]
    return f"{PART_PREFIX}{digest}"


def _rows(block) -> Iterable[dict]:
    from ray.data.block import BlockAccessor
    batch = BlockAccessor.for_block(block).to_batch_format("numpy")
    names = list(batch)
    for values in zip(*(batch[n] for n in names)):
        yield dict(zip(names, values))


class MDSPartSink(Datasink):
    """Each write task streams its rows into one MDS part; ``on_write_complete`` merges the index.

    ``columns`` is the MDS column mapping (``schema.mds_columns``); columns named ``_*_seconds``
    (stage timings) are summed into the part's ``stats.json`` instead of being stored.
    ``on_complete(out)`` runs after the merge (the converter writes dataset.json there).
    """

    def __init__(self, out: str, columns: dict[str, str], compression: str | None = "zstd",
                 hashes=("sha1", "xxh64"), size_limit: int | str = SHARD_SIZE,
                 on_complete: Callable[[str], None] | None = None):
        self.out = os.path.abspath(out)
        self.columns = dict(columns)
        self.compression = compression
        self.hashes = list(hashes)
        self.size_limit = size_limit
        self.on_complete = on_complete
        self.completed = False

    def on_write_start(self, schema=None) -> None:
        os.makedirs(self.out, exist_ok=True)

    def write(self, blocks, ctx) -> dict:
        from streaming import MDSWriter
        tmp = os.path.join(self.out, f"{TMP_PREFIX}{PART_PREFIX}{uuid.uuid4().hex[:16]}")
        start = time.perf_counter()
        keys, seconds, writer = [], {}, None
        try:
            for block in blocks:
                for row in _rows(block):
                    if writer is None:
                        writer = MDSWriter(out=tmp, columns=self.columns, compression=self.compression,
                                           hashes=self.hashes, size_limit=self.size_limit)
                    for c, v in row.items():
                        if c.startswith("_") and c.endswith("_seconds"):
                            seconds[c.strip("_")] = seconds.get(c.strip("_"), 0.0) + float(v)
                    writer.write({c: _as_mds_value(row[c]) for c in self.columns})
                    keys.append(str(row[schema.KEY]))
            if writer is None:  # an empty task writes no part
                return {"part": None, "count": 0}
            writer.finish()
            seconds["write_seconds"] = time.perf_counter() - start
            write_json_atomic(os.path.join(tmp, STATS_JSON), {"count": len(keys), **seconds})
            write_json_atomic(os.path.join(tmp, KEYS_JSON), keys)
            name = part_name(keys)
            try:
                os.rename(tmp, os.path.join(self.out, name))  # the commit point
            except OSError:
                if not os.path.exists(os.path.join(self.out, name, KEYS_JSON)):
                    raise
                shutil.rmtree(tmp, ignore_errors=True)  # a retry of a task that had committed
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        return {"part": name, "count": len(keys)}

    def on_write_complete(self, write_result) -> None:
        self.finalize()

    def finalize(self) -> int:
        """Merge the index over all committed parts (this run's and earlier ones) and run on_complete."""
        os.makedirs(self.out, exist_ok=True)
        count = merge_index(self.out)
        if self.on_complete is not None:
            self.on_complete(self.out)
        self.completed = True
        return count


def _as_mds_value(value):
    if isinstance(value, np.generic):
        return value.item()
    return value
