"""Columns of the data contract → the batch the model consumes, one way for every batch source.

The MDS source (stored shards) and the stream source (online mode) both hand over the same columns:
VAE moments at the model's resolution, text embeddings, token ids and each sample's key. Caption
dropout is a pure function of (seed, epoch, key), so a sample is dropped the same way whichever
source, rank, worker or restart reads it, and the same rows give the same batch offline and online.
"""

from __future__ import annotations

import dataclasses
import hashlib

import numpy as np
import torch

from diffusion import schema


def unit_hash(*values: int) -> float:
    """A uniform number in [0, 1) that is a pure function of ``values`` (splitmix64 over them)."""
    x = 0
    for v in values:
        x = (x ^ (int(v) & 0xFFFFFFFFFFFFFFFF)) + 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return (x >> 11) / float(1 << 53)


def key_number(key: str) -> int:
    """A sample key as a 64-bit number (stable across processes, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(str(key).encode(), digest_size=8).digest(), "little")


@dataclasses.dataclass(frozen=True)
class CaptionDropout:
    """Which samples train unconditionally (the empty-caption embedding), for classifier-free guidance."""

    rate: float = 0.0
    seed: int = 0

    def drops(self, key: str, epoch: int) -> bool:
        """Whether sample ``key`` gets the empty caption in ``epoch`` (a pass over the data)."""
        return self.rate > 0 and unit_hash(self.seed, epoch, key_number(key)) < self.rate

    def mask(self, keys, epoch: int) -> np.ndarray:
        return np.array([self.drops(k, epoch) for k in keys], dtype=bool)


SAMPLE_EPOCH = "epoch"  # in an MDS sample: the epoch it is read in (its caption dropout depends on it)


class ToModelBatch:
    """Stacked columns of one batch → the model's batch tensors, with caption dropout applied.

    ``columns`` maps contract column names to arrays with the batch first (``key`` to a sequence of
    strings); a ``sample_index`` column, when present, is passed on (it pins the eval noise).
    """

    def __init__(self, resolution: int, empty_text_embeds: np.ndarray, dropout: CaptionDropout = CaptionDropout()):
        self.moments_column = schema.vae_moments_column(resolution)
        self.empty_text_embeds = np.asarray(empty_text_embeds, dtype=np.float16)
        self.dropout = dropout

    def __call__(self, columns: dict, epoch: int) -> dict[str, torch.Tensor]:
        text = columns[schema.TEXT_EMBEDS]
        drop = self.dropout.mask(columns[schema.KEY], epoch) if self.dropout.rate > 0 else None
        if drop is not None and drop.any():
            if not text.flags.writeable:  # a stream's arrays may be read-only views
                text = text.copy()
            text[drop] = self.empty_text_embeds
        batch = {schema.BATCH_MOMENTS: torch.from_numpy(np.ascontiguousarray(columns[self.moments_column])),
                 schema.BATCH_TEXT_EMBEDS: torch.from_numpy(np.ascontiguousarray(text)),
                 schema.BATCH_INPUT_IDS: torch.from_numpy(np.asarray(columns[schema.INPUT_IDS], dtype=np.int64))}
        if schema.BATCH_SAMPLE_INDEX in columns:
            batch[schema.BATCH_SAMPLE_INDEX] = torch.as_tensor(np.asarray(columns[schema.BATCH_SAMPLE_INDEX]))
        return batch


class StackSamples:
    """A DataLoader ``collate_fn``: samples of one epoch (dicts of contract columns) → stacked columns →
    :class:`ToModelBatch`. Stacking is the one copy a sample's arrays make on their way into the batch."""

    def __init__(self, to_batch: ToModelBatch):
        self.to_batch = to_batch

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        arrays = (self.to_batch.moments_column, schema.TEXT_EMBEDS, schema.INPUT_IDS)
        columns = {name: np.stack([s[name] for s in samples]) for name in arrays}
        columns[schema.KEY] = [s[schema.KEY] for s in samples]
        columns[schema.BATCH_SAMPLE_INDEX] = np.array([s[schema.BATCH_SAMPLE_INDEX] for s in samples])
        return self.to_batch(columns, epoch=samples[0][SAMPLE_EPOCH])
