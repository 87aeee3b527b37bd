"""Sharded (FSDP ``state_dict_type: sharded``) checkpoints get what monolithic ones have, with real 2-rank
runs of ``run.py``'s own command over gloo, one after another in one ``composer -n 2`` launch:

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

import json
import os
import pickle
import shutil
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


# Every run of this file in one ``composer -n 2`` launch (each process imports torch and Composer once, not once a
# run): each rank runs ``run.py``'s own ``cli.run(main, "run.py", argv)`` for each step of STEPS (a JSON list of
# {"name", "argv", "before"}) in turn, its stdout and stderr (file descriptors 1 and 2: every print, warning and
# log line) in ``NAME-rankR.out``/``.err`` and its exit code (0, or the ``sys.exit`` code of a refusal) in
# ``NAME-rankR.rc``, and the step's save folder's listing after it in ``NAME.listing``, all in RECORD_DIR; ``before``
# is done by rank 0 alone, between barriers (what the test did between separate launches). A refused run's lock
# on its folder is closed after it, as its process's exit would (its file stays).
STEPS_HARNESS = r"""
import contextlib, gc, json, os, shutil, subprocess, sys
from composer.utils import dist
from diffusion import cli
from diffusion.launch import main
from diffusion.train.save_folder import SaveFolderLock

out, rank = os.environ["RECORD_DIR"], int(os.environ["RANK"])
holder = None


def cut(tmp):  # the first run's folder copied as "straight" (its newest two); then batch 4's folder: a shard
    folder = os.path.join(tmp, "resumed")  # cut short; batch 5's: a save killed before its index was written
    shutil.copytree(folder, os.path.join(tmp, "straight"), symlinks=True, ignore=shutil.ignore_patterns("ep0-ba3"))
    shard = os.path.join(folder, "ep0-ba4", "__1_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    shutil.rmtree(os.path.join(folder, "ep0-ba5"))
    os.mkdir(os.path.join(folder, "ep0-ba5"))
    shutil.copy(os.path.join(folder, "ep0-ba3", "__0_0.distcp"), os.path.join(folder, "ep0-ba5", "__0_0.distcp"))


def unreadable(tmp):  # the straight folder's checkpoints, none with its index
    folder = os.path.join(tmp, "cut")
    shutil.copytree(os.path.join(tmp, "straight"), folder, symlinks=True)
    for name in os.listdir(folder):
        if name.startswith("ep0-ba"):
            os.remove(os.path.join(folder, name, ".metadata"))


def hold(tmp):  # a live process holding the straight folder's lock
    global holder
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, json, os, socket, sys, time\n"
        f"fd = os.open({os.path.join(tmp, 'straight', '.run.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, json.dumps({'pid': os.getpid(), 'host': socket.gethostname(), 'command': 'holder'}).encode())\n"
        "print('held', flush=True)\n"
        "time.sleep(300)\n")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with open(os.path.join(out, "holder.pid"), "w") as f:
        f.write(str(holder.pid))


@contextlib.contextmanager
def recorded(name):
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    path = os.path.join(out, f"{name}-rank{rank}")
    with open(path + ".out", "w") as o, open(path + ".err", "w") as e:
        os.dup2(o.fileno(), 1), os.dup2(e.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])


try:
    for step in json.loads(os.environ["STEPS"]):
        if step.get("before"):
            if rank == 0:
                globals()[step["before"]](os.environ["STEPS_TMP"])
            dist.barrier()
        code = 0
        with recorded(step["name"]):
            try:
                cli.run(main, "run.py", step["argv"])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
        with open(os.path.join(out, f"{step['name']}-rank{rank}.rc"), "w") as f:
            f.write(str(code))
        for lock in [o for o in gc.get_objects() if isinstance(o, SaveFolderLock) and o._fd is not None]:
            os.close(lock._fd)
            lock._fd = None
        folder = [a.split("=", 1)[1] for a in step["argv"] if a.startswith("trainer.save_folder=")][-1]
        if rank == 0 and folder != "null":
            with open(os.path.join(out, f"{step['name']}.listing"), "w") as f:
                json.dump(sorted(os.listdir(folder)), f)
        dist.barrier()
finally:
    if holder is not None:
        holder.kill()
        holder.wait()
