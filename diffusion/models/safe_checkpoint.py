"""Reading a checkpoint never runs code from it.

A Composer checkpoint is a pickle, and a pickle can name any callable to build its objects: a file from
another team or a bucket could run anything when ``torch.load(..., weights_only=False)`` reads it (what
Composer's own loader does). Every checkpoint we read, for sampling, export, evaluation and training's
``load_path`` / autoresume, goes through :func:`load`: torch's weights-only unpickler, which builds
tensors, containers, numbers and strings and calls nothing but the few types our checkpoints hold
(:data:`ALLOWED`: NumPy arrays and dtypes in the RNG states, the torch version, a timedelta). A file that
needs anything else is refused in one line naming it and the first such name, before anything of it runs.
"""

from __future__ import annotations

import dataclasses
import datetime
import os
import pickle
import re

import torch

from diffusion.errors import InputError

_UNSUPPORTED = re.compile(r"GLOBAL ([\w.]+)")  # torch words it "Unsupported global: GLOBAL x", "unsupported GLOBAL x ..."


def _allowed() -> list:
    import numpy as np
    try:
        from numpy._core.multiarray import _reconstruct
    except ImportError:  # NumPy 1.x
        from numpy.core.multiarray import _reconstruct
    import torch.torch_version
    # the dtype classes NumPy 2 pickles arrays' dtypes by (numpy.dtypes.UInt32DType ...)
    dtype_classes = [type(np.dtype(code)) for code in "?bBhHiIlLqQefdgFDG"]
    return [_reconstruct, np.ndarray, np.dtype, *dtype_classes, torch.torch_version.TorchVersion,
            datetime.timedelta]


def load(path, map_location="cpu", mmap: bool = False):
    """``torch.load`` of ``path`` with the weights-only unpickler and :func:`_allowed`'s types; an
    :class:`~diffusion.errors.InputError` naming the file and what it asked for if it needs more.
    ``mmap``: tensors stay on disk until read (to look at a big checkpoint's small entries)."""
    with torch.serialization.safe_globals(_allowed()):
        try:
            return torch.load(os.path.expanduser(os.fspath(path)), map_location=map_location, weights_only=True,
                              **({"mmap": True} if mmap else {}))
        except pickle.UnpicklingError as e:
            found = _UNSUPPORTED.search(str(e))
            if found:
                raise _asks_to_call(path, found.group(1)) from None
            raise InputError(f"{path}: refused: not a checkpoint torch.save wrote (a raw pickle or a damaged "
                             f"file: {_first_line(e)}); reading it could run code, so it is not read") from None
        except RuntimeError as e:
            if "legacy .tar format" in str(e) or "legacy" in str(e).lower() and "weights_only" in str(e):
                raise InputError(f"{path}: refused: a checkpoint in torch's legacy .tar format, which cannot be "
                                 f"read without running code; re-save it with torch.save from a trusted "
                                 f"copy") from None
            raise


def _asks_to_call(where, name: str, what: str = "the checkpoint", holder: str = "checkpoint of ours") -> InputError:
    """The one-line refusal of a file whose pickle names ``name``, outside what ``holder`` ever holds."""
    return InputError(f"{where}: refused: {what} asks to call {name}, which no {holder} holds; loading it could "
                      f"run code, so it is not read")


def _first_line(error: BaseException) -> str:
    """The part of torch's several-paragraph refusal that says what it met."""
    text = str(error)
    if "WeightsUnpickler error: " in text:
        return text.split("WeightsUnpickler error: ", 1)[1].splitlines()[0][:160]
    return (text.strip().splitlines() or [type(error).__name__])[0][:160]


def check(path) -> None:
    """Refuse ``path`` (one line) if its pickle names anything outside :func:`_allowed`: a scan of the
    pickle alone, without reading the tensors, for the user's own path before Composer copies it."""
    path = os.fspath(path)
    try:
        names = torch.serialization.get_unsafe_globals_in_checkpoint(os.path.expanduser(path))
    except Exception:  # not a zip checkpoint (legacy or damaged): the weights-only load decides
        return
    allowed = {f"{obj.__module__}.{obj.__qualname__}" for obj in _allowed()}
    allowed |= {name.replace("numpy._core.", "numpy.core.") for name in allowed}
    refused = [name for name in names if name not in allowed]
    if refused:
        raise _asks_to_call(path, refused[0])


def guard_composer_loads() -> None:
    """Make Composer's checkpoint loading (``trainer.load_path``, autoresume) read through :func:`load`.

    Composer 0.32 reads whole-state checkpoints with ``torch.load(..., weights_only=False)`` in one
    function, ``composer.utils.checkpoint._torch_load_with_validation``; it is replaced by one that
    validates as before and then loads weights-only."""
    from composer.utils import checkpoint as composer_checkpoint
    if getattr(composer_checkpoint._torch_load_with_validation, "weights_only_guard", False):
        return

    def load_with_validation(checkpoint_filepath, map_location):
        return load(composer_checkpoint._ensure_valid_checkpoint(checkpoint_filepath), map_location=map_location)

    load_with_validation.weights_only_guard = True
    composer_checkpoint._torch_load_with_validation = load_with_validation


# ---- sharded (torch.distributed.checkpoint) checkpoints -----------------------------------------------
# A sharded checkpoint is a folder: one ``__R_0.distcp`` file per rank and a ``.metadata`` index. torch's
# reader unpickles ``.metadata`` with ``pickle.load`` and every non-tensor entry (timestamps, RNG states,
# the model description ...) with ``torch.load(weights_only=False)``: either could run code. Here the index
# is read by an unpickler that builds only the index's own types, and each entry with the weights-only
# unpickler and :func:`_allowed`.

