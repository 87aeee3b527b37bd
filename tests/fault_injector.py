"""FaultInjector: a test-only callback that kills its own training process once, mid-run.

Used to check fault tolerance (online mode under Ray Train, or a Composer launch): the process exits
abruptly at the end of one batch on one rank, as a crashed or preempted worker would. A marker file
records that the fault already happened, so the restarted run trains through to the end.
"""

from __future__ import annotations

import os

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist


class FaultInjector(Callback):
    """Exit the process (``os._exit``) at the end of batch ``at_batch`` on global rank ``rank``, once.

    Args:
        at_batch: the (1-based) batch count at whose end the process dies.
        marker: a path on storage every restart sees; written just before dying, and while it exists
            the injector does nothing.
        rank: the global rank that dies.
        exit_code: the process exit status (non-zero, so the launcher treats it as a failure).
    """

    def __init__(self, at_batch: int, marker: str, rank: int = 0, exit_code: int = 1):
        if at_batch < 1:
            raise ValueError(f"at_batch must be >= 1, got {at_batch}")
        self.at_batch, self.marker, self.rank, self.exit_code = int(at_batch), str(marker), int(rank), exit_code

    @property
    def fired(self) -> bool:
        return os.path.exists(self.marker)

    def batch_end(self, state: State, logger: Logger) -> None:
        if int(state.timestamp.batch) != self.at_batch or dist.get_global_rank() != self.rank or self.fired:
            return
        os.makedirs(os.path.dirname(os.path.abspath(self.marker)), exist_ok=True)
        with open(self.marker, "w") as f:
            f.write(f"killed rank {self.rank} at batch {self.at_batch}\n")
        # No cleanup, no exception: the point is to look like a crash.
        os._exit(self.exit_code)
