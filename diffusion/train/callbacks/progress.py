"""ProgressLine: one plain line every few seconds while training, and one at the end.

Composer's console logger prints every ``log_interval`` batches, which on a CPU can be minutes apart;
its progress bar redraws a terminal line and makes a mess of a log file. This callback prints, on rank 0
only, a single line at most every ``every_seconds`` (checked at the end of each batch) and a last one
when ``fit()`` ends::

    [progress] batch 120/4000 (3.0%)  loss 0.1234  32.1 samples/s  elapsed 2m00s  ETA 1h04m

``loss`` is this rank's mean training loss over the batches since the previous line; ``samples/s``
counts all ranks' samples over the same span; the ETA extrapolates the rate of this ``fit()`` (so a
resumed run's ETA is not skewed by the batches it resumed past). The final line gives the averages
over the whole ``fit()``. Enable it in a YAML with ``callbacks: {progress: {every_seconds: 10}}``.
"""

from __future__ import annotations

import sys
import time
from typing import Callable, Optional, TextIO

import torch
from composer.core import Callback, State, TimeUnit
from composer.loggers import Logger
from composer.utils import dist

from diffusion.cli import format_seconds
from diffusion.train.callbacks.nan_catcher import loss_tensors

LINE_PREFIX = "[progress] "  # every line starts so (diffusion.online picks them out of Ray workers' output)
_UNIT_NAMES = {TimeUnit.BATCH: "batch", TimeUnit.EPOCH: "epoch", TimeUnit.SAMPLE: "sample",
               TimeUnit.TOKEN: "token"}


class ProgressLine(Callback):
    """Print a progress line on rank 0 every ``every_seconds`` of training, and one at the end.

    Args:
        every_seconds: least wall time between two lines (the check runs after each batch, so a line
            comes at the first batch end after this much time).
        stream: where the lines go (default: ``sys.stdout`` at the time of printing).
        clock: a ``time.monotonic``-like function (tests pass a fake one).
    """

    def __init__(self, every_seconds: float = 10.0, stream: Optional[TextIO] = None,
                 clock: Callable[[], float] = time.monotonic):
        if every_seconds <= 0:
            raise ValueError(f"every_seconds must be positive, got {every_seconds}")
        self.every_seconds = float(every_seconds)
        self.stream = stream
        self.clock = clock
        self._reset(None)

    def _reset(self, state: Optional[State]) -> None:
        now = self.clock()
        samples = int(state.timestamp.sample) if state is not None else 0
        self._fit_start = self._last_time = now
        self._fit_start_samples = self._last_samples = samples
        self._fit_start_fraction = _fraction_done(state) if state is not None else 0.0
        self._loss_sum: Optional[torch.Tensor] = None  # summed on the device: no host sync per batch
        self._loss_batches = 0
        self._batch_sum: Optional[torch.Tensor] = None  # this batch's microbatch losses x their sizes
        self._batch_samples = 0
        self._fit_loss_sum = 0.0
        self._fit_loss_batches = 0

    # ---- Composer events --------------------------------------------------------------------------

    def fit_start(self, state: State, logger: Logger) -> None:
        self._reset(state)

    def after_loss(self, state: State, logger: Logger) -> None:
        # Once per microbatch, before Composer scales the loss in place for its backward: the batch's loss
        # is the mean over its microbatches weighted by their sizes, as loss/train/total is logged.
        values = loss_tensors(state.loss)
        if values:
            size = _samples(state.batch)
            loss = torch.stack([v.detach().float().mean() for v in values]).sum() * size
            self._batch_sum = loss if self._batch_sum is None else self._batch_sum + loss
            self._batch_samples += size

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._batch_samples:
            loss = self._batch_sum / self._batch_samples
            self._loss_sum = loss if self._loss_sum is None else self._loss_sum + loss
            self._loss_batches += 1
        self._batch_sum, self._batch_samples = None, 0
        if self.clock() - self._last_time >= self.every_seconds:
            self._print(state, final=False)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._print(state, final=True)

    # ---- the line ---------------------------------------------------------------------------------

    def _take_window_loss(self) -> Optional[float]:
        if not self._loss_batches:
            return None
        total, count = float(self._loss_sum), self._loss_batches
        self._fit_loss_sum += total
        self._fit_loss_batches += count
        self._loss_sum, self._loss_batches = None, 0
        return total / count

    def line(self, state: State, final: bool = False) -> str:
        """The progress line for ``state`` now (and the start of a new window)."""
        now = self.clock()
        samples = int(state.timestamp.sample)
        window_loss = self._take_window_loss()
        if final:
            seconds, new_samples = now - self._fit_start, samples - self._fit_start_samples
            loss = self._fit_loss_sum / self._fit_loss_batches if self._fit_loss_batches else None
        else:
            seconds, new_samples, loss = now - self._last_time, samples - self._last_samples, window_loss
        self._last_time, self._last_samples = now, samples

        parts = [("done: " if final else "") + _position(state)]
        if loss is not None:
            parts.append(f"loss {loss:.4f}" + (" (mean)" if final else ""))
        if seconds > 0:
            parts.append(f"{new_samples / seconds:.1f} samples/s" + (" (mean)" if final else ""))
        elapsed = now - self._fit_start
        parts.append(f"elapsed {format_seconds(elapsed)}")
        if not final:
            done, start = _fraction_done(state), self._fit_start_fraction
            if done > start and elapsed > 0:
                parts.append(f"ETA {format_seconds(elapsed * (1.0 - done) / (done - start))}")
        return LINE_PREFIX + "  ".join(parts)

    def _print(self, state: State, final: bool) -> None:
        text = self.line(state, final=final)
        if dist.get_global_rank() != 0:
            return
        stream = self.stream or sys.stdout
        print(text, file=stream, flush=True)


def _position(state: State) -> str:
    """``batch 120/4000 (3.0%)``, or in the unit of ``max_duration`` (``epoch 1/3 (33.3%), batch 120``)."""
    ts, max_duration = state.timestamp, state.max_duration
    batch = int(ts.batch)
    if max_duration is None:
        return f"batch {batch}"
    unit = _UNIT_NAMES.get(max_duration.unit, max_duration.unit.value)
    percent = f"({100 * _fraction_done(state):.1f}%)"
    if max_duration.unit == TimeUnit.BATCH:
        return f"batch {batch}/{max_duration.value} {percent}"
    return f"{unit} {int(ts.get(max_duration.unit))}/{max_duration.value} {percent}, batch {batch}"


def _fraction_done(state: State) -> float:
    """How much of ``max_duration`` is done, in [0, 1]; within an epoch too when the epoch's length is known."""
    max_duration = state.max_duration
    if max_duration is None or not max_duration.value:
        return 0.0
    ts = state.timestamp
    done = float(ts.get(max_duration.unit))
    if max_duration.unit == TimeUnit.EPOCH:
        length = state.dataloader_len
        if length is not None and int(length) > 0:
            done += min(int(ts.batch_in_epoch) / int(length), 1.0)
    return min(max(done / max_duration.value, 0.0), 1.0)


def _samples(batch) -> int:
    """Samples in a (micro)batch: the first dimension of its first tensor."""
    values = batch.values() if isinstance(batch, dict) else batch if isinstance(batch, (list, tuple)) else [batch]
    return next((int(v.shape[0]) for v in values if isinstance(v, torch.Tensor) and v.dim() > 0), 1)

