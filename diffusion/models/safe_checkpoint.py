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


def load(path, map_location="cpu"):
    """``torch.load`` of ``path`` with the weights-only unpickler and :func:`_allowed`'s types; an
    :class:`~diffusion.errors.InputError` naming the file and what it asked for if it needs more."""
    with torch.serialization.safe_globals(_allowed()):
        try:
            return torch.load(os.path.expanduser(os.fspath(path)), map_location=map_location, weights_only=True)
        except pickle.UnpicklingError as e:
            found = _UNSUPPORTED.search(str(e))
            if found:
                raise InputError(f"{path}: refused: the checkpoint asks to call {found.group(1)}, which no "
                                 f"checkpoint of ours holds; loading it could run code, so it is not read") from None
            raise


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
        raise InputError(f"{path}: refused: the checkpoint asks to call {refused[0]}, which no checkpoint of ours "
                         f"holds; loading it could run code, so it is not read")


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
