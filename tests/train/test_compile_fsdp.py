"""``trainer.compile`` under FSDP (issue 25 item 8), on 2 real ranks: each FSDP unit's block is compiled
whole, so the step has no graph breaks (a whole-model compile broke once per unit), and it trains the
weights the eager step trains."""

import json
import os

import pytest
import torch

from train_fixtures import launch_composer, tiny_overrides, write_latent_mds

HARNESS = '''
import json, os, sys, time, torch
import torch._dynamo
from torch._dynamo.utils import counters
from composer.utils import dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from diffusion.train.algorithms.ema import parameter_name
from diffusion.train.config import load_config
from diffusion.launch import parse_args
from diffusion.train.trainer import build_trainer

from composer.core import Callback


from composer.loggers import InMemoryLogger
from diffusion.errors import ConfigError


class GraphsAtEval(Callback):
    """The graphs compiled so far, at the end of each evaluator's run (eval, then the EMA's); and the whole
    gradient's norm after each backward (the last microbatch's: the batch's norm before clipping)."""

    def __init__(self):
        self.graphs, self.norms, self.last, self.first_batch = [], [], None, None

    def after_backward(self, state, logger):
        model = state.model.denoiser
        if isinstance(model, FSDP):
            with FSDP.summon_full_params(model, writeback=False, with_grads=True):
                squares = [p.grad.float().pow(2).sum() for p in model.parameters() if p.grad is not None]
        else:  # FSDP2 (one shard dimension): the squares of each rank's shards, summed over the ranks at once
            # (a full_tensor() a weight was 208 gathers a microbatch: seconds a batch on gloo)
            local = torch.stack([p.grad.to_local().float().pow(2).sum() for p in model.parameters()
                                 if p.grad is not None]).sum()
            torch.distributed.all_reduce(local)
            squares = [local]
        self.last = torch.stack(squares).sum().sqrt().item()

    def batch_end(self, state, logger):
        self.norms.append(self.last)
        if self.first_batch is None:  # the train step's graphs, before any eval
            self.first_batch = counters["stats"]["unique_graphs"]

    def eval_end(self, state, logger):
        self.graphs.append(counters["stats"]["unique_graphs"])


path, overrides = parse_args(sys.argv[1:])
out = os.environ["RECORD_DIR"]
for variant in json.loads(os.environ["VARIANTS"]):
    torch._dynamo.reset()
    counters.clear()
    started, cpu0 = time.time(), time.process_time()
    torch._dynamo.utils.compilation_time_metrics.clear()
    try:
        trainer = build_trainer(load_config(path, overrides + variant["overrides"]))
    except ConfigError as e:
        torch.save({"refused": str(e)}, os.path.join(out, f"{variant['name']}-rank{dist.get_global_rank()}.pt"))
        continue
    model = trainer.state.model
    at_eval = GraphsAtEval()
    trainer.state.callbacks.append(at_eval)
    logged = InMemoryLogger()
    logged.init(trainer.state, trainer.logger)
    trainer.logger.destinations = (*trainer.logger.destinations, logged)
    built = time.time() - started
    trainer.fit()
    record = {"phases": {"build": built, "fit": time.time() - started - built, "cpu": time.process_time() - cpu0,
                         "compile": {k: sum(v) for k, v in torch._dynamo.utils.compilation_time_metrics.items()}},
              "breaks": sum(counters["graph_break"].values()), "graphs": counters["stats"]["unique_graphs"],
              "at_eval": at_eval.graphs, "first_batch": at_eval.first_batch, "seconds": time.time() - started, "full_norms": at_eval.norms,
              "before_clip": [v for _, v in logged.data["l2_norm/grad/global_before_clip"]],
              "evals": {k: [float(v) for _, v in logged.data[k]] for k in logged.data if k.startswith("metrics/eval")},
              "checkpointed": sum(1 for m in model.denoiser.modules() if type(m).__name__ == "CheckpointWrapper"),
              "compiled": sum(1 for m in model.denoiser.modules() if getattr(m, "_compiled_call_impl", None))}
    if variant["fsdp"] == 1:
        with FSDP.summon_full_params(model.denoiser):
            record["final"] = {parameter_name(n): p.detach().clone() for n, p in model.denoiser.named_parameters()}
    else:
        record["final"] = {n: (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                           for n, p in model.denoiser.named_parameters()}
    from diffusion.train.algorithms.ema import EMA
    record["ema"] = [a.state_dict()["ema_params"] for a in trainer.state.algorithms if isinstance(a, EMA)]
    torch.save(record, os.path.join(out, f"{variant['name']}-rank{dist.get_global_rank()}.pt"))
    trainer.close()
'''


