"""One way for every command to start and to fail.

``cli.run(main, "laion_to_mds")`` calls ``main(argv)``; a :class:`~diffusion.errors.UserError` or a
missing/unreadable file the user named becomes one line on stderr (``laion_to_mds: error: ...``) and
exit status 2, Ctrl-C a one-line note and status 130. ``--debug`` anywhere on the command line (or
``DIFFUSION_DEBUG=1``) lets the traceback through instead.
"""

from __future__ import annotations

import argparse
import collections
import dataclasses
import errno
import os
import sys
from typing import Callable, Sequence

from diffusion import cpus
from diffusion.errors import UserError

DEBUG_FLAG = "--debug"
# Errors of the user's own files and folders (a wrong path, a read-only output, a full disk).
_FILE_ERRORS = (FileNotFoundError, IsADirectoryError, NotADirectoryError, PermissionError, FileExistsError)
_STORAGE_ERRNOS = {errno.ENOSPC, errno.EROFS, errno.EDQUOT}


def causes(error: BaseException | None):
    """``error`` and every exception behind it, nearest first, each once: what it was raised from (or, as Python's
    traceback shows it, during), a Ray task's own exception (``RayTaskError.cause``), and Ray Train's wrappers
    (``_base_exc``, and a failed worker group's ``worker_failures``, one per rank)."""
    seen, todo = set(), collections.deque([error])
    while todo:
        error = todo.popleft()
        if error is None or id(error) in seen:
            continue
        seen.add(id(error))
        yield error
        during = None if error.__cause__ is not None or error.__suppress_context__ else error.__context__
        todo.extend([getattr(error, "cause", None), error.__cause__, during,
                     getattr(error, "_base_exc", None), *dict(getattr(error, "worker_failures", None) or {}).values()])


def storage_error(error: BaseException) -> OSError | None:
    """The full or read-only storage behind ``error``, or None: ``error`` itself or any exception behind it
    (:func:`causes`), however deeply wrapped."""
    return next((e for e in causes(error) if isinstance(e, OSError) and e.errno in _STORAGE_ERRNOS), None)


def _is_users(error: BaseException) -> bool:
    """Whether ``error`` is the user's to fix (bad input, a wrong path, full or read-only storage)."""
    return (isinstance(error, (UserError, *_FILE_ERRORS))
            or isinstance(error, OSError) and error.errno in _STORAGE_ERRNOS)


def file_in_the_way(path: str) -> str | None:
    """Where making ``path``'s folders would fail: the nearest existing path above it, if that is a file."""
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):
        parent = os.path.dirname(parent)
    return None if os.path.isdir(parent) else parent


def _describe(error: BaseException) -> str:
    if (isinstance(error, NotADirectoryError) and error.filename  # the bare "Not a directory" said not which
            and error.strerror in (None, os.strerror(errno.ENOTDIR))):
        return f"{error.filename}: a file is in the way: a name on this path is a file, not a folder"
    if isinstance(error, OSError) and error.filename:
        return f"{error.filename}: {error.strerror or error}"
    return str(error)


def run(main: Callable[[list[str]], object], prog: str, argv: Sequence[str] | None = None,
        resumable: bool = False) -> None:
    """Run ``main(argv)`` as the command ``prog`` (see the module docstring).

    ``resumable`` commands say, when interrupted, that re-running the same command resumes.
    """
    argv = list(sys.argv[1:] if argv is None else argv)
    debug = DEBUG_FLAG in argv or os.environ.get("DIFFUSION_DEBUG", "") not in ("", "0")
    argv = [a for a in argv if a != DEBUG_FLAG]
    try:
        cpus.configure_process()  # before torch loads: waiting threads sleep, not spin (diffusion/cpus.py)
        main(argv)
    except Exception as e:
        if debug or not _is_users(e):
            raise
        print(f"{prog}: error: {_describe(e)}", file=sys.stderr)
        sys.exit(2)
    except KeyboardInterrupt as e:
        if debug:
            raise
        # a command that knows how far it got says so (training: "at batch N; re-run ... to resume")
        hint = f" {e}" if str(e) else "; re-run the same command to resume" if resumable else ""
        print(f"{prog}: interrupted{hint}", file=sys.stderr)
        sys.exit(130)
    except BaseException as e:  # torch's sharded-checkpoint errors wrap each rank's own (not an Exception)
        inner = _checkpoint_failure(e)
        if inner is None or debug or not _is_users(inner):
            raise
        print(f"{prog}: error: {_describe(inner)}", file=sys.stderr)
        sys.exit(2)


