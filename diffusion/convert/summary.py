"""Counting a conversion from what is on disk: committed parts, their stats, and the reject files.

Counts come from files, not from the run's memory, so a resumed job reports the whole job, and keys
recorded twice (an actor restarted, a batch redone after a kill) are counted once. Damaged records are
left out, never a crash: a part that is not committed (:func:`diffusion.convert.sink.read_part`) holds
nothing, an unreadable reject file rejects nothing (its rows are redone), an unreadable failed-input
record lists nothing (the file is tried again).
"""

from __future__ import annotations

import dataclasses
import json
import os

from diffusion.convert.failed_inputs import FAILED_INPUTS_DIR, read_failed_inputs
from diffusion.convert.sink import (EMPTY_COUNTED, EMPTY_PREFIX, KEYS_RECORD, REJECTS_DIR, STATS_RECORD, committed_parts, is_record, part_roots,
                                    read_rejects)


FAILED_SHOWN = 10  # failed input files listed by name in the table


@dataclasses.dataclass
class ConversionSummary:
    written: int = 0
    rejects: dict[str, int] = dataclasses.field(default_factory=dict)  # reason -> count
    parts: int = 0
    wall_seconds: float = 0.0  # this run only
    written_this_run: int = 0
    stage_seconds: dict[str, float] = dataclasses.field(default_factory=dict)  # summed over workers
    failed_inputs: dict[str, str] = dataclasses.field(default_factory=dict)  # input file -> why it was skipped
    empty_captions: dict[str, int] = dataclasses.field(default_factory=dict)  # --captions: name -> empty ones
    histograms: dict[str, dict[int, int]] = dataclasses.field(default_factory=dict)  # --embed: score -> {bin: rows}

    @property
    def rows_in(self) -> int:
        return self.written + sum(self.rejects.values())

    def table(self) -> str:
        """The summary a user reads at the end of a run."""
        label = max([28, *(len("rejected: " + reason) + 2 for reason in self.rejects)])  # --where rules are long
        lines = [f"{'rows in':<{label}}{self.rows_in:>10}", f"{'written':<{label}}{self.written:>10}"]
        for reason, n in sorted(self.rejects.items()):
            lines.append(f"{'rejected: ' + reason:<{label}}{n:>10}")
        for caption, n in sorted(self.empty_captions.items()):
            lines.append(f"{'empty caption ' + caption + ' (kept)':<{label}}{n:>10}")
        if self.failed_inputs:
            lines.append(f"{'input files failed, skipped':<{label}}{len(self.failed_inputs):>10}")
        lines.append(f"{'parts':<{label}}{self.parts:>10}")
        if self.wall_seconds > 0:
            rate = self.written_this_run / self.wall_seconds
            lines.append(f"{'images/s overall (this run)':<{label}}{rate:>10.1f}")
        for stage, seconds in sorted(self.stage_seconds.items()):
            if seconds > 0:
                name = stage.removesuffix("_seconds")
                lines.append(f"{'images/s per ' + name + ' worker':<{label}}{self.written / seconds:>10.1f}")
        if self.histograms:
            from diffusion.convert.curate import histogram_lines, histograms_of
            lines += ["score histograms (written rows):",
                      *("  " + line for line in histogram_lines(histograms_of(self.histograms)))]
        width = max(len(line) for line in lines)
        failed = [f"  {name}: {error}" for name, error in sorted(self.failed_inputs.items())[:FAILED_SHOWN]]
        if len(self.failed_inputs) > FAILED_SHOWN:
            failed.append(f"  ... and {len(self.failed_inputs) - FAILED_SHOWN} more (see {FAILED_INPUTS_DIR}/)")
        if failed:
            failed.insert(0, "failed input files (a re-run tries them again):")
        return "\n".join(["-" * width, *lines, "-" * width, *failed])


def _parts(out: str) -> list[str]:
    """Paths of the committed parts of an output (of every bucket, for a bucketed one)."""
    return [os.path.join(root, part) for root in part_roots(out) for part in committed_parts(root)]


def bucket_counts(out: str, empty_captions: dict | None = None) -> dict[str, int]:
    """Samples per bucket of a bucketed output (bucket directory name -> count); ``empty_captions``, when
    given, is filled with each bucket's empty further captions (bucket name -> {caption name: count})."""
    counts = {}
    prefix = EMPTY_PREFIX + EMPTY_COUNTED
    for root in part_roots(out)[1:]:
        name = os.path.basename(root)
        counts[name] = 0
        empty = {} if empty_captions is None else empty_captions.setdefault(name, {})
        for part in committed_parts(root):
            with open(os.path.join(root, part, STATS_RECORD)) as f:
                stats = json.load(f)
            counts[name] += int(stats.get("count", 0))
            for key, value in stats.items():
                if key.startswith(prefix):
                    empty[key[len(prefix):]] = empty.get(key[len(prefix):], 0) + int(value)
    return counts


def done_keys(out: str) -> tuple[set[str], dict[str, str]]:
    """(keys held by committed parts, {rejected key: reason}) under a local output directory."""
    written = set()
    for part in _parts(out):
        with open(os.path.join(part, KEYS_RECORD)) as f:
            written.update(json.load(f))
    rejected = {}
    rejects = os.path.join(out, REJECTS_DIR)
    for name in sorted(os.listdir(rejects)) if os.path.isdir(rejects) else []:
        if is_record(name):
            rejected.update(read_rejects(os.path.join(rejects, name)) or {})
    for key in written:  # a key both written and rejected cannot happen in one run; trust the part
        rejected.pop(key, None)
    return written, rejected


def summarize(out: str) -> ConversionSummary:
    """Counts of a local output; ``written`` is the samples its parts hold, what a reader sees."""
    _, rejected = done_keys(out)
    summary = ConversionSummary(parts=len(_parts(out)),
                                failed_inputs=read_failed_inputs(os.path.join(out, FAILED_INPUTS_DIR)))
    for reason in rejected.values():
        summary.rejects[reason] = summary.rejects.get(reason, 0) + 1
    for part in _parts(out):
        with open(os.path.join(part, STATS_RECORD)) as f:
            for name, value in json.load(f).items():
                if name == "count":
                    summary.written += int(value)
                elif name.startswith(EMPTY_PREFIX + EMPTY_COUNTED):
                    caption = name[len(EMPTY_PREFIX + EMPTY_COUNTED):]
                    summary.empty_captions[caption] = summary.empty_captions.get(caption, 0) + int(value)
                elif name.startswith("hist:"):  # --embed's score histograms: "hist:<column>:<bin>"
                    _, column, index = name.rsplit(":", 2) if name.count(":") >= 2 else (None, None, None)
                    if column and index.isdigit():
                        bins = summary.histograms.setdefault(column, {})
                        bins[int(index)] = bins.get(int(index), 0) + int(value)
                elif name.endswith("_seconds") and isinstance(value, (int, float)):
                    summary.stage_seconds[name] = summary.stage_seconds.get(name, 0.0) + value
    return summary
