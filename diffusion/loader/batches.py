"""Columns of the data contract → the batch the model consumes, one way for every batch source.

The MDS source (stored shards) and the stream source (online mode) both hand over the same columns:
VAE moments at the model's resolution, the text column the model is conditioned on (text embeddings,
or token ids for the model's frozen text encoder) and each sample's key. Caption dropout and every random number a training step draws for a sample (its posterior draw, noise,
offset and timestep: :class:`NoiseDraws`) are pure functions of (seed, epoch, key), so a sample is
treated the same way whichever source, rank, worker or restart reads it, and the same global batch
gives the same gradient whatever the microbatch size or the number of ranks.

Two more things enter the key, each only where it is not 0, so every other draw stays as it was:

- **the copy**: an epoch that repeats a sample (a stream's ``repeat``, a ``proportion`` or
  ``num_samples`` above the data) reads each copy as its own example, with its own draws. Copy ``c`` of
  a key is the one streaming numbers ``c``-th when it resamples the epoch, before shuffling and
  partitioning, so the numbering is the same whatever the ranks, workers and microbatches.
- **the phase**: a run that starts from another run's weights (phase 2 from phase 1, with the same
  seed) is one phase later than it (:mod:`diffusion.train.trainer` counts and records it), so it does not
  replay its predecessor's draws, epoch for epoch.
"""

from __future__ import annotations

import dataclasses
import hashlib
import typing

import numpy as np
import torch

from diffusion import schema
from diffusion.models.masking import PatchMask


def mix64(*values: int) -> int:
    """A 64-bit number that is a pure function of ``values`` (splitmix64 folded over them)."""
    x = 0
    for v in values:
        x = (x ^ (int(v) & 0xFFFFFFFFFFFFFFFF)) + 0x9E3779B97F4A7C15 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 30)) * 0xBF58476D1CE4E5B9 & 0xFFFFFFFFFFFFFFFF
        x = (x ^ (x >> 27)) * 0x94D049BB133111EB & 0xFFFFFFFFFFFFFFFF
        x ^= x >> 31
    return x


def unit_hash(*values: int) -> float:
    """A uniform number in [0, 1) that is a pure function of ``values``."""
    return (mix64(*values) >> 11) / float(1 << 53)


def key_number(key: str) -> int:
    """A sample key as a 64-bit number (stable across processes, unlike ``hash``)."""
    return int.from_bytes(hashlib.blake2b(str(key).encode(), digest_size=8).digest(), "little")


_SALT = 0x636F7079  # marks a key carrying a copy or phase number


def sample_draw_key(*values: int, copy: int = 0, phase: int = 0) -> tuple[int, ...]:
    """``values`` (seed, epoch, key ...), with the copy and the phase appended when either is not 0."""
    return values + (_SALT, int(copy), int(phase)) if copy or phase else values


@dataclasses.dataclass(frozen=True)
class CaptionDropout:
    """Which samples train unconditionally (the empty-caption embedding), for classifier-free guidance."""

    rate: float = 0.0
    seed: int = 0

    def drops(self, key: str, epoch: int, copy: int = 0, phase: int = 0) -> bool:
        """Whether sample ``key`` (its ``copy`` in the epoch) gets the empty caption in ``epoch`` (a pass
        over the data) of the run's ``phase``."""
        return self.rate > 0 and unit_hash(*sample_draw_key(self.seed, epoch, key_number(key), copy=copy,
                                                            phase=phase)) < self.rate

    def mask(self, keys, epoch: int, copies=None, phase: int = 0) -> np.ndarray:
        copies = [0] * len(keys) if copies is None else copies
        return np.array([self.drops(k, epoch, c, phase) for k, c in zip(keys, copies)], dtype=bool)


# Separates the noise's seeds from caption dropout's, which hash the same (seed, epoch, key).
_NOISE_STREAM = 0x6E6F697365


