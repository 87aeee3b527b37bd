"""LossTarget: MLPerf's text-to-image quality metric, and a training that stops itself when it is reached.

MLPerf Training (text-to-image, Flux.1 since v5.1) judges a run by one number: the held-out loss averaged
over 8 equidistant timesteps, with the noise pinned per sample, and time-to-train is the time until that
number falls to a target (0.586 for Flux at 256 px). ``model.eval_bins: 8`` measures the held-out loss at 8
fixed, equidistant noise levels by MLPerf's protocol (each held-out sample at one level in turn, pinned
latents and noise, every objective: ``metrics/eval/loss_bin0`` ... ``loss_bin7``); this callback logs their
mean at every eval as ``metrics/<evaluator>/loss_bins_mean`` (``metrics/eval/...`` for the trained weights,
``metrics/eval_ema/...`` for the EMA's when ``algorithms.ema`` evaluates them too) and, with ``target``,
stops training at the first eval whose mean for the ``weights`` it is told (``trained``, MLPerf's: the
weights being trained; or ``ema``) is at or below it, logging and printing the samples, batches and wall
time it took (``loss_target/samples``, ``loss_target/batches``, ``loss_target/wall_seconds``). The wall time
is MLPerf's clock: from the start of fit, evaluations included (Composer's own clock pauses during them),
carried over a resume. A NaN mean never reaches the target (a line says so), and a run that ends without
reaching it says that in one line.

    callbacks:
      loss_target: {target: 0.586}      # with model.eval_bins: 8, data.eval and trainer.eval_interval
"""

from __future__ import annotations

import math
import time

from composer.core import Callback, State
from composer.loggers import Logger
from composer.utils import dist

from diffusion.errors import ConfigError

METRIC = "loss_bins_mean"
WEIGHTS = {"trained": "eval", "ema": "eval_ema"}  # callbacks.loss_target.weights -> the evaluator it reads


class LossTarget(Callback):
    def __init__(self, target: float | None = None, weights: str = "trained"):
        try:  # YAML reads 1e-3 (no dot) as text
            target = None if target is None else float(target)
        except (TypeError, ValueError):
            raise ConfigError(f"callbacks.loss_target.target={target!r} is not a number") from None
        if target is not None and not target > 0:
            raise ConfigError(f"callbacks.loss_target.target={target} must be > 0 (a held-out loss), or null")
        if weights not in WEIGHTS:
            raise ConfigError(f"callbacks.loss_target.weights={weights!r}: trained (MLPerf's: the weights being "
                              f"trained) or ema (the EMA's, with algorithms.ema)")
        self.target, self.weights, self.label = target, weights, WEIGHTS[weights]
        self.reached: dict | None = None
        self.history: list[tuple[int, float]] = []  # (batch, mean) at every eval of the stated weights
        self._started: float | None = None  # time.monotonic() at this fit's start
        self._before = 0.0  # wall seconds of the run before a resume (from the checkpoint)

    def wall_seconds(self) -> float:
        """MLPerf's clock: wall seconds since the run's fit started, evaluations included."""
        return self._before + (time.monotonic() - self._started if self._started is not None else 0.0)

    def state_dict(self) -> dict:
        return {"wall_seconds": self.wall_seconds(), "reached": self.reached}

    def load_state_dict(self, state: dict) -> None:
        self._before = float(state.get("wall_seconds") or 0.0)
        self.reached = state.get("reached")

    def fit_start(self, state: State, logger: Logger) -> None:
        bins = int(getattr(state.model, "eval_bins", 0) or 0)
        if bins <= 0:
            raise ConfigError("callbacks.loss_target needs model.eval_bins > 0 (8 for MLPerf's metric), a data.eval "
                              "set and trainer.eval_interval")
        if not state.evaluators:
            raise ConfigError("callbacks.loss_target needs a held-out set: set data.eval (and trainer.eval_interval)")
        if self.label not in {e.label for e in state.evaluators}:
            raise ConfigError(f"callbacks.loss_target.weights={self.weights} needs the EMA evaluated: set "
                              f"algorithms.ema (or weights: trained)")
        self._started = time.monotonic()

    def eval_end(self, state: State, logger: Logger) -> None:
        bins = int(state.model.eval_bins)
        values = state.eval_metric_values  # this evaluator's (state.dataloader_label's) metrics
        found = [float(values[f"loss_bin{k}"]) for k in range(bins) if f"loss_bin{k}" in values]
        if len(found) != bins:
            return
        mean = sum(found) / bins
        label = state.dataloader_label or "eval"
        logger.log_metrics({f"metrics/{label}/{METRIC}": mean})
        if label != self.label:
            return
        batch = int(state.timestamp.batch)
        self.history.append((batch, mean))
        if self.target is None or self.reached is not None:
            return
        if math.isnan(mean):  # NaN <= target is False, but so is NaN > target: never counted as reached
            if dist.get_global_rank() == 0:
                print(f"[loss_target] held-out loss over {bins} levels is NaN at batch {batch} ({self.weights} "
                      f"weights): not counted as reaching the target {self.target}", flush=True)
            return
        if mean > self.target:
            return
        wall = self.wall_seconds()
        self.reached = {"batches": batch, "samples": int(state.timestamp.sample), "wall_seconds": wall,
                        "loss": mean, "target": self.target}
        logger.log_metrics({f"loss_target/{k}": v for k, v in self.reached.items() if k != "target"})
        if dist.get_global_rank() == 0:
            print(f"[loss_target] held-out loss over {bins} levels {mean:.4f} <= target {self.target} at batch "
                  f"{batch} ({self.reached['samples']} samples, {wall:.1f} s wall from the start of fit, evals "
                  f"included; {self.weights} weights): stopping", flush=True)
        state.stop_training()

    def fit_end(self, state: State, logger: Logger) -> None:
        if self.target is None or self.reached is not None or dist.get_global_rank() != 0:
            return
        batch = int(state.timestamp.batch)
        finite = [(b, m) for b, m in self.history if not math.isnan(m)]
        if finite:
            best_batch, best = min(finite, key=lambda p: p[1])
            seen = (f"last {self.history[-1][1]:.4f} at batch {self.history[-1][0]}, best {best:.4f} at batch "
                    f"{best_batch}")
        else:
            seen = "no finite held-out loss was measured" if self.history else "no eval ran"
        print(f"[loss_target] target {self.target} not reached in {batch} batches ({self.weights} weights; {seen}; "
              f"{self.wall_seconds():.1f} s wall)", flush=True)
