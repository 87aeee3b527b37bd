"""The suite's processes end with it: what a test started and left behind (a Composer launch's ranks, Ray's
daemons, a process in a session of its own) is ended when the session ends, also when it is interrupted
(Ctrl-C, and SIGTERM or SIGHUP, which are turned into an interrupt so fixtures' clean-ups run).

Every pytest process marks its environment, and so every process it starts and theirs, with its pid
(``DIFFUSION_TEST_OWNER``; the controller of ``-n`` workers also ``DIFFUSION_TEST_SESSION``); at the end it
ends the processes that still carry its mark, whoever their parent is now. A pytest plugin: the suite's
conftest imports its hooks; ``-p process_cleanup`` loads it alone."""

from __future__ import annotations

import atexit
import os
import signal
import threading
import time

import pytest

OWNER = "DIFFUSION_TEST_OWNER"
SESSION = "DIFFUSION_TEST_SESSION"
_marks: list[bytes] = []


def _interrupt(signum, frame):
    raise KeyboardInterrupt(f"signal {signal.Signals(signum).name}")


def marked(marks: list[bytes]) -> list[int]:
    """The pids of the processes (not this one) whose environment carries one of ``marks``."""
    me, found = os.getpid(), []
    for entry in os.listdir("/proc"):
        if not entry.isdigit() or int(entry) == me:
            continue
        try:
            with open(f"/proc/{entry}/environ", "rb") as f:
                environ = f.read().split(b"\0")
        except OSError:  # gone, or another user's
            continue
        if any(mark in environ for mark in marks):
            found.append(int(entry))
    return found


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def end_strays(grace: float = 2.0) -> list[int]:
    """End (SIGTERM, then SIGKILL after ``grace`` s) the processes still carrying this process's marks."""
    if not _marks or not os.path.isdir("/proc"):
        return []
    strays = marked(_marks)
    for sig in (signal.SIGTERM, signal.SIGKILL):
        for pid in strays:
            try:
                os.kill(pid, sig)
            except OSError:
                pass
        deadline = time.monotonic() + grace
        while sig == signal.SIGTERM and time.monotonic() < deadline and any(map(_alive, strays)):
            time.sleep(0.05)
        strays = [pid for pid in strays if _alive(pid)]
    return strays


def pytest_configure(config):
    pid = str(os.getpid())
    os.environ[OWNER] = pid
    _marks[:] = [f"{OWNER}={pid}".encode()]
    if not hasattr(config, "workerinput"):  # the controller, or a run without workers
        os.environ[SESSION] = pid
        _marks.append(f"{SESSION}={pid}".encode())
    if threading.current_thread() is threading.main_thread():
        for sig in (signal.SIGTERM, signal.SIGHUP):
            if signal.getsignal(sig) == signal.SIG_DFL:
                signal.signal(sig, _interrupt)
    atexit.register(end_strays)


@pytest.hookimpl(trylast=True)
def pytest_sessionfinish(session, exitstatus):
    if hasattr(session.config, "workerinput") or not session.config.getoption("numprocesses", None):
        end_strays()  # a worker's, or a run without workers (the controller's wait for its workers' exit)

