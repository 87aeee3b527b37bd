"""Hybrid sharding on CPU (gloo), in one launch of 4 ranks as `composer -n 4` starts them: a (replicate 2, shard 2)
mesh from the YAML's Composer keys, under FSDP1 (HYBRID_SHARD) and FSDP2 (a 2-D mesh), train the weights one
process trains on the same global batches, with the gradient clipped by the whole gradient's norm; the FSDP2
run's checkpoint after batch 1, resumed, ends as the straight run."""

import json
import time

import pytest
import torch

from diffusion.errors import ConfigError
from diffusion.train.config import load_config
from diffusion.train.trainer import mesh_degrees
from train_fixtures import FSDP_VARIANTS_HARNESS, fit_in_process, launch_composer, tiny_overrides, write_latent_mds

YAML = "yamls/tiny-mmdit-flow-cpu.yaml"


def test_hybrid_mesh_from_the_yaml_keys():
    """Both degrees unset: shard within a node, replicate across nodes; a shape that is not the world size,
    or a replicate degree without a hybrid strategy, is refused in one line."""
    def degrees(fsdp, world, local):
        return mesh_degrees(load_config(YAML, [f"trainer.fsdp={fsdp}"]), world, local)
    assert degrees("{sharding_strategy: HYBRID_SHARD}", 16, 8) == (2, 8)  # two nodes of 8
    assert degrees("{version: 2, sharding_strategy: HYBRID_SHARD}", 16, 8) == (2, 8)
    assert degrees("{sharding_strategy: HYBRID_SHARD, data_parallel_shard_degree: 4}", 16, 8) == (4, 4)
    assert degrees("{sharding_strategy: _HYBRID_SHARD_ZERO2, data_parallel_replicate_degree: 8}", 16, 8) == (8, 2)
    assert degrees("{sharding_strategy: FULL_SHARD}", 16, 8) == (None, -1)  # Composer's flat mesh
    # FSDP1 runs a shard group of one rank as NO_SHARD, which never all-reduces across the replicas (2 real ranks:
    # their weights 8e-5 apart after 3 batches, each logging its own norm): refused, on one-rank nodes too;
    # FSDP2 replicates over (2, 1), and one process has no replicas
    for fsdp, world, local in (("{sharding_strategy: HYBRID_SHARD}", 2, 1),
                               ("{sharding_strategy: _HYBRID_SHARD_ZERO2, data_parallel_shard_degree: 1}", 16, 8)):
        with pytest.raises(ConfigError, match="would not average gradients across the replicas"):
            degrees(fsdp, world, local)
    assert degrees("{version: 2, sharding_strategy: HYBRID_SHARD}", 2, 1) == (2, 1)
    assert degrees("{sharding_strategy: HYBRID_SHARD}", 1, 1) == (1, 1)
    with pytest.raises(ConfigError, match="must hold the world size, 16 ranks"):
        degrees("{sharding_strategy: HYBRID_SHARD, data_parallel_shard_degree: 3}", 16, 8)
    with pytest.raises(ConfigError, match="must be the world size"):
        degrees("{sharding_strategy: FULL_SHARD, data_parallel_shard_degree: 8}", 16, 8)
    with pytest.raises(ConfigError, match="data_parallel_replicate_degree=2 needs trainer.fsdp.sharding_strategy"):
        load_config(YAML, ["trainer.fsdp={version: 2, sharding_strategy: FULL_SHARD, data_parallel_replicate_degree: 2}"])


# After its variants, each rank stamps when its script ended and arms a dump of its stacks, should its exit (the
# interpreter's shutdown: atexit handlers, process groups, streaming's threads and shared memory) run on a minute.
EXIT_STAMP = r'''
import faulthandler, time
_record = os.path.join(os.environ["RECORD_DIR"], f"exit-rank{dist.get_global_rank()}")
with open(_record + ".time", "w") as _f:
    _f.write(repr(time.time()))
_stacks = open(_record + ".stacks", "w")
faulthandler.dump_traceback_later(60, file=_stacks)
'''


