"""The write stage: a Ray ``Datasink`` where every write task writes its own MDS part.

Layout of an output directory::

    index.json              merged index of every committed part (what StreamingDataset reads)
    dataset.json            schema.DatasetInfo
    convert.json            the settings its samples were made with (diffusion.convert.pipeline)
    empty_text_embeds.npy   the text embedding of ""
    part-<id>/              one per write task: index.json, shard.*.mds.zstd, keys.jsonl, stats.jsonl;
                            <id> is a hash of the part's keys, so the same rows make the same part
    rejects/<id>.jsonl      {key: reason} per transformed batch with rejects
    failed_inputs/<id>.jsonl one per input file that could not be read (see diffusion.convert.readers)

This is the layout streaming's own tools expect of a folder of MDS parts: below the root, the only
``*.json`` files are the parts' ``index.json``, so on a finished output ``streaming.base.util.merge_index(out)``
(which takes every ``*.json`` below the root for a part's index, and will not replace an ``index.json``
already at the root: remove it first) writes the same index the converter writes. The converter's
records are one line of JSON each, named ``*.jsonl``; an output written before they were
(``keys.json``, ``stats.json``, ``rejects/*.json``, ``failed_inputs/*.json``) has them renamed at the
start of its next run (:func:`migrate_records`), before anything else reads them. (A killed run's
temporary parts hold an ``index.json`` too, until the next run removes them.)

A part is written under a temporary name and renamed to ``part-<id>`` once complete, so a killed run
leaves only whole parts (plus temporary ones, removed on the next run); a retried write task whose
first attempt already committed finds its part there and discards the copy. ``keys.jsonl`` lists the
keys a part holds: together with ``rejects/`` it is what a re-run skips.

Records damaged on disk never block a re-run: a part whose ``keys.jsonl``, ``stats.jsonl`` or
``index.json`` is missing or unreadable, disagrees on the sample count, or whose shard files are
missing or of another size than its index says, is not committed (:func:`read_part`); the next run
removes it (:func:`remove_temporary_parts`) and converts its rows again. An unreadable reject file is
removed too, and its rows are redone.
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
from streaming import MDSWriter

from diffusion import schema
from diffusion.convert.failed_inputs import FAILED_INPUTS_DIR
from diffusion.convert.settings import SHARD_SIZE
from diffusion.convert.transforms import LEGACY_RECORD_SUFFIX, RECORD_SUFFIX

INDEX_JSON = "index.json"
PART_PREFIX = "part-"
TMP_PREFIX = ".tmp-"
KEYS_RECORD = "keys" + RECORD_SUFFIX  # a part's keys, in order: one line of JSON, a list
STATS_RECORD = "stats" + RECORD_SUFFIX  # a part's sample count and stage seconds: one line of JSON
REJECTS_DIR = "rejects"
# A part's stats count the empty values of each further caption (--captions) as "empty_caption_NAME".
EMPTY_COUNTED = schema.EXTRA_CAPTION_PREFIX
EMPTY_PREFIX = "empty_"


def write_json_atomic(path: str, obj) -> None:
    with open(path + ".tmp", "w") as f:
        json.dump(obj, f)
    os.replace(path + ".tmp", path)


def _read_json(path: str):
    with open(path) as f:
        return json.load(f)


def read_part(part_dir: str) -> tuple[list[str], dict, dict] | None:
    """(keys, MDS index, stats) of a committed part, or None if it is not one: a record missing or
    unreadable, counts that disagree (keys, stats' count, the index's samples), or a shard file
    missing or of another size than the index records."""
    try:
        keys, index, stats = (_read_json(os.path.join(part_dir, name)) for name in (KEYS_RECORD, INDEX_JSON, STATS_RECORD))
        if not (isinstance(keys, list) and all(isinstance(k, str) for k in keys) and isinstance(stats, dict)
                and isinstance(index, dict) and isinstance(index.get("shards"), list)):
            return None
        samples = 0
        for shard in index["shards"]:
            samples += int(shard["samples"])
            data = shard.get("zip_data") or shard["raw_data"]  # a compressed shard keeps only its zip file
            if os.path.getsize(os.path.join(part_dir, data["basename"])) != int(data["bytes"]):
                return None
        if not samples == len(keys) == int(stats.get("count", -1)):
            return None
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
    return keys, index, stats


_VERDICTS: dict[str, tuple[tuple, bool]] = {}  # part dir -> (its files' stat signature, read_part succeeded)


def _signature(part_dir: str) -> tuple:
    """What changes if anything in a part changes: each file's name, inode, size and mtime."""
    entries = []
    for entry in os.scandir(part_dir):
        st = entry.stat(follow_symlinks=False)
        entries.append((entry.name, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(sorted(entries))


def is_committed(part_dir: str) -> bool:
    """Whether :func:`read_part` accepts the part; remembered while its files stay the same, since a run
    asks several times and reading every part's keys is the costly part."""
    try:
        signature = _signature(part_dir)
    except OSError:
        return False
    cached = _VERDICTS.get(part_dir)
    if cached is not None and cached[0] == signature:
        return cached[1]
    verdict = read_part(part_dir) is not None
    _VERDICTS[part_dir] = (signature, verdict)
    return verdict


def _part_dirs(out: str) -> list[str]:
    if not os.path.isdir(out):
        return []
    return sorted(d for d in os.listdir(out) if d.startswith(PART_PREFIX) and os.path.isdir(os.path.join(out, d)))


def committed_parts(out: str) -> list[str]:
    """Names of the complete parts under ``out`` (:func:`read_part`), sorted (so the merged index is
    deterministic)."""
    return [d for d in _part_dirs(out) if is_committed(os.path.join(out, d))]


def remove_temporary_parts(out: str) -> list[str]:
    """Delete what a killed run or a damaged disk left that a re-run must redo, before it starts:
    half-written parts, parts whose records are damaged (:func:`read_part`), and reject files that
    cannot be read (and ``.tmp`` files a kill left in rejects/). Returns the removed parts' names."""
    if not os.path.isdir(out):
        return []
    stale = [d for d in os.listdir(out) if d.startswith(TMP_PREFIX + PART_PREFIX)]
    stale += [d for d in _part_dirs(out) if not is_committed(os.path.join(out, d))]
    for d in stale:
        shutil.rmtree(os.path.join(out, d), ignore_errors=True)
    rejects = os.path.join(out, REJECTS_DIR)
    for name in sorted(os.listdir(rejects)) if os.path.isdir(rejects) else []:
        path = os.path.join(rejects, name)
        if name.endswith(".tmp") or (is_record(name) and read_rejects(path) is None):
            try:
                os.remove(path)
            except OSError:
                pass
    return stale


def is_record(name: str) -> bool:
    """Whether a file in rejects/ or failed_inputs/ is a record (``.jsonl``; ``.json`` in the old layout)."""
    return name.endswith((RECORD_SUFFIX, LEGACY_RECORD_SUFFIX))


_LEGACY_PART_RECORDS = {"keys.json": KEYS_RECORD, "stats.json": STATS_RECORD}


def migrate_records(out: str) -> int:
    """Rename the records of an output written in the old layout (``keys.json``, ``stats.json``,
    ``rejects/*.json``, ``failed_inputs/*.json``) to their ``.jsonl`` names; returns how many were
    renamed. Each rename is atomic and a record already renamed is left alone, so a run killed
    half-way through is finished by the next one; run it before anything decides which parts are
    committed (a part with one record renamed and one not is complete, not damaged)."""
    if not os.path.isdir(out):
        return 0
    moves = []
    for entry in os.listdir(out):
        folder = os.path.join(out, entry)
        if not os.path.isdir(folder):
            continue
        if entry.startswith(PART_PREFIX):
            moves += [(os.path.join(folder, old), os.path.join(folder, new)) for old, new in _LEGACY_PART_RECORDS.items()]
        elif entry in (REJECTS_DIR, FAILED_INPUTS_DIR):
            moves += [(os.path.join(folder, name), os.path.join(folder, name[: -len(LEGACY_RECORD_SUFFIX)] + RECORD_SUFFIX))
                      for name in os.listdir(folder) if name.endswith(LEGACY_RECORD_SUFFIX)]
    renamed = 0
    for old, new in moves:
        if not os.path.exists(old):
            continue
        if os.path.exists(new):  # written by this code already: the old copy is the stale one
            os.remove(old)
        else:
            os.replace(old, new)
            renamed += 1
    return renamed


def read_rejects(path: str) -> dict[str, str] | None:
    """The {key: reason} of one reject file, or None if it is unreadable or not such a mapping."""
    try:
        rejects = _read_json(path)
    except (OSError, ValueError):
        return None
    if not isinstance(rejects, dict) or not all(isinstance(v, str) for v in rejects.values()):
        return None
    return rejects


def merge_index(out: str) -> int:
    """Write ``out/index.json`` listing every committed part's shards; returns the sample count.

    On a finished output, the same index as ``streaming.base.util.merge_index(out)`` writes (parts in
    name order, each part's shards in its own order; tested); this one reads only committed parts, so
    a temporary or damaged part a killed run left never enters the index.
    """
    shards = []
    for part in committed_parts(out):
        for shard in _read_json(os.path.join(out, part, INDEX_JSON))["shards"]:
            for name in ("raw_data", "zip_data", "raw_meta", "zip_meta"):
                if shard.get(name):
                    shard[name]["basename"] = f"{part}/{shard[name]['basename']}"
            shards.append(shard)
    write_json_atomic(os.path.join(out, INDEX_JSON), {"version": 2, "shards": shards})
    return sum(s["samples"] for s in shards)


def bucket_dirs(out: str) -> list[str]:
    """Names of the bucket datasets below a bucketed output root (``bucket-WxH``), sorted."""
    if not os.path.isdir(out):
        return []
    return sorted(d for d in os.listdir(out) if d.startswith(schema.BUCKET_PREFIX)
                  and os.path.isdir(os.path.join(out, d)))


def part_roots(out: str) -> list[str]:
    """The directories parts are written in: the output, and each of its buckets."""
    return [out] + [os.path.join(out, b) for b in bucket_dirs(out)]


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
    (stage timings) are summed into the part's ``stats.jsonl`` instead of being stored.
    ``on_complete(out)`` runs after the merge (the converter writes dataset.json there). ``hashes``
    are recorded per shard file in index.json: sha1 for any reader, and xxh3_64, the fastest
    streaming knows, which the training loader checks each shard with (xxh64 costs it twice as much).
    """

    def __init__(self, out: str, columns: dict[str, str], compression: str | None = "zstd",
                 hashes=("sha1", "xxh3_64"), size_limit: int | str = SHARD_SIZE,
                 on_complete: Callable[[str], None] | None = None,
                 bucket_columns: Callable[[str], dict[str, str]] | None = None,
                 histograms: dict | None = None):
        self.out = os.path.abspath(out)
        self.histograms = dict(histograms or {})  # --embed: {score column: (low, high, bins)} counted into stats
        self.bucket_columns = bucket_columns  # bucket directory name -> its MDS columns (rows carry BUCKET)
        self.columns = dict(columns)
        self.compression = compression
        self.hashes = list(hashes)
        self.size_limit = size_limit
        self.on_complete = on_complete
        self.completed = False

    def on_write_start(self, schema=None) -> None:
        os.makedirs(self.out, exist_ok=True)

    def _open_part(self, root: str) -> dict:
        tmp = os.path.join(root, f"{TMP_PREFIX}{PART_PREFIX}{uuid.uuid4().hex[:16]}")
        columns = self.columns if self.bucket_columns is None else self.bucket_columns(os.path.basename(root))
        return {"root": root, "tmp": tmp, "keys": [], "seconds": {}, "columns": columns,
                "writer": MDSWriter(out=tmp, columns=columns, compression=self.compression,
                                    hashes=self.hashes, size_limit=self.size_limit)}

    def _commit(self, part: dict, start: float) -> str:
        part["writer"].finish()
        part["seconds"]["write_seconds"] = time.perf_counter() - start
        tmp, keys = part["tmp"], part["keys"]
        write_json_atomic(os.path.join(tmp, STATS_RECORD), {"count": len(keys), **part["seconds"]})
        write_json_atomic(os.path.join(tmp, KEYS_RECORD), keys)
        name = part_name(keys)
        target = os.path.join(part["root"], name)
        try:
            os.rename(tmp, target)  # the commit point
        except OSError:
            if read_part(target) is not None:
                shutil.rmtree(tmp, ignore_errors=True)  # a retry of a task that had committed
            else:  # a damaged part of the same rows (a record lost on disk): this copy replaces it
                shutil.rmtree(target)
                os.rename(tmp, target)
        return os.path.relpath(target, self.out)

    def write(self, blocks, ctx) -> dict:
        """One part per write task (with buckets: one per bucket the task's rows fall in)."""
        start = time.perf_counter()
        parts: dict[str, dict] = {}  # root directory -> the part being written there
        try:
            for block in blocks:
                for row in _rows(block):
                    bucket = row.get(schema.BUCKET)
                    root = self.out if bucket is None else os.path.join(self.out, str(bucket))
                    if root not in parts:
                        os.makedirs(root, exist_ok=True)
                        parts[root] = self._open_part(root)
                    part = parts[root]
                    for c, v in row.items():
                        if c.startswith("_") and c.endswith("_seconds"):
                            part["seconds"][c.strip("_")] = part["seconds"].get(c.strip("_"), 0.0) + float(v)
                    part["writer"].write({c: _as_mds_value(row[c], part["columns"][c]) for c in part["columns"]})
                    for c in part["columns"]:  # --captions: a further caption that is empty is counted
                        if c.startswith(EMPTY_COUNTED) and row[c] == "":
                            part["seconds"][EMPTY_PREFIX + c] = part["seconds"].get(EMPTY_PREFIX + c, 0) + 1
                    for c in self.histograms:  # --embed: each written row's score, binned
                        index = _bin(self.histograms[c], row[c])
                        if index is not None:
                            name = f"hist:{c}:{index}"
                            part["seconds"][name] = part["seconds"].get(name, 0) + 1
                    part["keys"].append(str(row[schema.KEY]))
            names = [self._commit(part, start) for part in parts.values()]
        except BaseException:
            for part in parts.values():
                shutil.rmtree(part["tmp"], ignore_errors=True)
            raise
        if not names:  # an empty task writes no part
            return {"part": None, "count": 0}
        return {"part": names[0] if len(names) == 1 else names, "count": sum(len(p["keys"]) for p in parts.values())}

    def on_write_complete(self, write_result) -> None:
        self.finalize()

    def finalize(self) -> int:
        """Merge the index over all committed parts (this run's and earlier ones) and run on_complete."""
        os.makedirs(self.out, exist_ok=True)
        if self.bucket_columns is None:
            count = merge_index(self.out)
        else:
            count = sum(merge_index(os.path.join(self.out, b)) for b in bucket_dirs(self.out))
        if self.on_complete is not None:
            self.on_complete(self.out)
        self.completed = True
        return count


def _bin(spec, value) -> int | None:
    """The histogram bin of ``value``: outside (low, high), infinities too, the end bins; NaN none (the
    curation stage rejects such rows, so none should reach here)."""
    low, high, bins = spec
    position = (float(value) - low) / (high - low) * bins
    if np.isnan(position):
        return None
    return int(np.clip(np.floor(position), 0, bins - 1))


def _as_mds_value(value, encoding: str = ""):
    if isinstance(value, (bytes, bytearray)) and encoding.startswith("ndarray:"):  # bucketed moments
        _, dtype, shape = encoding.split(":")
        return np.frombuffer(value, dtype).reshape(tuple(int(d) for d in shape.split(",")))
    if isinstance(value, np.generic):
        return value.item()
    return value
