"""Training end to end on CPU: the loss falls; a killed-and-resumed run equals a straight one."""

import gc
import os
import shutil

import pytest
import torch
from composer.core import Callback

from diffusion.train.config import load_config
from diffusion import schema
from diffusion.models.checkpoint import load_denoiser
from diffusion.train.trainer import build_trainer
from train_fixtures import run_py_here, tiny_overrides, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "yamls", "tiny-cpu.yaml")


class RecordOrder(Callback):
    """The sample indices of every batch, in training order."""

    def __init__(self):
        self.batches = []

    def before_forward(self, state, logger):
        self.batches.append(state.batch[schema.BATCH_SAMPLE_INDEX].tolist())


@pytest.fixture(scope="module")
def mds(train_kit, tmp_path_factory):
    return write_latent_mds(str(tmp_path_factory.mktemp("mds")), kit=train_kit, n=48)


def _fit(kit, mds, *overrides, batches, save_folder=None):
    cfg = load_config(TINY, tiny_overrides(kit, mds, batches=batches, save_folder=save_folder, extra=overrides))
    trainer = build_trainer(cfg)
    order = RecordOrder()
    trainer.state.callbacks.append(order)
    trainer.fit()
    weights = {k: v.detach().clone() for k, v in trainer.state.model.state_dict().items() if k != "_extra_state"}
    ema = [a for a in trainer.state.algorithms if type(a).__name__ == "EMA"]
    ema_params = {k: v.clone() for k, v in ema[0].state_dict()["ema_params"].items()} if ema else None
    model = trainer.state.model
    trainer.close()
    del trainer
    gc.collect()  # releases the StreamingDataset's shared memory before the next run reuses the folder
    return model, weights, ema_params, order.batches


def _eval_loss(model, mds, kit):
    from diffusion.train.config import EvalLoaderConfig
    from diffusion.loader import mds_source
    from train_fixtures import kit_text_dim
    loader = mds_source.build_dataloader(EvalLoaderConfig(path=mds, batch_size=48, num_workers=0),
                                         resolution=64, text_dim=kit_text_dim(kit))
    batch = next(iter(loader))
    model.eval()
    out = model.eval_forward(batch)
    del loader
    return ((out["prediction"] - out["target"]) ** 2).mean().item()


@pytest.mark.slow
def test_loss_falls(train_kit, mds):
    model, *_ = _fit(train_kit, mds, "algorithms={}", batches=1)
    before = _eval_loss(model, mds, train_kit)
    # 10 batches: about 0.97 -> 0.31 (30 batches: 0.17); the bar is 0.78
    model, *_ = _fit(train_kit, mds, "algorithms={}", "optimizer.lr=3e-3", batches=10)
    after = _eval_loss(model, mds, train_kit)
    assert after < 0.8 * before, (before, after)


def test_the_same_seed_trains_the_same_weights_and_another_seed_does_not(train_kit, mds):
    # The UNet's random init comes from trainer.seed too: a re-run reproduces a run exactly.
    _, first, _, order = _fit(train_kit, mds, "algorithms={}", batches=2)
    _, again, _, order_again = _fit(train_kit, mds, "algorithms={}", batches=2)
    _, other, _, _ = _fit(train_kit, mds, "algorithms={}", "trainer.seed=18", batches=2)
    assert order_again == order
    for name in first:
        assert torch.equal(again[name], first[name]), name
    assert not torch.equal(other["denoiser.conv_in.weight"], first["denoiser.conv_in.weight"])


