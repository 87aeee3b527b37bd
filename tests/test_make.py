"""`make setup` where the disk has less room than the pinned set needs: one warning line before pip starts (CI's
install once stopped halfway with pip's "No space left on device" and nothing before it said why)."""

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _room(needs_gb: str) -> subprocess.CompletedProcess:
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    return subprocess.run(["make", "-s", "room", f"SETUP_NEEDS_GB={needs_gb}"], cwd=ROOT, capture_output=True,
                          text=True, timeout=60)


def test_setup_warns_in_one_line_where_the_disk_is_short_and_says_nothing_where_it_is_not():
    short = _room("1000000")  # more than any disk here has free
    assert short.returncode == 0 and short.stdout == ""  # a warning: the install still tries
    [line] = short.stderr.splitlines()
    assert line.startswith("make setup: warning: ") and line.endswith(
        " GB free here; the pinned install needs about 1000000 GB (7 in .venv, the rest while pip downloads)"), line
    roomy = _room("0")
    assert roomy.returncode == 0 and roomy.stdout == roomy.stderr == ""
