"""The MMDiT under real FSDP on CPU (`composer -n 2`, gloo): each joint transformer block is its own FSDP
unit (FSDP1 and FSDP2), and two ranks with EMA and microbatches train, with rectified flow, the weights
and EMA one process trains on the same global batches."""

import json
import os

import pytest
import torch

from diffusion.train.config import load_config
from train_fixtures import fit_in_process, launch_composer, tiny_overrides, write_latent_mds

HARNESS = r'''
import gc, json, os, sys
import torch
from composer.utils import dist
from diffusion.train.algorithms.ema import EMA, parameter_name
from diffusion.train.config import load_config
from diffusion.launch import parse_args
from diffusion.train.trainer import build_trainer

path, overrides = parse_args(sys.argv[1:])
for variant in json.loads(os.environ["VARIANTS"]):
    trainer = build_trainer(load_config(path, overrides + variant["overrides"]))
    model = trainer.state.model
    wrapped_blocks = sum(1 for m in model.denoiser.modules()
                         if type(m).__name__ == "FullyShardedDataParallel"
                         and type(m._fsdp_wrapped_module).__name__ == "JointTransformerBlock")
    fsdp2_blocks = sum(1 for m in model.denoiser.modules() if type(m).__name__ == "FSDPJointTransformerBlock")
    trainer.fit()
    record = {"blocks": wrapped_blocks + fsdp2_blocks}
    if wrapped_blocks:
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        with FSDP.summon_full_params(model.denoiser):
            record["final"] = {parameter_name(n): p.detach().clone() for n, p in model.named_parameters()}
    else:
        record["final"] = {parameter_name(n): p.full_tensor().detach().clone() for n, p in model.named_parameters()}
    ema = [a for a in trainer.state.algorithms if isinstance(a, EMA)][0]
    record["ema"] = ema.state_dict()["ema_params"]
    torch.save(record, os.path.join(os.environ["RECORD_DIR"], f"{variant['name']}-rank{dist.get_global_rank()}.pt"))
    trainer.close()
    del trainer, model
    gc.collect()
'''

YAML = "yamls/tiny-mmdit-flow-cpu.yaml"