@pytest.mark.slow
def test_resume_equals_a_straight_run(train_kit, mds, tmp_path):
    """2N batches straight == N, kill, autoresume, N: same data order, weights, EMA and checkpointed model."""
    n = 4
    straight = tmp_path / "straight"
    _, weights, ema, order = _fit(train_kit, mds, "trainer.save_interval=4ba", batches=2 * n,
                                  save_folder=str(straight))
    # "kill" after N batches: a fresh run folder holding only the first checkpoint, then autoresume
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    first = next(p for p in os.listdir(straight) if p.endswith(f"ba{n}-rank0.pt"))
    shutil.copy(straight / first, resumed / first)
    os.symlink(first, resumed / "latest-rank0.pt")
    _, weights2, ema2, order2 = _fit(train_kit, mds, "trainer.save_interval=4ba", "trainer.autoresume=true",
                                     batches=2 * n, save_folder=str(resumed))
    assert order2 == order[n:]  # continued mid-epoch (48 samples = 6 batches/epoch) in the same order
    assert len(order2) == n
    for name in weights:
        torch.testing.assert_close(weights2[name], weights[name], rtol=1e-5, atol=1e-6, msg=name)
    for name in ema:
        torch.testing.assert_close(ema2[name], ema[name], rtol=1e-5, atol=1e-6, msg=name)
    # the checkpoint alone rebuilds the UNet, with EMA weights by default
    unet, description, ema_used = load_denoiser(str(resumed / "latest-rank0.pt"))
    assert ema_used and description.resolution == 64 and description.model_ref == train_kit
    torch.testing.assert_close(unet.state_dict()["conv_in.weight"], ema["denoiser.conv_in.weight"])
    raw, _, ema_used = load_denoiser(str(resumed / "latest-rank0.pt"), ema=False)
    assert not ema_used
    torch.testing.assert_close(raw.state_dict()["conv_in.weight"], weights["denoiser.conv_in.weight"])


class RecordDraws(Callback):
    """Each batch's noise and timestep draws."""

    def __init__(self):
        self.draws = []

    def batch_start(self, state, logger):
        self.draws.append((state.batch[schema.BATCH_NOISE].clone(), state.batch[schema.BATCH_TIMESTEP_DRAW].clone()))


def _fit_draws(kit, mds, *overrides, batches, save_folder=None):
    cfg = load_config(TINY, tiny_overrides(kit, mds, batches=batches, save_folder=save_folder, extra=overrides))
    trainer = build_trainer(cfg)
    record = RecordDraws()
    trainer.state.callbacks.append(record)
    trainer.fit()
    phase = trainer.state.model.phase
    weights = {k: v.detach().clone() for k, v in trainer.state.model.state_dict().items() if k != "_extra_state"}
    trainer.close()
    del trainer
    gc.collect()
    return phase, record.draws, weights


@pytest.fixture(scope="module")
def phase_one(train_kit, mds, tmp_path_factory):
    """A first phase without EMA, as in yamls/sd2-base-{256,512}.yaml: 2 batches, its checkpoint in p1/ (what the
    next phase starts from), its draws and its final weights."""
    folder = tmp_path_factory.mktemp("phase-one") / "p1"
    phase, draws, weights = _fit_draws(train_kit, mds, "trainer.save_interval=2ba", "algorithms={}", batches=2,
                                       save_folder=str(folder))
    return {"checkpoint": folder / "latest-rank0.pt", "phase": phase, "draws": draws, "weights": weights}


def test_phase_two_starts_from_weights_with_a_fresh_schedule(train_kit, mds, phase_one):
    # As in yamls/sd2-base-{256,512}.yaml: phase 1 without EMA, phase 2 with; the weights load strictly.
    cfg = load_config(TINY, tiny_overrides(train_kit, mds, batches=2, extra=(
        f"trainer.load_path={phase_one['checkpoint']}", "trainer.load_weights_only=true",
        "trainer.load_strict=true")))
    trainer = build_trainer(cfg)
    assert int(trainer.state.timestamp.batch) == 0  # fresh schedule
    assert not trainer.state.optimizers[0].state  # fresh optimizer
    loaded = trainer.state.model.state_dict()
    torch.testing.assert_close(loaded["denoiser.conv_in.weight"], phase_one["weights"]["denoiser.conv_in.weight"])
    trainer.close()


