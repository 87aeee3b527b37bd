"""LossTarget: MLPerf's text-to-image quality metric, and a training that stops itself when it is reached.

MLPerf Training (text-to-image, Flux.1 since v5.1) judges a run by one number: the held-out loss averaged
over 8 equidistant timesteps, with the noise pinned per sample, and time-to-train is the time until that
number falls to a target (0.586 for Flux at 256 px). ``model.eval_bins: 8`` already measures the
held-out loss at 8 fixed, equidistant noise levels with pinned latents and noise for every objective
(``metrics/eval/loss_bin0`` ... ``loss_bin7``); this callback logs their mean at every eval as
``metrics/eval/loss_bins_mean`` and, with ``target``, stops training at the first eval whose mean is at or
below it, logging and printing the samples, batches and wall time it took (``loss_target/samples``,
``loss_target/batches``, ``loss_target/wall_seconds``).

    callbacks:
      loss_target: {target: 0.586}      # with model.eval_bins: 8, data.eval and trainer.eval_interval

Our bins sit at the centres of 8 equal slices of the noise range trained on (``bin_levels``), MLPerf's
at 8 equidistant timesteps: the same idea, not the same numbers, so a target is set per recipe.
"""

from __future__ import annotations

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from diffusion.errors import ConfigError

METRIC = "loss_bins_mean"


class LossTarget(Callback):
    def __init__(self, target: float | None = None):
        try:  # YAML reads 1e-3 (no dot) as text
            target = None if target is None else float(target)
        except (TypeError, ValueError):
            raise ConfigError(f"callbacks.loss_target.target={target!r} is not a number") from None
        if target is not None and not target > 0:
            raise ConfigError(f"callbacks.loss_target.target={target} must be > 0 (a held-out loss), or null")
        self.target = target
        self.reached: dict | None = None
        self.history: list[tuple[int, float]] = []  # (batch, mean) at every eval

    def fit_start(self, state: State, logger: Logger) -> None:
        bins = int(getattr(state.model, "eval_bins", 0) or 0)
        if bins <= 0:
            raise ConfigError("callbacks.loss_target needs model.eval_bins > 0 (8 for MLPerf's metric), a data.eval "
                              "set and trainer.eval_interval")
        if not state.evaluators:
            raise ConfigError("callbacks.loss_target needs a held-out set: set data.eval (and trainer.eval_interval)")

    def eval_end(self, state: State, logger: Logger) -> None:
        bins = int(state.model.eval_bins)
        values = state.eval_metric_values
        found = [float(values[f"loss_bin{k}"]) for k in range(bins) if f"loss_bin{k}" in values]
        if len(found) != bins:
            return
        mean = sum(found) / bins
        batch = int(state.timestamp.batch)
        self.history.append((batch, mean))
        logger.log_metrics({f"metrics/eval/{METRIC}": mean})
        if self.target is None or self.reached is not None or mean > self.target:
            return
        wall = state.timestamp.total_wct.total_seconds()
        self.reached = {"batches": batch, "samples": int(state.timestamp.sample), "wall_seconds": wall,
                        "loss": mean, "target": self.target}
        logger.log_metrics({f"loss_target/{k}": v for k, v in self.reached.items() if k != "target"})
        if dist.get_global_rank() == 0:
            print(f"[loss_target] held-out loss over {bins} levels {mean:.4f} <= target {self.target} at batch "
                  f"{batch} ({self.reached['samples']} samples, {wall:.1f} s wall): stopping", flush=True)
        state.stop_training()
