"""The save folder under crashes and collisions (issue 24 items 3 and 4), with a real training process where the
process is the point (the run killed mid-save) and run.py's own entry in the test's process for the others (the
run resuming after it takes over the dead process's lock all the same):

- a second run into a live run's ``trainer.save_folder`` is refused at start, naming the folder and the run;
- a run killed (SIGKILL) in the middle of writing a checkpoint leaves no cut file under a checkpoint's
  name: the re-run takes over the dead run's lock, resumes from the last complete checkpoint and saves
  past the one it was writing;
- a cut checkpoint under its final name (written by older code, or copied half) is set aside, not a
  dead end;
- a full disk while saving is one line, with the unfinished file removed and the earlier checkpoints whole.
"""

import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time

import pytest

from diffusion.train.save_folder import LOCK_NAME, is_complete
from train_fixtures import run_py_here, tiny_overrides, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "yamls", "tiny-cpu.yaml")

# run.py with Composer's checkpoint writer wrapped: at the save of batch HOLD_AT it waits for GO to exist,
# then writes half of the checkpoint and kills itself with SIGKILL, as a preempted node would.
HOLDING_RUN = textwrap.dedent("""
    import os, signal, sys, time
    import composer.utils.checkpoint as checkpoint
    write = checkpoint._write_checkpoint_file
    hold_at, go = sys.argv[1], sys.argv[2]
    def cut_short(state_dict, filename):
        if f"-ba{hold_at}-" not in filename:
            return write(state_dict, filename)
        while not os.path.exists(go):
            time.sleep(0.1)
        write(state_dict, filename)
        size = os.path.getsize(filename)
        with open(filename, "r+b") as f:
            f.truncate(size // 2)
        os.kill(os.getpid(), signal.SIGKILL)
    checkpoint._write_checkpoint_file = cut_short
    sys.argv = ["run.py", *sys.argv[3:]]
    from diffusion import cli
    from diffusion.launch import main
    cli.run(main, "run.py")
""")


@pytest.fixture(scope="module")
def mds(train_kit, tmp_path_factory):
    return write_latent_mds(str(tmp_path_factory.mktemp("mds")), kit=train_kit, n=32)


def _args(kit, mds, folder, batches, *extra):
    return [TINY, *tiny_overrides(kit, mds, batches=batches, save_folder=str(folder),
                                  extra=("trainer.save_interval=2ba", "algorithms={}", *extra))]


def _run_here(capfd, args):
    """run.py ARGS in this process (train_fixtures.run_py_here), for runs whose point is the save folder, not the
    process."""
    return run_py_here(capfd, *args)


def _error_lines(result):
    return [line for line in result.stderr.splitlines() if "error" in line]


def _wait_for(predicate, what, process, timeout=240):
    deadline = time.time() + timeout
    while not predicate():
        if process.poll() is not None:
            raise AssertionError(f"the holding run exited ({process.returncode}) before {what}: "
                                 f"{process.stderr.read()[-3000:]}")
        assert time.time() < deadline, f"no {what} after {timeout} s"
        time.sleep(0.2)


