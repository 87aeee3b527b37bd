"""Two jobs starting at once on one machine: streaming registers a dataset's shared memory under the lowest
free numeric prefix (find it, then create it). A job that found the same prefix as another, and created it
second, crashed with ``FileExistsError: '/0000NN_locals'`` (seen with two suite workers). Datasets now
register one job at a time, under a machine-wide lock."""

import subprocess
import sys

from diffusion.loader import mds_source, shared_memory
from train_fixtures import write_latent_mds

# "Another job": it holds the registration lock, finds the next free prefix as streaming does, and creates
# it only after a while (as a leader does after its ranks' barrier).
OTHER_JOB = r'''
import fcntl, os, sys, tempfile, time
from streaming.base.constant import LOCALS
from streaming.base.shared.memory import SharedMemory
from streaming.base.shared.prefix import _check_and_find, _get_path
fd = os.open(os.path.join(tempfile.gettempdir(), sys.argv[1]), os.O_RDWR | os.O_CREAT, 0o666)
fcntl.flock(fd, fcntl.LOCK_EX)
prefix = _check_and_find([sys.argv[2]], [None], LOCALS)
print(prefix, flush=True)
sys.stdin.readline()
time.sleep(1.5)
try:
    shm = SharedMemory(_get_path(prefix, LOCALS), True, 16)
    print("created", flush=True)
except FileExistsError as error:
    print("crashed:", error, flush=True)
    shm = None
os.close(fd)
sys.stdin.readline()
if shm is not None:
    shm.cleanup()
'''


def test_a_dataset_built_while_another_job_registers_waits_and_takes_the_next_prefix(train_kit, tmp_path):
    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=8)
    other = subprocess.Popen([sys.executable, "-c", OTHER_JOB, shared_memory.REGISTRATION_LOCK, str(tmp_path / "other")],
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        their_prefix = int(other.stdout.readline())
        other.stdin.write("go\n")
        other.stdin.flush()
        dataset = mds_source.LatentDataset(remote=None, local=mds, resolution=64, batch_size=4)
        assert other.stdout.readline().strip() == "created"  # the other job was not beaten to its prefix
        assert dataset._shm_prefix_int != their_prefix
        assert len(dataset) == 8
    finally:
        other.stdin.write("exit\n")
        other.stdin.flush()
        other.wait(timeout=30)
