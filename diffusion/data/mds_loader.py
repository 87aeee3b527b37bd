"""Training batches from MDS shards (local or remote) with mosaicml-streaming.

Each rank reads a disjoint part of every epoch; the sample order is a function of the shuffle seed and
the number of canonical nodes only, so a resumed run (Composer restores the dataset's state) continues
mid-epoch in the same order. Caption dropout happens here, at load time, and substitutes the stored
empty-caption embedding: a different subset of captions is dropped every epoch, reproducibly.
"""

from __future__ import annotations

import os
import tempfile
import urllib.parse
from typing import Any

import numpy as np
import torch
from streaming import StreamingDataLoader, StreamingDataset
from streaming.base.storage import CloudDownloader
from streaming.base.util import clean_stale_shared_memory

from diffusion.data import contract


class DatasetMismatchError(ValueError):
    """The shards were converted for a different resolution or text encoder than the model needs."""


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


def read_dataset_info(path: str, timeout: float = 120.0) -> contract.DatasetInfo:
    """``dataset.json`` of a local directory or a remote URI."""
    return contract.DatasetInfo.load(os.path.dirname(fetch_side_file(path, contract.DATASET_JSON, timeout)))


def check_compatible(info: contract.DatasetInfo, path: str, resolution: int, text_dim: int) -> None:
    if resolution not in info.resolutions:
        raise DatasetMismatchError(
            f"{path}: the shards hold resolutions {info.resolutions} but the model trains at {resolution} "
            f"(set model.resolution to one of them, or convert with --resolutions {resolution})")
    if info.text_dim != text_dim:
        raise DatasetMismatchError(
            f"{path}: text embeddings have dimension {info.text_dim} (from {info.model}) but the UNet's "
            f"cross_attention_dim is {text_dim}: convert with the model's own text encoder")


class LatentDataset(StreamingDataset):
    """MDS rows → batch dicts: unscaled moments at one resolution, text embeddings, token ids, index."""

    def __init__(self, *, remote: str | None, local: str | None, resolution: int, empty_text_embeds: np.ndarray,
                 caption_dropout: float = 0.0, dropout_seed: int = 0, **streaming_kwargs: Any):
        super().__init__(remote=remote, local=local, **streaming_kwargs)
        self.moments_column = contract.vae_moments_column(resolution)
        self.empty_text_embeds = np.asarray(empty_text_embeds, dtype=np.float16)
        self.caption_dropout = float(caption_dropout)
        self.dropout_seed = int(dropout_seed)
        self._epoch = 0

    def _resume_incr_epoch(self) -> tuple[int, int]:
        # Remember the epoch this worker is iterating, so that dropout differs per epoch.
        epoch, sample_in_epoch = super()._resume_incr_epoch()
        self._epoch = epoch
        return epoch, sample_in_epoch

    def drops_caption(self, index: int, epoch: int) -> bool:
        """Whether sample ``index`` gets the empty caption in ``epoch``: a pure function of both."""
        if self.caption_dropout <= 0:
            return False
        return bool(np.random.default_rng([self.dropout_seed, epoch, index]).random() < self.caption_dropout)

    def __getitem__(self, index: int) -> dict:
        row = super().__getitem__(index)
        if self.moments_column not in row:
            raise DatasetMismatchError(f"sample {index} has no column {self.moments_column} (has {sorted(row)})")
        text = self.empty_text_embeds if self.drops_caption(index, self._epoch) else row[contract.TEXT_EMBEDS]
        return {
            contract.BATCH_MOMENTS: torch.from_numpy(np.array(row[self.moments_column])),
            contract.BATCH_TEXT_EMBEDS: torch.from_numpy(np.array(text)),
            contract.BATCH_INPUT_IDS: torch.from_numpy(np.asarray(row[contract.INPUT_IDS], dtype=np.int64)),
            contract.BATCH_SAMPLE_INDEX: int(index),
        }


def build_dataset(loader_cfg, *, resolution: int, text_dim: int, device_batch_size: int,
                  seed: int = 0) -> LatentDataset:
    """The dataset of one loader section (``data.train`` or ``data.eval``), checked against the model."""
    path = loader_cfg.path
    info = read_dataset_info(path, loader_cfg.download_timeout)
    check_compatible(info, path, resolution, text_dim)
    empty = np.load(fetch_side_file(path, contract.EMPTY_TEXT_EMBEDS, loader_cfg.download_timeout))
    remote, local = (path, loader_cfg.local) if is_remote(path) else (None, path)
    return LatentDataset(
        remote=remote, local=local, resolution=resolution, empty_text_embeds=empty,
        caption_dropout=loader_cfg.caption_dropout, dropout_seed=seed, batch_size=device_batch_size,
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
                            device_batch_size=device_batch_size, seed=seed)
    workers = loader_cfg.num_workers
    # Its own generator: starting an epoch must not draw from the global RNG the model's noise comes
    # from, or a resumed run (which starts its iterator after restoring the RNG) would drift by a draw.
    return StreamingDataLoader(
        dataset, batch_size=device_batch_size, num_workers=workers, drop_last=True,
        generator=torch.Generator().manual_seed(seed),
        pin_memory=torch.cuda.is_available(), prefetch_factor=loader_cfg.prefetch_factor if workers else None,
        persistent_workers=loader_cfg.persistent_workers and workers > 0)


def clean_shared_memory() -> None:
    """Remove shared memory a killed run left behind (streaming refuses to start otherwise)."""
    clean_stale_shared_memory()
