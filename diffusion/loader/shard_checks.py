"""Integrity of stored shards: each one checked against its ``index.json`` before a sample of it is read.

The checks :class:`~diffusion.loader.mds_source.LatentDataset` runs (see its module's docstring for when):
a file's size, an MDS shard's header (sample count, offset table) and its hash, the fastest the index
records (:func:`pick_hash`); an index that cannot be used is named as it is loaded (:class:`CheckedStream`).
A read-only compressed dataset is read through a decompression cache (:func:`needs_decompression_cache`).
"""

from __future__ import annotations

import hashlib
import json
import mmap
import os
import struct
import tempfile
from typing import Any

import numpy as np
from streaming import Stream, StreamingDataset
from streaming.base.format import get_index_basename
from streaming.base.format.base.reader import FileInfo
from streaming.base.hashing import get_hash, is_hash
from streaming.base.shared import SharedArray
from streaming.base.shared.prefix import _get_path
from streaming.base.world import World

from diffusion.errors import DataIntegrityError
from diffusion.loader.dataset_info import one_line
from diffusion.storage import same_place_key


# Hashes to check a shard with, fastest first (xxh3 ~3x xxh64 on one core); any other the index records
# comes after these (sha1 and md5 are 4-10x slower than xxh64).
HASH_PREFERENCE = ("xxh3_64", "xxh128", "xxh3_128", "xxh64", "xxh32")
_VERIFIED_SHM = "verified_shards"  # per node: 1 once a shard's raw files were checked
_EVICTIONS_SHM = "evicted_shards"  # per node, under a cache limit: evictions of each shard, then of all


def pick_hash(recorded) -> str | None:
    """The algorithm to check a file with, of those its index entry records; None if it records none."""
    usable = [algo for algo in recorded if is_hash(algo)]
    return next((algo for algo in HASH_PREFERENCE if algo in usable), min(usable, default=None))


def size_problem(size: int, info: FileInfo) -> str | None:
    if size != info.bytes:
        return f"is {size:,} bytes where index.json records {info.bytes:,} (truncated or overwritten)"
    return None


def _mds_problem(data, samples: int) -> str | None:
    """What is wrong with an MDS shard's header (sample count, offset table) given the index's count."""
    if len(data) < 4:
        return "has no MDS header"
    count, = struct.unpack_from("<I", data, 0)
    if count != samples:
        return f"holds {count:,} samples where index.json records {samples:,}"
    if len(data) < 4 * (count + 2):
        return "is shorter than its MDS offset table"
    offsets = np.frombuffer(data[4:4 * (count + 2)], "<u4").astype(np.int64)  # a copy: the map stays closable
    # [count][count + 1 offsets][the writer's config, JSON][samples]
    if offsets[0] < 4 * (count + 2) or offsets[-1] != len(data) or (np.diff(offsets) < 0).any():
        return "has a corrupt MDS offset table"
    return None


def check_file(path: str, info: FileInfo, algo: str | None, *, samples: int | None = None, data=None) -> str | None:
    """What is wrong with the shard file at ``path`` given its index entry ``info``, or None: its size,
    its MDS header when ``samples`` (the index's sample count) is given, its ``algo`` hash unless None.
    ``data``: the file already mapped. Raises FileNotFoundError for a file that is not there."""
    if data is not None:
        return size_problem(len(data), info) or _content_problem(data, info, algo, samples)
    with open(path, "rb") as f:
        problem = size_problem(os.fstat(f.fileno()).st_size, info)
        if problem:
            return problem
        with mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ) as data:
            return _content_problem(data, info, algo, samples)


def _content_problem(data, info: FileInfo, algo: str | None, samples: int | None) -> str | None:
    problem = _mds_problem(data, samples) if samples is not None else None
    if problem is None and algo is not None and get_hash(algo, data) != info.hashes[algo]:
        problem = f"does not match its {algo} hash in index.json (its bytes changed on disk or in transfer)"
    return problem


