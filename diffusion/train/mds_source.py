"""Training batches from MDS shards (local or remote) with mosaicml-streaming.

Each rank reads a disjoint part of every epoch; the sample order is a function of the shuffle seed and
the number of canonical nodes only, so a resumed run (Composer restores the dataset's state) continues
mid-epoch in the same order. Samples become batches through :mod:`diffusion.train.batches`, as the
online stream's do: caption dropout substitutes the stored empty-caption embedding, for a different,
reproducible subset of sample keys every epoch.

Reading is zero-copy where it can be: a sample's arrays are views into the memory-mapped shard, and
the only copy is the one collation makes into the batch (streaming's own path copies a sample three
times on the way). Shards streaming does not hold as fixed-shape MDS arrays, or a dataset with a
cache limit (whose eviction must see every access), take streaming's path.
"""

from __future__ import annotations

import collections
import mmap
import os
import struct
import tempfile
import urllib.parse
from typing import Any, Sequence

import numpy as np
import torch
from streaming import StreamingDataLoader, StreamingDataset
from streaming.base.format.mds.reader import MDSReader
from streaming.base.storage import CloudDownloader
from streaming.base.util import clean_stale_shared_memory

from diffusion import schema
from diffusion.errors import DatasetMismatchError
from diffusion.train.batches import SAMPLE_EPOCH, CaptionDropout, StackSamples, ToModelBatch


def is_remote(path: str) -> bool:
    return urllib.parse.urlparse(path).scheme not in ("", "file")


def fetch_side_file(path: str, name: str, timeout: float = 120.0) -> str:
    """A local copy (or the local path) of ``name`` beside the shards' ``index.json``."""
    if not is_remote(path):
        return os.path.join(path, name)
    local = os.path.join(tempfile.mkdtemp(prefix="mds-meta-"), name)  # per process: no download races
    remote = path.rstrip("/") + "/" + name
    try:
        CloudDownloader.direct_download(remote, local, timeout=timeout)
    except Exception as e:
        raise FileNotFoundError(f"could not download {remote} ({type(e).__name__}: {e}): "
                                f"is {path!r} a dataset written by convert/laion_to_mds.py?") from e
    return local


def read_dataset_info(path: str, timeout: float = 120.0) -> schema.DatasetInfo:
    """``dataset.json`` of a local directory or a remote URI."""
    return schema.DatasetInfo.load(os.path.dirname(fetch_side_file(path, schema.DATASET_JSON, timeout)))


def check_compatible(info: schema.DatasetInfo, path: str, resolution: int, text_dim: int) -> None:
    if resolution not in info.resolutions:
        raise DatasetMismatchError(
            f"{path}: the shards hold resolutions {info.resolutions} but the model trains at {resolution} "
            f"(set model.resolution to one of them, or convert with --resolutions {resolution})")
    if info.text_dim != text_dim:
        raise DatasetMismatchError(
            f"{path}: text embeddings have dimension {info.text_dim} (from {info.model}) but the UNet's "
            f"cross_attention_dim is {text_dim}: convert with the model's own text encoder")