@dataclasses.dataclass(frozen=True)
class NoiseDraws:
    """The random numbers one training step needs per sample, drawn in the loader from a generator
    seeded by (seed, epoch, key), in a fixed order: the posterior draw ε_z and the noise ε (each the
    latent's shape), a per-channel offset, a uniform number that picks the timestep, and with
    ``perturbation`` the input-perturbation noise (last, so switching it on changes nothing else).

    The model only reads them (no generator, no host sync, nothing for ``torch.compile`` to break on),
    and a sample gets the same numbers however the global batch is split into ranks and microbatches.
    """

    seed: int = 0
    perturbation: bool = False
    # The objective's draw for the noise level (``Objective.level_draw``: e.g. flow's logit-normal
    # density through diffusers' sampler); None: a uniform number in [0, 1), as the DDPM objectives take.
    level: typing.Callable | None = None
    # With masked training (``model.masking``): which latent patches each sample keeps, drawn last.
    mask: PatchMask | None = None
    # With token routing (``model.routing``): which patches each sample sends through the routed span.
    route: PatchMask | None = None

    def __call__(self, keys, epoch: int, latent_shape, copies=None, phase: int = 0,
                 posterior: bool = True) -> dict[str, torch.Tensor]:
        """``posterior``: the batch holds moments to draw latents from (deterministic latents need no ε_z)."""
        n, shape = len(keys), tuple(int(d) for d in latent_shape)
        draws = {schema.BATCH_POSTERIOR_NOISE: torch.empty(n, *shape)} if posterior else {}
        draws.update({schema.BATCH_NOISE: torch.empty(n, *shape), schema.BATCH_OFFSET_NOISE: torch.empty(n, shape[0]),
                      schema.BATCH_TIMESTEP_DRAW: torch.empty(n)})
        if self.perturbation:
            draws[schema.BATCH_PERTURBATION_NOISE] = torch.empty(n, *shape)
        if self.mask is not None:
            draws[schema.BATCH_PATCH_KEEP] = torch.empty(n, self.mask.kept(shape), dtype=torch.long)
        if self.route is not None:
            draws[schema.BATCH_ROUTE_KEEP] = torch.empty(n, self.route.kept(shape), dtype=torch.long)
        generator = torch.Generator()
        copies = [0] * n if copies is None else copies
        for i, key in enumerate(keys):
            generator.manual_seed(mix64(*sample_draw_key(self.seed, _NOISE_STREAM, epoch, key_number(key),
                                                         copy=copies[i], phase=phase)))
            for name, values in draws.items():  # dict order is the draw order
                if name == schema.BATCH_TIMESTEP_DRAW and self.level is not None:
                    values[i:i + 1] = self.level(generator)
                elif name == schema.BATCH_TIMESTEP_DRAW:
                    values[i:i + 1].uniform_(generator=generator)
                elif name == schema.BATCH_PATCH_KEEP:
                    values[i] = self.mask(shape, generator)
                elif name == schema.BATCH_ROUTE_KEEP:
                    values[i] = self.route(shape, generator)
                else:
                    values[i].normal_(generator=generator)
        return draws


SAMPLE_EPOCH = "epoch"  # in an MDS sample: the epoch it is read in (its caption dropout depends on it)
SAMPLE_COPY = "copy"  # in an MDS sample: which copy of its key it is in the epoch (0 unless repeated)


