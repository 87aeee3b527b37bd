"""CpuWatch callback: torch's threads follow the CPUs other work leaves free, between batches.

The trainer adds it by itself where :func:`diffusion.cpus.spin_watch` applies: a CPU whose threads spin
because the machine was quiet at start, one rank on the node, pools sized by us. Each change prints one
line (``# cpus: other work is using 1.4 of 2 CPUs: torch threads 2 -> 1 ...``); at fit end the count
chosen at start comes back. ``DIFFUSION_CPU_WATCH=off`` turns it off.
"""

from __future__ import annotations

from composer.core import Callback, State
from composer.loggers import Logger

from diffusion.cpus import SpinWatch


class CpuWatch(Callback):
    def __init__(self, watch: SpinWatch):
        self.watch = watch

    def batch_end(self, state: State, logger: Logger) -> None:
        line = self.watch.poll()  # the training thread's own OpenMP setting: set here, not from another thread
        if line:
            print(line, flush=True)
            logger.log_metrics({"cpus/torch_threads": self.watch.threads})

    def fit_end(self, state: State, logger: Logger) -> None:
        self.watch.restore()
