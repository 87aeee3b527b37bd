"""Streaming's shared memory that killed runs left on this node, found and removed at training start.

A killed run leaves its datasets' POSIX shared-memory segments (``/dev/shm/000003_locals`` ...) and
filelocks (in the temp directory) behind, and streaming refuses to start a dataset over a prefix
still registered. Streaming's own ``clean_stale_shared_memory`` removes every prefix's segments,
another running job's included (which then fails or hangs); :func:`clean_shared_memory` removes a
prefix only when no live process on the node maps or holds any of its segments.

Streaming registers a new dataset under the lowest free prefix: it finds one, waits at its ranks' barrier,
then the node's first rank creates it. Two jobs starting at once on one node could find the same prefix,
and the second to create it crashed (``FileExistsError: '/000011_locals'``).
:func:`one_registration_at_a_time` makes jobs take turns, and the clean-up takes the same turn, so it
never looks at a prefix another job is registering.
"""

from __future__ import annotations

import collections
import contextlib
import fcntl
import os
import tempfile
from multiprocessing.shared_memory import SharedMemory as _BuiltinSharedMemory

from streaming.base.shared.prefix import _get_path

_SHM_DIR = "/dev/shm"  # where POSIX shared memory lives on Linux, one file per segment
REGISTRATION_LOCK = "diffusion-streaming-prefix.lock"  # in the temp directory, beside streaming's filelocks


@contextlib.contextmanager
def _node_turn(held: bool):
    """The node's registration lock, held for the block where ``held`` (a node's first rank)."""
    fd = None
    if held:
        fd = os.open(os.path.join(tempfile.gettempdir(), REGISTRATION_LOCK), os.O_RDWR | os.O_CREAT, 0o666)
        fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        yield
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


@contextlib.contextmanager
def one_registration_at_a_time():
    """Around a job's dataset construction on every rank: the node's first rank holds the lock, and the
    job's ranks wait for it at a barrier before and after, so one job registers a prefix at a time and
    the next finds it taken."""
    from streaming.base.distributed import barrier, get_local_rank
    with _node_turn(get_local_rank() == 0):
        barrier()  # the other ranks start only once their first rank holds the lock
        yield
        barrier()  # every rank has attached before the next job may register


def _prefix_of(name: str) -> int | None:
    """The streaming prefix of a shared-memory segment or filelock name (``000003_locals``), or None."""
    head, _, rest = name.partition("_")
    return int(head) if len(head) == 6 and head.isdigit() and rest else None


def _shm_users(names: set[str]) -> dict[str, set[int]]:
    """{segment name: pids of the processes on this node that map it or hold it open}, of ``names``.
    Processes whose maps cannot be read (another user's) are left out: they cannot open our segments,
    which are created owner-only."""
    users: dict[str, set[int]] = {name: set() for name in names}
    prefix = _SHM_DIR + "/"
    for pid in filter(str.isdigit, os.listdir("/proc")):
        found: set[str] = set()
        try:
            with open(f"/proc/{pid}/maps") as f:
                for line in f:
                    at = line.find(prefix)
                    if at >= 0:
                        found.add(line[at + len(prefix):].split(" (deleted)")[0].strip())
            fd_dir = f"/proc/{pid}/fd"
            for fd in os.listdir(fd_dir):
                try:
                    target = os.readlink(os.path.join(fd_dir, fd))
                except OSError:
                    continue
                if target.startswith(prefix):
                    found.add(target[len(prefix):])
        except OSError:  # gone meanwhile, or not ours to read
            continue
        for name in found & names:
            users[name].add(int(pid))
    return users


def _released(prefix_int: int) -> bool:
    """Whether the dataset that registered ``prefix_int`` has released it (streaming zeroes the size
    of its ``locals`` record when the dataset is deleted; its segments stay until its process exits)."""
    from streaming.base.constant import LOCALS
    try:
        shm = _BuiltinSharedMemory(_get_path(prefix_int, LOCALS))
    except (FileNotFoundError, ValueError, OSError):
        return True
    try:
        return len(shm.buf) < 4 or bytes(shm.buf[:4]) == bytes(4)
    finally:
        shm.close()


def stale_shared_memory() -> tuple[list[str], list[str]]:
    """(segment paths, filelock paths) of the streaming shared memory on this node that no live dataset
    uses. A prefix is in use while some process maps or holds any of its segments, unless that is only
    this process and its dataset was deleted; a prefix's filelocks (in the temp directory) are stale
    once no segment of it is in use. Another job's segments and filelocks are never listed."""
    from streaming.base.constant import BARRIER_FILELOCK, CACHE_FILELOCK
    # Filelocks first: a dataset creates its segments before its filelocks, so one whose filelock is
    # listed here has its segments listed (and mapped) below.
    root = tempfile.gettempdir()
    lock_names = [name for name in os.listdir(root)
                  if name.endswith((f"_{BARRIER_FILELOCK}", f"_{CACHE_FILELOCK}")) and _prefix_of(name) is not None]
    try:
        entries = os.listdir(_SHM_DIR)
    except OSError:
        return [], []
    by_prefix: dict[int, list[str]] = collections.defaultdict(list)
    for name in entries:
        prefix_int = _prefix_of(name)
        if prefix_int is not None:
            by_prefix[prefix_int].append(name)
    users = _shm_users({name for names in by_prefix.values() for name in names})
    me, live, segments = os.getpid(), set(), []
    for prefix_int, names in sorted(by_prefix.items()):
        pids = set().union(*(users[name] for name in names))
        if not pids or (pids == {me} and _released(prefix_int)):
            segments += [os.path.join(_SHM_DIR, name) for name in sorted(names)]
        else:
            live.add(prefix_int)
    locks = sorted(os.path.join(root, name) for name in lock_names if _prefix_of(name) not in live)
    return segments, locks


def clean_shared_memory() -> None:
    """Remove the streaming shared memory (and filelocks) that killed runs left on this node, and only
    that: segments some live process still uses (another job's, on this node) are kept.

    Streaming's own ``clean_stale_shared_memory`` removes every prefix's segments, another running
    job's included (which then fails or hangs); here a prefix is stale only when no process on the
    node maps or holds any of its segments (:func:`stale_shared_memory`). Where ``/dev/shm`` cannot
    be listed (not Linux) nothing is removed: a new dataset then takes the next free prefix."""
    from streaming.base.distributed import barrier, get_local_rank
    if get_local_rank() == 0:
        with _node_turn(True):  # not while another job registers a prefix it has not mapped yet
            segments, locks = stale_shared_memory()
            for path in segments + locks:
                try:
                    os.unlink(path)
                except OSError:
                    pass  # another user's, or removed meanwhile
    barrier()  # the other local ranks start their datasets once the stale prefixes are gone
