"""Jobs starting at once on one machine: streaming registers a dataset's shared memory under the lowest
free numeric prefix (find it, then create it). A job that found the same prefix as another, and created it
second, crashed with ``FileExistsError: '/0000NN_locals'`` (seen with two suite workers, and with jobs whose
``TMPDIR``s differ: two users, two containers sharing ``/dev/shm``). Datasets now register one job at a time
under a lock that lives in ``/dev/shm`` itself, open to every user, held only while a node's first rank
finds and creates its prefix: never across a barrier, so two node ranks on one host do not deadlock. A
wait on it is bounded and ends in one line naming the holder; a dead holder's lock is taken over."""

import json
import os
import selectors
import shutil
import socket
import subprocess
import sys
import tempfile
import time

import pytest

from diffusion.loader import mds_source, shared_memory
from train_fixtures import write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Node rank 1 of a two-"node" job on this host (LOCAL_WORLD_SIZE=1: it is its node's first rank), with the
# window between finding a free prefix and creating it widened, as a busy machine widens it.
NODE_RANK = r'''
import datetime, sys, time
import torch.distributed as dist
from streaming.base.constant import LOCALS
from streaming.base.shared import prefix
from diffusion.loader import mds_source
find = prefix._check_and_find
def slow_find(local, remote, shm_name):
    found = find(local, remote, shm_name)
    if shm_name == LOCALS:
        time.sleep(0.5)
    return found
prefix._check_and_find = slow_find
dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=240))
dataset = mds_source.LatentDataset(remote=None, local=sys.argv[1], resolution=64, batch_size=4)
print(dataset._shm_prefix_int, len(dataset), flush=True)
sys.stdin.readline()
'''

# Takes the registration lock (in the folder argv[1]) as a job would, says so, and holds it until told;
# with "orphan", forks a child that inherits the lock and dies itself (a holder that died mid-turn while a
# process it started lives on).
HOLDER = r'''
import os, sys, time
from diffusion.loader import shared_memory
shared_memory.lock_dir = lambda: sys.argv[1]
with shared_memory.registration_turn():
    if sys.argv[2] == "orphan":
        if os.fork() == 0:
            time.sleep(60)
            os._exit(0)
        print(os.getpid(), flush=True)
        os._exit(0)
    print(os.getpid(), flush=True)
    sys.stdin.readline()
'''


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _readline(process, seconds: float) -> str:
    """The process's next stdout line, or fail naming it after ``seconds``."""
    with selectors.DefaultSelector() as selector:
        selector.register(process.stdout, selectors.EVENT_READ)
        if not selector.select(timeout=seconds):
            pytest.fail(f"pid {process.pid} said nothing for {seconds:g} s (deadlocked?)")
    return process.stdout.readline().strip()


def _slow_find(monkeypatch):
    from streaming.base.constant import LOCALS
    from streaming.base.shared import prefix
    find = prefix._check_and_find

    def slow_find(local, remote, shm_name):
        found = find(local, remote, shm_name)
        if shm_name == LOCALS:
            time.sleep(0.5)
        return found
    monkeypatch.setattr(prefix, "_check_and_find", slow_find)


def test_two_node_ranks_on_one_host_with_other_tmpdirs_register_at_once(train_kit, tmp_path, monkeypatch):
    """Two node ranks of one job on this host, each with its own TMPDIR (as two users' or two containers'
    jobs sharing /dev/shm have): this process is node 0, a real process node 1, and both register at once.
    With a lock per TMPDIR both took the same prefix and one crashed (FileExistsError); with one lock
    held across streaming's barrier they would wait on each other for ever. Here each takes its own."""
    import datetime

    import torch.distributed as dist
    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=8)
    (tmp_path / "node0-tmp").mkdir()
    (tmp_path / "node1-tmp").mkdir()
    job = dict(WORLD_SIZE="2", LOCAL_WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1",
               MASTER_PORT=str(_free_port()), **{shared_memory.WAIT_ENV: "30"})
    env = {k: v for k, v in os.environ.items() if k not in ("GROUP_RANK", "LOCAL_RANK")}
    env.update(job, PYTHONPATH=ROOT, RANK="1", NODE_RANK="1", TMPDIR=str(tmp_path / "node1-tmp"), OMP_NUM_THREADS="1")
    node1 = subprocess.Popen([sys.executable, "-c", NODE_RANK, mds], env=env, stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True, start_new_session=True)
    try:
        for name, value in dict(job, RANK="0", NODE_RANK="0").items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "node0-tmp"))
        _slow_find(monkeypatch)
        if dist.is_initialized():  # an in-process Composer Trainer earlier on this worker leaves its 1-rank group
            dist.destroy_process_group()
        dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=240))
        try:
            dataset = mds_source.LatentDataset(remote=None, local=mds, resolution=64, batch_size=4)
        finally:
            dist.destroy_process_group()
        theirs = _readline(node1, 60).split()
        assert len(theirs) == 2 and theirs[0].isdigit(), theirs  # a prefix and a length, not a crash
        assert dataset._shm_prefix_int != int(theirs[0])
        assert len(dataset) == int(theirs[1]) == 4  # 8 samples over the job's two ranks
    finally:
        try:
            node1.stdin.write("exit\n")
            node1.stdin.close()
            node1.wait(timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            os.killpg(node1.pid, 9)
            node1.wait()


@pytest.fixture
def lock_folder(monkeypatch):
    """A folder like /dev/shm (sticky, open to every user) for a registration lock of the test's own."""
    folder = tempfile.mkdtemp(prefix="shm-lock-test-", dir="/tmp")
    os.chmod(folder, 0o1777)
    monkeypatch.setattr(shared_memory, "lock_dir", lambda: folder)
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _holder(folder: str, mode: str = "hold") -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", HOLDER, folder, mode], env=dict(os.environ, PYTHONPATH=ROOT),
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)


