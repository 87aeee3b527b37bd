"""Input files that cannot be read: recorded (``failed_inputs/``), reported in the summary, tried again
on the next run (a file's record goes once it reads to its end)."""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import zlib

from diffusion.convert.transforms import LEGACY_RECORD_SUFFIX, RECORD_SUFFIX
from diffusion.errors import InputError

FAILED_INPUTS_DIR = "failed_inputs"  # beside rejects/: one {file, uri, error, rows_read} record (.jsonl) per failed file


def file_errors() -> tuple[type[BaseException], ...]:
    """What reading a damaged or foreign file raises (and nothing a bug alone would): I/O and Arrow
    errors, tar and compression errors, and ValueError, which InputError and parquet's and PIL's
    complaints about bad data are."""
    import pyarrow as pa
    return (OSError, EOFError, ValueError, tarfile.TarError, zlib.error, pa.ArrowException)


def describe_error(error: BaseException) -> str:
    """One line: an InputError's own message (it names the file), else the type and message."""
    text = str(error) if isinstance(error, InputError) else f"{type(error).__name__}: {error}"
    text = " ".join(text.split())
    return text if len(text) <= 500 else text[:497] + "..."


def _failed_record_path(directory: str, name: str) -> str:
    return os.path.join(directory, hashlib.sha1(name.encode("utf-8", "surrogateescape")).hexdigest()[:16] + RECORD_SUFFIX)


def record_failed_input(directory: str, name: str, uri: str, error: BaseException, rows_read: int) -> None:
    """Record (atomically) that input file ``name`` failed, replacing any earlier record of it."""
    os.makedirs(directory, exist_ok=True)
    path = _failed_record_path(directory, name)
    with open(path + ".tmp", "w") as f:
        json.dump({"file": name, "uri": uri, "error": describe_error(error), "rows_read": rows_read}, f)
    os.replace(path + ".tmp", path)


def clear_failed_input(directory: str, name: str) -> None:
    """Forget an earlier failure of ``name`` (it has now been read to its end)."""
    path = _failed_record_path(directory, name)
    for old in (path, path[: -len(RECORD_SUFFIX)] + LEGACY_RECORD_SUFFIX):  # and its record in the old layout
        try:
            os.remove(old)
        except FileNotFoundError:
            pass


def read_failed_inputs(directory: str) -> dict[str, str]:
    """{file name: error} of the failed input files recorded under ``directory`` (unreadable records,
    e.g. cut short by a kill, are left out: the file is tried again on the next run anyway)."""
    failed = {}
    if not os.path.isdir(directory):
        return failed
    for entry in sorted(os.listdir(directory)):
        if not entry.endswith((RECORD_SUFFIX, LEGACY_RECORD_SUFFIX)):  # legacy: an output not yet migrated
            continue
        try:
            with open(os.path.join(directory, entry)) as f:
                record = json.load(f)
            failed[str(record["file"])] = str(record["error"])
        except (OSError, ValueError, KeyError, TypeError):
            continue
    return failed