SD2_STRUCTURE = dict(layers_per_block=2, block_out_channels=[32, 32, 64, 64], attention_head_dim=[1, 1, 2, 2],
                     down_block_types=["CrossAttnDownBlock2D"] * 3 + ["DownBlock2D"],
                     up_block_types=["UpBlock2D"] + ["CrossAttnUpBlock2D"] * 3)


def sd2_structure_kit(train_kit: str, out: str) -> str:
    """The training kit with SD2-base's UNet block structure (4 stages of 2 layers, cross-attention in the
    first three, 38 blocks) at reduced widths."""
    import shutil
    from diffusion.kit.build import SD2_UNET
    shutil.copytree(train_kit, out)
    with open(os.path.join(out, "unet", "config.json")) as f:
        config = json.load(f)
    config.update({k: SD2_UNET[k] for k in ("layers_per_block", "down_block_types", "up_block_types")}, **SD2_STRUCTURE)
    with open(os.path.join(out, "unet", "config.json"), "w") as f:
        json.dump(config, f)
    return out


def unet_blocks(kit: str) -> int:
    from diffusers import UNet2DConditionModel
    with torch.device("meta"):
        unet = UNet2DConditionModel.from_config(UNet2DConditionModel.load_config(os.path.join(kit, "unet")))
    return sum(1 for m in unet.modules() if type(m).__name__ in ("ResnetBlock2D", "BasicTransformerBlock"))