def test_a_later_phase_does_not_replay_its_predecessors_draws_and_resumes_exactly(train_kit, mds, phase_one, tmp_path):
    """Phase 2 starts from phase 1's weights with the same seed, at epoch 0 again: other noise and levels
    (issue 25 item 2); within phase 2, a resumed run draws what the straight run drew."""
    phase, first = phase_one["phase"], phase_one["draws"]
    assert phase == 0 and len(first) == 2
    handed = (f"trainer.load_path={phase_one['checkpoint']}", "trainer.load_weights_only=true",
              "trainer.save_interval=2ba", "algorithms={}")
    phase, second, _ = _fit_draws(train_kit, mds, *handed, batches=4, save_folder=str(tmp_path / "p2"))
    assert phase == 1
    for (noise1, level1), (noise2, level2) in zip(first, second):
        assert not torch.equal(noise1, noise2) and not torch.equal(level1, level2)
    saved = torch.load(tmp_path / "p2" / "latest-rank0.pt", map_location="cpu", weights_only=False)
    assert saved["state"]["model"]["_extra_state"]["phase"] == 1  # recorded: a phase 3 would be 2
    # phase 2 killed after 2 batches and resumed: still phase 1, the same draws as straight through
    resumed = tmp_path / "p2-resumed"
    resumed.mkdir()
    shutil.copy(tmp_path / "p2" / "ep0-ba2-rank0.pt", resumed / "ep0-ba2-rank0.pt")
    os.symlink("ep0-ba2-rank0.pt", resumed / "latest-rank0.pt")
    phase, rest, _ = _fit_draws(train_kit, mds, *handed, "trainer.autoresume=true", batches=4,
                                save_folder=str(resumed))
    assert phase == 1 and len(rest) == 2
    for (noise, level), (noise2, level2) in zip(rest, second[2:]):
        assert torch.equal(noise, noise2) and torch.equal(level, level2)


def test_rerunning_a_finished_run_reports_it_and_exits_zero(train_kit, mds, tmp_path, capfd):
    """`composer run.py x.yaml` again after the run finished: a report, not Composer's max_duration error. (Both
    runs through run.py's entry in this process: the report is the command's, not its process's.)"""
    args = [TINY, *tiny_overrides(train_kit, mds, batches=2, save_folder=str(tmp_path / "ckpt"),
                                  extra=("trainer.autoresume=true", "trainer.save_interval=2ba"))]
    first = run_py_here(capfd, *args)
    assert first.returncode == 0, first.stderr[-2000:]
    checkpoints = sorted(os.listdir(tmp_path / "ckpt"))
    again = run_py_here(capfd, *args)
    assert again.returncode == 0, again.stderr[-2000:]
    assert "run already finished" in again.stdout and "2ba" in again.stdout
    assert "Traceback" not in again.stderr
    assert sorted(os.listdir(tmp_path / "ckpt")) == checkpoints  # nothing trained or saved


