"""Several captions per image: which one a sample trains on, per epoch.

``data.train.captions: {caption: 0.3, recap_llava: 0.7}`` (MosaicML's ``caption_selection_probs``, PRX's
``caption_keys``): each sample's caption column in an epoch is drawn with those probabilities from a
uniform number that is a pure function of (seed, epoch, sample key), salted by the copy and the phase like
every other per-sample draw (:mod:`diffusion.loader.batches`): the copies of a repeated sample draw their
own captions, a later phase does not replay its predecessor's, and a resumed run, another rank count or
microbatch size picks the same caption. Caption dropout composes with it: it hashes (seed, epoch, key) on its own stream, so a
dropped sample is dropped whichever caption it drew, and a caption's share of the dropped samples is
its share of all.
"""

from __future__ import annotations

import bisect
import dataclasses
import itertools

from diffusion import schema
from diffusion.loader.batches import key_number, sample_draw_key, unit_hash

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

    def choose(self, key: str, epoch: int, copy: int = 0, phase: int = 0) -> str:
        """The caption column sample ``key`` (its ``copy`` in the epoch) trains on in ``epoch`` of ``phase``."""
        u = unit_hash(*sample_draw_key(self.seed, _CAPTION_STREAM, epoch, key_number(key), copy=copy, phase=phase))
        bounds = list(itertools.accumulate(p for _, p in self.probabilities))
        i = min(bisect.bisect_right(bounds, u), len(bounds) - 1)
        while self.probabilities[i][1] == 0:  # u on a zero-width edge: the previous column with weight
            i -= 1
        return self.probabilities[i][0]

    def choices(self, keys, epoch: int, copies=None, phase: int = 0) -> list[str]:
        copies = [0] * len(keys) if copies is None else copies
        return [self.choose(k, epoch, c, phase) for k, c in zip(keys, copies)]


@dataclasses.dataclass(frozen=True)
class CaptionColumns:
    """A sample's drawn caption in place of its first: ``columns`` maps each further caption's name to
    (its text column, its stored ``text_column``[, its token counts]); a drawn caption that is empty ("")
    leaves the first. The loader's collate step applies it, where each sample's copy and the run's phase
    are known."""

    choice: CaptionChoice
    columns: dict
    text_column: str

    def apply(self, row: dict, epoch: int, copy: int = 0, phase: int = 0) -> dict:
        chosen = self.columns.get(self.choice.choose(row[schema.KEY], epoch, copy, phase))
        if chosen is not None and row[chosen[0]] != "":
            row[self.text_column] = row[chosen[1]]
            if len(chosen) > 2:
                row[schema.TEXT_TOKENS] = row[chosen[2]]
        for names in self.columns.values():
            for name in names:
                row.pop(name, None)
        return row
