"""The save folder: one run at a time, checkpoints written whole, a resume never blocked by a cut one.

- **Atomic saves.** Composer 0.32 writes a checkpoint straight under its final name: a kill -9 or a
  full disk mid-write leaves a truncated ``ep0-ba8-rank0.pt``, and every later autoresume stops with
  Composer's "... may conflict with a future checkpoint" until someone deletes it.
  :func:`write_checkpoints_atomically` makes Composer write ``.partial-<name>`` and rename it to
  ``<name>`` once complete (and flushed to disk), so a checkpoint under its final name is always whole.
  Remote uploads start from that renamed file (Composer's uploader copies it, then uploads), and an
  object store shows an object only once its upload completes. A write that fails for want of space
  removes its partial file and stops the run in one line (``OSError`` ENOSPC naming the checkpoint).
- **Resume.** With autoresume, :func:`recover` looks at the folder first: unfinished ``.partial-`` files
  are removed, a checkpoint cut short (written before atomic saves, or by other tools) is set aside
  as ``<name>.incomplete``, and ``latest-rank0.pt`` is pointed at the last complete checkpoint; each
  step is one line on stderr. A remote (``s3://``) folder's ``latest-rank0.pt.symlink`` is pointed at the
  newest checkpoint uploaded (:func:`point_remote_latest`: Composer moves it late, so a kill leaves it behind).
- **One run per folder.** :class:`SaveFolderLock` holds ``.run.lock`` in the (local) folder: an advisory
  ``flock`` the kernel drops when the process dies, and the holder's pid, host and command. A second
  run is refused at start naming the folder and the live run. A lock left by a dead process on this
  host is stale and taken over (one line); one written by another host whose lock is free cannot be
  judged from here and is refused, saying to delete it if that run is gone.

Checkpoints are Composer's defaults: ``ep{epoch}-ba{batch}-rank{rank}.pt`` and ``latest-rank{rank}.pt``;
only global rank 0 writes them (monolithic checkpoints). Sharded checkpoints are folders Composer links
only once complete, and are left as they are.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import pickle
import posixpath
import re
import socket
import sys
import time
import zipfile

from composer.core import Callback

from diffusion.errors import UserError

PARTIAL_PREFIX = ".partial-"
INCOMPLETE_SUFFIX = ".incomplete"
LOCK_NAME = ".run.lock"
LATEST = "latest-rank0.pt"
CHECKPOINT_FILE = re.compile(r"^ep(\d+)-ba(\d+)-rank0\.pt$")
_SHARDED = re.compile(r"^ep(\d+)-ba(\d+)$")  # Composer's sharded_ckpt_prefix_dir
_FULL = {errno.ENOSPC, errno.EDQUOT, errno.EFBIG}


class SaveFolderInUse(UserError):
    """Another live run holds the save folder."""


def note(message: str) -> None:
    print(f"note: {message}", file=sys.stderr, flush=True)


# ---- atomic saves -------------------------------------------------------------------------------------

def write_checkpoints_atomically() -> None:
    """Route Composer's checkpoint writes (``composer.utils.checkpoint._write_checkpoint_file``, the one
    function every monolithic save goes through) through :func:`_write_whole`."""
    from composer.utils import checkpoint as composer_checkpoint
    original = composer_checkpoint._write_checkpoint_file
    if getattr(original, "atomic", False):
        return

    def write(state_dict, filename):
        _write_whole(original, state_dict, filename)
    write.atomic = True
    composer_checkpoint._write_checkpoint_file = write


def _write_whole(write, state_dict, filename: str) -> None:
    """``write(state_dict, partial)``, flushed to disk, then renamed to ``filename``; the partial file is
    removed if anything fails. The partial name keeps the ending (``.pt``, ``.tar.gz`` ...) Composer
    picks the format by."""
    folder, name = os.path.split(filename)
    partial = os.path.join(folder, PARTIAL_PREFIX + name)
    try:
        write(state_dict, partial)
        _fsync(partial)
        os.replace(partial, filename)
        _fsync(folder or ".")
    except BaseException as e:
        with contextlib.suppress(OSError):
            os.remove(partial)
        interrupt = _interrupt_behind(e)
        if interrupt is not None and interrupt is not e:
            # Ctrl-C or SIGTERM in the middle of torch's zip writer (Composer's sys.exit(130) or (143)) comes out as
            # the writer's own RuntimeError ("unexpected pos"), the interrupt its context: raise what stopped it
            raise interrupt from None
        if isinstance(e, OSError) and e.errno in _FULL:
            raise OSError(e.errno, f"{os.strerror(e.errno)}: this checkpoint was not saved (its unfinished file is "
                                   f"removed; the checkpoints before it are whole); free space, then re-run with "
                                   f"trainer.autoresume=true to continue from the last one", filename) from None
        raise


def _interrupt_behind(error: BaseException) -> BaseException | None:
    """The KeyboardInterrupt or SystemExit that ``error`` is, or was raised while handling, if any."""
    seen = set()
    while error is not None and id(error) not in seen:
        if isinstance(error, (KeyboardInterrupt, SystemExit)):
            return error
        seen.add(id(error))
        error = error.__context__
    return None


def _fsync(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


# ---- resume --------------------------------------------------------------------------------------------

def is_complete(path: str) -> bool:
    """Whether a ``torch.save`` file is whole: torch writes a zip archive whose directory comes last, so
    a file cut short has none (or is empty)."""
    try:
        with zipfile.ZipFile(path) as archive:
            return any(n.endswith("/data.pkl") or n == "data.pkl" for n in archive.namelist())
    except (zipfile.BadZipFile, OSError, ValueError):
        return False


def sharded_problem(folder: str) -> str | None:
    """Why the sharded checkpoint ``folder`` is not whole, or None: its index (``.metadata``, which torch
    writes last, through a temporary file renamed into place, once every rank's shard is flushed) must be
    readable and every shard it names at least as long as the bytes it indexes there. A hostile index is
    an :class:`~diffusion.errors.InputError`, not a cut checkpoint."""
    from diffusion.models import safe_checkpoint
    try:
        index = safe_checkpoint.read_index(folder)
    except FileNotFoundError:
        return "no .metadata: its save never finished"
    except (OSError, EOFError, pickle.UnpicklingError, AttributeError, TypeError, ValueError) as e:
        return f"its .metadata cannot be read ({type(e).__name__})"
    needed: dict[str, int] = {}
    for info in getattr(index, "storage_data", {}).values():
        name = os.fspath(info.relative_path)
        needed[name] = max(needed.get(name, 0), int(info.offset) + int(info.length))
    for name, size in sorted(needed.items()):
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            return f"its shard {name} is missing"
        if os.path.getsize(path) < size:
            return f"its shard {name} is cut short ({os.path.getsize(path)} of {size} bytes)"
    return None


def _problem(path: str) -> str | None:
    """Why the checkpoint at ``path`` (a file, or a sharded checkpoint's folder) cannot be resumed from."""
    if os.path.isdir(path):
        return sharded_problem(path)
    if is_complete(path):
        return None
    return f"it was cut short ({os.path.getsize(path)} bytes, no zip directory)"


class UnreadableCheckpoints(UserError):
    """The save folder holds checkpoints, and none that autoresume can read."""


def recover(folder: str, start_fresh: bool = False) -> list[str]:
    """Make the local save ``folder`` resumable (see the module docstring); returns the notices given.

    Checkpoints are ``ep{E}-ba{B}-rank0.pt`` files (monolithic) or ``ep{E}-ba{B}`` folders (sharded). If
    the folder holds checkpoints and none is whole, this raises :class:`UnreadableCheckpoints` rather
    than let the run start over, unless ``start_fresh`` (``trainer.start_fresh``): the cut ones are set
    aside either way, never deleted."""
    notices = []
    if not os.path.isdir(folder):
        return notices
    complete, set_aside = [], []
    for name in sorted(os.listdir(folder)):
        path = os.path.join(folder, name)
        if name.startswith(PARTIAL_PREFIX) and not os.path.isdir(path):
            os.remove(path)
            notices.append(f"removed {path}, a checkpoint write that never finished")
            continue
        if name.endswith(INCOMPLETE_SUFFIX):
            set_aside.append(name)
            continue
        match = CHECKPOINT_FILE.match(name) or _SHARDED.match(name)
        if not match or os.path.islink(path) or not os.path.exists(path):
            continue
        if os.path.isdir(path) != (_SHARDED.match(name) is not None):
            continue  # a folder named like a file, or the reverse: not a checkpoint of ours
        problem = _problem(path)
        if problem is None:
            complete.append((int(match.group(2)), name))
        else:
            os.replace(path, path + INCOMPLETE_SUFFIX)
            set_aside.append(name + INCOMPLETE_SUFFIX)
            notices.append(f"set aside {path} as {name + INCOMPLETE_SUFFIX}: {problem}; resuming from the last "
                           f"complete checkpoint (delete the set-aside one once you no longer need it)")
    latest = os.path.join(folder, LATEST)
    target = os.path.join(folder, os.readlink(latest)) if os.path.islink(latest) else None
    newest = max(complete)[1] if complete else None
    if target is not None and os.path.exists(target) and _problem(target) is None:
        # a complete latest: moved only when a newer complete checkpoint exists (a kill between the
        # rename and Composer's symlink update), which Composer would otherwise refuse to save past
        inside = os.path.dirname(os.path.abspath(target)) == os.path.abspath(folder)
        base = os.path.basename(os.path.normpath(target))
        current = (CHECKPOINT_FILE.match(base) or _SHARDED.match(base)) if inside else None
        if newest is None or current is None or int(current.group(2)) >= max(complete)[0]:
            return notices
    if newest is not None:
        _point(latest, newest)
        notices.append(f"{latest} now points to {newest}, the last complete checkpoint")
        return notices
    unreadable = set_aside or (target is not None and os.path.lexists(latest))
    if unreadable and not start_fresh:
        what = ", ".join(set_aside) or f"{LATEST} -> {os.readlink(latest)}"
        for message in notices:
            note(message)
        raise UnreadableCheckpoints(
            f"trainer.save_folder={folder} holds checkpoints autoresume cannot read ({what}) and no complete "
            f"one; rather than start this run over, nothing was trained: set trainer.start_fresh=true to "
            f"start from the beginning (the unreadable ones stay set aside), or give this run another "
            f"trainer.save_folder")
    if os.path.lexists(latest):
        os.remove(latest)
        notices.append(f"removed {latest}: it pointed to no complete checkpoint and there is none; "
                       f"training starts from the beginning (trainer.start_fresh)")
    return notices


def point_remote_latest(save_folder: str, run_name: str | None) -> list[str]:
    """Point a remote save folder's ``latest-rank0.pt.symlink`` at its newest checkpoint; returns the notices.

    Composer 0.32 uploads that object (what autoresume follows) only after a checkpoint's upload is confirmed:
    a process polls for the object every 30 s, and the pointer goes up at the first batch end after that
    (or at ``fit()``'s end). A run killed in between (any node, any time in that window) leaves the pointer
    at the checkpoint before, or none: the next launch starts over and its first upload stops on the
    object already there ("overwrite was set to False"). An object store shows an object only once its
    upload completed, so every ``ep{E}-ba{B}-rank0.pt`` listed is whole: the pointer is moved to the
    newest one when it names an older one, none, or one that is gone. Sharded checkpoints (folders, which
    are complete only with every rank's shard) are left to Composer's pointer."""
    import tempfile

    from composer.utils import format_name_with_dist, parse_uri
    from composer.utils.file_helpers import (BACKEND_TO_OBJECT_STORE_FACTORY, create_symlink_file,
                                             extract_path_from_symlink)
    backend, bucket, path = parse_uri(format_name_with_dist(save_folder, run_name or ""))
    if backend not in BACKEND_TO_OBJECT_STORE_FACTORY:
        return []  # dbfs, wandb ...: Composer's own
    prefix = path.strip("/") + "/" if path.strip("/") else ""
    pointer = prefix + LATEST + ".symlink"
    try:
        store = BACKEND_TO_OBJECT_STORE_FACTORY[backend](bucket, path)
        found = {}
        for key in store.list_objects(prefix):
            match = CHECKPOINT_FILE.match(key[len(prefix):])
            if match:
                found[int(match.group(2))] = key
        if not found:
            return []
        try:
            named = extract_path_from_symlink(pointer, store).strip()
        except FileNotFoundError:
            named = None
        newest = found[max(found)]
        sharded = _SHARDED.match(posixpath.basename(named or ""))
        if named == newest or (sharded and int(sharded.group(2)) >= max(found)):
            return []  # up to date, or a newer sharded checkpoint's folder: Composer's
        with tempfile.TemporaryDirectory() as temporary:
            link = os.path.join(temporary, "latest.symlink")
            create_symlink_file(newest, link)
            store.upload_object(pointer, link)
    except Exception as e:  # storage trouble: Composer's own autoresume reads what is there and says why
        return [f"could not check {save_folder} for a checkpoint newer than its {LATEST} pointer "
                f"({type(e).__name__}: {e})"]
    was = f"named {named}" if named in found.values() else ("named the missing " + named if named else "was missing")
    return [f"{backend}://{bucket}/{pointer} now names {newest}, the newest checkpoint uploaded whole (it {was}: "
            f"the run stopped before Composer moved it)"]


def _point(link: str, name: str) -> None:
    temporary = f"{link}.{os.getpid()}.tmp"
    with contextlib.suppress(FileNotFoundError):
        os.remove(temporary)
    os.symlink(name, temporary)
    os.replace(temporary, link)


# ---- one run per folder -----------------------------------------------------------------------------

def _start_time(pid: int) -> str | None:
    """The process's start time in clock ticks since boot (Linux), telling a reused pid from the holder."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return None


def _alive(pid: int, start: str | None) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return start is None or _start_time(pid) in (None, start)


class SaveFolderLock(Callback):
    """``.run.lock`` in ``folder`` for the life of this process's run (see the module docstring); a Composer
    callback that releases it when the Trainer closes (after the checkpoint saver's last upload).

    Args:
        folder: the local save folder.
        shown: how the folder is named in messages (``trainer.save_folder`` as given).
    """

    def __init__(self, folder: str, shown: str | None = None):
        self.folder, self.shown = folder, shown or folder
        self.path = os.path.join(folder, LOCK_NAME)
        self._fd: int | None = None

    def acquire(self) -> list[str]:
        """Take the lock or raise :class:`SaveFolderInUse`; returns the notices given (a stale lock taken over)."""
        try:
            os.makedirs(self.folder, exist_ok=True)
        except (FileExistsError, NotADirectoryError):  # was a bare "[Errno 17] File exists", the file untouched
            raise UserError(f"trainer.save_folder={self.shown}: not a folder (it, or a folder above it, is a "
                            f"file); give the folder to write checkpoints in") from None
        me = {"pid": os.getpid(), "host": socket.gethostname(), "start": _start_time(os.getpid())}
        while True:
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT, 0o644)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                holder = self._read(fd)
                os.close(fd)
                if holder.get("pid") == me["pid"] and holder.get("host") == me["host"]:
                    return []  # this process's own earlier trainer, still open: the same run
                raise SaveFolderInUse(self._refusal(holder, "is running")) from None
            if os.path.exists(self.path) and os.fstat(fd).st_ino == os.stat(self.path).st_ino:
                break
            os.close(fd)  # released and removed between our open and flock: take the new file
        holder, notices = self._read(fd), []
        if holder:
            if holder.get("host") != me["host"]:
                os.close(fd)
                raise SaveFolderInUse(self._refusal(holder, "may still be running (another host: it cannot be "
                                                            "checked from here)", stale_hint=True))
            if holder.get("pid") != me["pid"]:
                state = "exited" if not _alive(holder.get("pid", -1), holder.get("start")) else "released its lock"
                notices.append(f"{self.path}: taking over the lock of pid {holder.get('pid')} on {holder.get('host')}, "
                               f"which {state} without removing it")
        os.ftruncate(fd, 0)
        os.pwrite(fd, json.dumps({**me, "since": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
                                  "command": " ".join(sys.argv)[:300]}).encode(), 0)
        os.fsync(fd)
        self._fd = fd
        return notices

    def release(self) -> None:
        if self._fd is None:
            return
        with contextlib.suppress(OSError):
            if os.fstat(self._fd).st_ino == os.stat(self.path).st_ino:
                os.remove(self.path)  # removed while still locked, so no one else can hold this inode
        os.close(self._fd)
        self._fd = None

    def post_close(self) -> None:
        self.release()

    @staticmethod
    def _read(fd: int) -> dict:
        try:
            return json.loads(os.pread(fd, 4096, 0).decode() or "{}")
        except (ValueError, OSError):
            return {}

    def _refusal(self, holder: dict, status: str, stale_hint: bool = False) -> str:
        who = (f"pid {holder.get('pid', '?')} on {holder.get('host', '?')}, since {holder.get('since', '?')}: "
               f"{holder.get('command', '?')}")
        hint = f"; if it is not, delete {self.path}" if stale_hint else ""
        return (f"trainer.save_folder={self.shown} is in use by another run ({who}), which {status}{hint}; two "
                f"runs in one folder overwrite each other's checkpoints: wait for it, stop it, or give this run "
                f"another trainer.save_folder")


# ---- more than one node ----------------------------------------------------------------------------------

def node_unique_signal_files() -> None:
    """Give each node its own name for Composer's signal files.

    Composer 0.32 releases a node's other ranks once its local rank 0 has finished an autoresume download
    or a checkpoint load by writing a signal file beside the checkpoint, then removes it. The name is
    meant to be the node's own (``._signal_file_node{N}_...``), but it is broadcast from global rank 0, so
    every node gets node 0's name: in a save folder every node sees, the nodes' leaders write and remove
    one file, and the slower one fails (``No such file or directory``; its peers then lose the connection).
    Known upstream: llm-foundry #1736 and #504, composer #2363. This keeps Composer's function (the
    broadcast still runs on every rank, so its collective stays in step) and appends the node's own rank
    to the name it returns."""
    from composer.utils import dist
    shared_name = dist.get_node_signal_file_name
    if getattr(shared_name, "node_unique", False):
        return

    def own_name(rng=None):
        return f"{shared_name(rng)}-on-node{dist.get_node_rank()}"
    own_name.node_unique = True
    dist.get_node_signal_file_name = own_name


def node_count() -> int:
    from composer.utils import dist
    return max(1, dist.get_world_size() // max(1, dist.get_local_world_size()))


def check_shared(folder: str, shown: str, wait: float = 10.0) -> None:
    """On more than one node, refuse (:class:`~diffusion.errors.UserError`, one line, on every rank) a local
    save ``folder`` that is not one folder for every node: global rank 0 writes a marker file there and
    each node's local rank 0 looks for it (for up to ``wait`` seconds, as a network file system may show a
    new file late). Only global rank 0 writes checkpoints; a node that sees none cannot resume
    (Composer: "Downloading the checkpoint to all nodes failed")."""
    import uuid

    from composer.utils import dist
    nodes = node_count()
    if nodes < 2:
        return
    name = [f".node-check-{uuid.uuid4().hex}" if dist.get_global_rank() == 0 else None]
    dist.broadcast_object_list(name, src=0)
    marker = os.path.join(folder, name[0])
    if dist.get_global_rank() == 0:
        os.makedirs(folder, exist_ok=True)
        with open(marker, "w") as f:
            f.write(socket.gethostname())
    dist.barrier()
    def sees() -> bool:  # listing the folder revalidates a network file system's cached view of it
        with contextlib.suppress(OSError):
            return name[0] in os.listdir(folder)
        return False

    seen = True
    if dist.get_local_rank() == 0:
        deadline = time.monotonic() + wait
        while not sees() and time.monotonic() < deadline:
            time.sleep(0.2)
        seen = sees()
    answers = dist.all_gather_object((dist.get_node_rank(), seen))
    if dist.get_global_rank() == 0:
        with contextlib.suppress(OSError):
            os.remove(marker)
    blind = sorted({node for node, saw in answers if not saw})
    if blind:
        which = ", ".join(str(n) for n in blind)
        raise UserError(f"trainer.save_folder={shown} is not one folder for all {nodes} nodes: node "
                        f"{which} {'does' if len(blind) == 1 else 'do'} not see what node 0 writes there, so "
                        f"{'it' if len(blind) == 1 else 'they'} could never resume; on several nodes save to "
                        f"s3://... or to shared storage mounted at the same path on every node")


# ---- at the start of a run -----------------------------------------------------------------------------

def claim(save_folder: str | None, run_name: str | None, autoresume: bool, start_fresh: bool = False) -> list[Callback]:
    """At the start of a run, on global rank 0: lock the save folder and, with autoresume, :func:`recover`
    it (``start_fresh``: see there); every rank raises the same error if that fails. Returns ``[lock]`` for the Trainer's callbacks
    (``[]`` without a save folder, and on other ranks)."""
    from composer.utils import dist, format_name_with_dist, parse_uri
    if not save_folder:
        return []
    write_checkpoints_atomically()
    node_unique_signal_files()
    # the local folder Composer saves in (a remote save_folder's local copy: its path as a relative one)
    folder = format_name_with_dist(parse_uri(save_folder)[2], run_name or "")
    if "://" not in save_folder:
        check_shared(folder, save_folder)
    lock, error = None, None
    if dist.get_global_rank() == 0:
        lock = SaveFolderLock(folder, save_folder)
        try:
            notices = lock.acquire()
            if autoresume:
                notices += recover(folder, start_fresh)
            if autoresume and "://" in save_folder:  # before any node's autoresume reads the pointer
                notices += point_remote_latest(save_folder, run_name)
            for message in notices:
                note(message)
        except UserError as e:
            error = e
            lock.release()  # refused before training: the folder is left unlocked (a no-op where another run holds it)
    if dist.get_world_size() > 1:
        shared = [str(error) if error else None]
        dist.broadcast_object_list(shared, src=0)
        if shared[0] and error is None:
            error = UserError(shared[0])
    if error is not None:
        raise error
    return [lock] if lock is not None else []
