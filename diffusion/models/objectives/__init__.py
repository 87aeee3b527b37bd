"""Training objectives: how a noise level is drawn, the noisy input formed, the target and the loss weight.

An objective is named in the YAML (``model.objective``) and found here by that name: every module of
this package lists the names it serves in ``OBJECTIVES = {name: class}``, so a new objective is one new
file. Each class takes the :class:`~diffusion.train.config.ModelConfig` and the model reference it trains
against, and implements :class:`Objective`.
"""

from __future__ import annotations

import functools

from diffusion.models import registry
from diffusion.models.objectives.base import Objective

__all__ = ["Objective", "names", "build_objective", "objective_class"]


@functools.lru_cache(maxsize=1)
def _registry() -> dict:
    return registry.collect(__name__, __path__, "OBJECTIVES")


def names() -> list[str]:
    return sorted(_registry())


def objective_class(name: str):
    found = _registry()
    if name not in found:
        raise ValueError(f"model.objective={name!r}: no such objective; choose one of {', '.join(sorted(found))}")
    return found[name]


def build_objective(name: str, model_cfg, model_ref: str) -> Objective:
    """The objective ``name`` for ``model_cfg`` (a :class:`diffusion.train.config.ModelConfig`) on ``model_ref``."""
    return objective_class(name).from_config(name, model_cfg, model_ref)


def from_description(name: str, params: dict) -> Objective:
    """An objective rebuilt from what a checkpoint's model description records (sampling, export)."""
    return objective_class(name).from_params(name, params)