class CheckedStream(Stream):
    """A stream whose index.json is checked as it is loaded: one that cannot be used is named."""

    def get_shards(self, world: World, allow_unsafe_types: bool) -> list:
        index = os.path.join(self.remote or self.local, self.split, get_index_basename())
        fix = "restore it from a copy, or re-convert the dataset"
        if self.remote is None and not os.path.isfile(index):
            raise DataIntegrityError(f"{index} is missing: is {self.local} a dataset written by "
                                     f"convert/laion_to_mds.py? If so, {fix}")
        try:
            shards = super().get_shards(world, allow_unsafe_types)
        except (ValueError, KeyError, TypeError, AttributeError) as e:  # JSONDecodeError is a ValueError
            raise DataIntegrityError(f"{index} is not a usable MDS index ({type(e).__name__}: {one_line(e)}): "
                                     f"{fix}") from e
        for i, shard in enumerate(shards):
            infos = [info for pair in shard.file_pairs for info in pair if info is not None]
            if not (isinstance(shard.samples, int) and shard.samples >= 0) or not all(
                    isinstance(info.bytes, int) and info.bytes > 0 and isinstance(info.hashes, dict)
                    and isinstance(info.basename, str) and not os.path.isabs(info.basename)
                    and ".." not in info.basename.split("/") for info in infos):
                raise DataIntegrityError(f"{index} is not a usable MDS index (shard {i}: samples "
                                         f"{shard.samples!r}, files {[vars(info) for info in infos]}): {fix}")
        return shards


def shared_flags(dataset: StreamingDataset) -> Any:
    """One byte per shard, shared by every process of the node reading this dataset (per process when a
    stale segment of another size is in the way); cleared by the local leader."""
    return _shared_zeros(dataset, _VERIFIED_SHM, dataset.num_shards, np.uint8)


def shared_evictions(dataset: StreamingDataset) -> Any:
    """How many times each shard was evicted from the node's cache, then (at ``num_shards``) all evictions:
    a count per shard, shared like :func:`shared_flags`."""
    return _shared_zeros(dataset, _EVICTIONS_SHM, dataset.num_shards + 1, np.uint64)


def _shared_zeros(dataset: StreamingDataset, name: str, size: int, dtype) -> Any:
    try:
        array = SharedArray(size, dtype, _get_path(dataset._shm_prefix_int, name))
        array.numpy()  # a stale, smaller segment: TypeError
    except (TypeError, ValueError, OSError):
        array = np.zeros(size, dtype)
    if dataset._unique_rank_world.is_local_leader:
        array[:] = 0  # a segment another dataset of this process left behind (the same prefix) is stale
    return array


def needs_decompression_cache(path: str) -> bool:
    """Whether the local dataset at ``path`` holds compressed shards not yet decompressed where their
    raw file cannot be written (a read-only directory or file system). Streaming decompresses a shard
    beside its compressed file; here it cannot, so the shards are read through a cache directory."""
    try:
        with open(os.path.join(path, get_index_basename())) as f:
            shards = json.load(f)["shards"]
        wanted = {os.path.dirname(os.path.join(path, shard["raw_data"]["basename"])) for shard in shards
                  if shard.get("zip_data") and not os.path.exists(os.path.join(path, shard["raw_data"]["basename"]))}
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return False  # no usable index: the stream's own check names it
    return any(os.path.isdir(d) and not os.access(d, os.W_OK) for d in wanted)


def default_cache(path: str, section: str = "data.train") -> str:
    """The cache folder a remote dataset is downloaded into, or a read-only compressed one decompressed into,
    where ``data.*.local`` is unset: ``$TMPDIR/diffusion-mds-cache/<digest of the path>``, ``-eval`` appended
    for ``data.eval``. The same on every run, so a re-run or a resumed one reuses what is there (streaming's
    own default, a folder per remote that must not exist yet, refused every run after the first); the train
    and eval loaders of one dataset each have their own (streaming refuses two live datasets one folder)."""
    digest = hashlib.sha1(same_place_key(path).encode("utf-8", "surrogateescape")).hexdigest()[:16]
    return os.path.join(tempfile.gettempdir(), "diffusion-mds-cache",
                        digest + ("-eval" if section == "data.eval" else ""))