def test_a_prefix_whose_locals_is_there_but_another_segment_is_not_is_passed_over(tmp_path, monkeypatch):
    """streaming's find answers, for each segment name, the first prefix lacking it; the largest can be a prefix
    whose locals exists (a dataset between registering and making its other segments, a half-removed one). Taking
    it failed (FileExistsError) and the same find gave it again: 101 tries, each walk leaving the segments it
    opened open, until one run's node rank died of "Too many open files" (a make test on this machine). Now the
    next prefix is taken, after one find."""
    from streaming.base.shared import prefix as streaming_prefix
    from streaming.base.world import World
    taken = {shared_memory._prefix_of(name) for name in os.listdir("/dev/shm") + os.listdir(tempfile.gettempdir())}
    stuck = next(p for p in range(900_000, 999_998) if p not in taken and p + 1 not in taken)
    locals_path = f"/dev/shm/{stuck:06d}_locals"
    with open(locals_path, "wb") as f:  # its locals only, as a dataset has right after registering
        f.write(bytes(64))
    finds = []
    monkeypatch.setattr(streaming_prefix, "_check_and_find_retrying",
                        lambda local, remote, shm_name, retry: finds.append(shm_name) or stuck)
    try:
        prefix_int, shm = shared_memory.register_prefix([str(tmp_path / "local")], [None], World.detect())
        try:
            assert prefix_int == stuck + 1 and len(finds) == len(set(finds))  # one find a segment name
        finally:
            shm.cleanup()
    finally:
        os.unlink(locals_path)


def test_a_holder_that_never_lets_go_is_named_in_one_line_within_the_wait(train_kit, tmp_path, lock_folder, monkeypatch):
    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=8)
    holder = _holder(lock_folder)
    try:
        pid = int(_readline(holder, 60))
        monkeypatch.setenv(shared_memory.WAIT_ENV, "1")
        start = time.monotonic()
        with pytest.raises(shared_memory.RegistrationLockTimeout) as caught:
            mds_source.LatentDataset(remote=None, local=mds, resolution=64, batch_size=4)
        assert time.monotonic() - start < 10
        message = str(caught.value)
        assert "\n" not in message and "held for more than 1 s" in message, message
        assert f"by pid {pid} on {socket.gethostname()}" in message and "running '-c " in message, message
        shared_memory.clean_shared_memory()  # the clean-up waits as long, says so, and lets training start
    finally:
        holder.stdin.write("exit\n")
        holder.stdin.close()
        holder.wait(timeout=30)
    with shared_memory.registration_turn(wait=5):  # released with its holder
        pass


def test_a_holder_that_died_while_its_child_keeps_the_lock_is_taken_over(lock_folder):
    holder = _holder(lock_folder, "orphan")
    pid = int(_readline(holder, 60))
    holder.wait(timeout=30)
    start = time.monotonic()
    with shared_memory.registration_turn(wait=20):
        taken = time.monotonic() - start
    assert taken < shared_memory.STALE_AFTER + 5, taken
    with open(shared_memory.registration_lock_path()) as f:  # a new lock file: the old one stays with the orphan
        assert f.read() == ""
    assert pid > 0


