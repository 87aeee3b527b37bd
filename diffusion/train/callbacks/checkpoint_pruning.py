"""Remote checkpoint pruning: keep the newest ``save_num_checkpoints_to_keep`` checkpoints in an s3:// save folder.

Composer's ``save_num_checkpoints_to_keep`` deletes local files only; with a remote ``save_folder`` every
checkpoint stays in the bucket (~10 GB each at SD2 size). :func:`remote_pruner` gives the trainer this
callback when the save folder is remote and the setting is positive; on rank 0 it lists the folder,
groups its objects by checkpoint (``ep{E}-ba{B}-rank{R}.pt``, or the ``ep{E}-ba{B}/`` folder of a
sharded checkpoint) and deletes all but the newest N, never the one a ``latest-rank{R}.pt.symlink``
points to (what autoresume loads), nor anything newer than it.

Uploads are asynchronous (Composer's ``RemoteUploader``): a checkpoint still uploading is not listed yet,
so pruning after each save keeps N that are complete plus, while it uploads, the newest; it runs after
each save and at fit end, once Composer has waited for every upload and written the final symlink.
The callback must come after Composer's ``CheckpointSaver`` in ``state.callbacks`` (the trainer
appends it after building the Trainer, which adds the saver last).

Autoresume from a remote folder: Composer 0.32 downloads the remote ``latest`` to a *local* path made
of the URI (``./s3:/bucket/run/latest-rank0.pt`` under the working directory) and, on the next launch
from there, loads that copy without asking the remote: the checkpoint of the previous resume, whose
successors are already uploaded (its re-upload then fails). :func:`forget_autoresume_download` removes
that copy before the Trainer is built, so every launch resumes from the remote ``latest``.

Storage is reached as everywhere else (:func:`diffusion.storage.filesystem_for`): s3:// with the
endpoint from ``AWS_ENDPOINT_URL``/``S3_ENDPOINT_URL``, and pyarrow's other filesystems.
"""

from __future__ import annotations

import logging
import os
import posixpath
import re
import warnings

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

log = logging.getLogger(__name__)

_CHECKPOINT = re.compile(r"ep(\d+)-ba(\d+)(?![0-9])")


def _batch_of(name: str) -> int | None:
    """The batch count in a checkpoint's name (``ep0-ba12-rank0.pt``, ``ep0-ba12``), or None."""
    matches = _CHECKPOINT.findall(name)
    return int(matches[-1][1]) if matches else None


def forget_autoresume_download(save_folder: str | None, run_name: str | None) -> None:
    """Remove Composer's local copy of a remote ``latest`` checkpoint (see the module docstring), on
    each node's local rank 0, before the Trainer's autoresume looks for it."""
    if not save_folder or "://" not in save_folder or dist.get_local_rank() != 0:
        return
    from composer.utils import format_name_with_dist
    # Composer's path: the save folder (run name filled in) as a local path, rank 0's latest filename.
    stale = os.path.join(format_name_with_dist(save_folder, run_name or ""), "latest-rank0.pt")
    if os.path.lexists(stale):
        log.info("Removing %s, a local copy of a remote checkpoint from an earlier autoresume", stale)
        os.remove(stale)


def remote_pruner(save_folder: str | None, num_checkpoints_to_keep: int) -> list[Callback]:
    """``[RemoteCheckpointPruner]`` for a remote ``save_folder`` and a positive count; else ``[]``.

    A remote that pyarrow cannot reach (Composer also uploads to oci://, azure://, ...) is warned about
    here, at start, and left unpruned, as Composer leaves it."""
    if not save_folder or "://" not in save_folder or num_checkpoints_to_keep <= 0:
        return []
    from diffusion.storage import filesystem_for
    try:
        filesystem_for(save_folder)
    except ValueError as e:
        warnings.warn(f"trainer.save_num_checkpoints_to_keep={num_checkpoints_to_keep} keeps local checkpoints "
                      f"only: remote checkpoints under {save_folder} are not pruned ({e})")
        return []
    return [RemoteCheckpointPruner(save_folder, num_checkpoints_to_keep)]