@pytest.mark.slow
def test_a_second_run_is_refused_and_a_run_killed_mid_save_resumes_past_its_cut_checkpoint(train_kit, mds, tmp_path,
                                                                                            capfd):
    folder, go = tmp_path / "ckpt", tmp_path / "go"
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    first = subprocess.Popen([sys.executable, "-c", HOLDING_RUN, "4", str(go),
                              *_args(train_kit, mds, folder, 6, "trainer.autoresume=true")],
                             cwd=ROOT, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    try:
        # batch 2's checkpoint is written, batch 4's write waits for GO: the first run is live
        _wait_for(lambda: os.path.isfile(folder / "ep0-ba2-rank0.pt") and os.path.islink(folder / "latest-rank0.pt"),
                  "checkpoint at batch 2", first)
        second = _run_here(capfd, _args(train_kit, mds, folder, 6, "trainer.autoresume=true"))
        assert second.returncode == 2, second.stderr[-3000:]
        assert "Traceback" not in second.stderr
        [line] = _error_lines(second)
        assert line.startswith(f"run.py: error: trainer.save_folder={folder} is in use by another run (pid "
                               f"{first.pid} on "), line
        assert "run.py" in line and "give this run another trainer.save_folder" in line
        assert first.poll() is None  # the live run was left alone
        go.touch()
        first.wait(timeout=240)
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()
    assert first.returncode == -signal.SIGKILL
    # the write was cut: nothing under batch 4's checkpoint name, the earlier checkpoint whole
    assert not os.path.exists(folder / "ep0-ba4-rank0.pt")
    assert os.path.isfile(folder / ".partial-ep0-ba4-rank0.pt")
    assert is_complete(str(folder / "ep0-ba2-rank0.pt"))
    kept = os.stat(folder / "ep0-ba2-rank0.pt")

    again = _run_here(capfd, _args(train_kit, mds, folder, 6, "trainer.autoresume=true"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"taking over the lock of pid {first.pid}" in again.stderr and "which exited" in again.stderr
    assert "a checkpoint write that never finished" in again.stderr
    # resumed from batch 2 and saved batches 4 and 6, each whole; the first run's batch 2 is counted
    # with them and pruned, so the folder keeps the YAML's 2 (it kept 3 once a run had been resumed)
    assert f"resuming from {folder / 'ep0-ba2-rank0.pt'} at batch 2" in again.stdout
    assert kept.st_size > 0
    assert sorted(n for n in os.listdir(folder) if n.startswith("ep")) == [f"ep{(b - 1) // 4}-ba{b}-rank0.pt"
                                                                             for b in (4, 6)]
    assert all(is_complete(str(folder / n)) for n in os.listdir(folder) if n.startswith("ep"))
    assert os.readlink(folder / "latest-rank0.pt") == "ep1-ba6-rank0.pt"
    assert not os.path.exists(folder / LOCK_NAME)  # released at the end of the run

    # a checkpoint cut short under its final name (older code, a half copy) is set aside, not a dead end
    last = folder / "ep1-ba6-rank0.pt"
    with open(last, "r+b") as f:
        f.truncate(os.path.getsize(last) // 3)
    resumed = _run_here(capfd, _args(train_kit, mds, folder, 6, "trainer.autoresume=true"))
    assert resumed.returncode == 0, resumed.stderr[-3000:]
    assert f"set aside {last} as ep1-ba6-rank0.pt.incomplete: it was cut short" in resumed.stderr
    assert f"now points to ep0-ba4-rank0.pt, the last complete checkpoint" in resumed.stderr
    assert os.path.isfile(str(last) + ".incomplete") and is_complete(str(last))  # batch 6 trained again
    assert os.readlink(folder / "latest-rank0.pt") == "ep1-ba6-rank0.pt"


def test_a_full_disk_while_saving_is_one_line_and_leaves_the_earlier_checkpoints_whole(train_kit, mds, tmp_path,
                                                                                         capfd):
    folder = tmp_path / "ckpt"
    folder.mkdir()
    # batch 4's checkpoint lands on a device that is always full
    os.symlink("/dev/full", folder / ".partial-ep0-ba4-rank0.pt")
    # its own copy of the data: the failed run's trainer is never closed (streaming refuses a dataset's folder to a
    # second dataset in this process while the first is open)
    result = _run_here(capfd, _args(train_kit, shutil.copytree(mds, tmp_path / "mds"), folder, 4))
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    [line] = _error_lines(result)
    assert line.startswith(f"run.py: error: {folder / 'ep0-ba4-rank0.pt'}: No space left on device: this "
                           f"checkpoint was not saved"), line
    assert not os.path.lexists(folder / ".partial-ep0-ba4-rank0.pt")
    assert not os.path.exists(folder / "ep0-ba4-rank0.pt")
    assert is_complete(str(folder / "ep0-ba2-rank0.pt"))
    assert os.readlink(folder / "latest-rank0.pt") == "ep0-ba2-rank0.pt"


def test_autoresume_refuses_another_runs_checkpoint_and_leaves_it_as_it_was(train_kit, mmdit_train_kit, mds, tmp_path,
                                                                            capfd):
    """A second command with another model or dataset into the same save folder (the README's T5 command
    once inherited the demo's) is refused in one line naming the folder and the difference; the first
    run's checkpoints, ``latest`` and lock are untouched."""
    folder = tmp_path / "ckpt"
    first = _run_here(capfd, _args(train_kit, mds, folder, 2, "trainer.autoresume=true"))
    assert first.returncode == 0, first.stderr[-3000:]
    assert f"done: trained to batch 2 of 2ba; checkpoint: {folder / 'ep0-ba2-rank0.pt'}" in first.stdout
    before = {name: os.stat(folder / name, follow_symlinks=False).st_mtime_ns for name in os.listdir(folder)}
    other_data = write_latent_mds(str(tmp_path / "other"), kit=train_kit, n=16, seed=3)
    for change, expected in ((f"data.train.path={other_data}", f"its training data is '{mds}', this run's "
                                                                f"'{other_data}'"),
                             (f"model.ref={mmdit_train_kit}", f"its model.ref is '{train_kit}', this run's "
                                                               f"'{mmdit_train_kit}'")):
        second = _run_here(capfd, _args(train_kit, mds, folder, 4, "trainer.autoresume=true", change))
        assert second.returncode == 2, second.stderr[-3000:]
        assert "Traceback" not in second.stderr
        [line] = _error_lines(second)
        assert line.startswith(f"run.py: error: trainer.save_folder={folder} holds another run's checkpoint "
                               f"(ep0-ba2-rank0.pt): {expected}"), line
        assert "give this run its own trainer.save_folder" in line
        after = {name: os.stat(folder / name, follow_symlinks=False).st_mtime_ns for name in os.listdir(folder)}
        assert after == before
    # the same command again resumes its own run
    again = _run_here(capfd, _args(train_kit, mds, folder, 4, "trainer.autoresume=true"))
    assert again.returncode == 0, again.stderr[-3000:]
    assert f"resuming from {folder / 'ep0-ba2-rank0.pt'} at batch 2" in again.stdout


def test_a_save_folder_that_is_a_file_is_one_line_and_the_file_is_kept(tmp_path):
    """trainer.save_folder naming a file (or a folder under one) was a bare "[Errno 17] File exists"."""
    from diffusion.errors import UserError
    from diffusion.train.save_folder import SaveFolderLock
    taken = tmp_path / "weights.pt"
    taken.write_bytes(b"an earlier checkpoint")
    for folder in (taken, taken / "ckpt"):
        with pytest.raises(UserError) as refused:
            SaveFolderLock(str(folder)).acquire()
        assert str(refused.value) == (f"trainer.save_folder={folder}: not a folder (it, or a folder above it, is a "
                                      f"file); give the folder to write checkpoints in")
    assert taken.read_bytes() == b"an earlier checkpoint"


def test_a_run_refused_for_its_unreadable_checkpoints_leaves_the_folder_unlocked(tmp_path):
    """autoresume on a folder whose only checkpoint is cut is refused; the refused run held the folder's lock and
    kept it (the next run printed "taking over the lock of pid N ... which exited without removing it")."""
    from diffusion.train.save_folder import SaveFolderLock, UnreadableCheckpoints, claim
    folder = tmp_path / "ckpt"
    folder.mkdir()
    (folder / "ep0-ba2-rank0.pt").write_bytes(b"cut short")
    with pytest.raises(UnreadableCheckpoints):
        claim(str(folder), None, autoresume=True)
    assert not (folder / LOCK_NAME).exists()
    later = SaveFolderLock(str(folder))
    assert later.acquire() == []  # no stale lock to take over
    later.release()


def test_ctrl_c_in_the_middle_of_a_checkpoint_write_stops_the_run_as_ctrl_c(tmp_path):
    """Composer turns Ctrl-C into ``sys.exit(130)`` wherever Python is, and torch's zip writer reports an
    exception raised in the middle of its write as its own error ("unexpected pos"), the interrupt as that
    error's context: the run ended with rc 1 and a traceback instead of run.py's line saying where it stopped
    (tests/train/test_launch_lines.py, when its Ctrl-C landed in a save; a fresh clone, 2026-11-29). The
    write now raises the interrupt itself, and its unfinished file is removed."""
    import torch
    from diffusion.train.save_folder import _write_whole

    class SignalledMidWrite:  # the checkpoint's file, Ctrl-C arriving during its third write
        def __init__(self, f):
            self.f, self.writes = f, 0

        def write(self, data):
            self.writes += 1
            if self.writes == 3:
                os.kill(os.getpid(), signal.SIGINT)
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    def composers_write(state_dict, filename):  # composer.utils.checkpoint._write_checkpoint_file's way
        with open(filename, "wb") as f:
            torch.save(state_dict, SignalledMidWrite(f))

    def composers_handler(signum, frame):  # composer.core.engine's SIGINT handler
        sys.exit(128 + signum)

    target = tmp_path / "ep0-ba2-rank0.pt"
    previous = signal.signal(signal.SIGINT, composers_handler)
    try:
        with pytest.raises(SystemExit) as stopped:
            _write_whole(composers_write, {"weight": torch.ones(64, 64)}, str(target))
    finally:
        signal.signal(signal.SIGINT, previous)
    assert stopped.value.code == 130
    assert os.listdir(tmp_path) == []  # neither the checkpoint nor its unfinished file
