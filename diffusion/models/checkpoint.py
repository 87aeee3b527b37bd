"""Read a UNet back out of a Composer checkpoint written by training, with no config needed.

The model's extra state (``StableDiffusion.get_extra_state``) records how to rebuild it; the EMA
algorithm's state carries the averaged weights under the ComposerModel's parameter names.
"""

from __future__ import annotations

import os

import torch

from diffusion.models.stable_diffusion import EXTRA_STATE_KEYS

UNET_PREFIX = "unet."
EXTRA_STATE = "_extra_state"


def read_state(checkpoint_path: str) -> dict:
    """The ``state`` dict of a Composer checkpoint (a local file or any URI Composer can fetch)."""
    path = os.fspath(checkpoint_path)
    if not os.path.exists(path):
        from composer.utils import get_file
        local = os.path.join(_cache_dir(), os.path.basename(path))
        get_file(path, local, overwrite=True)
        path = local
    # Composer checkpoints hold timestamps, RNG states and algorithm objects' state, not just tensors.
    saved = torch.load(path, map_location="cpu", weights_only=False)
    if "state" not in saved or "model" not in saved["state"]:
        raise ValueError(f"{checkpoint_path}: not a Composer checkpoint (no state.model)")
    return saved["state"]


def load_unet(checkpoint_path: str, ema: bool = True):
    """``(unet, info)``: the trained UNet (EMA weights when ``ema`` and present) and how it was trained.

    ``info`` holds ``model_ref, unet_config, scaling_factor, prediction_type, resolution, text_dim`` and
    ``ema_used``.
    """
    from diffusers import UNet2DConditionModel
    state = read_state(checkpoint_path)
    model_state = state["model"]
    info = model_state.get(EXTRA_STATE)
    if not isinstance(info, dict) or "unet_config" not in info:
        raise ValueError(f"{checkpoint_path}: the checkpoint does not describe its model (no {EXTRA_STATE}); "
                         f"was it written by diffusion.train?")
    info = {k: info.get(k) for k in EXTRA_STATE_KEYS}
    weights = {k[len(UNET_PREFIX):]: v for k, v in model_state.items() if k.startswith(UNET_PREFIX)}
    ema_params = ema_weights(state) if ema else None
    if ema_params:
        weights.update({k[len(UNET_PREFIX):]: v for k, v in ema_params.items() if k.startswith(UNET_PREFIX)})
    unet = UNet2DConditionModel.from_config(info["unet_config"])
    missing, unexpected = unet.load_state_dict(weights, strict=False)
    if missing or unexpected:
        raise ValueError(f"{checkpoint_path}: UNet weights do not match its config "
                         f"(missing {missing[:5]}, unexpected {unexpected[:5]})")
    info["ema_used"] = bool(ema_params)
    return unet.eval(), info


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