class ToModelBatch:
    """Stacked columns of one batch → the model's batch tensors, with caption dropout applied.

    ``columns`` maps contract column names to arrays with the batch first (``key`` to a sequence of
    strings); a ``sample_index`` column, when present, is passed on (it pins the eval noise), and a
    ``copy`` column numbers repeated samples' copies. With ``noise`` (training batches), each sample's
    :class:`NoiseDraws` are added. ``phase`` is the run's phase (set by the trainer before the first batch).
    ``latent_space`` (the datasets' :class:`~diffusion.schema.LatentSpace`; None: SD's moments) says which
    column holds the latents: moments go under ``vae_moments``, deterministic latents under ``vae_latents``.

    The text column is ``text_embeds`` (a dropped caption gets ``empty_text``, the embedding of ""), or
    with ``text_column=input_ids`` the token ids (a dropped caption gets ``empty_text``, the ids of "",
    which the model's text encoder turns into the same embedding the sampler's unconditional input is).
    With ``empty_tokens`` (the token count of "") the batch carries each caption's token count
    (``text_tokens``, its attention mask), a dropped caption's being ``empty_tokens``. With ``empty_pooled`` (the
    pooled vector of "", datasets of Flux's two text encoders) it carries ``pooled_text_embeds``, a dropped
    caption's being ``empty_pooled``.
    """

    def __init__(self, resolution: int, empty_text: np.ndarray, dropout: CaptionDropout = CaptionDropout(),
                 noise: NoiseDraws | None = None, text_column: str = schema.TEXT_EMBEDS,
                 empty_tokens: int | None = None, latent_space: schema.LatentSpace | None = None,
                 empty_pooled: np.ndarray | None = None):
        if text_column not in (schema.TEXT_EMBEDS, schema.INPUT_IDS):
            raise ValueError(f"text_column {text_column!r}: {schema.TEXT_EMBEDS} or {schema.INPUT_IDS}")
        self.latent_space = latent_space or schema.LatentSpace()
        self.moments_column = self.latent_space.column(resolution)
        self.text_column = text_column
        dtype = np.float16 if text_column == schema.TEXT_EMBEDS else np.int64
        self.empty_text = np.asarray(empty_text, dtype=dtype)
        self.dropout = dropout
        self.noise = noise
        self.empty_tokens = empty_tokens
        self.empty_pooled = None if empty_pooled is None else np.asarray(empty_pooled, dtype=np.float16)
        self.phase = 0

    def __call__(self, columns: dict, epoch: int) -> dict[str, torch.Tensor]:
        text = columns[self.text_column]
        if self.text_column == schema.INPUT_IDS:
            text = np.array(text, dtype=np.int64)  # a copy: torch wants int64 ids
        copies = columns.get(SAMPLE_COPY)
        drop = self.dropout.mask(columns[schema.KEY], epoch, copies, self.phase) if self.dropout.rate > 0 else None
        if drop is not None and drop.any():
            if not text.flags.writeable:  # a stream's arrays may be read-only views
                text = text.copy()
            text[drop] = self.empty_text
        batch_key = schema.BATCH_TEXT_EMBEDS if self.text_column == schema.TEXT_EMBEDS else schema.BATCH_INPUT_IDS
        batch = {self.latent_space.batch_key: torch.from_numpy(np.ascontiguousarray(columns[self.moments_column])),
                 batch_key: torch.from_numpy(np.ascontiguousarray(text))}
        if self.empty_tokens is not None:
            tokens = np.array(columns[schema.TEXT_TOKENS], dtype=np.int64)
            if drop is not None:
                tokens[drop] = self.empty_tokens
            batch[schema.BATCH_TEXT_TOKENS] = torch.from_numpy(tokens)
        if self.empty_pooled is not None:
            pooled = np.array(columns[schema.POOLED_TEXT_EMBEDS], dtype=np.float16)  # a copy: dropout writes it
            if drop is not None:
                pooled[drop] = self.empty_pooled
            batch[schema.BATCH_POOLED_TEXT_EMBEDS] = torch.from_numpy(pooled)
        if schema.BATCH_SAMPLE_INDEX in columns:
            batch[schema.BATCH_SAMPLE_INDEX] = torch.as_tensor(np.asarray(columns[schema.BATCH_SAMPLE_INDEX]))
        if self.noise is not None:
            stored = batch[self.latent_space.batch_key]
            posterior = self.latent_space.stored == schema.MOMENTS
            latent_shape = (stored.shape[1] // 2 if posterior else stored.shape[1], *stored.shape[2:])
            batch.update(self.noise(columns[schema.KEY], epoch, latent_shape, copies, self.phase, posterior=posterior))
        return batch


class StackSamples:
    """A DataLoader ``collate_fn``: samples of one epoch (dicts of contract columns) → stacked columns →
    :class:`ToModelBatch`. Stacking is the one copy a sample's arrays make on their way into the batch.
    With ``captions`` (a :class:`~diffusion.loader.captions.CaptionColumns`: several captions per image),
    each sample first takes the caption it draws for its epoch, copy and the run's phase."""

    def __init__(self, to_batch: ToModelBatch, captions=None):
        self.to_batch = to_batch
        self.captions = captions

    def __call__(self, samples: list[dict]) -> dict[str, torch.Tensor]:
        if self.captions is not None:
            for s in samples:
                self.captions.apply(s, s[SAMPLE_EPOCH], s.get(SAMPLE_COPY, 0), self.to_batch.phase)
        arrays = (self.to_batch.moments_column, self.to_batch.text_column,
                  *((schema.TEXT_TOKENS,) if self.to_batch.empty_tokens is not None else ()),
                  *((schema.POOLED_TEXT_EMBEDS,) if self.to_batch.empty_pooled is not None else ()))
        columns = {name: np.stack([s[name] for s in samples]) for name in arrays}
        columns[schema.KEY] = [s[schema.KEY] for s in samples]
        columns[schema.BATCH_SAMPLE_INDEX] = np.array([s[schema.BATCH_SAMPLE_INDEX] for s in samples])
        columns[SAMPLE_COPY] = [s.get(SAMPLE_COPY, 0) for s in samples]
        return self.to_batch(columns, epoch=samples[0][SAMPLE_EPOCH])
