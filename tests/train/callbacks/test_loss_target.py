"""callbacks.loss_target: MLPerf's averaged held-out loss is logged, and a run stops itself at its target."""

import os

import pytest

from diffusion.errors import ConfigError
from diffusion.train.config import load_config
from train_fixtures import fit_in_process, tiny_overrides, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))
TINY = os.path.join(ROOT, "yamls", "tiny-cpu.yaml")


@pytest.fixture(scope="module")
def mds(train_kit, tmp_path_factory):
    return write_latent_mds(str(tmp_path_factory.mktemp("target_mds") / "mds"), kit=train_kit, n=16)


def _fit(train_kit, mds, *extra, callbacks=()):
    from composer.core import Callback

    class Seen(Callback):
        def __init__(self):
            self.eval = []  # (evaluator, its metrics) at every eval's end

        def eval_end(self, state, logger):
            self.eval.append((state.dataloader_label, dict(state.eval_metric_values)))

    cfg = load_config(TINY, tiny_overrides(train_kit, mds, batches=6, batch_size=8, extra=(
        "model.eval_bins=8", f"data.eval.path={mds}", "data.eval.batch_size=8", "data.eval.num_workers=0",
        "data.train.num_workers=0", "trainer.eval_interval=2ba", "algorithms={}", *extra)))
    seen = Seen()
    _, batches = fit_in_process(cfg, callbacks=[seen, *callbacks])
    return seen, batches


def _mean(metrics):
    return sum(metrics[f"loss_bin{k}"] for k in range(8)) / 8


EMA = "algorithms.ema={smoothing: 0.99, start: 0ba, warmup: false}"


def _callbacks():
    from composer.core import Callback

    class NanAtBatch4(Callback):
        """The trained weights' held-out loss read as NaN at batch 4 (LossTarget sees it after this)."""

        def eval_end(self, state, logger):
            if state.dataloader_label == "eval" and int(state.timestamp.batch) == 4:
                state.eval_metric_values["loss_bin3"] = float("nan")

    class SlowEval(Callback):
        """Each eval batch takes 0.4 s more; Composer's clock at each eval's end."""

        def __init__(self):
            self.slept, self.composer_clock = 0.0, []  # at each trained-weights eval's end: (slept, clock)

        def eval_batch_end(self, state, logger):
            import time
            time.sleep(0.4)
            self.slept += 0.4

        def eval_end(self, state, logger):
            if state.dataloader_label == "eval":
                self.composer_clock.append((self.slept, state.timestamp.total_wct.total_seconds()))
    return NanAtBatch4(), SlowEval()


def test_the_averaged_loss_is_the_mean_of_eight_bins_and_a_reached_target_stops_the_run(train_kit, mds, capsys):
    from diffusion.train.callbacks.loss_target import LossTarget
    # EMA on, a target never reached, NaN read at batch 4: the trained weights' mean is the one logged as
    # metrics/eval/loss_bins_mean and judged, the EMA's is logged apart; NaN is not a reached target, and
    # the end of the run says the target was not reached.
    nan, _ = _callbacks()
    logged = LossTarget(target=1e-9)
    seen, batches = _fit(train_kit, mds, EMA, callbacks=[nan, logged])
    assert len(batches) == 6  # no stop at the NaN
    trained = [m for label, m in seen.eval if label == "eval"]
    ema = [m for label, m in seen.eval if label == "eval_ema"]
    assert len(trained) == len(ema) == 3  # an eval every 2 batches, both weights
    assert [b for b, _ in logged.history] == [2, 4, 6] and logged.reached is None
    assert logged.history[0][1] == pytest.approx(_mean(trained[0]))
    assert logged.history[0][1] != pytest.approx(_mean(ema[0]))
    out = capsys.readouterr().out
    assert ("[loss_target] held-out loss over 8 levels is NaN at batch 4 (trained weights): not counted as "
            "reaching the target 1e-09") in out
    assert (f"[loss_target] target 1e-09 not reached in 6 batches (trained weights; last "
            f"{logged.history[-1][1]:.4f} at batch 6, best ") in out
    # A target between the two weights' first means: only the stated weights' mean stops the run.
    low, high = sorted([_mean(trained[0]), _mean(ema[0])])
    stated = "trained" if low == _mean(trained[0]) else "ema"
    other = {"trained": "ema", "ema": "trained"}[stated]
    _, batches = _fit(train_kit, mds, EMA, callbacks=[LossTarget(target=(low + high) / 2, weights=other)])
    assert len(batches) > 2  # the other weights' mean was below it at batch 2; these were not
    # A target above the first eval's mean: the run stops at that eval, batch 2 of 6, and says so, with
    # the wall time from the start of fit, evaluations included (MLPerf's clock; Composer's pauses in them).
    _, slow = _callbacks()
    stopping = LossTarget(target=_mean(trained[0]) + 1e-6)
    _, batches = _fit(train_kit, mds, EMA, callbacks=[slow, stopping])
    assert len(batches) == 2
    out = capsys.readouterr().out
    assert "[loss_target]" in out and "at batch 2 (16 samples" in out and "evals included; trained weights" in out
    slept, clock = slow.composer_clock[0]  # by the end of the eval that reached the target
    assert slept >= 0.8 and stopping.reached["wall_seconds"] >= clock + 0.9 * slept  # the eval's two batches
    with pytest.raises(ConfigError, match="must be > 0"):
        LossTarget(target=0)
    with pytest.raises(ConfigError, match=r"callbacks.loss_target.weights='raw': trained"):
        LossTarget(target=1, weights="raw")


def test_without_bins_the_callback_names_the_missing_key(train_kit, mds):
    cfg = load_config(TINY, tiny_overrides(train_kit, mds, batches=2, extra=(
        "data.train.num_workers=0", "algorithms={}", "callbacks.loss_target.target=0.5")))
    with pytest.raises(ConfigError, match="model.eval_bins"):
        fit_in_process(cfg)
    # the EMA's mean stated, no EMA evaluated; an eval protocol without bins to read it
    cfg = load_config(TINY, tiny_overrides(train_kit, mds, batches=2, extra=(
        "data.train.num_workers=0", "algorithms={}", "model.eval_bins=8", f"data.eval.path={mds}",
        "data.eval.batch_size=8", "data.eval.num_workers=0", "trainer.eval_interval=2ba",
        "callbacks.loss_target={target: 0.5, weights: ema}")))
    with pytest.raises(ConfigError, match=r"callbacks.loss_target.weights=ema needs the EMA evaluated: set "
                                          r"algorithms.ema \(or weights: trained\)"):
        fit_in_process(cfg)
    with pytest.raises(ConfigError, match=r"model.eval_protocol=all_levels is read only with model.eval_bins > 0"):
        load_config(TINY, tiny_overrides(train_kit, mds, batches=2, extra=("model.eval_protocol=all_levels",)))
