"""NaNCatcher: stop training at the first batch whose loss is NaN or infinite, saying which batch."""

from __future__ import annotations

import math

import torch
from composer.core import Callback, State
from composer.loggers import Logger


class NonFiniteLossError(RuntimeError):
    """The training loss became NaN or infinite."""


def _loss_values(loss) -> list[torch.Tensor]:
    # state.loss is a tensor, or a dict/list/tuple of tensors when the model returns several losses.
    if isinstance(loss, dict):
        return [v for item in loss.values() for v in _loss_values(item)]
    if isinstance(loss, (list, tuple)):
        return [v for item in loss for v in _loss_values(item)]
    if isinstance(loss, torch.Tensor):
        return [loss.detach()]
    if isinstance(loss, (int, float)):
        return [torch.tensor(float(loss))]
    return []


class NaNCatcher(Callback):
    """After every batch, raise :class:`NonFiniteLossError` if the loss is NaN/inf.

    The check costs one device sync per batch (a scalar); the loss logger syncs anyway.
    """

    def batch_end(self, state: State, logger: Logger) -> None:
        values = _loss_values(state.loss)
        if not values:
            return
        # One reduction and one host sync, however many loss terms there are.
        finite = bool(torch.stack([torch.isfinite(v).all() for v in values]).all())
        if finite:
            return
        ts = state.timestamp
        batch = int(ts.batch)  # batches completed, this one included
        loss = [float(v.float().mean()) for v in values]
        what = "NaN" if any(math.isnan(v) for v in loss) else "infinite"
        raise NonFiniteLossError(
            f"training loss is {what} ({', '.join(f'{v:g}' for v in loss)}) at batch index {batch - 1} "
            f"(batch {batch} of the run, epoch {int(ts.epoch)}, {int(ts.sample)} samples seen, "
            f"batch {int(ts.batch_in_epoch)} of this epoch); stopping. Usual causes: a learning rate too "
            f"high for this batch size, fp16 overflow (use amp_bf16), or a corrupt sample in that batch.")
