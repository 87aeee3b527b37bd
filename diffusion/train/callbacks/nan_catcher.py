"""NaNCatcher: stop training at the first batch whose loss is NaN or infinite in any microbatch, saying
which batch, microbatch and rank; and never let non-finite weights be checkpointed.

Composer leaves ``state.loss`` at the *last* microbatch's loss, so checking it alone misses a NaN in
any other microbatch. What this checks instead:

- after every microbatch's loss (``Event.AFTER_LOSS``), a finite flag kept on the device (no sync);
- at ``BATCH_END``, Composer's ``total_loss_dict``: the sum of every microbatch's loss, averaged over
  the ranks, already on the host. One non-finite microbatch on any rank makes it non-finite, and every
  rank sees the same value, so all ranks stop together (none is left waiting in a collective). Only
  then one small collective finds the first bad microbatch and its rank, for the message. This is
  before the batch's eval and checkpoint events;
- before a checkpoint is written (a checkpoint event on which Composer's ``CheckpointSaver`` will
  save), the weights and the EMA's averages, every rank's shards, in one pass: a loss can be finite
  while its gradients are not, and then the weights the step wrote are not.
"""

from __future__ import annotations

import math

import torch
from composer.core import Callback, Event, State
from composer.loggers import Logger
from composer.utils import dist


class NonFiniteLossError(RuntimeError):
    """The training loss (or the weights about to be saved) became NaN or infinite."""


def loss_tensors(loss) -> list[torch.Tensor]:
    """``state.loss`` as tensors: a tensor, or a dict/list/tuple of them when the model returns several."""
    if isinstance(loss, dict):
        return [v for item in loss.values() for v in loss_tensors(item)]
    if isinstance(loss, (list, tuple)):
        return [v for item in loss for v in loss_tensors(item)]
    if isinstance(loss, torch.Tensor):
        return [loss.detach()]
    if isinstance(loss, (int, float)):
        return [torch.tensor(float(loss))]
    return []


def _all_finite(tensors: list[torch.Tensor]) -> torch.Tensor:
    """One device bool: every element of every tensor is finite (no host sync)."""
    flags = [torch.isfinite(t).all() for t in tensors if t.numel()]
    return torch.stack(flags).all() if flags else torch.tensor(True)


def _where(state: State, batch: int) -> str:
    ts = state.timestamp
    return (f"at batch index {batch - 1} (batch {batch} of the run, epoch {int(ts.epoch)}, {int(ts.sample)} "
            f"samples seen, batch {int(ts.batch_in_epoch)} of this epoch)")


_CAUSES = ("Usual causes: a learning rate too high for this batch size, fp16 overflow (use amp_bf16), or a "
           "corrupt sample in that batch.")


def _save_due(state: State, event: Event) -> bool:
    """Whether Composer's checkpoint saver writes a checkpoint on this event (its own test, which has no
    side effect that changes its answer when asked twice)."""
    from composer.callbacks import CheckpointSaver
    for callback in state.callbacks:
        if isinstance(callback, CheckpointSaver):
            try:
                if (callback.save_interval(state, event)
                        and callback.last_checkpoint_batch != state.timestamp.batch):
                    return True
            except Exception:  # an interval we cannot ask about: check anyway
                return True
    return False


