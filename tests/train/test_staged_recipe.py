"""A staged recipe (issue 28) hands each phase the last one's weights and EMA, strictly: the tiny
micro-budget recipe's two phases (masked, then unmasked) run through run.py's entry with the arguments a user
types (in this process: run_py_here; a run.py process pays ~15 CPU-s of imports, and run.py's own process
behaviour is tested in tests/test_cpus.py, tests/train/test_launch_lines.py and tests/train/test_config.py), and
a phase started from another network is refused in one line."""

import pytest
import torch

from train_fixtures import run_py_here, tiny_overrides, write_latent_mds


def _args(yaml, kit, mds, *extra):
    return [yaml, *tiny_overrides(kit, mds, batches=2, batch_size=4, extra=(
        "model.prediction_type=null", "algorithms.ema.smoothing=0.5", "algorithms.ema.warmup=false", *extra))]


@pytest.mark.slow
def test_phases_hand_over_weights_and_ema_and_refuse_another_network(mmdit_train_kit, train_kit, tmp_path, capfd):
    from diffusion.models import safe_checkpoint
    mds = write_latent_mds(str(tmp_path / "mds"), kit=mmdit_train_kit, n=16)
    first, second = tmp_path / "masked", tmp_path / "finetune"
    done = run_py_here(capfd, *_args("yamls/tiny-mmdit-masked-cpu.yaml", mmdit_train_kit, mds,
                                     f"trainer.save_folder={first}", "trainer.save_interval=2ba"))
    assert done.returncode == 0, done.stderr[-3000:]
    handed = str(first / "latest-rank0.pt")
    phase1 = safe_checkpoint.load(handed)["state"]
    done = run_py_here(capfd, *_args("yamls/tiny-mmdit-finetune-cpu.yaml", mmdit_train_kit, mds,
                                     f"trainer.save_folder={second}", "trainer.save_interval=1ba",
                                     f"trainer.load_path={handed}", f"algorithms.ema.init_from={handed}"))
    assert done.returncode == 0, done.stderr[-3000:]
    after_one = safe_checkpoint.load(next(second.glob("ep*-ba1-rank0.pt")))["state"]
    ema1, ema2 = dict(phase1["algorithms"])["EMA"], dict(after_one["algorithms"])["EMA"]
    assert ema2["num_updates"] == ema1["num_updates"] + 1  # the average went on, it did not restart
    name = "denoiser.proj_out.weight"
    weights1 = phase1["model"][name]
    # EMA after one step = 0.5 * phase 1's EMA + 0.5 * the new weights: phase 1's average carried over
    expected = 0.5 * ema1["ema_params"][name] + 0.5 * after_one["model"][name]
    torch.testing.assert_close(ema2["ema_params"][name], expected, rtol=1e-5, atol=1e-6)
    assert not torch.equal(weights1, ema1["ema_params"][name])

    # a UNet checkpoint as the "previous phase" of the MMDiT: refused in one line
    unet_mds = write_latent_mds(str(tmp_path / "unet-mds"), kit=train_kit, n=8)
    done = run_py_here(capfd, *_args("yamls/tiny-cpu.yaml", train_kit, unet_mds,
                                     f"trainer.save_folder={tmp_path / 'unet'}", "trainer.save_interval=2ba",
                                     "model.prediction_type=epsilon"))
    assert done.returncode == 0, done.stderr[-3000:]
    wrong = str(tmp_path / "unet" / "latest-rank0.pt")
    done = run_py_here(capfd, *_args("yamls/tiny-mmdit-finetune-cpu.yaml", mmdit_train_kit, mds,
                                     f"trainer.save_folder={tmp_path / 'x'}", f"trainer.load_path={wrong}",
                                     f"algorithms.ema.init_from={wrong}"))
    errors = [line for line in done.stderr.splitlines() if "error:" in line]
    assert done.returncode == 2 and "Traceback" not in done.stderr and len(errors) == 1, done.stderr[-3000:]
    assert "UNet2DConditionModel" in errors[0] and "SD3Transformer2DModel" in errors[0]