class _ShardLayout:
    """Where the wanted fixed-shape array columns sit inside one MDS shard's samples.

    An MDS sample is ``[uint32 size of each variable-size column][column bytes, in column order]``;
    a fixed-shape ``ndarray:<dtype>:<shape>`` column is its raw array bytes, a ``str`` column UTF-8.
    """

    def __init__(self, reader: MDSReader, wanted: Sequence[str]):
        self.path = os.path.join(reader.dirname, reader.split or "", reader.raw_data.basename)
        missing = sorted(set(wanted) - set(reader.column_names))
        if missing:  # streaming's path names the sample and what it has
            raise ValueError(f"no column {', '.join(missing)}")
        sizes = reader.column_sizes  # None for a variable-size column
        self.header = struct.Struct(f"<{sum(s is None for s in sizes)}I")
        self.columns = []  # (name, dtype, shape, fixed size or None) in column order
        for name, encoding, size in zip(reader.column_names, reader.column_encodings, sizes):
            dtype, shape = None, None
            if name in wanted and encoding == "str":
                dtype = str
            elif name in wanted:
                parts = encoding.split(":")
                if parts[0] != "ndarray" or len(parts) != 3:
                    raise ValueError(f"column {name} is {encoding!r}, not a fixed-shape array or str")
                dtype, shape = np.dtype(parts[1]), tuple(int(d) for d in parts[2].split(","))
            self.columns.append((name, dtype, shape, size))

    def arrays(self, data, begin: int) -> dict:
        """The wanted columns of the sample starting at byte ``begin`` of ``data``: arrays as read-only
        views, strings decoded."""
        variable = iter(self.header.unpack_from(data, begin))
        offset, out = begin + self.header.size, {}
        for name, dtype, shape, size in self.columns:
            size = next(variable) if size is None else size
            if dtype is str:
                out[name] = data[offset:offset + size].decode("utf-8")
            elif dtype is not None:
                out[name] = np.frombuffer(data, dtype, size // dtype.itemsize, offset).reshape(shape)
            offset += size
        return out


class LatentDataset(StreamingDataset):
    """MDS rows → samples: unscaled moments at one resolution, text embeddings, token ids, the sample's
    key and index, and the epoch it is read in.

    Samples hold numpy arrays (read-only views where possible); :class:`~diffusion.train.batches.StackSamples`
    turns a list of them into the model's batch.
    """

    max_open_shards = 256  # memory maps kept open per process

    def __init__(self, *, remote: str | None, local: str | None, resolution: int, **streaming_kwargs: Any):
        super().__init__(remote=remote, local=local, **streaming_kwargs)
        self.moments_column = schema.vae_moments_column(resolution)
        self._epoch = 0
        self._wanted = (self.moments_column, schema.TEXT_EMBEDS, schema.INPUT_IDS, schema.KEY)
        self._layouts: dict[int, _ShardLayout | None] = {}
        self._maps: collections.OrderedDict = collections.OrderedDict()

    def __getstate__(self):  # memory maps stay in the process that opened them
        state = self.__dict__.copy()
        state["_maps"] = collections.OrderedDict()
        return state

    def _resume_incr_epoch(self) -> tuple[int, int]:
        # Remember the epoch this worker is iterating: caption dropout differs per epoch.
        epoch, sample_in_epoch = super()._resume_incr_epoch()
        self._epoch = epoch
        return epoch, sample_in_epoch

    def _layout(self, shard_id: int) -> _ShardLayout | None:
        if shard_id not in self._layouts:
            shard, layout = self.shards[shard_id], None
            if isinstance(shard, MDSReader) and self.cache_limit is None:
                try:
                    layout = _ShardLayout(shard, self._wanted)
                except ValueError:
                    layout = None
            self._layouts[shard_id] = layout
        return self._layouts[shard_id]

    def _mapped(self, shard_id: int, layout: _ShardLayout):
        data = self._maps.get(shard_id)
        if data is None:
            with open(layout.path, "rb") as f:  # FileNotFoundError: not downloaded yet
                data = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            self._maps[shard_id] = data
            if len(self._maps) > self.max_open_shards:
                self._maps.popitem(last=False)  # closed once no batch views it any more
        else:
            self._maps.move_to_end(shard_id)
        return data

    def _read(self, index: int) -> dict[str, np.ndarray]:
        shard_id, sample_in_shard = self.spanner[index]
        layout = self._layout(shard_id)
        if layout is not None:
            try:
                data = self._mapped(shard_id, layout)
            except FileNotFoundError:
                pass  # streaming's path below downloads the shard
            else:
                begin, = struct.unpack_from("<I", data, 4 * (1 + sample_in_shard))
                return layout.arrays(data, begin)
        row = super().__getitem__(index)
        if self.moments_column not in row:
            raise DatasetMismatchError(f"sample {index} has no column {self.moments_column} (has {sorted(row)})")
        return {name: row[name] if name == schema.KEY else np.asarray(row[name]) for name in self._wanted}

    def __getitem__(self, index: int) -> dict:
        row = self._read(index)
        row[schema.BATCH_SAMPLE_INDEX] = int(index)
        row[SAMPLE_EPOCH] = self._epoch
        return row


def build_dataset(loader_cfg, *, resolution: int, text_dim: int, device_batch_size: int) -> LatentDataset:
    """The dataset of one loader section (``data.train`` or ``data.eval``), checked against the model."""
    path = loader_cfg.path
    info = read_dataset_info(path, loader_cfg.download_timeout)
    check_compatible(info, path, resolution, text_dim)
    remote, local = (path, loader_cfg.local) if is_remote(path) else (None, path)
    return LatentDataset(
        remote=remote, local=local, resolution=resolution, batch_size=device_batch_size,
        shuffle=loader_cfg.shuffle, shuffle_seed=loader_cfg.shuffle_seed, predownload=loader_cfg.predownload,
        cache_limit=loader_cfg.cache_limit, num_canonical_nodes=loader_cfg.num_canonical_nodes,
        download_timeout=loader_cfg.download_timeout, epoch_size=loader_cfg.num_samples)


def build_dataloader(loader_cfg, *, resolution: int, text_dim: int, world_size: int = 1,
                     seed: int = 0) -> StreamingDataLoader:
    """A StreamingDataLoader yielding device batches (the global ``batch_size`` split across ranks)."""
    if loader_cfg.batch_size % world_size:
        raise ValueError(f"batch_size {loader_cfg.batch_size} does not divide evenly across {world_size} ranks")
    device_batch_size = loader_cfg.batch_size // world_size
    dataset = build_dataset(loader_cfg, resolution=resolution, text_dim=text_dim,
                            device_batch_size=device_batch_size)
    empty = np.load(fetch_side_file(loader_cfg.path, schema.EMPTY_TEXT_EMBEDS, loader_cfg.download_timeout))
    to_batch = ToModelBatch(resolution, empty, CaptionDropout(loader_cfg.caption_dropout, seed))
    workers = loader_cfg.num_workers
    # Its own generator: starting an epoch must not draw from the global RNG the model's noise comes
    # from, or a resumed run (which starts its iterator after restoring the RNG) would drift by a draw.
    return StreamingDataLoader(
        dataset, batch_size=device_batch_size, num_workers=workers, drop_last=True, collate_fn=StackSamples(to_batch),
        generator=torch.Generator().manual_seed(seed),
        pin_memory=torch.cuda.is_available(), prefetch_factor=loader_cfg.prefetch_factor if workers else None,
        persistent_workers=loader_cfg.persistent_workers and workers > 0)


def clean_shared_memory() -> None:
    """Remove shared memory a killed run left behind (streaming refuses to start otherwise)."""
    clean_stale_shared_memory()