@pytest.mark.slow
def test_four_ranks_as_two_by_two_hybrid_fsdp1_and_fsdp2_train_as_one_process_and_resume_exactly(
        mmdit_train_kit, tmp_path):
    """4 ranks, each weight sharded over 2 and replicated twice (FSDP1 HYBRID_SHARD; FSDP2 with a 2-D mesh), with
    EMA and clipping every step, train the weights of one process on the same 2 global batches; the FSDP2 run's
    full checkpoint after batch 1 (what a run stopped there leaves), resumed, ends with the straight run's weights
    and EMA."""
    mds = write_latent_mds(str(tmp_path / "mds"), kit=mmdit_train_kit, n=32)
    # Adam with eps = 1 (smooth in the gradient), a fast EMA: see test_fsdp_mmdit.py; clipped at every step, so a
    # norm that counted the replicated shards twice would change the weights
    common = tiny_overrides(mmdit_train_kit, mds, batches=2, batch_size=8, extra=(
        "model.prediction_type=null", "model.objective=flow", "data.train.shuffle=false", "optimizer.eps=1.0",
        "optimizer.lr=0.05", "trainer.grad_clip_norm=0.01", "algorithms.ema.smoothing=0.9",
        "algorithms.ema.warmup=false"))
    mesh = "data_parallel_replicate_degree: 2, data_parallel_shard_degree: 2"
    fsdp1 = [f"trainer.fsdp={{sharding_strategy: HYBRID_SHARD, {mesh}}}"]
    fsdp2 = [f"trainer.fsdp={{version: 2, sharding_strategy: HYBRID_SHARD, {mesh}}}"]
    saved = tmp_path / "stopped"
    # the straight FSDP2 run saves after batch 1 (and on): the checkpoint a run stopped there leaves
    variants = [{"name": "fsdp1", "overrides": fsdp1},
                {"name": "fsdp2", "overrides": [*fsdp2, f"trainer.save_folder={saved}", "trainer.save_interval=1ba",
                                                "trainer.save_num_checkpoints_to_keep=-1"]},
                {"name": "resumed", "overrides": [*fsdp2, f"trainer.load_path={saved}/ep0-ba1-rank0.pt"]}]
    for variant in variants:
        variant["blocks"] = ["JointTransformerBlock"]
    result = launch_composer(tmp_path / "harness.py", FSDP_VARIANTS_HARNESS + EXIT_STAMP, [YAML, *common],
                             processes=4, launcher="plain",
                             env={"RECORD_DIR": str(tmp_path), "VARIANTS": json.dumps(variants)})
    returned = time.time()
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    # the launch returns when its ranks are done, not a collective's timeout (300 s) later
    ended = max(float((tmp_path / f"exit-rank{r}.time").read_text()) for r in range(4))
    stacks = "".join((tmp_path / f"exit-rank{r}.stacks").read_text() for r in range(4))
    assert returned - ended < 120, (returned - ended, stacks)

    one = fit_in_process(load_config(YAML, common))[0]  # one process, whole batches of 8
    for name in ("fsdp1", "fsdp2", "resumed"):
        ranks = [torch.load(tmp_path / f"{name}-rank{r}.pt", weights_only=False) for r in range(4)]
        assert ranks[0]["mesh"] == (2, 2), (name, ranks[0]["mesh"])  # sharded over 2 ranks, not all 4
        assert ranks[0]["blocks"] == 4, (name, ranks[0]["blocks"])  # every joint block its own unit
        final = ranks[0]["final"]
        assert len(final) > 50 and set(final) <= set(one)
        for rank in ranks:
            for key, tensor in rank["final"].items():
                torch.testing.assert_close(tensor, one[key], rtol=1e-5, atol=1e-6, msg=f"{name} {key}")
        assert [k for k in ranks[0]["ema"] if not torch.allclose(ranks[0]["ema"][k], one[k])]  # the EMA lags

    straight = torch.load(tmp_path / "fsdp2-rank0.pt", weights_only=False)
    resumed = torch.load(tmp_path / "resumed-rank0.pt", weights_only=False)
    for what in ("final", "ema"):
        assert set(resumed[what]) == set(straight[what])
        for key, tensor in resumed[what].items():
            torch.testing.assert_close(tensor, straight[what][key], rtol=0, atol=0, msg=f"{what} {key}")
