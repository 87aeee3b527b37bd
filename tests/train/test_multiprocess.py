"""`composer -n 2 run.py yamls/tiny-cpu.yaml` on CPU (gloo DDP): disjoint samples, identical weights."""

import os
import subprocess
import sys

import pytest
import torch

from train_fixtures import tiny_overrides, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The same entry point as run.py, plus a recorder: each rank saves the sample indices it trained on
# and its final weights, so the test can compare ranks.
HARNESS = '''
import os, sys, torch
from composer.core import Callback
from diffusion.config import load_config
from diffusion import schema
from diffusion.train.command import parse_args
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


@pytest.mark.slow
def test_two_ranks_read_disjoint_samples_and_agree(train_kit, tmp_path):
    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=64)
    harness = tmp_path / "harness.py"
    harness.write_text(HARNESS)
    composer = os.path.join(os.path.dirname(sys.executable), "composer")
    args = ["yamls/tiny-cpu.yaml", *tiny_overrides(train_kit, mds, batches=4, batch_size=16,
                                                  save_folder=str(tmp_path / "ckpt")),
            "trainer.save_interval=4ba"]
    env = dict(os.environ, RECORD_DIR=str(tmp_path), PYTHONPATH=ROOT, OMP_NUM_THREADS="1")
    result = subprocess.run([composer, "-n", "2", "--master_port", "29533", str(harness), *args], cwd=ROOT,
                            env=env, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    r0, r1 = (torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1))
    assert len(r0["seen"]) == len(r1["seen"]) == 4 * 8  # 4 batches of 16 global = 8 per rank
    assert not set(r0["seen"]) & set(r1["seen"])  # disjoint
    assert len(set(r0["seen"]) | set(r1["seen"])) == 64  # together: one epoch, each sample once
    for name, tensor in r0["weights"].items():
        if name != "_extra_state":
            torch.testing.assert_close(r1["weights"][name], tensor, rtol=0, atol=0, msg=name)
    assert os.path.exists(tmp_path / "ckpt" / "latest-rank0.pt")


@pytest.mark.slow
def test_composer_launches_run_py(train_kit, tmp_path):
    """The product's own entry point under the launcher, as a user types it."""
    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=32)
    composer = os.path.join(os.path.dirname(sys.executable), "composer")
    args = tiny_overrides(train_kit, mds, batches=2, batch_size=8, save_folder=str(tmp_path / "ckpt"))
    result = subprocess.run([composer, "-n", "2", "--master_port", "29534", "run.py", "yamls/tiny-cpu.yaml",
                             *args, "trainer.save_interval=2ba"], cwd=ROOT, capture_output=True, text=True,
                            timeout=600, env=dict(os.environ, OMP_NUM_THREADS="1"))
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    assert os.path.exists(tmp_path / "ckpt" / "latest-rank0.pt")