def test_eval_reports_raw_and_ema_loss_apart_and_the_grad_norm_is_logged(train_kit, mds, tmp_path):
    """Held-out loss of the raw weights every eval, of the EMA once it has started (at 3/4 of the run),
    under their own names, over the whole held-out set (its last batch partial: 4 + 4 + 2); Composer's
    OptimizerMonitor (callbacks.optimizer_monitor) logs grad norms."""
    from composer.loggers import InMemoryLogger
    from diffusion.loader.mds_source import build_dataloader
    from diffusion.models.latent_diffusion import _per_sample_mse
    held_out = write_latent_mds(str(tmp_path / "eval"), kit=train_kit, n=10, seed=1)
    cfg = load_config(TINY, tiny_overrides(train_kit, mds, batches=4, extra=(
        f"data.eval={{path: {held_out}, batch_size: 4, num_workers: 0}}", "trainer.eval_interval=2ba",
        "algorithms.ema={smoothing: 0.9, start: 0.75dur, warmup: false}", "optimizer.lr=1e-2",
        "callbacks={optimizer_monitor: {batch_log_interval: 1}}")))
    trainer = build_trainer(cfg)
    logged = InMemoryLogger()
    logged.init(trainer.state, trainer.logger)
    trainer.logger.destinations = (*trainer.logger.destinations, logged)
    trainer.fit()
    raw, ema = logged.data["metrics/eval/loss"], logged.data["metrics/eval_ema/loss"]
    assert [int(t.batch) for t, _ in raw] == [2, 4]
    assert [int(t.batch) for t, _ in ema] == [4]  # the EMA started after batch 3: nothing of it before
    assert ema[0][1] != raw[1][1]  # two models, two losses, on the same held-out batches and noise
    # (no warm-up: its first update, at batch 4, would take the weights as they are, as diffusers' does)
    # the last eval's loss is the mean over all 10 held-out samples (each one's noise and level pinned by its
    # index), as one batch of the whole set gives it: not over the first 8 (the partial batch dropped)
    model = trainer.state.model
    cfg.data.eval.batch_size = 10
    whole = next(iter(build_dataloader(cfg.data.eval, resolution=cfg.model.resolution, text_dim=model.text_dim,
                                       drop_last=False)))
    model.eval()
    with torch.no_grad():
        per_sample = _per_sample_mse(model.eval_forward(whole))
    trainer.close()
    assert len(per_sample) == 10
    assert raw[1][1] == pytest.approx(per_sample.mean().item(), rel=1e-5)
    assert raw[1][1] != pytest.approx(per_sample[:8].mean().item(), rel=1e-4)
    norms = logged.data["l2_norm/grad/global"]
    assert [int(t.batch) for t, _ in norms] == [1, 2, 3, 4]
    assert all(0 < value < float("inf") for _, value in norms)
    assert logged.data["l2_norm/grad/denoiser.conv_in.weight"][0][1] > 0


def test_the_gradient_norm_before_clipping_and_the_clip_ratio_are_logged(train_kit, mds):
    """With trainer.grad_clip_norm the monitor's norm is the clipped one; the spikes users watch for are the
    norm before clipping, logged every batch with the ratio clipping applied (issue 25, item 3)."""
    from composer.loggers import InMemoryLogger
    cfg = load_config(TINY, tiny_overrides(train_kit, mds, batches=3, extra=(
        "trainer.grad_clip_norm=0.001", "callbacks={optimizer_monitor: {batch_log_interval: 1}}")))
    trainer = build_trainer(cfg)
    logged = InMemoryLogger()
    logged.init(trainer.state, trainer.logger)
    trainer.logger.destinations = (*trainer.logger.destinations, logged)
    trainer.fit()
    trainer.close()
    before = [v for _, v in logged.data["l2_norm/grad/global_before_clip"]]
    after = [v for _, v in logged.data["l2_norm/grad/global"]]
    ratio = [v for _, v in logged.data["l2_norm/grad/clip_ratio"]]
    assert len(before) == len(after) == len(ratio) == 3
    for b, a, r in zip(before, after, ratio):
        assert b > 0.01 and a == pytest.approx(0.001, rel=1e-3)  # clipped to the threshold...
        assert r == pytest.approx(0.001 / b, rel=1e-4)  # ...by this factor


def test_a_load_path_without_this_models_weights_is_refused(train_kit, mds, tmp_path):
    """trainer.load_path at a checkpoint holding no weights of this model used to train from scratch, exit
    0 (issue 24, item 5): it is refused in one line naming what the file holds and what was needed."""
    from diffusion.errors import ConfigError
    path = tmp_path / "other.pt"
    torch.save({"state": {"model": {"encoder.weight": torch.zeros(2)}, "timestamp": {}}}, path)
    cfg = load_config(TINY, tiny_overrides(train_kit, mds, batches=1, extra=(f"trainer.load_path={path}",)))
    with pytest.raises(ConfigError, match=r"holds 1 tensors \(encoder\), and 0 of the \d+ this UNet2DConditionModel"):
        build_trainer(cfg)