class NaNCatcher(Callback):
    """Raise :class:`NonFiniteLossError` at the end of a batch with a NaN/inf loss in any microbatch, and
    before saving a checkpoint whose weights (or EMA averages) are not finite.

    Costs per batch: one device-side flag per microbatch and a look at the loss Composer already
    synchronised; a pass over the local weights only when a checkpoint is about to be written.
    """

    def __init__(self):
        self._finite: list[torch.Tensor] = []  # per microbatch of the current batch, this rank
        self._losses: list[list[torch.Tensor]] = []

    # ---- the loss of every microbatch --------------------------------------------------------------
    def before_train_batch(self, state: State, logger: Logger) -> None:
        # Per attempt: auto-microbatching re-runs a batch after an OOM, with new microbatches.
        self._finite, self._losses = [], []

    def after_loss(self, state: State, logger: Logger) -> None:
        values = loss_tensors(state.loss)
        if values:
            self._finite.append(_all_finite(values))
            self._losses.append(values)

    def batch_end(self, state: State, logger: Logger) -> None:
        totals = getattr(state, "total_loss_dict", None) or {}
        if totals:
            bad = {k: v for k, v in totals.items() if not math.isfinite(float(v))}
            if not bad:
                return
            losses = [float(v) for v in bad.values()]
            shown = ", ".join(f"{k.rsplit('/', 1)[-1]}={float(v):g}" for k, v in bad.items())
            where_in_batch = self._first_bad_microbatch(state, collective=True)
        else:  # no synchronised total (not Composer's training loop): this rank's microbatches
            if not self._finite or bool(torch.stack(self._finite).all()):
                return
            losses = [float(v.float().mean()) for values in self._losses for v in values]
            shown = ", ".join(f"{v:g}" for v in losses if not math.isfinite(v))
            where_in_batch = self._first_bad_microbatch(state, collective=False)
        what = "NaN" if any(math.isnan(v) for v in losses) else "infinite"
        raise NonFiniteLossError(
            f"training loss is {what} ({shown}) {_where(state, int(state.timestamp.batch))}{where_in_batch}; "
            f"stopping before this batch is evaluated or checkpointed. {_CAUSES}")

    def _first_bad_microbatch(self, state: State, collective: bool) -> str:
        """``": first in microbatch m of n on rank r"``, from every rank's flags (one collective when asked:
        all ranks are here together, as they all saw the same non-finite total)."""
        n = len(self._finite)
        first = 0
        if n:
            bad = (~torch.stack(self._finite)).nonzero()
            first = int(bad[0, 0]) + 1 if len(bad) else 0
        world, rank = dist.get_world_size(), dist.get_global_rank()
        if collective and world > 1:
            table = torch.zeros(world, 2, dtype=torch.int64)
            table[rank] = torch.tensor([first, n])
            table = state.device.tensor_to_device(table)
            dist.all_reduce(table, reduce_operation="SUM")
            rows = table.cpu().tolist()
        else:
            rows = {rank: [first, n]}
            rows = [rows.get(r, [0, 0]) for r in range(max(world, rank + 1))]
        for r, (first_r, n_r) in enumerate(rows):
            if first_r:
                return f": first in microbatch {first_r} of {n_r} on rank {r}"
        return ""

    # ---- nothing non-finite is saved ----------------------------------------------------------------
    def batch_checkpoint(self, state: State, logger: Logger) -> None:
        self._check_before_save(state, Event.BATCH_CHECKPOINT)

    def epoch_checkpoint(self, state: State, logger: Logger) -> None:
        self._check_before_save(state, Event.EPOCH_CHECKPOINT)

    def iteration_checkpoint(self, state: State, logger: Logger) -> None:
        self._check_before_save(state, Event.ITERATION_CHECKPOINT)

    @torch.no_grad()
    def _check_before_save(self, state: State, event: Event) -> None:
        # Every rank asks the same (timestamp-based) question, so all enter the all-reduce below.
        if not _save_due(state, event):
            return
        named = _named_state_tensors(state)
        finite = _all_finite([t for _, t in named])
        bad = state.device.tensor_to_device(torch.tensor([0 if bool(finite) else 1], dtype=torch.int64))
        dist.all_reduce(bad, reduce_operation="MAX")
        if not int(bad.item()):
            return
        local = [name for name, t in named if t.numel() and not bool(torch.isfinite(t).all())]
        names = f"{len(local)} tensor(s) on rank {dist.get_global_rank()}, e.g. {', '.join(local[:3])}" \
            if local else f"on another rank than {dist.get_global_rank()}"
        batch = int(state.timestamp.batch)
        raise NonFiniteLossError(
            f"weights are not finite after batch index {batch - 1} (batch {batch} of the run): {names}. Every "
            f"loss was finite: non-finite gradients? Not saving this checkpoint; the last one written stays "
            f"the latest. {_CAUSES}")


def _named_state_tensors(state: State) -> list[tuple[str, torch.Tensor]]:
    """This rank's weights (local shards under FSDP) and EMA averages, by name."""
    from diffusion.train.algorithms.ema import EMA, parameter_name
    named = [(parameter_name(n), p.detach()) for n, p in state.model.named_parameters()]
    for algorithm in state.algorithms:
        if isinstance(algorithm, EMA):
            named += [(f"EMA of {n}", t) for n, t in algorithm.local_averages()]
    return [(n, t.to_local() if hasattr(t, "to_local") else t) for n, t in named]
