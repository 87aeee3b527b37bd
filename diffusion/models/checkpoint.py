"""Read a denoiser back out of a Composer checkpoint written by training, with no config needed.

The model's extra state (``LatentDiffusion.get_extra_state``: the model description) records how to rebuild it; the EMA
algorithm's state carries the averaged weights under the ComposerModel's parameter names.

:func:`check_checkpoint` is the cheap look a command takes at its ``--checkpoint`` before loading any
model, so a wrong path or a file that is no checkpoint is one line naming it, in a second or two.
"""

from __future__ import annotations

import errno
import os
import pickle

import torch

from diffusion.errors import InputError
from diffusion.models import safe_checkpoint

DENOISER_PREFIX = "denoiser."
UNET_PREFIX = "unet."  # checkpoints written before the model wing
EXTRA_STATE = "_extra_state"
_WHAT = "a Composer checkpoint file (e.g. CKPT_FOLDER/latest-rank0.pt) or a diffusers pipeline directory"
# torch.save writes a zip archive (PK..); the legacy format is a pickle (protocol 2+: 0x80 first).
_TORCH_MAGIC = (b"PK\x03\x04", b"\x80")


def is_remote(path: str) -> bool:
    """A URI Composer fetches (``s3://``, ``oci://``, ``https://`` ...), not a local path."""
    return "://" in path


def check_checkpoint(path) -> None:
    """Fail fast, before any model loads, when ``path`` cannot be a checkpoint :func:`load_denoiser` or
    :func:`diffusion.models.sampling.load_trained` reads.

    A missing local path is a ``FileNotFoundError`` carrying the path; a directory without
    ``model_index.json`` or a file that is not a ``torch.save`` file is an :class:`InputError` naming it.
    Remote URIs are left to the download, whose errors name them.
    """
    path = os.fspath(path)
    if is_remote(path):
        return
    local = os.path.expanduser(path)
    if not os.path.exists(local):
        raise FileNotFoundError(errno.ENOENT, f"no such checkpoint; expected {_WHAT}", path)
    if os.path.isdir(local):
        if os.path.exists(os.path.join(local, "model_index.json")):
            return
        latest = os.path.join(path, "latest-rank0.pt")
        hint = (f"; did you mean {latest}?" if os.path.exists(os.path.join(local, "latest-rank0.pt"))
                else f"; expected {_WHAT}")
        raise InputError(f"{path}: a directory without model_index.json, so no diffusers pipeline{hint}")
    with open(local, "rb") as f:
        head = f.read(4)
    if not head.startswith(_TORCH_MAGIC):
        raise InputError(f"{path}: not a checkpoint (not a file torch.save wrote); expected {_WHAT}")


def read_state(checkpoint_path: str) -> dict:
    """The ``state`` dict of a Composer checkpoint (a local file or any URI Composer can fetch)."""
    path = os.fspath(checkpoint_path)
    if is_remote(path):
        from composer.utils import get_file
        local = os.path.join(_cache_dir(), os.path.basename(path))
        get_file(path, local, overwrite=True)
        path = local
    check_checkpoint(path)
    # Composer checkpoints hold timestamps, RNG states and algorithm state: read weights-only, never run code.
    try:
        saved = safe_checkpoint.load(path)
    except (pickle.UnpicklingError, EOFError, RuntimeError) as e:  # truncated or not a torch file
        raise InputError(f"{checkpoint_path}: not a readable checkpoint ({type(e).__name__}: "
                         f"{str(e).splitlines()[0] if str(e) else 'no detail'})") from e
    if not isinstance(saved, dict) or not isinstance(saved.get("state"), dict) or "model" not in saved["state"]:
        raise InputError(f"{checkpoint_path}: not a Composer checkpoint (no state.model); expected {_WHAT}")
    return saved["state"]


def load_denoiser(checkpoint_path: str, ema: bool = True):
    """``(denoiser, description, ema_used)``: the trained denoiser (EMA weights when ``ema`` and present)
    and its :class:`~diffusion.models.description.ModelDescription`. Checkpoints written before the
    description existed (SD2 UNets, their weights under ``unet.``) are read too."""
    from diffusion.models.description import ModelDescription
    state = read_state(checkpoint_path)
    model_state = state["model"]
    extra = model_state.get(EXTRA_STATE)
    try:
        description = ModelDescription.from_extra_state(extra if isinstance(extra, dict) else {})
    except KeyError:
        raise InputError(f"{checkpoint_path}: the checkpoint does not describe its model (no {EXTRA_STATE}); "
                         f"was it written by diffusion.train?") from None
    weights = _denoiser_weights(model_state)
    ema_params = ema_weights(state) if ema else None
    if ema_params:
        weights.update(_denoiser_weights(ema_params))
    denoiser = description.build_denoiser()
    missing, unexpected = denoiser.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise InputError(f"{checkpoint_path}: {description.denoiser} weights do not match its config "
                         f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    return denoiser.eval(), description, bool(ema_params)


def _denoiser_weights(named: dict) -> dict:
    """The denoiser's tensors of a model state dict (or EMA parameters) by the denoiser's own names."""
    return {k[len(prefix):]: v for k, v in named.items()
            for prefix in (DENOISER_PREFIX, UNET_PREFIX) if k.startswith(prefix)}


def ema_weights(state: dict) -> dict | None:
    """The EMA algorithm's averaged parameters from a checkpoint's state, or None."""
    for name, algo_state in state.get("algorithms") or []:
        if name == "EMA" and isinstance(algo_state, dict) and algo_state.get("ema_params"):
            return algo_state["ema_params"]
    return None


def _cache_dir() -> str:
    path = os.path.join(os.path.expanduser("~"), ".cache", "diffusion", "checkpoints")
    os.makedirs(path, exist_ok=True)
    return path
