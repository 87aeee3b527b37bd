"""``trainer.compile`` under FSDP (issue 25 item 8), on 2 real ranks: each FSDP unit's block is compiled
whole, so the step has no graph breaks (a whole-model compile broke once per unit), and it trains the
weights the eager step trains."""

import json
import os

import pytest
import torch

from train_fixtures import launch_composer, tiny_overrides, write_latent_mds

HARNESS = '''
import json, os, sys, torch
import torch._dynamo
from torch._dynamo.utils import counters
from composer.utils import dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from diffusion.train.algorithms.ema import parameter_name
from diffusion.train.config import load_config
from diffusion.launch import parse_args
from diffusion.train.trainer import build_trainer

path, overrides = parse_args(sys.argv[1:])
out = os.environ["RECORD_DIR"]
for variant in json.loads(os.environ["VARIANTS"]):
    torch._dynamo.reset()
    counters.clear()
    trainer = build_trainer(load_config(path, overrides + variant["overrides"]))
    model = trainer.state.model
    trainer.fit()
    record = {"breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"],
              "compiled": sum(1 for m in model.denoiser.modules() if getattr(m, "_compiled_call_impl", None))}
    if variant["fsdp"] == 1:
        with FSDP.summon_full_params(model.denoiser):
            record["final"] = {parameter_name(n): p.detach().clone() for n, p in model.denoiser.named_parameters()}
    else:
        record["final"] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                           for n, p in model.denoiser.named_parameters()}
    torch.save(record, os.path.join(out, f"{variant['name']}-rank{dist.get_global_rank()}.pt"))
    trainer.close()
'''


@pytest.mark.slow
def test_compile_under_fsdp_compiles_each_block_whole_and_trains_as_eager(train_kit, tmp_path):
    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=32)
    # Adam with eps 1: an update proportional to the gradient (SGD-like), so that float rounding in a
    # near-zero gradient cannot flip a whole Adam step
    common = tiny_overrides(train_kit, mds, batches=2, batch_size=8,
                            extra=("algorithms={}", "optimizer.lr=1e-2", "optimizer.eps=1.0"))
    variants = []
    for version in (1, 2):
        fsdp = f"trainer.fsdp={{sharding_strategy: FULL_SHARD, version: {version}}}"
        variants += [{"name": f"fsdp{version}-eager", "fsdp": version, "overrides": [fsdp]},
                     {"name": f"fsdp{version}-compiled", "fsdp": version,
                      "overrides": [fsdp, "trainer.compile=true", "trainer.compile_backend=aot_eager"]}]
    result = launch_composer(tmp_path / "harness.py", HARNESS, ["yamls/tiny-cpu.yaml", *common], port=29571,
                             env={"RECORD_DIR": str(tmp_path), "VARIANTS": json.dumps(variants)})
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    from diffusers import UNet2DConditionModel
    config = UNet2DConditionModel.load_config(os.path.join(train_kit, "unet"))
    blocks = sum(1 for m in UNet2DConditionModel.from_config(config).modules()
                 if type(m).__name__ in ("ResnetBlock2D", "BasicTransformerBlock"))
    for version in (1, 2):
        for rank in (0, 1):
            eager = torch.load(tmp_path / f"fsdp{version}-eager-rank{rank}.pt", weights_only=False)
            compiled = torch.load(tmp_path / f"fsdp{version}-compiled-rank{rank}.pt", weights_only=False)
            assert eager["graphs"] == 0 and eager["compiled"] == 0
            # every block compiled, none broken: one graph per distinct block (some share one)
            assert compiled["compiled"] == blocks and compiled["breaks"] == 0, (version, compiled["breaks"])
            assert 0 < compiled["graphs"] <= blocks
            for name, weight in eager["final"].items():
                torch.testing.assert_close(compiled["final"][name], weight, rtol=1e-4, atol=1e-6, msg=name)


def test_compile_without_fsdp_compiles_the_whole_step_and_trains_as_eager(train_kit, tmp_path):
    """One process: Composer compiles the whole model with the configured backend (no graph breaks in the
    training forward, tests/loader/test_batches.py), and the weights are the eager step's."""
    import torch._dynamo
    from torch._dynamo.utils import counters

    from diffusion.train.config import load_config
    from train_fixtures import fit_in_process
    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=16)
    common = tiny_overrides(train_kit, mds, batches=2, batch_size=8,
                            extra=("algorithms={}", "optimizer.lr=1e-2", "optimizer.eps=1.0"))
    yaml = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))), "yamls",
                        "tiny-cpu.yaml")
    eager, _ = fit_in_process(load_config(yaml, common))
    torch._dynamo.reset()
    counters.clear()
    compiled, _ = fit_in_process(load_config(yaml, [*common, "trainer.compile=true", "trainer.compile_backend=aot_eager"]))
    assert counters["stats"]["unique_graphs"] >= 1  # it did compile
    for name, weight in eager.items():
        torch.testing.assert_close(compiled[name], weight, rtol=1e-4, atol=1e-6, msg=name)