"""


class Step:
    """One step's record: ``returncodes`` (each rank's), ``stdout`` and ``stderr`` (rank 0's, as a launch prints
    them), ``err`` (each rank's stderr), ``listing`` (its save folder's names after it)."""

    def __init__(self, out, name):
        listing = out / f"{name}.listing"
        self.listing = json.loads(listing.read_text()) if listing.exists() else None
        self.returncodes = [int((out / f"{name}-rank{r}.rc").read_text()) for r in (0, 1)]
        self.stdout = (out / f"{name}-rank0.out").read_text()
        self.err = [(out / f"{name}-rank{r}.err").read_text() for r in (0, 1)]
        self.stderr = self.err[0]


@pytest.fixture(scope="module")
def runs(train_kit, tmp_path_factory):
    """One launch, its steps in turn: a 5-batch sharded run keeping 3 checkpoints (its batch 5 is the straight
    run's weights; a copy keeping the newest two is the "straight" folder), then cut: batch 4's shard cut
    short, batch 5's save never finished; resumed to 5 under the same command, keeping 2. Then a copy of the
    straight folder without the checkpoints' indexes, refused and then started fresh; a run into the
    straight folder while another process holds its lock; last, a run whose ``trainer.load_path`` is a sharded
    checkpoint whose index would run code when unpickled."""
    tmp = tmp_path_factory.mktemp("sharded")
    mds = write_latent_mds(str(tmp / "mds"), kit=train_kit, n=48)
    # a refused run's dataset is never closed (streaming refuses its folder to a second dataset in the process)
    copies = [str(shutil.copytree(mds, tmp / name)) for name in ("mds-refused", "mds-locked", "mds-hostile")]
    import torch.distributed.checkpoint as dcp
    hostile = tmp / "hostile" / "ep0-ba5"  # a .metadata that calls open() when unpickled, beside real shards
    dcp.save({"weight": torch.ones(2), "step": 5}, checkpoint_id=str(hostile))
    with open(hostile / ".metadata", "wb") as f:
        pickle.dump(_Marker(str(tmp / "ran")), f)
    keep3 = "trainer.save_num_checkpoints_to_keep=3"
    steps = [{"name": "first", "argv": _args(train_kit, mds, tmp / "resumed", 5, keep3)},
             {"name": "resumed", "argv": _args(train_kit, mds, tmp / "resumed", 5), "before": "cut"},
             {"name": "refused", "argv": _args(train_kit, copies[0], tmp / "cut", 6), "before": "unreadable"},
             {"name": "fresh", "argv": _args(train_kit, mds, tmp / "cut", 1, "trainer.start_fresh=true")},
             {"name": "second", "argv": _args(train_kit, copies[1], tmp / "straight", 6), "before": "hold"},
             {"name": "hostile", "argv": [TINY, "trainer.device=cpu", f"trainer.load_path={hostile}",
                                          "trainer.max_duration=1ba", "trainer.save_folder=null",
                                          "trainer.autoresume=false", f"data.train.path={copies[2]}",
                                          "data.train.batch_size=8", f"model.ref={train_kit}", "algorithms={}",
                                          "callbacks={}", "loggers={}"]}]
    script = tmp / "steps.py"
    script.write_text(STEPS_HARNESS)
    composer = os.path.join(os.path.dirname(sys.executable), "composer")
    env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", RECORD_DIR=str(tmp), STEPS_TMP=str(tmp),
               STEPS=json.dumps(steps))
    launch = run_group([composer, "-n", "2", "--master_port", str(free_port()), str(script)], cwd=ROOT, env=env,
                       timeout=800)
    assert launch.returncode == 0, launch.stdout[-4000:] + launch.stderr[-4000:]
    done = {step["name"]: Step(tmp, step["name"]) for step in steps}
    return {"tmp": tmp, "mds": mds, "holder": int((tmp / "holder.pid").read_text()), "hostile_index": hostile, **done}


@pytest.mark.slow
def test_autoresume_continues_a_sharded_run_from_its_last_complete_checkpoint(runs):
    first, resumed, folder = runs["first"], runs["resumed"], runs["tmp"] / "resumed"
    assert first.returncodes == [0, 0], first.stderr[-4000:]
    assert resumed.returncodes == [0, 0], resumed.stderr[-4000:]
    assert not any("Traceback" in err for err in resumed.err)
    assert first.listing == ["ep0-ba3", "ep0-ba4", "ep0-ba5", "latest-rank0.pt"]  # 1 and 2 pruned
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
def test_a_folder_of_unreadable_checkpoints_is_refused_unless_asked_to_start_fresh(runs):
    folder, refused, fresh = runs["tmp"] / "cut", runs["refused"], runs["fresh"]
    assert refused.returncodes == [2, 2], refused.stderr[-4000:]  # every rank refuses (exit 2)
    assert not any("Traceback" in err for err in refused.err)
    [line] = _error_lines(refused)[:1]
    assert f"trainer.save_folder={folder} holds checkpoints autoresume cannot read" in line
    assert "set trainer.start_fresh=true" in line
    assert not any(n.startswith("ep0-ba") and not n.endswith(".incomplete") for n in refused.listing)
    assert fresh.returncodes == [0, 0], fresh.stderr[-4000:]
    assert "resuming from" not in fresh.stdout
    assert sorted(n for n in os.listdir(folder) if n.endswith(".incomplete")) == ["ep0-ba4.incomplete",
                                                                                 "ep0-ba5.incomplete"]
    assert os.readlink(folder / "latest-rank0.pt") == "ep0-ba1"


@pytest.mark.slow
def test_a_second_run_into_a_sharded_runs_folder_is_refused(runs):
    """The lock is the same for sharded runs: a live holder (here a process holding ``.run.lock``)
    refuses the second run at start, before any rank trains."""
    folder, second = runs["tmp"] / "straight", runs["second"]
    assert second.returncodes == [2, 2], second.stderr[-4000:]
    [line] = _error_lines(second)[:1]
    assert f"trainer.save_folder={folder} is in use by another run (pid {runs['holder']}" in line
    assert os.readlink(folder / "latest-rank0.pt") == "ep0-ba5"


class _Marker:
    """Unpickling this runs ``open(path, "w")``: the payload a hostile checkpoint carries."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def test_a_sharded_index_or_entry_that_would_run_code_is_refused_and_runs_nothing(tmp_path):
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


@pytest.mark.slow
def test_a_sharded_load_path_that_would_run_code_is_refused_in_one_line_before_any_rank_reads_it(runs):
    """Through the command (the launch's last run): every rank refuses ``trainer.load_path`` in one line, and the
    index's payload never runs."""
    hostile = runs["hostile"]
    assert hostile.returncodes == [2, 2], hostile.stderr[-3000:]
    assert not any("Traceback" in err for err in hostile.err)
    [line] = _error_lines(hostile)
    assert line.startswith(f"run.py: error: {runs['hostile_index'] / '.metadata'}: refused"), line
    assert not (runs["tmp"] / "ran").exists()
