"""Denoiser adapters: how the model calls a diffusers denoiser class, builds it, wraps it and samples it.

``model.denoiser`` names a diffusers class (``UNet2DConditionModel``, ``SD3Transformer2DModel``), or
``auto``: the class of the model reference's ``transformer/`` component where it has one, else its
``unet/``. Each module of this package lists the classes it adapts in ``DENOISERS = {class name:
adapter}``, so another diffusers transformer (PixArt, DiT, SANA) is one new file.
"""

from __future__ import annotations

import functools
import json
import os

from diffusion.models import loading
from diffusion.models import registry
from diffusion.models.denoisers.base import DenoiserAdapter

__all__ = ["DenoiserAdapter", "adapter", "adapter_for", "names", "resolve_class"]


@functools.lru_cache(maxsize=1)
def _registry() -> dict:
    return registry.collect(__name__, __path__, "DENOISERS")


def names() -> list[str]:
    return sorted(_registry())


def adapter(class_name: str) -> DenoiserAdapter:
    found = _registry()
    if class_name not in found:
        raise ValueError(f"model.denoiser={class_name!r}: no adapter for it; choose one of "
                         f"{', '.join(sorted(found))} (or auto)")
    return found[class_name]


# Where a wrapper keeps the module it wraps: FSDP1, activation checkpointing, torch.compile, DDP.
_WRAPPED = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod", "module")


def adapter_for(module) -> DenoiserAdapter:
    """The adapter of a denoiser module, also once FSDP2 has wrapped it (its class is then a subclass
    named ``FSDP<class>``: the first class in its ancestry with an adapter) or FSDP1, activation
    checkpointing, torch.compile or DDP has (the module inside the wrapper)."""
    found = _registry()
    inner = module
    while inner is not None:
        for cls in type(inner).__mro__:
            if cls.__name__ in found:
                return found[cls.__name__]
        inner = next((getattr(inner, name) for name in _WRAPPED if getattr(inner, name, None) is not None), None)
    return adapter(type(module).__name__)  # one line naming it


def resolve_class(model_ref: str, denoiser: str = "auto") -> str:
    """The denoiser class a run trains: ``denoiser`` itself, or with ``auto`` the class the model
    reference's ``transformer/`` (else ``unet/``) config names."""
    if denoiser != "auto":
        adapter(denoiser)  # one line for an unknown name
        return denoiser
    root = loading.resolve_model(model_ref, components=())
    for component in ("transformer", "unet"):
        path = os.path.join(root, component, "config.json")
        if os.path.exists(path):
            with open(path) as f:
                return json.load(f).get("_class_name") or "UNet2DConditionModel"
    return "UNet2DConditionModel"  # a hub id whose layout is not local yet: SD2's
