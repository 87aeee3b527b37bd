"""An interrupted suite left three Ray clusters behind: what a test starts must end with the session, also
when the session is stopped with SIGTERM (a CI job cancelled, ``timeout make test``)."""

import os
import subprocess
import sys
import time

import pytest

TESTS = os.path.dirname(os.path.abspath(__file__))

# A test that starts a process in a session of its own (as Ray's daemons and a Composer launch's ranks
# are), which outlives its starter, then waits until the session is stopped.
INNER = '''
import os, subprocess, sys, time

def test_leaves_a_process_behind():
    starter = subprocess.run([sys.executable, "-c", "import subprocess, sys; print(subprocess.Popen("
                              "[sys.executable, '-c', 'import time; time.sleep(300)'], start_new_session=True, "
                              "stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL).pid)"],
                             capture_output=True, text=True)
    with open(os.environ["STRAY_PID"], "w") as f:
        f.write(starter.stdout)
    time.sleep(300)
'''


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not os.path.isdir("/proc"), reason="finds processes through /proc")
def test_a_session_stopped_with_sigterm_ends_the_processes_its_tests_left(tmp_path):
    (tmp_path / "test_inner.py").write_text(INNER)
    stray_file = tmp_path / "stray.pid"
    env = {k: v for k, v in os.environ.items() if k not in ("PYTEST_ADDOPTS", "PYTEST_XDIST_WORKER")}
    env.update(PYTHONPATH=TESTS, STRAY_PID=str(stray_file))
    inner = subprocess.Popen([sys.executable, "-m", "pytest", "-q", "-p", "process_cleanup", "--noconftest",
                              "-p", "no:cacheprovider", "--rootdir", str(tmp_path), "-o", "addopts=",
                              str(tmp_path / "test_inner.py")],
                             cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    stray = None
    try:
        deadline = time.monotonic() + 120
        while stray is None and time.monotonic() < deadline and inner.poll() is None:
            text = stray_file.read_text().strip() if stray_file.exists() else ""
            stray = int(text) if text.isdigit() else None
            time.sleep(0.1)
        assert stray is not None and _alive(stray), inner.communicate(timeout=5)[0][-2000:] if inner.poll() is not None else ""
        inner.terminate()  # SIGTERM to pytest alone, as a cancelled job's runner sends it
        out, _ = inner.communicate(timeout=60)
        assert "KeyboardInterrupt" in out or "Interrupted" in out, out[-2000:]
        assert not _alive(stray), f"pid {stray} outlived the session"
    finally:
        if inner.poll() is None:
            inner.kill()
            inner.wait()
        if stray is not None and _alive(stray):
            os.kill(stray, 9)