def test_the_yamls_dist_timeout_reaches_composers_trainer_and_the_process_group(train_kit, mds, monkeypatch):
    """trainer.dist_timeout is how long ranks wait for rank 0 to write a full checkpoint (issue 49 item 5)."""
    import diffusion.train.trainer as trainer_module
    seen = {}

    class Captured(Exception):
        pass

    def fake_trainer(**kwargs):
        seen["trainer"] = kwargs["dist_timeout"]
        raise Captured

    real_init = trainer_module.dist.initialize_dist
    monkeypatch.setattr(trainer_module, "Trainer", fake_trainer)
    monkeypatch.setattr(trainer_module.dist, "initialize_dist",
                        lambda device, timeout: (seen.__setitem__("group", timeout), real_init(device, timeout))[1])
    cfg = load_config(TINY, tiny_overrides(train_kit, mds, batches=1, extra=("trainer.dist_timeout=1800",)))
    with pytest.raises(Captured):
        build_trainer(cfg)
    gc.collect()  # the loader built before the Trainer lets go of its shared memory
    assert seen == {"trainer": 1800.0, "group": 1800.0}


def test_a_compiled_run_with_evals_steps_its_spinning_threads_down_when_work_arrives_and_back_at_the_end(
        train_kit, mds, tmp_path, monkeypatch, capfd):
    """The spin watch inside a real training (compiled blocks, evals between batches): a run that chose the spin at
    a quiet start meets other work on every CPU (a scripted /proc/stat: the run's own CPU time plus 2 CPUs of
    others); its threads step down to 1 between batches, with one line, training and evals go on, and the count
    chosen at start is back at the end."""
    import time

    from diffusion import cpus
    from diffusion.train.callbacks.cpu_watch import CpuWatch
    for name in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS"):  # the suite's own settings: a user's would switch it off
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv(cpus.CHOICE, "quiet at start: the test's")
    monkeypatch.setattr(cpus, "WATCH_SECONDS", 0.0)
    start = time.monotonic()
    monkeypatch.setattr(cpus, "_busy_seconds", lambda mask, path=cpus.PROC_STAT: (
        sum(os.times()[:2]) + 2.0 * (time.monotonic() - start)))
    monkeypatch.setattr(cpus, "affinity_cpus", lambda: 2)
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1})
    threads = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        held_out = write_latent_mds(str(tmp_path / "eval"), kit=train_kit, n=8, seed=1)
        cfg = load_config(TINY, tiny_overrides(train_kit, mds, batches=4, extra=(
            f"data.eval={{path: {held_out}, batch_size: 8, num_workers: 0}}", "trainer.eval_interval=2ba",
            "trainer.compile=true", "trainer.compile_backend=eager")))
        trainer = build_trainer(cfg)
        assert any(isinstance(c, CpuWatch) for c in trainer.state.callbacks)

        class Threads(Callback):
            def __init__(self):
                self.seen = []

            def batch_end(self, state, logger):
                self.seen.append(torch.get_num_threads())
        seen = Threads()
        trainer.state.callbacks.append(seen)
        trainer.fit()
        assert int(trainer.state.timestamp.batch) == 4
        trainer.close()
        assert seen.seen[0] == 2 and seen.seen[-1] == 1, seen.seen  # the first poll only marks
        assert torch.get_num_threads() == 2  # restored at fit end
        lines = [line for line in capfd.readouterr().out.splitlines() if line.startswith("# cpus: other work")]
        assert len(lines) == 1 and "torch threads 2 -> 1" in lines[0], lines
    finally:
        torch.set_num_threads(threads)


def test_trainer_device_gpu_without_cuda_is_refused_in_one_line(train_kit, mds, monkeypatch):
    """Composer's DeviceGPU raised it from deep in the start as a traceback."""
    from diffusion.errors import ConfigError
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    cfg = load_config(TINY, tiny_overrides(train_kit, mds, batches=1, extra=("trainer.device=gpu",)))
    with pytest.raises(ConfigError, match=r"^trainer.device=gpu: torch sees no CUDA device on this machine; use "
                                          r"trainer.device=cpu"):
        build_trainer(cfg)
