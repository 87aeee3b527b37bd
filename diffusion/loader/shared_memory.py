"""Streaming's shared memory that killed runs left on this node, found and removed at training start.

A killed run leaves its datasets' POSIX shared-memory segments (``/dev/shm/000003_locals`` ...) and
filelocks (in the temp directory) behind, and streaming refuses to start a dataset over a prefix
still registered. Streaming's own ``clean_stale_shared_memory`` removes every prefix's segments,
another running job's included (which then fails or hangs); :func:`clean_shared_memory` removes a
prefix only when no live process on the node maps or holds any of its segments.

Streaming registers a new dataset under the lowest free prefix: every rank finds one, the ranks wait
at a barrier, then the node's first rank creates it. Two jobs starting at once on one machine could
find the same prefix, and the second to create it crashed (``FileExistsError: '/000011_locals'``).
Within :func:`one_registration_at_a_time` the node's first rank finds *and* creates its prefix under
a machine-wide lock (:func:`registration_turn`), then hands the prefix to its node's other ranks
(one gather in place of streaming's two barriers); the clean-up takes the same turn, so it never
looks at a prefix another job is registering.

The lock lives where the shared memory does (``/dev/shm``, shared by every user and container that
shares the segments, whatever their ``TMPDIR``), is open to every user, and is never held across a
barrier: a job's other node, or a second node rank on the same host, never waits on it. Its holder
writes who it is into the lock file, and a wait longer than ``DIFFUSION_SHM_LOCK_WAIT`` seconds
(default 60) ends in one line naming the holder. A holder that died while a process it started still
holds the lock is taken over. Without the lock (a lock file another user made unreadable), a
registration that loses the race to a prefix takes the next one.

A process sees only its own PID namespace's processes in ``/proc``: a job in another container sharing
``/dev/shm`` looks dead from here. Each registration records which PID namespace made the prefix, in a
small file beside the lock (:data:`REGISTRY`); the clean-up judges only prefixes registered from its own
namespace (or recorded by none) and leaves the others to their own namespace's jobs.
"""

from __future__ import annotations

import collections
import contextlib
import datetime
import errno
import fcntl
import json
import os
import socket
import sys
import tempfile
import time
from multiprocessing.shared_memory import SharedMemory as _BuiltinSharedMemory

_SHM_DIR = "/dev/shm"  # where POSIX shared memory lives on Linux, one file per segment
REGISTRATION_LOCK = "diffusion-streaming-prefix.lock"  # in /dev/shm, beside the segments it guards
WAIT_ENV = "DIFFUSION_SHM_LOCK_WAIT"  # seconds a job waits for the lock before it says who holds it
DEFAULT_WAIT = 60.0
STALE_AFTER = 1.0  # seconds a dead holder's lock is left before it is taken over
REGISTRY = "diffusion-streaming-prefixes.json"  # in lock_dir(): {prefix: {"ns": PID namespace, "pid": pid}}
_JOB_VARIABLES = ("SLURM_JOB_ID", "PBS_JOBID", "LSB_JOBID", "JOB_ID", "KUBERNETES_POD_NAME", "HOSTNAME")


class RegistrationLockTimeout(RuntimeError):
    """The machine-wide registration lock stayed held past the wait; the message names its holder."""


def lock_dir() -> str:
    """Where the registration lock lives: ``/dev/shm`` (machine-wide, like the segments), or the temp
    directory where there is no ``/dev/shm`` (not Linux)."""
    return _SHM_DIR if os.path.isdir(_SHM_DIR) else tempfile.gettempdir()


def registration_lock_path() -> str:
    return os.path.join(lock_dir(), REGISTRATION_LOCK)


def _wait_seconds() -> float:
    try:
        return max(0.0, float(os.environ.get(WAIT_ENV, "") or DEFAULT_WAIT))
    except ValueError:
        return DEFAULT_WAIT


