"""Sharded (FSDP ``state_dict_type: sharded``) checkpoints get what monolithic ones have, with real 2-rank
``composer -n 2 run.py`` runs over gloo:

- autoresume resumes a sharded run from its last complete checkpoint folder (it used to find none, remove
  ``latest`` and start over at batch 1) and trains the weights a straight run trains;
- a folder whose save never finished (no ``.metadata``) or whose shard was cut is set aside as
  ``<name>.incomplete``, never deleted;
- pruning counts the checkpoints earlier runs left in the folder;
- a folder holding only unreadable checkpoints is refused in one line instead of starting over, unless
  ``trainer.start_fresh=true``;
- the save folder's lock refuses a second run;
- a ``.metadata`` or an entry that would run code when unpickled is refused in one line and runs nothing.
"""

import os
import pickle
import shutil
import subprocess
import sys

import pytest
import torch

from train_fixtures import free_port, run_group, tiny_overrides, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "yamls", "tiny-cpu.yaml")


def _args(kit, mds, folder, batches, *extra):
    return [TINY, *tiny_overrides(kit, mds, batches=batches, save_folder=str(folder), extra=(
        "trainer.device=cpu", "trainer.fsdp={state_dict_type: sharded, sharding_strategy: FULL_SHARD}",
        "algorithms={}", "trainer.autoresume=true", "trainer.save_interval=1ba",
        "trainer.save_num_checkpoints_to_keep=2", *extra))]


def _launch(args, ranks=2, timeout=400):
    composer = os.path.join(os.path.dirname(sys.executable), "composer")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    command = ([composer, "-n", str(ranks), "--master_port", str(free_port())] if ranks > 1 else [sys.executable])
    return run_group([*command, os.path.join(ROOT, "run.py"), *args], cwd=ROOT, env=env, timeout=timeout)


def _error_lines(result):
    return [line for line in (result.stderr + result.stdout).splitlines() if ": error: " in line]


def _weights(folder):
    """The model tensors of a sharded checkpoint folder, read in this (single) process."""
    import tempfile
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "whole.pt")
        dcp_to_torch_save(str(folder), out)
        state = torch.load(out, weights_only=False)["state"]["model"]
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


@pytest.fixture(scope="module")
def runs(train_kit, tmp_path_factory):
    """One 5-batch sharded run keeping 3 checkpoints (its batch 5 is the straight run's weights; a copy
    keeping the newest two is the "straight" folder), then cut: batch 4's shard cut short, batch 5's save
    never finished. Resumed to 5 under the same command, keeping 2 (two launches, not three)."""
    tmp = tmp_path_factory.mktemp("sharded")
    mds = write_latent_mds(str(tmp / "mds"), kit=train_kit, n=48)
    folder = tmp / "resumed"
    first = _launch(_args(train_kit, mds, folder, 5, "trainer.save_num_checkpoints_to_keep=3"))
    assert first.returncode == 0, first.stderr[-4000:]
    kept_after_first = sorted(os.listdir(folder))
    shutil.copytree(folder, tmp / "straight", symlinks=True, ignore=shutil.ignore_patterns("ep0-ba3"))
    # batch 4's folder: a shard cut short; batch 5's: a save killed before its index was written
    shard = folder / "ep0-ba4" / "__1_0.distcp"
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    shutil.rmtree(folder / "ep0-ba5")
    (folder / "ep0-ba5").mkdir()
    shutil.copy(folder / "ep0-ba3" / "__0_0.distcp", folder / "ep0-ba5" / "__0_0.distcp")
    resumed = _launch(_args(train_kit, mds, folder, 5))
    return {"tmp": tmp, "mds": mds, "first": first, "resumed": resumed, "kept_after_first": kept_after_first}


@pytest.mark.slow
def test_autoresume_continues_a_sharded_run_from_its_last_complete_checkpoint(runs):
    resumed, folder = runs["resumed"], runs["tmp"] / "resumed"
    assert resumed.returncode == 0, resumed.stderr[-4000:]
    assert "Traceback" not in resumed.stderr
    assert runs["kept_after_first"] == ["ep0-ba3", "ep0-ba4", "ep0-ba5", "latest-rank0.pt"]  # 1 and 2 pruned
    assert f"set aside {folder / 'ep0-ba4'} as ep0-ba4.incomplete: its shard __1_0.distcp is cut short" in resumed.stderr
    assert f"set aside {folder / 'ep0-ba5'} as ep0-ba5.incomplete: no .metadata" in resumed.stderr
    assert f"resuming from {folder / 'ep0-ba3'} at batch 3" in resumed.stdout
    assert f"done: trained to batch 5 of 5ba; checkpoint: {folder / 'ep0-ba5'}" in resumed.stdout
    # the newest two, the first run's batch 3 counted and pruned; the set-aside ones kept
    assert sorted(os.listdir(folder)) == ["ep0-ba4", "ep0-ba4.incomplete", "ep0-ba5", "ep0-ba5.incomplete",
                                          "latest-rank0.pt"]
    assert os.readlink(folder / "latest-rank0.pt") == "ep0-ba5"
    straight, ours = _weights(runs["tmp"] / "straight" / "ep0-ba5"), _weights(folder / "ep0-ba5")
    assert straight.keys() == ours.keys() and straight
    for name, tensor in straight.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_a_folder_of_unreadable_checkpoints_is_refused_unless_asked_to_start_fresh(runs, train_kit):
    tmp, mds = runs["tmp"], runs["mds"]
    folder = tmp / "cut"
    shutil.copytree(tmp / "straight", folder, symlinks=True)
    for name in os.listdir(folder):
        if name.startswith("ep0-ba"):
            os.remove(folder / name / ".metadata")
    refused = _launch(_args(train_kit, mds, folder, 6))
    # every rank refuses (exit 2); Composer's launcher exits with its own code once a rank has failed
    assert refused.returncode != 0, refused.stderr[-4000:]
    assert "Traceback" not in refused.stderr
    [line] = _error_lines(refused)[:1]
    assert f"trainer.save_folder={folder} holds checkpoints autoresume cannot read" in line
    assert "set trainer.start_fresh=true" in line
    assert not any(n.startswith("ep0-ba") and not n.endswith(".incomplete") for n in os.listdir(folder))
    fresh = _launch(_args(train_kit, mds, folder, 1, "trainer.start_fresh=true"))
    assert fresh.returncode == 0, fresh.stderr[-4000:]
    assert "resuming from" not in fresh.stdout
    assert sorted(n for n in os.listdir(folder) if n.endswith(".incomplete")) == ["ep0-ba4.incomplete",
                                                                                 "ep0-ba5.incomplete"]
    assert os.readlink(folder / "latest-rank0.pt") == "ep0-ba1"


