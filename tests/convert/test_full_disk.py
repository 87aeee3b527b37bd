"""The converter on a full disk (issue 24 item 9): one line naming the output, no traceback; what was
written is kept, and after making room the same command finishes the job (a real small tmpfs)."""

import os
import subprocess
import sys

import pytest

RESOLUTIONS = (32, 64)  # as the shared conversion (tests/convert/conftest.py)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture
def small_disk(tmp_path):
    """A 96 KB tmpfs (mounting one needs root, as on the CI machine and here)."""
    where = tmp_path / "disk"
    where.mkdir()
    mounted = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(where)], capture_output=True)
    if mounted.returncode:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    yield where
    subprocess.run(["umount", "-l", str(where)], check=False)


@pytest.mark.slow
def test_a_full_disk_is_one_line_and_a_rerun_after_making_room_finishes(small_disk, sample_data, tiny_kit,
                                                                         manifest, ray_local):
    out = small_disk / "mds"
    flags = ["--input", sample_data, "--output", str(out), "--model", tiny_kit,
             "--resolutions", *map(str, RESOLUTIONS), "--no-progress"]
    command = [sys.executable, "convert/laion_to_mds.py", *flags]
    # The real command, joining the session's Ray (RAY_ADDRESS, as on a cluster) rather than starting a local
    # cluster of its own: Ray's start is ~10 CPU-s and ~15 s of a loaded machine, and not what this test is about.
    env = dict(os.environ, PYTHONPATH=ROOT, RAY_ADDRESS=ray_local.get_runtime_context().gcs_address)
    full = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert full.returncode == 2, full.stderr[-3000:]
    assert "Traceback" not in full.stderr, full.stderr[-3000:]
    errors = [line for line in full.stderr.splitlines() if "error" in line.lower() and "core_worker" not in line]
    assert errors == [f"laion_to_mds: error: {out}: No space left on device while writing the output (what was "
                      f"written is kept: make room, then re-run the same command to resume)"], full.stderr[-3000:]
    subprocess.run(["mount", "-o", "remount,size=64m", str(small_disk)], check=True)
    # The same command (its flags through the command's own parser and main) in this process, on the session's
    # Ray: a second CLI process pays its driver's imports again (~100 s of the suite with its own Ray). The
    # error line and status above are the real command's; a failure here raises.
    from diffusion.convert.command import main
    again = main(flags)
    # the sample's good rows: what the shared clean conversion writes (test_sample_converts_with_exact_counts),
    # without waiting for it here (~90 s where this test runs alone)
    assert again.written == manifest["good"]
    from diffusion import schema
    assert schema.DatasetInfo.load(str(out)).count == manifest["good"]  # the whole job, once
