"""The MMDiT under real FSDP on CPU (`composer -n 2`, gloo), in one launch: each joint transformer block is
its own FSDP unit (FSDP1 and FSDP2), and two ranks with EMA and microbatches train, with rectified flow, the
weights and EMA one process trains on the same global batches; with ``model.repa`` too (FSDP1 and FSDP2),
through the switch-off batch, with gradient clipping (one global norm over the denoiser and the projector),
and a run resumed from a checkpoint before it ends as the straight one; FSDP2 sharded checkpoints with the
EMA's shards beside the weights' resume the EMA exactly."""

import json
import os
import shutil

import pytest
import torch

from diffusion.train.config import load_config
from train_fixtures import (FSDP_VARIANTS_HARNESS, fit_in_process, launch_composer, tiny_overrides,
                            write_latent_mds)

YAML = "yamls/tiny-mmdit-flow-cpu.yaml"


@pytest.mark.slow
def test_two_ranks_fsdp1_and_fsdp2_with_ema_and_repa_train_as_one_process_and_resume_exactly(
        mmdit_train_kit, tmp_path):
    """2 ranks of 2 microbatches each with EMA train the weights (and, with ``model.repa``, the projector) of
    one process training the same 3 global batches whole, under FSDP1 and FSDP2; REPA's alignment switches
    off from batch 2. The FSDP1 REPA run's checkpoint after batch 1, resumed (Composer's
    load_path, the switch-off batch crossed after the resume) ends with the same weights and EMA; so does the
    FSDP2 run stopped after batch 1 with a sharded checkpoint (each rank's EMA shards beside its weights') and
    autoresumed."""
    from diffusion.kit.encoder_fit import TINY_ENCODER_ASSET
    from diffusion.kit.vae_fit import TINY_VAE_ASSET
    kit = str(tmp_path / "kit")  # REPA decodes the latents with the data's VAE: the kit's fitted one
    shutil.copytree(mmdit_train_kit, kit)
    shutil.rmtree(os.path.join(kit, "vae"), ignore_errors=True)
    shutil.copytree(TINY_VAE_ASSET, os.path.join(kit, "vae"))
    mds = write_latent_mds(str(tmp_path / "mds"), kit=kit, n=32)
    # Adam with eps = 1 (smooth in the gradient), no clipping, a fast EMA: see test_multiprocess.py
    common = tiny_overrides(kit, mds, batches=3, batch_size=8, extra=(
        "model.prediction_type=null", "model.objective=flow", "data.train.shuffle=false", "optimizer.eps=1.0",
        "optimizer.lr=0.05", "trainer.grad_clip_norm=null", "algorithms.ema.smoothing=0.9",
        "algorithms.ema.warmup=false"))
    repa = [f"model.repa.encoder={TINY_ENCODER_ASSET}", "model.repa.block=2", "model.repa.until=2",
            "model.repa.projector_dim=16"]
    fsdp1 = ["trainer.fsdp={sharding_strategy: FULL_SHARD}", "trainer.device_train_microbatch_size=2"]
    fsdp2 = ["trainer.fsdp={version: 2, sharding_strategy: FULL_SHARD}", "trainer.device_train_microbatch_size=2"]
    saved = tmp_path / "stopped"
    sharded = tmp_path / "sharded"  # FSDP2 sharded checkpoints, the EMA's shards beside the weights' (issue 49)
    fsdp2_sharded = ["trainer.fsdp={version: 2, sharding_strategy: FULL_SHARD, state_dict_type: sharded}",
                     "trainer.device_train_microbatch_size=2", "trainer.autoresume=true",
                     f"trainer.save_folder={sharded}", "trainer.save_num_checkpoints_to_keep=-1"]
    variants = [{"name": "fsdp1", "overrides": fsdp1},
                # FSDP2 stopped after batch 1 and autoresumed to batch 3 (the straight FSDP2 run with EMA)
                {"name": "sharded-stopped", "overrides": [*fsdp2_sharded, "trainer.max_duration=1ba",
                                                          "trainer.save_interval=1ba"]},
                {"name": "sharded-resumed", "overrides": [*fsdp2_sharded, "trainer.save_interval=3ba"]},
                # it saves after batch 1 (and on): the checkpoint a run stopped there leaves
                {"name": "fsdp1-repa", "overrides": [*fsdp1, *repa, f"trainer.save_folder={saved}",
                                                     "trainer.save_interval=1ba",
                                                     "trainer.save_num_checkpoints_to_keep=-1"]},
                {"name": "fsdp2-repa", "overrides": [*fsdp2, *repa]},
                # clipped every step: the projector and the denoiser by one global norm, as one process clips
                # them (Composer clipped each FSDP1 root, the projector apart: issue 47, item 6)
                {"name": "fsdp1-repa-clip", "overrides": [*fsdp1, *repa, "trainer.grad_clip_norm=0.01"]},
                {"name": "resumed", "overrides": [*fsdp1, *repa, f"trainer.load_path={saved}/ep0-ba1-rank0.pt"]}]
    for variant in variants:
        variant["blocks"] = ["JointTransformerBlock"]
    result = launch_composer(tmp_path / "harness.py", FSDP_VARIANTS_HARNESS, [YAML, *common],
                             env={"RECORD_DIR": str(tmp_path), "VARIANTS": json.dumps(variants)})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]

    one = fit_in_process(load_config(YAML, common))[0]  # one process, whole batches of 8
    one_repa = fit_in_process(load_config(YAML, [*common, *repa]))[0]
    one_clip = fit_in_process(load_config(YAML, [*common, *repa, "trainer.grad_clip_norm=0.01"]))[0]
    for name, expected in (("fsdp1", one), ("sharded-resumed", one), ("fsdp1-repa", one_repa),
                           ("fsdp2-repa", one_repa), ("fsdp1-repa-clip", one_clip)):
        ranks = [torch.load(tmp_path / f"{name}-rank{r}.pt", weights_only=False) for r in range(2)]
        assert ranks[0]["blocks"] == 4, (name, ranks[0]["blocks"])  # every joint block its own unit
        final = ranks[0]["final"]
        assert len(final) > 50 and set(final) <= set(expected)  # every parameter, gathered whole
        projector = [k for k in final if k.startswith("repa.projector.")]
        assert bool(projector) == ("repa" in name), (name, projector)
        for key, tensor in final.items():
            torch.testing.assert_close(tensor, expected[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
        ema = ranks[0]["ema"]
        assert set(ema) == set(final)  # the EMA averages every weight, the projector too
        moved = [k for k in ema if not torch.allclose(ema[k], expected[k])]
        assert moved  # the EMA lags the weights: it is its own average, checkpointed whole
        if name.startswith("fsdp2"):  # rank 0 alone (it writes) keeps the gathered EMA; rank 1 no whole copy
            assert ranks[1]["ema"].keys() == ema.keys() and not any(t.numel() for t in ranks[1]["ema"].values())

    # the FSDP2 run cut after batch 1 wrote each rank's EMA shards beside its weights' (two chunks a weight
    # sharded), and autoresumed ends with the EMA (3 updates) of the straight run of the same batches (FSDP1's)
    from diffusion.models.safe_checkpoint import read_index
    index = read_index(sharded / "ep0-ba1").state_dict_metadata
    prefix = "state.callbacks.EMAShards.EMA."
    ema_entries = {k[len(prefix):]: v for k, v in index.items() if k.startswith(prefix)}
    straight_ema = torch.load(tmp_path / "fsdp1-rank0.pt", weights_only=False)["ema"]
    assert set(ema_entries) == set(straight_ema) and max(len(v.chunks) for v in ema_entries.values()) == 2
    resumed_sharded = torch.load(tmp_path / "sharded-resumed-rank0.pt", weights_only=False)
    assert resumed_sharded["ema_state"]["num_updates"] == 3 and resumed_sharded["ema_state"]["ema_params_beside"]
    for key, tensor in resumed_sharded["ema"].items():
        torch.testing.assert_close(tensor, straight_ema[key], rtol=1e-5, atol=1e-6, msg=f"sharded ema {key}")

    straight = torch.load(tmp_path / "fsdp1-repa-rank0.pt", weights_only=False)
    resumed = torch.load(tmp_path / "resumed-rank0.pt", weights_only=False)
    for what in ("final", "ema"):
        assert set(resumed[what]) == set(straight[what])
        for key, tensor in resumed[what].items():
            torch.testing.assert_close(tensor, straight[what][key], rtol=0, atol=0, msg=f"{what} {key}")