def _as_nobody(function) -> tuple[int, str]:
    """Run ``function`` in a forked child acting as user nobody; (its exit status, what it wrote to stderr).
    Forked rather than started: the venv's interpreter may not be readable to nobody."""
    import io
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: never returns into pytest
        status = 1
        try:
            os.close(read)
            sys.stderr = io.StringIO()
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            try:
                function()
                status = 0
            except Exception as error:
                print(error, file=sys.stderr)
            os.write(write, sys.stderr.getvalue().encode())
        finally:
            os._exit(status)
    os.close(write)
    with os.fdopen(read, "rb") as f:
        err = f.read().decode()
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1]), err


@pytest.mark.skipif(os.geteuid() != 0, reason="acting as another user needs root")
@pytest.mark.parametrize("mode", [0o644, 0o600])
def test_a_lock_file_another_user_made_does_not_stop_this_user(lock_folder, mode):
    """The lock file made by one user (as an umask of 022 or 077 leaves it) and another user's job: it runs
    (waiting its turn where it can read the file), instead of failing with "Permission denied"."""
    path = os.path.join(lock_folder, shared_memory.REGISTRATION_LOCK)
    os.close(os.open(path, os.O_RDWR | os.O_CREAT, 0o666))
    os.chmod(path, mode)

    def register(wait):
        def turn():
            with shared_memory.registration_turn(wait=wait):
                pass
        return turn

    status, err = _as_nobody(register(5))
    assert status == 0, err
    if mode == 0o644:  # readable: it still waits its turn behind this user's job
        with shared_memory.registration_turn():
            status, err = _as_nobody(register(0.5))
        assert status == 1
        assert err.strip().startswith(f"could not register a dataset's shared memory: the machine-wide lock {path} "
                                      f"has been held for more than 0.5 s by pid {os.getpid()}"), err
    else:  # unreadable to it: it says so in one line and registers without the lock
        assert err.strip().startswith("note: ") and "\n" not in err.strip(), err


# A job with a dataset open: says its prefix, then reads every sample each time it is told to.
OPEN_DATASET = r'''
import sys
from diffusion.loader import mds_source
dataset = mds_source.LatentDataset(remote=None, local=sys.argv[1], resolution=64, batch_size=4)
print(dataset._shm_prefix_int, flush=True)
for line in sys.stdin:
    print(sum(1 for _ in dataset), flush=True)
'''

# In a private mount namespace with a /dev/shm of its own (nothing of this machine's is touched): job A opens a
# dataset; a job in another PID namespace (a second container sharing /dev/shm) runs the start-up clean-up;
# then A reads again. Prints JSON: A's segments before and after, and what A read.
CONTAINERS = r'''
import json, os, subprocess, sys
a = subprocess.Popen([sys.executable, "-c", sys.argv[1], sys.argv[2]], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                     text=True)
prefix = int(a.stdout.readline())
mine = lambda: sorted(n for n in os.listdir("/dev/shm") if n.startswith(f"{prefix:06d}_"))
before = mine()
subprocess.run(["unshare", "--pid", "--fork", "--mount-proc", sys.executable, "-c",
                "from diffusion.loader import shared_memory; shared_memory.clean_shared_memory()"], check=True)
after = mine()
a.stdin.write("read\n")
a.stdin.flush()
read = a.stdout.readline().strip()
a.stdin.close()
a.wait(timeout=60)
print(json.dumps({"before": before, "after": after, "read": read}))
'''


def test_cleanup_in_another_pid_namespace_keeps_a_live_jobs_shared_memory(train_kit, tmp_path):
    """Two containers sharing /dev/shm: the clean-up of a job in its own PID namespace cannot see the other
    job's processes in /proc; it took their live segments for a killed job's and removed them (the other job
    then crashed, FileExistsError: '/000000_epoch_shape'). Real processes in two PID namespaces."""
    if os.geteuid() != 0 or shutil.which("unshare") is None or subprocess.run(
            ["unshare", "--pid", "--fork", "--mount-proc", "true"], capture_output=True).returncode:
        pytest.skip("needs root and unshare (PID and mount namespaces)")
    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=8)
    (tmp_path / "tmp").mkdir()
    env = dict(os.environ, PYTHONPATH=ROOT, TMPDIR=str(tmp_path / "tmp"), OMP_NUM_THREADS="1")
    script = f"mount -t tmpfs tmpfs /dev/shm && exec {sys.executable} -c \"$0\" \"$1\" \"$2\""
    done = subprocess.run(["unshare", "--mount", "--propagation", "private", "sh", "-c", script, CONTAINERS,
                           OPEN_DATASET, mds], cwd=ROOT, env=env, capture_output=True, text=True, timeout=240)
    assert done.returncode == 0, done.stderr[-3000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    assert result["before"] and result["after"] == result["before"]
    assert result["read"] == "8"
