"""Components the YAML names: ``name → "module:Class"``, imported only when a config uses the name.

The config validator checks a component's keyword arguments against its signature before training
starts, so ``callbacks.speed_monitor.windw_size`` fails at once, not after the data has loaded.
"""

from __future__ import annotations

import difflib
import importlib
import inspect
from typing import Any

from diffusion.errors import ConfigError

ALGORITHMS = {
    "ema": "diffusion.train.algorithms.ema:EMA",
    "posthoc_ema": "diffusion.train.algorithms.posthoc_ema:PostHocEMA",
    "low_precision_groupnorm": "composer.algorithms:LowPrecisionGroupNorm",
    "low_precision_layernorm": "composer.algorithms:LowPrecisionLayerNorm",
}
CALLBACKS = {
    "speed_monitor": "diffusion.train.callbacks.speed_monitor:SpeedMonitor",
    "lr_monitor": "composer.callbacks:LRMonitor",
    "optimizer_monitor": "diffusion.train.callbacks.optimizer_monitor:OptimizerMonitor",
    "memory_monitor": "composer.callbacks:MemoryMonitor",
    "runtime_estimator": "composer.callbacks:RuntimeEstimator",
    "nan_catcher": "diffusion.train.callbacks.nan_catcher:NaNCatcher",
    "cost_projection": "diffusion.train.callbacks.cost:CostProjection",
    "image_logger": "diffusion.train.callbacks.image_logger:ImageLogger",
    "progress": "diffusion.train.callbacks.progress:ProgressLine",
    "text_encoder_share": "diffusion.train.callbacks.text_encoder_share:TextEncoderShare",
    "loss_target": "diffusion.train.callbacks.loss_target:LossTarget",
    "judge_metrics": "diffusion.train.callbacks.judge_metrics:JudgeMetrics",
}
LOGGERS = {
    "console": "composer.loggers:ConsoleLogger",
    "progress_bar": "composer.loggers:ProgressBarLogger",
    "wandb": "composer.loggers:WandBLogger",
}
REGISTRIES = {"algorithms": ALGORITHMS, "callbacks": CALLBACKS, "loggers": LOGGERS}


def component_class(section: str, name: str):
    """Import the class registered as ``section.name``; a missing module is a config error."""
    target = REGISTRIES[section][name]
    module_name, _, attr = target.partition(":")
    try:
        return getattr(importlib.import_module(module_name), attr)
    except (ImportError, AttributeError) as e:
        raise ConfigError(f"{section}.{name}: {target} is not available ({type(e).__name__}: {e})") from e


def check_kwargs(section: str, name: str, kwargs: Any) -> None:
    if not isinstance(kwargs, dict):
        raise ConfigError(f"{section}.{name}: expected a mapping of arguments (or {{}}), got {kwargs!r}")
    params = inspect.signature(component_class(section, name)).parameters
    if any(p.kind is p.VAR_KEYWORD for p in params.values()):
        return
    valid = [p for p in params if p != "self"]
    for key in kwargs:
        if key not in valid:
            close = difflib.get_close_matches(key, valid, n=1)
            hint = f"; did you mean {close[0]!r}?" if close else ""
            raise ConfigError(f"unknown config key '{section}.{name}.{key}'{hint} "
                              f"Valid keys here: {', '.join(valid) or '(none)'}")
    missing = [p for p, v in params.items() if v.default is v.empty and p not in kwargs
               and v.kind not in (v.VAR_POSITIONAL, v.VAR_KEYWORD)]
    if missing:
        raise ConfigError(f"{section}.{name}: missing required argument(s) {', '.join(missing)}")


def build_components(section: str, entries: dict[str, dict]) -> list:
    """Instantiate every enabled component of one section, in the YAML's order."""
    built = []
    for name, kwargs in entries.items():
        try:
            built.append(component_class(section, name)(**kwargs))
        except ConfigError:
            raise
        except (ValueError, TypeError) as e:  # a value its constructor refuses (EMA smoothing 2): name the key
            raise ConfigError(f"{section}.{name}: {e}") from e
    return built
