"""The held-out loss: each sample of the eval set counted once, on any number of ranks.

Streaming hands every rank the same number of eval samples: where the set does not divide evenly, it repeats
some samples to fill the shorter ranks' shares (and the canonical nodes' partitions), and a loader that drops
its last incomplete batch never scores the set's tail. A plain mean of the batches' losses is then the mean of
another set: 24 of 30 samples at a batch of 8 on one rank, 2 samples counted twice on 4 ranks. The eval loader
keeps its last batch (``build_dataloader(..., drop_last=False)``), and this metric keeps each sample's loss by
its index in the dataset: on ``compute`` the ranks' samples are gathered (torchmetrics' ``cat`` states), a
sample seen more than once counts once (its losses averaged: they are equal, the noise and level being pinned
by the index, up to the batch's float rounding), and the mean is over the distinct samples.

A batch without sample indices (a source that carries none) counts each of its samples once as it comes.
``update`` is called for every batch, with no samples where a batch has none for this metric (an MLPerf
bin): every rank then holds its states in their own dtypes when torchmetrics gathers them.
"""

from __future__ import annotations

import torch
from torchmetrics import Metric
from torchmetrics.utilities import dim_zero_cat

NO_INDEX = -1


class HeldOutLoss(Metric):
    """The mean per-sample loss over the distinct samples seen (by sample index), across ranks."""

    full_state_update = False

    def __init__(self, **kwargs):
        super().__init__(**kwargs)
        self.add_state("index", default=[], dist_reduce_fx="cat")
        self.add_state("loss", default=[], dist_reduce_fx="cat")

    def update(self, per_sample: torch.Tensor, index: torch.Tensor | None = None) -> None:
        """``per_sample``: (B,) losses; ``index``: (B,) the samples' indices in the dataset, or None."""
        per_sample = per_sample.detach().float().reshape(-1)
        if index is None:
            index = torch.full_like(per_sample, NO_INDEX, dtype=torch.long)
        self.index.append(index.to(per_sample.device, torch.long).reshape(-1))
        self.loss.append(per_sample)

    def compute(self) -> torch.Tensor:
        if isinstance(self.loss, list) and not self.loss:  # no eval batch
            return torch.tensor(float("nan"))
        index, loss = dim_zero_cat(self.index).long(), dim_zero_cat(self.loss)
        if not loss.numel():
            return torch.tensor(float("nan"))
        indexed = index != NO_INDEX
        unique, inverse = torch.unique(index[indexed], return_inverse=True)
        sums = torch.zeros(len(unique), dtype=torch.float64, device=loss.device)
        sums.index_add_(0, inverse, loss[indexed].double())
        counts = torch.zeros_like(sums).index_add_(0, inverse, torch.ones_like(sums[inverse]))
        each = torch.cat([sums / counts, loss[~indexed].double()])
        return each.mean().float()
