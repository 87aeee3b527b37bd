"""TextEncoderShare callback: how much of each training step the frozen text encoder takes.

A run that trains from token ids (``model.text: ids``) encodes the batch's captions in every step; MFU
(Composer's SpeedMonitor, from :meth:`StableDiffusion.flops_per_batch`) still counts the UNet's training
FLOPs only, so this is where the trade shows. Every ``interval`` and at fit end it logs

    time/text_encoder_share   text encoder seconds / training wall seconds since the last log

The trainer adds it by itself to every run whose model has a text encoder; for other runs it logs
nothing.
"""

from __future__ import annotations

import time

from composer.core import Callback, Event, State
from composer.loggers import Logger
from composer.utils import create_interval_scheduler

SHARE_KEY = "time/text_encoder_share"


def _text_encoder(state: State):
    model = state.model
    model = getattr(model, "module", model)  # DDP
    return getattr(model, "text_encoder", None)


class TextEncoderShare(Callback):
    """Log the text encoder's share of training time (``time/text_encoder_share``).

    Args:
        interval: a Composer time string ("100ba"); also logged at fit end.
    """

    def __init__(self, interval: str = "100ba"):
        self._due = create_interval_scheduler(interval, include_end_of_training=False, checkpoint_events=False)
        self._since: float | None = None
        self.last: float | None = None  # the last share logged

    def fit_start(self, state: State, logger: Logger) -> None:
        encoder = _text_encoder(state)
        if encoder is not None:
            encoder.take_seconds()  # start from zero: nothing before the first step counts
        self._since = time.perf_counter()

    def batch_end(self, state: State, logger: Logger) -> None:
        if self._due(state, Event.BATCH_END):
            self._log(state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        self._log(state, logger)

    def _log(self, state: State, logger: Logger) -> None:
        encoder = _text_encoder(state)
        if encoder is None or self._since is None:
            return
        seconds = encoder.take_seconds()  # waits for the GPU's last encode, so the wall time below covers it
        now = time.perf_counter()
        wall, self._since = now - self._since, now
        if wall > 0:
            self.last = seconds / wall
            logger.log_metrics({SHARE_KEY: self.last})