@pytest.mark.slow
@pytest.mark.timeout(2100)  # the launches' own limits: the aot_eager variants take 4-5 min each on a loaded 2-core box
def test_compile_under_fsdp_trains_as_eager_through_evals_ema_microbatches_and_a_resume(train_kit, tiny_kit, tmp_path):
    """FSDP1 and FSDP2 with ``trainer.compile``, an eval set whose last batch is partial (run padded to the full
    batch: no graphs of its own, the held-out losses eager's), EMA (its own eval)
    and (FSDP2) a microbatch size with a remainder: every block compiled whole, no graph breaks, no graph
    compiled after the first eval, the eager run's weights and EMA; FSDP1 refuses to accumulate
    microbatches compiled; with per-block activation checkpointing the eager weights too: compiled FSDP2
    (``aot_eager``) from the start, and FSDP1 in a run resumed from the compiled FSDP1 run's batch-2 checkpoint (saved without the
    wrappers), with the image logger's guided batch at each eval's batch and nothing compiled after the
    resumed run's first eval, which ends as the straight one. The logged pre-clip norm is the
    whole gradient's. With SD2-base's block structure (38 blocks) the graphs of the train and eval shapes
    exceed the old cache limit (one entry per block: the first eval died with FailOnRecompileLimitHit),
    and their count stays the same through the later evals."""
    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=32)
    held_out = write_latent_mds(str(tmp_path / "eval"), kit=train_kit, n=12, seed=1)  # 6 a rank: 4 + 2
    # Adam with eps 1: an update proportional to the gradient (SGD-like), so that float rounding in a
    # near-zero gradient cannot flip a whole Adam step
    common = tiny_overrides(train_kit, mds, batches=4, batch_size=8, extra=(
        "optimizer.lr=1e-2", "optimizer.eps=1.0", "algorithms.ema.smoothing=0.9", "algorithms.ema.warmup=false",
        f"data.eval.path={held_out}", "data.eval.batch_size=8", "data.eval.num_workers=0",
        "trainer.eval_interval=2ba", "trainer.grad_clip_norm=0.05"))
    compiled = ["trainer.compile=true", "trainer.compile_backend=aot_eager"]
    # 4 samples a rank: FSDP2 in microbatches of 3 + 1; compiled FSDP1 takes them whole (it cannot accumulate)
    micro = {1: "trainer.device_train_microbatch_size=4", 2: "trainer.device_train_microbatch_size=3"}
    saved = tmp_path / "stopped"
    # the compiled FSDP1 run also saves at batch 2 (and 4): the checkpoint a run stopped at batch 2 leaves
    saving = [f"trainer.save_folder={saved}", "trainer.save_interval=2ba", "trainer.save_num_checkpoints_to_keep=-1"]
    variants = []
    for version in (1, 2):
        fsdp = f"trainer.fsdp={{sharding_strategy: FULL_SHARD, version: {version}}}"
        # compiled FSDP2 also checkpoints each block (Composer's wrapper around the compiled block): the
        # checkpointed blocks' recomputed forward runs the AOT graph again (one run, not two: compile is its cost)
        variants += [{"name": f"fsdp{version}-eager", "fsdp": version, "overrides": [fsdp, micro[version]]},
                     {"name": f"fsdp{version}-compiled", "fsdp": version,
                      "overrides": [fsdp, micro[version], *compiled,
                                    *(saving if version == 1 else ["trainer.activation_checkpointing=true"])]}]
    fsdp1 = "trainer.fsdp={sharding_strategy: FULL_SHARD}"
    variants.append({"name": "fsdp1-accumulating", "fsdp": 1, "overrides": [fsdp1, *compiled,
                                                                             "trainer.device_train_microbatch_size=3"]})
    # dynamo's guards only (backend eager: the eager run's numbers, no code generated)
    guards_only = ["trainer.compile=true", "trainer.compile_backend=eager"]
    # resumed from the compiled FSDP1 run's batch-2 checkpoint, FSDP1 with checkpointed blocks compiled inside
    # (a checkpoint saved without the wrappers) and the image logger's guided batch (another shape and grad
    # mode) sampled at each eval's batch: an eval and a grid at batches 3 and 4 (one run, not two: a run's
    # compile is most of its cost)
    images = tmp_path / "images"
    variants.append({"name": "resumed", "fsdp": 1, "overrides": [
        fsdp1, micro[1], *guards_only, "trainer.activation_checkpointing=true",
        f"trainer.load_path={saved}/ep0-ba2-rank0.pt", "trainer.eval_interval=1ba",
        f"callbacks.image_logger={{prompts: [a red circle], interval: 1ba, steps: 2, guidance_scale: 3.0, "
        f"model_ref: {tiny_kit}, save_folder: {images}}}"]})  # the VAE and text encoder: the fitted kit's
    result = launch_composer(tmp_path / "harness.py", HARNESS, ["yamls/tiny-cpu.yaml", *common],
                             env={"RECORD_DIR": str(tmp_path), "VARIANTS": json.dumps(variants)}, timeout=1500,
                             launcher="plain")
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    # the recompile count: dynamo's guards alone (backend eager: no code generated), an eval after each of 2 batches,
    # FSDP1 on one rank (each rank compiles its own graphs: a second rank only traced the same ones again), the
    # batch of 8 whole (compiled FSDP1 cannot accumulate), the held-out 12 as 8 + 4
    sd2 = sd2_structure_kit(train_kit, str(tmp_path / "sd2-structure"))
    sd2_variant = {"name": "sd2", "fsdp": 1, "overrides": [fsdp1, f"model.ref={sd2}", "trainer.compile=true",
                                                           "trainer.compile_backend=eager",
                                                           "trainer.device_train_microbatch_size=8",
                                                           "trainer.max_duration=2ba", "trainer.eval_interval=1ba"]}
    result = launch_composer(tmp_path / "harness.py", HARNESS, ["yamls/tiny-cpu.yaml", *common],
                             env={"RECORD_DIR": str(tmp_path), "VARIANTS": json.dumps([sd2_variant])}, timeout=600,
                             launcher="plain", processes=1)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    blocks = unet_blocks(train_kit)
    for version in (1, 2):
        for rank in (0, 1):
            eager = torch.load(tmp_path / f"fsdp{version}-eager-rank{rank}.pt", weights_only=False)
            compiled = torch.load(tmp_path / f"fsdp{version}-compiled-rank{rank}.pt", weights_only=False)
            assert eager["graphs"] == 0 and eager["compiled"] == 0
            # every block compiled, none broken: one graph per distinct block and shape (some share one)
            assert compiled["compiled"] == blocks and compiled["breaks"] == 0, (version, compiled["breaks"])
            assert len(compiled["at_eval"]) == 4 and len(set(compiled["at_eval"])) == 1, compiled["at_eval"]
            # the eval's 6 samples a rank as 4 + 2: the partial batch runs padded to the full batch's graphs, so
            # the first eval compiled one shape's graphs beside the train step's (FSDP1 takes the 4 whole,
            # FSDP2 as 3 + 1: two shapes); before, another set for the 2 (FSDP1 22 -> 33 graphs)
            train_shapes = version
            assert compiled["at_eval"][0] * train_shapes == compiled["first_batch"] * (train_shapes + 1), (
                compiled["first_batch"], compiled["at_eval"])
            # and scores the held-out set as eager does (raw weights and EMA, each eval)
            assert compiled["evals"].keys() == eager["evals"].keys() == {"metrics/eval/loss", "metrics/eval_ema/loss"}
            for key, losses in eager["evals"].items():
                assert len(losses) == 2 and compiled["evals"][key] == pytest.approx(losses, rel=1e-4), key
            final = {name.replace("_checkpoint_wrapped_module.", ""): w for name, w in compiled["final"].items()}
            assert final.keys() == eager["final"].keys()
            for name, weight in eager["final"].items():
                torch.testing.assert_close(final[name], weight, rtol=1e-4, atol=1e-6, msg=name)
            ema = {name.replace("_checkpoint_wrapped_module.", ""): w for name, w in compiled["ema"][0].items()}
            for name, weight in eager["ema"][0].items():
                torch.testing.assert_close(ema[name], weight, rtol=1e-4, atol=1e-6, msg=name)
            # compiled FSDP2's blocks are checkpointed too (FSDP1's in the resumed run); eager's are not
            assert eager["checkpointed"] == 0 and compiled["checkpointed"] == (blocks if version == 2 else 0)
    # the logged norm is the whole gradient's before clipping (clipped at 0.05: it did clip), on every rank
    for name in ("fsdp1-eager", "fsdp2-eager", "fsdp1-compiled", "fsdp2-compiled"):
        ranks = [torch.load(tmp_path / f"{name}-rank{r}.pt", weights_only=False) for r in (0, 1)]
        assert len(ranks[0]["before_clip"]) == 4 and ranks[0]["before_clip"] == ranks[1]["before_clip"]
        assert ranks[0]["before_clip"] == pytest.approx(ranks[0]["full_norms"], rel=1e-4), name
        assert min(ranks[0]["before_clip"]) > 0.05
    refused = torch.load(tmp_path / "fsdp1-accumulating-rank0.pt", weights_only=False)["refused"]
    assert "cannot accumulate microbatches (trainer.device_train_microbatch_size=3 < 4 samples a rank)" in refused
    straight = torch.load(tmp_path / "fsdp1-eager-rank0.pt", weights_only=False)
    resumed = torch.load(tmp_path / "resumed-rank0.pt", weights_only=False)
    assert resumed["checkpointed"] == blocks and resumed["breaks"] == 0, resumed["breaks"]
    # the evals after the resume (at batches 3 and 4, each the raw weights' and the EMA's): nothing compiled
    # after the first
    assert len(resumed["at_eval"]) == 4 and len(set(resumed["at_eval"])) == 1, resumed["at_eval"]
    assert len([n for n in os.listdir(images) if n.endswith(".png")]) >= 2  # a grid at batch 3 and at 4
    for name, weight in straight["final"].items():
        torch.testing.assert_close(resumed["final"][name], weight, rtol=1e-4, atol=1e-6, msg=name)
    for name, weight in straight["ema"][0].items():
        torch.testing.assert_close(resumed["ema"][0][name], weight, rtol=1e-4, atol=1e-6, msg=name)
    sd2_run = torch.load(tmp_path / "sd2-rank0.pt", weights_only=False)
    sd2_blocks = unet_blocks(sd2)
    assert sd2_blocks == 38 and sd2_run["compiled"] == sd2_blocks and sd2_run["breaks"] == 0
    assert len(sd2_run["at_eval"]) == 4  # 2 evals, each the raw weights' and the EMA's
    assert sd2_run["at_eval"][0] > max(8, sd2_blocks)  # beyond the old limit: the first eval failed
    assert len(set(sd2_run["at_eval"])) == 1, sd2_run["at_eval"]  # no eval compiles anything new
    assert sd2_run["at_eval"][0] == 2 * sd2_run["first_batch"]  # the train step's graphs and the eval's (56)


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


def test_compile_refuses_a_microbatch_size_that_changes():
    """``auto`` tries microbatch sizes until one fits: compiled, each would compile every block again."""
    from diffusion.errors import ConfigError
    from diffusion.train.config import load_config
    with pytest.raises(ConfigError, match="trainer.compile=true with trainer.device_train_microbatch_size=auto"):
        load_config("yamls/tiny-cpu.yaml", ["trainer.compile=true", "trainer.device_train_microbatch_size=auto"])
