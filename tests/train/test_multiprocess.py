"""`composer -n 2 run.py yamls/tiny-cpu.yaml` on CPU (gloo DDP): disjoint samples, identical weights, and
the same weights as one process training the same global batches in any number of microbatches."""

import os
import sys


import pytest
import torch

from diffusion.train.config import load_config
from train_fixtures import fit_in_process, free_port, run_group, tiny_overrides, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The same entry point as run.py, plus a recorder: each rank saves the sample indices it trained on
# and its final weights, so the test can compare ranks.
HARNESS = '''
import os, sys, torch
from composer.core import Callback
from diffusion.train.config import load_config
from diffusion import schema
from diffusion.launch import parse_args
from diffusion.train.trainer import build_trainer

class Record(Callback):
    seen = []
    def before_forward(self, state, logger):
        self.seen += state.batch[schema.BATCH_SAMPLE_INDEX].tolist()

path, overrides = parse_args(sys.argv[1:])
trainer = build_trainer(load_config(path, overrides))
record = Record()
trainer.state.callbacks.append(record)
trainer.fit()
rank = int(os.environ["RANK"])
torch.save({"seen": record.seen, "weights": trainer.state.model.module.state_dict()},
           os.path.join(os.environ["RECORD_DIR"], f"rank{rank}.pt"))
trainer.close()
'''


def _fit_one_process(args: list[str]):
    """Train in this process: the sample indices of each batch (sorted) and the final weights."""
    weights, batches = fit_in_process(load_config(args[0], args[1:]))
    return [sorted(b) for b in batches], weights


@pytest.mark.slow
def test_two_ranks_read_disjoint_samples_and_agree(train_kit, tmp_path):
    """Two ranks split each global batch; the result equals one process training the same global
    batches whole or in microbatches of 4 or 8: the noise is the sample's, not the split's. The data is
    a mix of two datasets (data.train.streams), so the mix's partitioning across ranks is covered too."""
    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=32)
    other = write_latent_mds(str(tmp_path / "other"), kit=train_kit, n=32, seed=1)
    harness = tmp_path / "harness.py"
    harness.write_text(HARNESS)
    composer = os.path.join(os.path.dirname(sys.executable), "composer")
    # input perturbation and offset noise on: every kind of draw takes part
    args = ["yamls/tiny-cpu.yaml", *tiny_overrides(train_kit, mds, batches=4, batch_size=16,
                                                  save_folder=str(tmp_path / "ckpt"),
                                                  extra=("model.offset_noise=0.1", "model.input_perturbation=0.1",
                                                         "data.train.shuffle=false", "algorithms={}",
                                                         # Adam with a large eps: smooth in the gradient
                                                         # (see below), so float error stays float error
                                                         "optimizer.eps=1.0", "optimizer.lr=0.1",
                                                         "data.train.path=null",
                                                         f"data.train.streams=[{{path: {mds}}}, {{path: {other}}}]")),
            "trainer.save_interval=4ba"]
    env = dict(os.environ, RECORD_DIR=str(tmp_path), PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    result = run_group([composer, "-n", "2", "--master_port", str(free_port()), str(harness), *args], cwd=ROOT,
                       env=env, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert len(r0["seen"]) == len(r1["seen"]) == 4 * 8  # 4 batches of 16 global = 8 per rank
    assert not set(r0["seen"]) & set(r1["seen"])  # disjoint
    assert len(set(r0["seen"]) | set(r1["seen"])) == 64  # together: one epoch, each sample once
    for name, tensor in r0["weights"].items():
        if name != "_extra_state":
            torch.testing.assert_close(r1["weights"][name], tensor, rtol=0, atol=0, msg=name)
    assert os.path.exists(tmp_path / "ckpt" / "latest-rank0.pt")

    two_rank_batches = [sorted(r0["seen"][i:i + 8] + r1["seen"][i:i + 8]) for i in range(0, 32, 8)]
    one_process = [a for a in args if not a.startswith("trainer.save_folder")] + ["trainer.save_folder=null"]
    for microbatch in ("null", 4, 8):
        batches, weights = _fit_one_process(one_process + [f"trainer.device_train_microbatch_size={microbatch}"])
        assert batches == two_rank_batches, microbatch  # the same global batches ...
        # ... give the same weights, to float tolerance. (Summation order differs between the splits; with
        # Adam's usual eps, a near-zero gradient's sign decides a whole lr-sized first step, so this test
        # uses eps = 1, where the step is continuous in the gradient.)
        for name, tensor in r0["weights"].items():
            if name != "_extra_state":
                torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"microbatch {microbatch}: {name}: {m}")


@pytest.mark.slow
def test_fsdp2_trains_as_one_process_does_with_ema_and_a_full_checkpoint(train_kit, tmp_path):
    """``composer -n 2 run.py ...``, the product's own entry point under the launcher as a user types it,
    with ``trainer.fsdp.version=2`` (torch's fully_shard through Composer), as the SD2 YAMLs allow it: two
    CPU ranks, EMA, two microbatches per rank train the weights one process trains on the same global
    batches (gradients averaged over the ranks, not summed), and the checkpoint holds them whole with
    the EMA."""
    from diffusion.models.checkpoint import load_denoiser
    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=32)
    composer = os.path.join(os.path.dirname(sys.executable), "composer")
    # Adam with eps = 1: smooth in the gradient (see test_two_ranks_read_disjoint_samples_and_agree), and
    # no clipping, which would hide gradients of the wrong size
    common = ["yamls/tiny-cpu.yaml", *tiny_overrides(train_kit, mds, batches=3, batch_size=8,
                                                     extra=("data.train.shuffle=false", "optimizer.eps=1.0",
                                                            "optimizer.lr=0.1", "trainer.grad_clip_norm=null"))]
    fsdp2 = ["trainer.fsdp.version=2", "trainer.fsdp.sharding_strategy=SHARD_GRAD_OP",
             "trainer.device_train_microbatch_size=2", f"trainer.save_folder={tmp_path / 'ckpt'}",
             "trainer.save_interval=3ba"]
    result = run_group([composer, "-n", "2", "--master_port", str(free_port()), "run.py", *common, *fsdp2],
                       cwd=ROOT, timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    ema, _, ema_used = load_denoiser(str(tmp_path / "ckpt" / "latest-rank0.pt"))
    raw, _, _ = load_denoiser(str(tmp_path / "ckpt" / "latest-rank0.pt"), ema=False)
    assert ema_used and not torch.equal(ema.conv_in.weight, raw.conv_in.weight)

    _, one_process = _fit_one_process(common)
    for name, tensor in raw.state_dict().items():
        torch.testing.assert_close(tensor, one_process["denoiser." + name], rtol=1e-5, atol=1e-7, msg=name)