@pytest.mark.slow
def test_a_second_run_into_a_sharded_runs_folder_is_refused(runs, train_kit, tmp_path):
    """The lock is the same for sharded runs: a live holder (here a process holding ``.run.lock``)
    refuses the second run at start, before any rank trains."""
    folder = runs["tmp"] / "straight"
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, json, os, socket, sys, time\n"
        f"fd = os.open({str(folder / '.run.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, json.dumps({'pid': os.getpid(), 'host': socket.gethostname(), 'command': 'holder'}).encode())\n"
        "print('held', flush=True)\n"
        "time.sleep(300)\n")], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        second = _launch(_args(train_kit, runs["mds"], folder, 6))
    finally:
        holder.kill()
        holder.wait()
    assert second.returncode != 0, second.stderr[-4000:]
    [line] = _error_lines(second)[:1]
    assert f"trainer.save_folder={folder} is in use by another run (pid {holder.pid}" in line
    assert os.readlink(folder / "latest-rank0.pt") == "ep0-ba5"


class _Marker:
    """Unpickling this runs ``open(path, "w")``: the payload a hostile checkpoint carries."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_sharded_index_or_entry_that_would_run_code_is_refused_and_runs_nothing(train_kit, tmp_path):
    import torch.distributed.checkpoint as dcp
    from diffusion.errors import InputError
    from diffusion.models import safe_checkpoint
    marker = tmp_path / "ran"
    # 1. a .metadata that calls open() when unpickled, beside a real checkpoint's shards
    hostile_index = tmp_path / "ep0-ba5"
    dcp.save({"weight": torch.ones(2), "step": 5}, checkpoint_id=str(hostile_index))
    with open(hostile_index / ".metadata", "wb") as f:
        pickle.dump(_Marker(str(marker)), f)
    with pytest.raises(InputError, match=r"\.metadata: refused: the sharded checkpoint's index asks to call "
                                         r"(builtins|io)\.open"):
        safe_checkpoint.check_sharded(hostile_index)
    safe_checkpoint.guard_sharded_loads()
    with pytest.raises(InputError, match="refused"):
        dcp.FileSystemReader(str(hostile_index)).read_metadata()
    # 2. a well-formed index whose non-tensor entry calls open()
    hostile_entry = tmp_path / "entry"
    dcp.save({"weight": torch.ones(2), "extra": _Marker(str(marker))}, checkpoint_id=str(hostile_entry))
    with pytest.raises(InputError, match=r"\(extra\): refused: the checkpoint asks to call (builtins|io)\.open"):
        safe_checkpoint.check_sharded(hostile_entry)
    target = {"weight": torch.zeros(2), "extra": None}
    with pytest.raises(BaseException) as raised:  # torch wraps each rank's error in a CheckpointException
        dcp.load(target, checkpoint_id=str(hostile_entry))
    failures = [exc for exc, _ in raised.value.failures.values()]
    assert failures and all(isinstance(exc, InputError) and "refused: the checkpoint asks to call" in str(exc)
                            for exc in failures)
    assert not marker.exists()
    # 3. through the command: trainer.load_path is refused in one line before any rank reads it
    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=8)
    result = _launch([TINY, "trainer.device=cpu", f"trainer.load_path={hostile_index}", "trainer.max_duration=1ba",
                      "trainer.save_folder=null", "trainer.autoresume=false", f"data.train.path={mds}", "data.train.batch_size=8",
                      f"model.ref={train_kit}", "algorithms={}", "callbacks={}", "loggers={}"], ranks=1)
    assert result.returncode == 2, result.stderr[-3000:]
    assert "Traceback" not in result.stderr
    [line] = _error_lines(result)
    assert line.startswith(f"run.py: error: {hostile_index / '.metadata'}: refused"), line
    assert not marker.exists()