METADATA = ".metadata"


def _index_class(module: str, name: str):
    """The class ``module.name`` if a sharded checkpoint's index may hold it, else None."""
    import enum
    import pathlib
    if module == "torch.distributed.checkpoint.metadata":
        from torch.distributed.checkpoint import metadata
        found = getattr(metadata, name, None)
        ok = isinstance(found, type) and (dataclasses.is_dataclass(found) or issubclass(found, enum.Enum))
        return found if ok and found.__module__ == module else None
    if (module, name) == ("torch.distributed.checkpoint.filesystem", "_StorageInfo"):
        from torch.distributed.checkpoint.filesystem import _StorageInfo
        return _StorageInfo
    if module == "torch":
        found = getattr(torch, name, None)
        return found if isinstance(found, torch.dtype) or found is torch.Size else None
    if (module, name) == ("torch.serialization", "_get_layout"):
        return torch.serialization._get_layout  # a layout by its name
    if module == "pathlib" and name in ("PosixPath", "PurePosixPath", "WindowsPath", "PureWindowsPath"):
        return getattr(pathlib, name)
    if (module, name) == ("collections", "OrderedDict"):
        import collections
        return collections.OrderedDict
    return None


class _IndexUnpickler(pickle.Unpickler):
    def find_class(self, module, name):
        found = _index_class(module, name)
        if found is None:
            raise pickle.UnpicklingError(f"GLOBAL {module}.{name}")
        return found


def read_index(folder):
    """The ``.metadata`` of the sharded checkpoint ``folder``, unpickled with only its own types; an
    :class:`~diffusion.errors.InputError` naming the file and what it asked for if it needs more (a
    missing or cut index raises ``OSError``/``EOFError``/``pickle.UnpicklingError`` for the caller)."""
    path = os.path.join(os.path.expanduser(os.fspath(folder)), METADATA)
    with open(path, "rb") as f:
        try:
            return _IndexUnpickler(f).load()
        except pickle.UnpicklingError as e:
            found = _UNSUPPORTED.search(str(e))
            if found:
                raise _asks_to_call(path, found.group(1), "the sharded checkpoint's index", "checkpoint index") from None
            raise


def load_entry(data: bytes, where: str):
    """One non-tensor entry of a sharded checkpoint (``torch.save`` bytes), weights-only with :func:`_allowed`."""
    import io
    with torch.serialization.safe_globals(_allowed()):
        try:
            return torch.load(io.BytesIO(data), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            found = _UNSUPPORTED.search(str(e))
            if found:
                raise _asks_to_call(where, found.group(1)) from None
            raise


def read_entries(folder, prefix: str = "") -> dict:
    """The non-tensor entries of the sharded checkpoint ``folder`` whose flattened name starts with
    ``prefix`` (``state.model._extra_state.`` ...), each read as :func:`load_entry` does: {name: value}."""
    from torch.distributed.checkpoint.metadata import BytesStorageMetadata
    folder = os.path.expanduser(os.fspath(folder))
    index = read_index(folder)
    wanted = {name for name, meta in index.state_dict_metadata.items()
              if isinstance(meta, BytesStorageMetadata) and name.startswith(prefix)}
    out = {}
    for key, info in index.storage_data.items():
        if key.fqn not in wanted:
            continue
        path = os.path.join(folder, os.fspath(info.relative_path))
        with open(path, "rb") as f:
            f.seek(info.offset)
            data = f.read(info.length)
        out[key.fqn] = load_entry(data, f"{path} ({key.fqn})")
    return out


def check_sharded(folder) -> None:
    """Refuse (one line) a sharded checkpoint whose index or any non-tensor entry needs more than our
    checkpoints hold, before any rank of Composer's loader reads it."""
    read_entries(folder)


def guard_sharded_loads() -> None:
    """Make torch's sharded-checkpoint reader (which Composer's ``load_path`` and autoresume use) read the
    index with :func:`read_index`'s unpickler and each non-tensor entry weights-only."""
    from torch.distributed.checkpoint import filesystem
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
    reader = filesystem.FileSystemReader
    if getattr(reader.read_metadata, "weights_only_guard", False):
        return
    original_read_metadata = reader.read_metadata

    def read_metadata(self):
        if not (isinstance(self.path, (str, os.PathLike)) and os.path.isdir(os.fspath(self.path))):
            return original_read_metadata(self)  # not a local folder: torch's own (remote readers download first)
        from torch.distributed.checkpoint.metadata import StorageMeta
        index = read_index(self.path)
        if getattr(index, "storage_meta", None) is None:
            index.storage_meta = StorageMeta()
        index.storage_meta.load_id = getattr(self, "load_id", None)
        return index
    read_metadata.weights_only_guard = True
    reader.read_metadata = read_metadata

    def load_bytes(self, read_item, value):
        loaded = load_entry(value.getvalue() if hasattr(value, "getvalue") else value.read(),
                            f"sharded checkpoint entry {read_item.dest_index.fqn}")
        if self.flatten_state_dict:
            from torch.distributed.checkpoint._traverse import set_element
            set_element(self.original_state_dict, self.mappings[read_item.dest_index.fqn], loaded)
        else:
            self.state_dict[read_item.dest_index.fqn] = loaded
    load_bytes.weights_only_guard = True
    DefaultLoadPlanner.load_bytes = load_bytes
