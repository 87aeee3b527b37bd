"""CostProjection callback: what the configured schedule will cost at the throughput this run measures.

Times the run (wall clock from the end of batch ``warmup_batches``, so compilation and data-loader start-up
do not count, to each projection) and logs, every ``interval`` and at fit end:

    cost/samples_per_sec_per_gpu, cost/gpu_hours, cost/days, cost/dollars

for this run's ``max_duration`` (in samples: batches x global batch) plus any ``extra_phases`` (e.g. the
512 px phase while the 256 px phase runs), on ``gpus`` GPUs (default: this run's world size) at
``price_per_gpu_hour``. The numbers come from :func:`diffusion.cost.project_cost`.

The evals, checkpoints and image grids of the timed span count in its rate, as they count in the run's
wall time and bill: the rate is the schedule's as it runs, not the training step's alone (Composer's
``throughput/device/samples_per_sec``, which ``diffusion.cost --from-run`` prefers, pauses for evals). A
projection logged just after an eval holds that eval whole in a short span: the later ones spread it.
"""

from __future__ import annotations

import time

from composer.core import Callback, Event, State, TimeUnit
from composer.loggers import Logger
from composer.utils import create_interval_scheduler, dist

from diffusion import cost


class CostProjection(Callback):
    """Log projected GPU-hours, days and $ of the configured schedule at the measured throughput.

    Args:
        price_per_gpu_hour: $ per GPU-hour.
        interval: a Composer time string ("500ba"); the projection is also logged at fit end.
        gpus: GPUs to project for (default: the world size of this run; scaling assumed linear).
        resolution: the resolution this run trains at (a label in the projection).
        extra_phases: other phases of the schedule, ``[{"resolution": 512, "samples": ..., "samples_per_sec_per_gpu": ...}]``.
        warmup_batches: batches not timed at the start of each fit.
    """

    def __init__(self, price_per_gpu_hour: float = 2.0, interval: str = "500ba", gpus: int | None = None,
                 resolution: int = 256, extra_phases: list[dict] | None = None, warmup_batches: int = 2):
        self.price_per_gpu_hour, self.gpus, self.resolution = price_per_gpu_hour, gpus, int(resolution)
        self.extra_phases = [dict(p) for p in extra_phases or []]
        for p in self.extra_phases:
            missing = {"resolution", "samples", "samples_per_sec_per_gpu"} - set(p)
            if missing:
                raise ValueError(f"CostProjection extra_phases entry {p} lacks {', '.join(sorted(missing))}")
        self.warmup_batches = warmup_batches
        self._due = create_interval_scheduler(interval, include_end_of_training=False, checkpoint_events=False)
        self._start: tuple[float, int] | None = None  # (time, samples) when timing began
        self._seen = 0
        self.last: cost.CostProjection | None = None

    def fit_start(self, state: State, logger: Logger) -> None:
        self._start, self._seen = None, 0

    def batch_end(self, state: State, logger: Logger) -> None:
        self._seen += 1
        if self._seen == self.warmup_batches or (self._start is None and self.warmup_batches <= 0):
            self._start = (time.perf_counter(), int(state.timestamp.sample))
        elif self._due(state, Event.BATCH_END):
            self.log_projection(state, logger)

    def fit_end(self, state: State, logger: Logger) -> None:
        self.log_projection(state, logger)

    def samples_per_sec_per_gpu(self, state: State) -> float | None:
        """Measured since warm-up; None until at least one timed batch has run."""
        if self._start is None:
            return None
        seconds = time.perf_counter() - self._start[0]
        samples = int(state.timestamp.sample) - self._start[1]  # Composer counts samples over all ranks
        if seconds <= 0 or samples <= 0:
            return None
        return samples / seconds / dist.get_world_size()

    def scheduled_samples(self, state: State) -> int:
        """This run's max_duration in samples (batches x the global batch the run has used so far)."""
        duration, ts = state.max_duration, state.timestamp
        if duration is None:
            raise ValueError("CostProjection needs the trainer's max_duration")
        if duration.unit == TimeUnit.SAMPLE:
            return int(duration.value)
        global_batch = int(ts.sample) / max(int(ts.batch), 1)
        if duration.unit == TimeUnit.BATCH:
            return int(round(duration.value * global_batch))
        if duration.unit == TimeUnit.EPOCH and state.dataloader_len is not None:
            return int(round(duration.value * int(state.dataloader_len) * global_batch))
        raise ValueError(f"CostProjection cannot turn max_duration {duration} into samples")

    def log_projection(self, state: State, logger: Logger) -> cost.CostProjection | None:
        rate = self.samples_per_sec_per_gpu(state)
        if rate is None:
            return None
        samples = {self.resolution: self.scheduled_samples(state)}
        rates, sources = {self.resolution: rate}, {self.resolution: "measured"}
        for p in self.extra_phases:
            samples[int(p["resolution"])] = int(p["samples"])
            rates[int(p["resolution"])] = float(p["samples_per_sec_per_gpu"])
        self.last = cost.project_cost(samples, rates, self.gpus or dist.get_world_size(),
                                      self.price_per_gpu_hour, sources)
        logger.log_metrics({cost.OWN_KEY: rate, "cost/gpu_hours": self.last.gpu_hours,
                            "cost/days": self.last.days, "cost/dollars": self.last.dollars})
        return self.last