def _start_time(pid: int) -> str | None:
    """The process's start time (``/proc/PID/stat`` field 22), telling a live holder from a reused pid;
    None when no such process runs here."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            return None
        except OSError:
            pass
        return "?"


def _identity() -> dict:
    """Who holds the lock: written into the lock file for the jobs that wait on it."""
    job = next((f"{name}={os.environ[name]}" for name in _JOB_VARIABLES if os.environ.get(name)), "")
    command = " ".join([os.path.basename(sys.argv[0] or sys.executable), *sys.argv[1:]])[:160]
    return {"pid": os.getpid(), "start": _start_time(os.getpid()), "host": socket.gethostname(),
            "uid": os.getuid(), "since": time.time(), "command": command, "job": job}


def _read_holder(fd: int) -> dict | None:
    try:
        holder = json.loads(os.pread(fd, 4096, 0).decode("utf-8", "replace") or "null")
    except (OSError, ValueError):
        return None
    return holder if isinstance(holder, dict) and isinstance(holder.get("pid"), int) else None


def _dead(holder: dict | None) -> bool:
    """Whether the holder recorded in the lock file is a process of this host that no longer runs."""
    if not holder or holder.get("host") != socket.gethostname():
        return False
    now = _start_time(holder["pid"])
    return now is None or (now != "?" and holder.get("start") not in (None, "?", now))


def describe_holder(holder: dict | None) -> str:
    if not holder:
        return "a holder that did not write its name (its lock file was read-only to it)"
    since = datetime.datetime.fromtimestamp(float(holder.get("since", 0)), datetime.timezone.utc)
    job = f", {holder['job']}" if holder.get("job") else ""
    return (f"pid {holder['pid']} on {holder.get('host', '?')} (uid {holder.get('uid', '?')}{job}) since "
            f"{since:%Y-%m-%d %H:%M:%S} UTC, running {holder.get('command', '?')!r}")


def _open_lock(path: str) -> tuple[int | None, bool]:
    """(descriptor, writable) of the lock file, created open to every user; (None, False) where it
    cannot be opened at all (another user made it unreadable). An existing file is opened without
    O_CREAT (which a sticky ``/dev/shm`` refuses on another user's file under fs.protected_regular),
    read-only where it is not writable to us: flock needs no write access."""
    for _ in range(10):
        for flags, writable in ((os.O_RDWR, True), (os.O_RDONLY, False)):
            try:
                return os.open(path, flags), writable
            except FileNotFoundError:
                break
            except PermissionError:
                continue
        else:
            return None, False
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o666)
        except FileExistsError:
            continue  # another job created it meanwhile: open theirs
        except OSError:
            return None, False
        try:
            os.fchmod(fd, 0o666)  # every user of the machine, whatever our umask
        except OSError:
            pass
        return fd, True
    return None, False


def _take_over(fd: int, path: str) -> bool:
    """Replace the lock file that a dead holder's surviving child keeps locked (a new file, a free lock),
    if it is still the file ``fd`` opened and ours to remove."""
    try:
        if os.stat(path).st_ino != os.fstat(fd).st_ino:
            return True  # replaced already: open the new one
        os.unlink(path)
        return True
    except FileNotFoundError:
        return True
    except OSError:
        return False


_UNLOCKED_NOTE = []


@contextlib.contextmanager
def registration_turn(wait: float | None = None, what: str = "register a dataset's shared memory"):
    """The machine-wide registration lock, held for the block; raises :class:`RegistrationLockTimeout`
    (one line naming the holder) when it stays held past ``wait`` seconds (``DIFFUSION_SHM_LOCK_WAIT``).
    Never hold it across a barrier or any wait on another process."""
    wait = _wait_seconds() if wait is None else wait
    path = registration_lock_path()
    deadline, pause, dead_since = time.monotonic() + wait, 0.01, None
    while True:
        fd, writable = _open_lock(path)
        if fd is None:
            if not _UNLOCKED_NOTE:
                _UNLOCKED_NOTE.append(path)
                print(f"note: {path} cannot be opened by this user (another user made it unreadable); "
                      f"registering streaming's shared memory without it", file=sys.stderr, flush=True)
            yield
            return
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as error:
            if error.errno not in (errno.EWOULDBLOCK, errno.EACCES, errno.EAGAIN):
                os.close(fd)
                raise
            holder = _read_holder(fd)
            if _dead(holder):
                dead_since = dead_since or time.monotonic()
                if time.monotonic() - dead_since >= STALE_AFTER and _take_over(fd, path):
                    os.close(fd)
                    dead_since = None
                    continue
            else:
                dead_since = None
            os.close(fd)
            if time.monotonic() >= deadline:
                raise RegistrationLockTimeout(
                    f"could not {what}: the machine-wide lock {path} has been held for more than {wait:g} s "
                    f"by {describe_holder(holder)}; if that job is stuck, end it, or wait for it and re-run "
                    f"(or set {WAIT_ENV} to wait longer)") from None
            time.sleep(pause)
            pause = min(0.2, pause * 2)
            continue
        break
    try:
        if writable:
            data = json.dumps(_identity()).encode()
            os.ftruncate(fd, 0)
            os.pwrite(fd, data, 0)
        yield
    finally:
        if writable:
            try:
                os.ftruncate(fd, 0)
            except OSError:
                pass
        os.close(fd)  # releases the lock


def _pid_namespace() -> str | None:
    try:
        return os.readlink("/proc/self/ns/pid")  # "pid:[4026531836]", the same for every process of a namespace
    except OSError:
        return None


def _read_registry() -> dict:
    try:
        with open(os.path.join(lock_dir(), REGISTRY)) as f:
            data = json.load(f)
        return data if isinstance(data, dict) else {}
    except (OSError, ValueError):
        return {}


def _write_registry(data: dict) -> None:
    """Replace the registry (under the registration lock), open to every user; left as it is where it cannot be."""
    path = os.path.join(lock_dir(), REGISTRY)
    temporary = f"{path}.{os.getpid()}.tmp"
    try:
        with open(temporary, "w") as f:
            json.dump(data, f)
        os.chmod(temporary, 0o666)
        os.replace(temporary, path)
    except OSError:
        with contextlib.suppress(OSError):
            os.unlink(temporary)


def _record_registration(prefix_int: int) -> None:
    _write_registry({**_read_registry(), str(prefix_int): {"ns": _pid_namespace(), "pid": os.getpid()}})


def register_prefix(streams_local, streams_remote, world, retry: int = 100):
    """Streaming's ``get_shm_prefix``, with the node's first rank finding and creating its prefix in one
    machine-wide turn, and its node's other ranks told the prefix by one gather instead of finding it
    themselves between two barriers (streaming's own pieces, in that order). A prefix created by
    another job between the find and the create (one that runs without the lock) is skipped."""
    from streaming.base.constant import LOCALS, SHM_TO_CLEAN
    from streaming.base.distributed import all_gather_object
    from streaming.base.shared import SharedMemory
    from streaming.base.shared import prefix as streaming_prefix
    from streaming.base.shared.prefix import _get_path
    from torch import distributed as dist

    distributed = dist.is_available() and dist.is_initialized()
    if not distributed and world.num_ranks > 1:  # streaming's own, whose barriers are then no-ops
        with registration_turn():
            prefix_int, shm = streaming_prefix.get_shm_prefix(streams_local, streams_remote, world, retry)
            if world.is_local_leader:
                _record_registration(prefix_int)
            return prefix_int, shm
    streaming_prefix._check_self(streams_local)
    prefix_int, shm, failure = None, None, None
    if world.is_local_leader:
        try:
            with registration_turn():
                # streaming's find, once (each of its walks leaves every segment it opened open until exit)
                prefix_int = max(streaming_prefix._check_and_find_retrying(streams_local, streams_remote,
                                                                           shm_name=name, retry=retry)
                                 for name in SHM_TO_CLEAN)
                for _ in range(1 + retry):
                    data = streaming_prefix._pack_locals(streams_local, prefix_int)
                    try:
                        shm = SharedMemory(_get_path(prefix_int, LOCALS), True, len(data))
                    except FileExistsError:
                        # taken: by a job that registered without the lock meanwhile, or a prefix whose locals
                        # is there while another of its segments is not (a dataset between registering and
                        # making the rest, a half-removed one), which the find answers again every time
                        prefix_int += 1
                        continue
                    shm.buf[:len(data)] = data
                    _record_registration(prefix_int)
                    break
                else:
                    raise RuntimeError(f"no free shared-memory prefix after {1 + retry} tries")
        except Exception as error:  # the node's other ranks learn it too, instead of waiting forever
            failure = error
    if not distributed:
        if failure is not None:
            raise failure
        return prefix_int, shm
    told = all_gather_object(prefix_int if failure is None else f"{type(failure).__name__}: {failure}")
    if failure is not None:
        raise failure
    if not world.is_local_leader:
        prefix_int = told[world.rank - world.rank_of_node]
        if isinstance(prefix_int, str):
            raise RuntimeError(f"the node's first rank could not register the dataset's shared memory: {prefix_int}")
        shm = SharedMemory(_get_path(prefix_int, LOCALS), False)
        their_locals, their_prefix_int = streaming_prefix._unpack_locals(bytes(shm.buf))
        if streams_local != their_locals or prefix_int != their_prefix_int:
            raise RuntimeError(f"the node's first rank registered shared-memory prefix {their_prefix_int} for "
                               f"{their_locals}, but this rank reads {streams_local}: give every rank the same "
                               f"data.*.local")
    return prefix_int, shm


@contextlib.contextmanager
def one_registration_at_a_time():
    """Around a job's dataset construction on every rank: streaming registers the dataset's shared memory
    through :func:`register_prefix` (the node's first rank holds the machine-wide lock only while it
    finds and creates its prefix, never across a barrier), so one job registers a prefix at a time and
    the next finds it taken."""
    import streaming.base.dataset as streaming_dataset
    original = streaming_dataset.get_shm_prefix
    streaming_dataset.get_shm_prefix = register_prefix
    try:
        yield
    finally:
        streaming_dataset.get_shm_prefix = original


def _prefix_of(name: str) -> int | None:
    """The streaming prefix of a shared-memory segment or filelock name (``000003_locals``), or None."""
    head, _, rest = name.partition("_")
    return int(head) if len(head) == 6 and head.isdigit() and rest else None


def _shm_users(names: set[str]) -> dict[str, set[int]]:
    """{segment name: pids of the processes on this node that map it or hold it open}, of ``names``.
    A mapping the kernel marks "(deleted)" is of a removed segment, not of the file now under its name
    (a prefix is reused once its segments are gone): it is no use of that name.
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
                    if at >= 0 and not line.rstrip().endswith(" (deleted)"):  # a removed file, not the name's
                        found.add(line[at + len(prefix):].strip())
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
    from streaming.base.shared.prefix import _get_path
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
    this process and its dataset was deleted; a prefix registered from another PID namespace (another
    container's job, whose processes this one cannot see) counts as in use; a prefix's filelocks (in the
    temp directory) are stale once no segment of it is in use. Another job's segments and filelocks are
    never listed."""
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
    registry, here = _read_registry(), _pid_namespace()
    me, live, segments = os.getpid(), set(), []
    for prefix_int, names in sorted(by_prefix.items()):
        pids = set().union(*(users[name] for name in names))
        made_by = registry.get(str(prefix_int))
        if isinstance(made_by, dict) and made_by.get("ns") != here:  # its users are not in this /proc
            live.add(prefix_int)
        elif not pids or (pids == {me} and _released(prefix_int)):
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
    be listed (not Linux) nothing is removed: a new dataset then takes the next free prefix, as it does
    when the registration lock stays held past its wait (one line says by whom).
    The lock is released before the barrier: a second node rank on this host never waits on it there."""
    from streaming.base.distributed import barrier, get_local_rank
    if get_local_rank() == 0:
        try:
            with registration_turn(what="clean up stale shared memory"):  # not while another job registers
                segments, locks = stale_shared_memory()  # a prefix it has not mapped yet
                for path in segments + locks:
                    try:
                        os.unlink(path)
                    except OSError:
                        pass  # another user's, or removed meanwhile
                registry = _read_registry()
                with contextlib.suppress(OSError):
                    present = {str(_prefix_of(n)) for n in os.listdir(_SHM_DIR) if _prefix_of(n) is not None}
                    if set(registry) - present:  # records of prefixes whose segments are gone
                        _write_registry({k: v for k, v in registry.items() if k in present})
        except RegistrationLockTimeout as error:
            print(f"note: {error}; stale shared memory is left for now", file=sys.stderr, flush=True)
    barrier()  # the other local ranks start their datasets once the stale prefixes are gone