@pytest.mark.slow
def test_two_ranks_fsdp_train_the_mmdit_as_one_process_with_ema(mmdit_train_kit, tmp_path):
    mds = write_latent_mds(str(tmp_path / "mds"), kit=mmdit_train_kit, n=32)
    # Adam with eps = 1 (smooth in the gradient), no clipping, a fast EMA: see test_multiprocess.py
    common = tiny_overrides(mmdit_train_kit, mds, batches=3, batch_size=8, extra=(
        "model.prediction_type=null", "model.objective=flow", "data.train.shuffle=false", "optimizer.eps=1.0",
        "optimizer.lr=0.05", "trainer.grad_clip_norm=null", "algorithms.ema.smoothing=0.9",
        "algorithms.ema.warmup=false", "trainer.device_train_microbatch_size=2"))
    variants = [{"name": "fsdp1", "overrides": ["trainer.fsdp={sharding_strategy: FULL_SHARD}"]},
                {"name": "fsdp2", "overrides": ["trainer.fsdp={version: 2, sharding_strategy: FULL_SHARD}"]}]
    result = launch_composer(tmp_path / "harness.py", HARNESS, [YAML, *common], port=29547,
                             env={"RECORD_DIR": str(tmp_path), "VARIANTS": json.dumps(variants)})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    one = fit_in_process(load_config(YAML, common))[0]
    for name in ("fsdp1", "fsdp2"):
        ranks = [torch.load(tmp_path / f"{name}-rank{r}.pt", weights_only=False) for r in range(2)]
        assert ranks[0]["blocks"] == 4, (name, ranks[0]["blocks"])  # every joint block its own unit
        final = ranks[0]["final"]
        assert len(final) > 50 and set(final) <= set(one)  # every parameter, gathered whole
        for key, tensor in final.items():
            torch.testing.assert_close(tensor, one[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
        ema = ranks[0]["ema"]
        assert set(ema) == set(final)
        moved = [k for k in ema if not torch.allclose(ema[k], one[k])]
        assert moved  # the EMA lags the weights: it is its own average, checkpointed whole


# Composer's FSDP1 wraps each child of the model as its own unit: REPA's projector is one beside the denoiser
HARNESS_EVERY_UNIT = HARNESS.replace("summon_full_params(model.denoiser)", "summon_full_params(model)")


@pytest.mark.slow
def test_two_ranks_fsdp_with_ema_and_repa_train_as_one_process_and_resume_exactly_through_the_switch_off(
        mmdit_train_kit, tmp_path):
    """``model.repa`` under FSDP1 with EMA on 2 ranks of 2 microbatches each: the weights, the projector and
    the EMA of one process training the same 3 global batches whole (rank and microbatch invariance); the
    alignment switches off from batch 2. The same run stopped after batch 1 and resumed from its checkpoint
    (Composer's load_path, the switch-off batch crossed after the resume) ends with the same weights and EMA."""
    import shutil
    from diffusion.kit.encoder_fit import TINY_ENCODER_ASSET
    from diffusion.kit.vae_fit import TINY_VAE_ASSET
    kit = str(tmp_path / "kit")  # REPA decodes the latents with the data's VAE: the kit's fitted one
    shutil.copytree(mmdit_train_kit, kit)
    shutil.rmtree(os.path.join(kit, "vae"), ignore_errors=True)
    shutil.copytree(TINY_VAE_ASSET, os.path.join(kit, "vae"))
    mds = write_latent_mds(str(tmp_path / "mds"), kit=kit, n=32)
    common = tiny_overrides(kit, mds, batches=3, batch_size=8, extra=(
        "model.prediction_type=null", "model.objective=flow", "data.train.shuffle=false", "optimizer.eps=1.0",
        "optimizer.lr=0.05", "trainer.grad_clip_norm=null", "algorithms.ema.smoothing=0.9",
        "algorithms.ema.warmup=false", f"model.repa.encoder={TINY_ENCODER_ASSET}", "model.repa.block=2",
        "model.repa.until=2", "model.repa.projector_dim=16"))
    fsdp = ["trainer.fsdp={sharding_strategy: FULL_SHARD}", "trainer.device_train_microbatch_size=2"]
    saved = tmp_path / "stopped"
    variants = [{"name": "straight", "overrides": fsdp},
                {"name": "stopped", "overrides": [*fsdp, "trainer.max_duration=1ba", f"trainer.save_folder={saved}",
                                                  "trainer.save_interval=1ba"]},
                {"name": "resumed", "overrides": [*fsdp, f"trainer.load_path={saved}/ep0-ba1-rank0.pt"]}]
    result = launch_composer(tmp_path / "harness.py", HARNESS_EVERY_UNIT, [YAML, *common], port=29548,
                             env={"RECORD_DIR": str(tmp_path), "VARIANTS": json.dumps(variants)})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    one = fit_in_process(load_config(YAML, common))[0]  # one process, whole batches of 8
    straight = torch.load(tmp_path / "straight-rank0.pt", weights_only=False)
    resumed = torch.load(tmp_path / "resumed-rank0.pt", weights_only=False)
    projector = [k for k in straight["final"] if k.startswith("repa.projector.")]
    assert projector and set(straight["ema"]) == set(straight["final"])  # the EMA averages the projector too
    for key, tensor in straight["final"].items():
        torch.testing.assert_close(tensor, one[key], rtol=1e-5, atol=1e-6, msg=key)
    for what in ("final", "ema"):
        assert set(resumed[what]) == set(straight[what])
        for key, tensor in resumed[what].items():
            torch.testing.assert_close(tensor, straight[what][key], rtol=0, atol=0, msg=f"{what} {key}")
