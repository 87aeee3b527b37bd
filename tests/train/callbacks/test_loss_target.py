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
            self.eval, self.logged = [], {}

        def eval_end(self, state, logger):
            self.eval.append(dict(state.eval_metric_values))

    cfg = load_config(TINY, tiny_overrides(train_kit, mds, batches=6, batch_size=8, extra=(
        "model.eval_bins=8", f"data.eval.path={mds}", "data.eval.batch_size=8", "data.eval.num_workers=0",
        "data.train.num_workers=0", "trainer.eval_interval=2ba", "algorithms={}", *extra)))
    seen = Seen()
    _, batches = fit_in_process(cfg, callbacks=[seen, *callbacks])
    return seen, batches


def test_the_averaged_loss_is_the_mean_of_eight_bins_and_a_reached_target_stops_the_run(train_kit, mds, capsys):
    from diffusion.train.callbacks.loss_target import LossTarget
    logged = LossTarget()
    seen, batches = _fit(train_kit, mds, callbacks=[logged])
    assert len(batches) == 6 and len(seen.eval) == 3  # no target: the whole run, an eval every 2 batches
    first = [seen.eval[0][f"loss_bin{k}"] for k in range(8)]
    assert [b for b, _ in logged.history] == [2, 4, 6] and logged.reached is None
    assert logged.history[0][1] == pytest.approx(sum(first) / 8)
    # A target above the first eval's mean: the run stops at that eval, batch 2 of 6, and says so.
    stopped, batches = _fit(train_kit, mds, f"callbacks.loss_target.target={sum(first) / 8 + 1e-6}")
    assert len(batches) == 2
    out = capsys.readouterr().out
    assert "[loss_target]" in out and "at batch 2 (16 samples" in out
    # A target never reached: the whole run.
    _, batches = _fit(train_kit, mds, "callbacks.loss_target.target=1e-9")
    assert len(batches) == 6
    with pytest.raises(ConfigError, match="must be > 0"):
        LossTarget(target=0)


def test_without_bins_the_callback_names_the_missing_key(train_kit, mds):
    cfg = load_config(TINY, tiny_overrides(train_kit, mds, batches=2, extra=(
        "data.train.num_workers=0", "algorithms={}", "callbacks.loss_target.target=0.5")))
    with pytest.raises(ConfigError, match="model.eval_bins"):
        fit_in_process(cfg)