class RemoteCheckpointPruner(Callback):
    """Deletes all but the newest ``keep`` checkpoints under the remote ``folder`` (see the module docstring).

    Args:
        folder: the trainer's ``save_folder`` (``s3://bucket/run``).
        keep: how many checkpoints to keep, besides the one the ``latest`` symlink points to.
    """

    def __init__(self, folder: str, keep: int):
        if keep <= 0:
            raise ValueError(f"keep must be positive, got {keep}")
        self.folder, self.keep = folder, int(keep)
        self._fs = None
        self._saves_seen = 0
        self.deleted: list[str] = []  # object paths deleted by this process, oldest first

    def _filesystem(self):
        if self._fs is None:
            from diffusion.storage import filesystem_for
            self._fs, self._root = filesystem_for(self.folder)
            self._root = self._root.rstrip("/")
        return self._fs, self._root

    # ---- Composer hooks ----------------------------------------------------------------------
    def batch_end(self, state: State, logger: Logger) -> None:
        saves = _saves(state)
        if saves != self._saves_seen:  # a checkpoint was saved since the last pass
            self._saves_seen = saves
            self._format_folder(state)
            self.prune()

    def fit_end(self, state: State, logger: Logger) -> None:
        self._format_folder(state)
        self.prune()  # after the saver's fit_end: every upload done, the final symlink written

    def _format_folder(self, state: State) -> None:
        if "{" in self.folder:  # e.g. s3://bucket/{run_name}/checkpoints, as Composer formats it
            from composer.utils import format_name_with_dist
            self.folder, self._fs = format_name_with_dist(self.folder, state.run_name), None

    # ---- pruning -----------------------------------------------------------------------------
    def checkpoints(self) -> tuple[dict[int, list[str]], set[int]]:
        """The folder's checkpoints (batch count → object paths) and the batch counts symlinks point to."""
        import pyarrow.fs as pafs
        fs, root = self._filesystem()
        groups: dict[int, list[str]] = {}
        targets: set[int] = set()
        infos = fs.get_file_info(pafs.FileSelector(root, recursive=True, allow_not_found=True))
        for info in infos:
            if info.type != pafs.FileType.File:
                continue
            relative = posixpath.relpath(info.path, root)
            top = relative.split("/", 1)[0]
            if relative.endswith(".symlink"):
                with fs.open_input_stream(info.path) as f:
                    target = _batch_of(f.read().decode("utf-8", "replace").strip())
                if target is not None:
                    targets.add(target)
                continue
            batch = _batch_of(top)
            if batch is not None:
                groups.setdefault(batch, []).append(info.path)
        return groups, targets

    def prune(self) -> list[str]:
        """Delete what is beyond the newest ``keep`` (rank 0 only); returns the object paths deleted."""
        if dist.get_global_rank() != 0:
            return []
        try:
            groups, targets = self.checkpoints()
        except OSError as e:  # storage trouble must not stop training: Composer's own upload retries
            log.warning("Not pruning remote checkpoints under %s this time: %s", self.folder, e)
            return []
        newest = sorted(groups, reverse=True)[:self.keep]
        # Never what autoresume would load, nor anything newer (a symlink not yet moved forward).
        oldest_protected = min(targets) if targets else None
        doomed = [b for b in groups if b not in newest and (oldest_protected is None or b < oldest_protected)]
        fs, _ = self._filesystem()
        deleted = []
        for batch in sorted(doomed):
            for path in sorted(groups[batch]):
                try:
                    fs.delete_file(path)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    log.warning("Could not delete old checkpoint object %s: %s", path, e)
                    continue
                deleted.append(path)
        if deleted:
            log.info("Pruned %d old checkpoint object(s) under %s (keeping the newest %d)", len(deleted),
                     self.folder, self.keep)
        self.deleted += deleted
        return deleted


def _saves(state: State) -> int:
    """How many checkpoints Composer's CheckpointSaver has saved in this process."""
    from composer.callbacks import CheckpointSaver
    return sum(cb.symlink_count for cb in state.callbacks if isinstance(cb, CheckpointSaver))


# ---- the local save folder ----------------------------------------------------------------------------
_LOCAL = re.compile(r"^ep(\d+)-ba(\d+)(-rank\d+\.pt)?$")  # a monolithic file, or a sharded checkpoint's folder


def local_pruner(save_folder: str | None, num_checkpoints_to_keep: int) -> list[Callback]:
    """``[LocalCheckpointPruner]`` for a local ``save_folder`` and a positive count; else ``[]``."""
    if not save_folder or "://" in save_folder or num_checkpoints_to_keep <= 0:
        return []
    return [LocalCheckpointPruner(save_folder, num_checkpoints_to_keep)]


class LocalCheckpointPruner(Callback):
    """Keeps the newest ``keep`` checkpoints in a local save folder, counting those earlier runs of the
    same command left there (Composer's own rotation forgets them once a run is interrupted and resumed,
    so a resumed run kept one more than asked after every interruption). Never deletes what ``latest``
    points to, nor anything newer; set-aside (``.incomplete``) and unfinished (``.partial-``) ones are not
    checkpoints here and are left alone. Rank 0 prunes, after each save and at the end of ``fit()``; the
    trainer hands Composer ``save_num_checkpoints_to_keep=-1`` so the two never delete the same file.
    """

    def __init__(self, folder: str, keep: int):
        if keep <= 0:
            raise ValueError(f"keep must be positive, got {keep}")
        self.folder, self.keep = folder, int(keep)
        self._saves_seen = 0
        self.deleted: list[str] = []

    def batch_end(self, state: State, logger: Logger) -> None:
        saves = _saves(state)
        if saves != self._saves_seen:
            self._saves_seen = saves
            self.prune(state.run_name)

    def fit_end(self, state: State, logger: Logger) -> None:
        self.prune(state.run_name)

    def prune(self, run_name: str | None = None) -> list[str]:
        if dist.get_global_rank() != 0:
            return []
        import shutil
        from composer.utils import format_name_with_dist
        folder = format_name_with_dist(self.folder, run_name or "") if "{" in self.folder else self.folder
        if not os.path.isdir(folder):
            return []
        groups: dict[int, list[str]] = {}
        for name in os.listdir(folder):
            match = _LOCAL.match(name)
            path = os.path.join(folder, name)
            if match and not os.path.islink(path):
                groups.setdefault(int(match.group(2)), []).append(path)
        protected = None
        for name in os.listdir(folder):
            if name.startswith("latest-rank") and os.path.islink(os.path.join(folder, name)):
                batch = _batch_of(os.readlink(os.path.join(folder, name)))
                if batch is not None:
                    protected = batch if protected is None else min(protected, batch)
        newest = sorted(groups, reverse=True)[:self.keep]
        deleted = []
        for batch in sorted(groups):
            if batch in newest or (protected is not None and batch >= protected):
                continue
            for path in sorted(groups[batch]):
                try:
                    shutil.rmtree(path) if os.path.isdir(path) else os.remove(path)
                except FileNotFoundError:
                    continue
                except OSError as e:
                    log.warning("Could not delete old checkpoint %s: %s", path, e)
                    continue
                deleted.append(path)
        self.deleted += deleted
        return deleted
