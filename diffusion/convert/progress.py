"""The conversion's progress line: rows done of the input's, written, rejected, rate and ETA.

    [convert] rows 1,234/10,000 (12.3%)  written 1,100  rejected 134  45.2 rows/s  elapsed 27s  ETA 3m14s

A thread of the driver counts what is on disk, as the summary does (:mod:`diffusion.convert.summary`):
committed parts and reject records, each file read once, so a resumed job shows the whole job and the
rate is this run's. To a terminal the line is redrawn in place every second; to a log file (not a TTY)
a new line is printed every ``LOG_SECONDS``, so a log stays short. The input's row count comes from the
parquet footers (a tar's or tfrecord's metadata parquet beside it; a folder's images one each), read by
the same thread; where it cannot be known (a tar without its metadata) the line has no total and no ETA.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Callable, TextIO

from diffusion.cli import format_seconds
from diffusion.convert.sink import REJECTS_DIR, STATS_RECORD, committed_parts, is_record, part_roots, read_rejects

LINE_PREFIX = "[convert] "
TTY_SECONDS = 1.0  # a terminal's line is redrawn this often
LOG_SECONDS = 60.0  # a log file gets a line this often


def input_rows(formats: dict[str, str], columns) -> int | None:
    """Rows the input holds (failed downloads, ``status`` other than ``success``, left out, as the read
    leaves them out), from parquet footers and status columns; None where a file's count is unknown."""
    import pyarrow.parquet as pq

    from diffusion.convert.files import _open
    from diffusion.schema import RAW_STATUS
    total = 0
    for uri, fmt in formats.items():
        if fmt == "folder":
            total += 1
            continue
        parquet = uri if fmt == "parquet" else os.path.splitext(uri)[0] + ".parquet"
        try:
            with _open(parquet) as f:
                pf = pq.ParquetFile(f)
                if RAW_STATUS in pf.schema_arrow.names:
                    status = pf.read(columns=[RAW_STATUS]).column(0).to_pylist()
                    total += sum(1 for s in status if s == "success")
                else:
                    total += pf.metadata.num_rows
        except Exception:  # no metadata beside a shard, or a file the read will record as failed
            return None
    return total


class DiskCounts:
    """(written, rejected) under an output directory, read incrementally: a committed part's stats and a
    reject record are read once (neither changes once written)."""

    def __init__(self, out: str):
        self.out = out
        self._written: dict[str, int] = {}
        self._records: set[str] = set()
        self._rejected: set[str] = set()  # ids: a row recorded twice (a batch redone) counts once

    def __call__(self) -> tuple[int, int]:
        import json
        for root in part_roots(self.out):
            for part in committed_parts(root):
                path = os.path.join(root, part)
                if path not in self._written:
                    try:
                        with open(os.path.join(path, STATS_RECORD)) as f:
                            self._written[path] = int(json.load(f).get("count", 0))
                    except (OSError, ValueError):
                        continue  # read again next time
        rejects = os.path.join(self.out, REJECTS_DIR)
        for name in os.listdir(rejects) if os.path.isdir(rejects) else []:
            if is_record(name) and name not in self._records:
                records = read_rejects(os.path.join(rejects, name))
                if records is not None:
                    self._records.add(name)
                    self._rejected.update(records)
        return sum(self._written.values()), len(self._rejected)


class ConversionProgress:
    """The progress line (module docstring), printed by a daemon thread between :meth:`start` and
    :meth:`stop`; ``total`` is a callable giving the input's rows (or None), called on that thread."""

    def __init__(self, out: str, total: Callable[[], int | None] | None = None, limit: int | None = None,
                 stream: TextIO | None = None, every_seconds: float | None = None,
                 clock: Callable[[], float] = time.monotonic):
        self.counts = DiskCounts(out)
        self.stream = stream if stream is not None else sys.stderr
        self.tty = bool(getattr(self.stream, "isatty", lambda: False)())
        self.every = every_seconds or (TTY_SECONDS if self.tty else LOG_SECONDS)
        self.clock = clock
        self._total_of, self._limit, self.total = total, limit, None
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._start_time = self._start_rows = None
        self._width = 0

    def line(self) -> str:
        written, rejected = self.counts()
        rows, now = written + rejected, self.clock()
        if self._start_time is None:
            self._start_time, self._start_rows = now, rows
        elapsed = now - self._start_time
        rate = (rows - self._start_rows) / elapsed if elapsed > 0 else 0.0
        done = f"rows {rows:,}"
        eta = ""
        if self.total:
            done += f"/{self.total:,} ({100.0 * min(rows, self.total) / self.total:.1f}%)"
            if rate > 0:
                eta = f"  ETA {format_seconds(max(self.total - rows, 0) / rate)}"
        return (f"{LINE_PREFIX}{done}  written {written:,}  rejected {rejected:,}  {rate:.1f} rows/s  "
                f"elapsed {format_seconds(elapsed)}{eta}")

    def _show(self, final: bool = False) -> None:
        text = self.line()
        if self.tty:  # redrawn in place; blanks cover a longer line before it
            self.stream.write("\r" + text.ljust(self._width) + ("\n" if final else ""))
            self._width = len(text)
        else:
            self.stream.write(text + "\n")
        self.stream.flush()

    def _run(self) -> None:
        if self._total_of is not None:
            try:
                self.total = self._total_of()
            except Exception:  # a count is a nicety: never the reason a conversion fails
                self.total = None
            if self.total is not None and self._limit is not None:
                self.total = min(self.total, self._limit)
        while not self._stop.wait(self.every):
            try:
                self._show()
            except Exception:  # an output being rewritten under us: the next tick reads it again
                pass

    def start(self) -> "ConversionProgress":
        self.line()  # the starting count: the rate is this run's
        self._thread = threading.Thread(target=self._run, name="convert-progress", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        """Stop the thread; a terminal's line is drawn a last time and ended."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
        if self.tty:
            try:
                self._show(final=True)
            except Exception:
                pass

    def __enter__(self) -> "ConversionProgress":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()