def _checkpoint_failure(error: BaseException) -> BaseException | None:
    """The first rank's own error inside torch's ``CheckpointException`` (a full disk while saving a
    sharded checkpoint, a refused entry while loading one), or None for any other exception."""
    if type(error).__name__ != "CheckpointException":
        return None
    failures = getattr(error, "failures", None) or {}
    for failure in failures.values():
        return failure[0] if isinstance(failure, tuple) else failure
    return None


def _command(module: str, prog: str, resumable: bool = False) -> Callable[[], None]:
    """A console script: ``module.main`` run as the command ``prog``."""
    def start() -> None:
        import importlib
        run(importlib.import_module(module).main, prog, resumable=resumable)
    start.__doc__ = f"The ``{prog}`` command: ``{module}.main``."
    return start


# `pip install .` puts these on PATH (setup.py's console_scripts); each is also `python -m <module>`.
sd_download = _command("diffusion.download.job", "sd-download", resumable=True)
sd_convert = _command("diffusion.convert.command", "sd-convert", resumable=True)
sd_train = _command("diffusion.launch", "sd-train")
sd_online = _command("diffusion.online", "sd-online")
sd_generate = _command("diffusion.sample.generate", "sd-generate")
sd_export = _command("diffusion.sample.export", "sd-export")
sd_evaluate = _command("diffusion.sample.evaluate", "sd-evaluate")
sd_cost = _command("diffusion.cost", "sd-cost")
sd_kit = _command("diffusion.kit.build", "sd-kit")
sd_sample_data = _command("diffusion.kit.sample", "sd-sample-data")
sd_demo = _command("diffusion.demo", "sd-demo")
sd_posthoc_ema = _command("diffusion.posthoc_ema", "sd-posthoc-ema")


# ---- command-line flags -----------------------------------------------------------------------------

def format_seconds(seconds: float) -> str:
    """``42s``, ``3m05s``, ``2h07m``: a duration as every progress line writes it."""
    seconds = max(0, int(round(seconds)))
    if seconds < 60:
        return f"{seconds}s"
    if seconds < 3600:
        return f"{seconds // 60}m{seconds % 60:02d}s"
    return f"{seconds // 3600}h{seconds % 3600 // 60:02d}m"


def _whole_number(text: str, least: int, what: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a whole number") from None
    if value < least:
        raise argparse.ArgumentTypeError(f"{text} is not {what}")
    return value


def positive_int(text: str) -> int:
    """An argparse type: an integer of at least 1."""
    return _whole_number(text, 1, "a positive whole number")


def non_negative_int(text: str) -> int:
    """An argparse type: an integer of at least 0 (a seed numpy takes)."""
    return _whole_number(text, 0, "a whole number of at least 0")


# ---- command-line flags from a config dataclass ------------------------------------------------------

def flag(default=dataclasses.MISSING, help: str = "", flag_name: str | None = None, **argparse_kwargs):
    """A config field that is also a command-line flag, ``--field-name`` unless ``flag_name`` says
    otherwise (see :func:`add_flags`)."""
    return dataclasses.field(default=default, metadata={"help": help, "flag": flag_name, "argparse": argparse_kwargs})


def add_flags(parser: argparse.ArgumentParser, cls) -> None:
    """One flag per :func:`flag` field of the dataclass ``cls``: the config is the single declaration."""
    fields = [f for f in dataclasses.fields(cls) if "help" in f.metadata]
    for f in sorted(fields, key=lambda f: f.default is not dataclasses.MISSING):  # required flags first
        name = f.metadata.get("flag") or "--" + f.name.replace("_", "-")
        if isinstance(f.default, bool):  # a switch: --x turns on what is off by default, --no-x the other way
            if f.default:
                name = "--no-" + f.name.replace("_", "-")
            parser.add_argument(name, dest=f.name, action="store_false" if f.default else "store_true",
                                help=f.metadata["help"])
            continue
        required = f.default is dataclasses.MISSING
        shown = f.metadata["help"] + ("" if required or f.default is None else f" (default: {_show(f.default)})")
        parser.add_argument(name, dest=f.name, required=required, help=shown,
                            **({} if required else {"default": f.default}), **f.metadata["argparse"])


def _show(value) -> str:
    return " ".join(map(str, value)) if isinstance(value, (list, tuple)) else str(value)


def from_flags(cls, args: argparse.Namespace):
    """The dataclass ``cls`` from parsed :func:`add_flags` arguments."""
    return cls(**{f.name: getattr(args, f.name) for f in dataclasses.fields(cls) if hasattr(args, f.name)})
