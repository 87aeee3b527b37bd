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

__all__ = ["Objective", "names", "build_objective", "objective_class", "check_keys"]


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
    check_keys(name, model_cfg)
    return objective_class(name).from_config(name, model_cfg, model_ref)


def check_keys(name: str, model_cfg) -> None:
    """Refuse, in one line naming the key, a ``model.*`` key that another objective reads (its ``reads``)
    and ``name``'s does not, set away from its default: e.g. ``model.min_snr_gamma`` under ``flow``, or
    ``model.flow.shift`` under ``epsilon``, which would be accepted and silently ignored."""
    import dataclasses
    from diffusion.errors import ConfigError
    if not dataclasses.is_dataclass(model_cfg):
        return
    readers: dict[str, list[str]] = {}
    for other, cls in sorted(_registry().items()):
        for key in cls.reads:
            readers.setdefault(key, []).append(other)
    defaults = type(model_cfg)()
    for key in sorted(set(readers) - set(objective_class(name).reads)):
        value, default = getattr(model_cfg, key, None), getattr(defaults, key, None)
        if dataclasses.is_dataclass(value):  # a section (model.flow): each of its keys
            changed = [(f"{key}.{f.name}", getattr(value, f.name)) for f in dataclasses.fields(value)
                       if getattr(value, f.name) != getattr(default, f.name)]
        else:
            changed = [(key, value)] if value != default else []
        for path, set_to in changed:
            who = " and ".join(readers[key])
            raise ConfigError(f"model.{path}={set_to!r}: only the {who} objective{'s' if len(readers[key]) > 1 else ''} "
                              f"read{'' if len(readers[key]) > 1 else 's'} it, and this run trains {name}, which would "
                              f"ignore it: remove the key (or set model.objective to one that reads it)")


def from_description(name: str, params: dict) -> Objective:
    """An objective rebuilt from what a checkpoint's model description records (sampling, export)."""
    return objective_class(name).from_params(name, params)
