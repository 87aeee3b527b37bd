"""MLPerf's Flux benchmark as a recipe: yamls/mlperf-flux/ holds MLPerf Training v5.1's hyperparameters for
Flux.1-schnell's shapes (the flux-schnell kit, configs only), diffusion.cost projects its GPU-hours, and the tiny
CPU twin trains with the same keys and stops itself at its target, reporting the time-to-train."""

import os

import pytest
import torch

from diffusion.models import loading
from diffusion.train.config import load_config
from train_fixtures import fit_in_process, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FULL = os.path.join(ROOT, "yamls", "mlperf-flux", "flux-schnell-256.yaml")
TWIN = os.path.join(ROOT, "yamls", "tiny-flux-mlperf-cpu.yaml")
# mlcommons/logging rcp_checker/training_5.1.0/rcps_flux1.json: batch -> (base lr, warm-up batches)
MLPERF_RCPS = {1024: (2.0e-4, 0), 2048: (2.5e-4, 0), 4096: (4.0e-4, 100)}


def test_the_recipe_holds_mlperfs_hyperparameters_and_the_twin_the_same_keys():
    full, twin = load_config(FULL), load_config(TWIN)
    for cfg in (full, twin):  # MLPerf's closed-division values (training_rules.adoc, v5.1)
        assert (cfg.optimizer.name, cfg.optimizer.betas, cfg.optimizer.eps, cfg.optimizer.weight_decay,
                cfg.optimizer.decay) == ("adamw", [0.9, 0.95], 1e-8, 0.1, "all")
        assert cfg.trainer.grad_clip_norm == 1.0 and cfg.data.train.caption_dropout == 0.1
        assert (cfg.model.objective, cfg.model.flow.sigma_density, cfg.model.flow.shift, cfg.model.flow.weighting) == (
            "flow", "uniform", 1.0, "none")
        assert cfg.model.eval_bins == 8 and cfg.callbacks["loss_target"] == {"target": 0.586}
        assert cfg.scheduler.name == "constant_with_warmup"
    batch = full.data.train.batch_size
    assert (full.optimizer.lr, int(full.scheduler.t_warmup[:-2])) == MLPERF_RCPS[batch]
    assert full.model.resolution == 256 and full.data.eval.num_samples == 29_696
    assert int(full.trainer.eval_interval[:-2]) * batch == 262_144  # MLPerf's evaluation frequency
    assert full.trainer.precision == "amp_bf16" and full.trainer.fsdp.version == 2


def test_the_flux_schnell_kit_has_flux_schnells_shapes_and_mlperfs_flops(tmp_path):
    from diffusers import FluxTransformer2DModel
    from diffusion.kit.build import build_kit
    from diffusion.models.flops import training_gflop_per_image
    kit = build_kit("flux-schnell", tmp_path / "kit")
    config = FluxTransformer2DModel.load_config(kit / "transformer")
    with torch.device("meta"):
        params = sum(p.numel() for p in FluxTransformer2DModel.from_config(config).parameters())
    assert params / 1e9 == pytest.approx(11.9, abs=0.01)  # MLPerf's reference: ~11.9B
    vae = loading.load_vae_config(str(kit))
    assert (vae["latent_channels"], vae["scaling_factor"], vae["shift_factor"]) == (16, 0.3611, 0.1159)
    text = loading.load_text_encoder_config(str(kit))
    assert loading.text_encoder_type(text) == "t5" and loading.text_encoder_width(text) == config["joint_attention_dim"]
    assert not list(kit.rglob("*.safetensors"))  # configs only
    tflop = training_gflop_per_image("FluxTransformer2DModel", dict(config), 256, 4096, 256) / 1000
    assert tflop == pytest.approx(20.3, rel=0.01)  # MLPerf counts 20.3 TFLOP per training sample


def test_the_cost_recipe_projects_the_reference_runs_at_the_cost_models_flux_rate(capsys):
    from diffusion import cost
    projection = cost.main(["--recipe", os.path.join(ROOT, "yamls", "cost", "mlperf-flux.yaml")])
    (phase,) = projection.phases
    assert phase.samples % 1024 == 0 and abs(phase.samples - 8_768_717) < 1024  # the RCPs' mean at batch 1024
    rate = cost.RECIPE_PER_GPU[256] * cost.UNET_TRAIN_GFLOP[256] / cost.recipe_gflop_per_image("flux-schnell", 256)
    assert phase.samples_per_sec_per_gpu == pytest.approx(rate, rel=1e-3)
    assert projection.gpu_hours == pytest.approx(671, abs=1)
    assert "671 GPU-hours" in capsys.readouterr().out


def test_the_tiny_twin_trains_and_stops_at_its_target_reporting_time_to_train(tiny_flux_kit, tmp_path, capsys):
    space = loading.latent_space_of(loading.load_vae_config(tiny_flux_kit))
    mds = write_latent_mds(str(tmp_path / "mds"), kit=tiny_flux_kit, n=16, latent_space=space)
    paths = [f"model.ref={tiny_flux_kit}", f"data.train.path={mds}", f"data.eval.path={mds}", "data.train.batch_size=8",
             "data.eval.batch_size=8", "data.eval.num_samples=16", "trainer.save_folder=null", "loggers={}",
             "trainer.autoresume=false", "callbacks.progress=null", "callbacks.speed_monitor=null"]
    never = load_config(TWIN, paths + ["trainer.max_duration=4ba", "trainer.eval_interval=2ba",
                                       "callbacks.loss_target.target=1e-9"])
    _, batches = fit_in_process(never)
    out = capsys.readouterr().out  # no stop, and the end says so in one line
    assert len(batches) == 4 and "stopping" not in out and "[loss_target] target 1e-09 not reached in 4 batches" in out
    # A target the first eval reaches: the run stops there and reports MLPerf's time-to-train.
    reached = load_config(TWIN, paths + ["trainer.max_duration=6ba", "trainer.eval_interval=2ba",
                                         "callbacks.loss_target.target=100"])
    _, batches = fit_in_process(reached)
    out = capsys.readouterr().out
    assert len(batches) == 2 and "[loss_target]" in out and "at batch 2 (16 samples" in out and "s wall" in out
