"""Several captions per image: which one a sample trains on, per epoch.

``data.train.captions: {caption: 0.3, recap_llava: 0.7}`` (MosaicML's ``caption_selection_probs``, PRX's
``caption_keys``): each sample's caption column in an epoch is drawn with those probabilities from a
uniform number that is a pure function of (seed, epoch, sample key), like every other per-sample draw
(:mod:`diffusion.loader.batches`), so a resumed run, another rank count or microbatch size picks the
same caption. Caption dropout composes with it: it hashes (seed, epoch, key) on its own stream, so a
dropped sample is dropped whichever caption it drew, and a caption's share of the dropped samples is
its share of all.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools

from diffusion.loader.batches import key_number, unit_hash

_CAPTION_STREAM = 0x63617074  # separates this draw from caption dropout's and the noise's


@dataclasses.dataclass(frozen=True)
class CaptionChoice:
    """Pick one of several caption columns per (epoch, sample key) with the given probabilities."""

    probabilities: tuple[tuple[str, float], ...]
    seed: int = 0

    @classmethod
    def from_mapping(cls, probabilities: dict[str, float], seed: int = 0, where: str = "data.train.captions"):
        """From ``{column: weight}``: weights ≥ 0, not all 0, normalised to sum to 1; a bad one is a
        ValueError naming ``where`` and the column."""
        if not probabilities:
            raise ValueError(f"{where}: name at least one caption column")
        for name, p in probabilities.items():
            if not isinstance(p, (int, float)) or p < 0:
                raise ValueError(f"{where}.{name}: a probability must be a number >= 0, got {p!r}")
        total = float(sum(probabilities.values()))
        if total <= 0:
            raise ValueError(f"{where}: the probabilities add up to 0")
        return cls(tuple((str(n), float(p) / total) for n, p in probabilities.items()), seed)

    @property
    def columns(self) -> tuple[str, ...]:
        return tuple(name for name, _ in self.probabilities)

    def choose(self, key: str, epoch: int) -> str:
        """The caption column sample ``key`` trains on in ``epoch``."""
        u = unit_hash(self.seed, _CAPTION_STREAM, epoch, key_number(key))
        bounds = list(itertools.accumulate(p for _, p in self.probabilities))
        i = min(bisect.bisect_right(bounds, u), len(bounds) - 1)
        while self.probabilities[i][1] == 0:  # u on a zero-width edge: the previous column with weight
            i -= 1
        return self.probabilities[i][0]

    def choices(self, keys, epoch: int) -> list[str]:
        return [self.choose(k, epoch) for k in keys]
