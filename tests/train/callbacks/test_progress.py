"""ProgressLine prints batch/max_duration, loss, samples/s and ETA every N seconds and at the end."""

import io
import pathlib
import re

import pytest
import torch
import yaml
from composer import Trainer
from composer.models import ComposerModel
from torch.utils.data import DataLoader, TensorDataset

from diffusion.train import components
from diffusion.train.callbacks import progress
from diffusion.train.callbacks.progress import ProgressLine, format_seconds

BATCH = 4
SECONDS_PER_BATCH = 4.0


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


class Linear(ComposerModel):
    """A linear model whose every training batch takes ``SECONDS_PER_BATCH`` on the fake clock."""

    def __init__(self, clock: Clock):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.clock = clock
        self.losses: list[float] = []

    def forward(self, batch):
        return self.layer(batch[0])

    def loss(self, outputs, batch):
        self.clock.now += SECONDS_PER_BATCH
        loss = torch.nn.functional.mse_loss(outputs, batch[1])
        self.losses.append(float(loss))
        return loss

    def get_metrics(self, is_train=False):
        return {}


def train(max_duration: str, every_seconds: float = 10.0, samples: int = 32):
    clock, out = Clock(), io.StringIO()
    model = Linear(clock)
    x = torch.randn(samples, 2, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x[:, :1] * 3 - 1), batch_size=BATCH)
    trainer = Trainer(model=model, train_dataloader=data, max_duration=max_duration,
                      callbacks=[ProgressLine(every_seconds=every_seconds, stream=out, clock=clock)],
                      optimizers=torch.optim.SGD(model.parameters(), lr=0.01), device="cpu",
                      progress_bar=False, log_to_console=False)
    trainer.fit()
    return out.getvalue().splitlines(), model.losses


def test_a_line_every_n_seconds_and_one_at_the_end():
    lines, losses = train("8ba", every_seconds=10)
    # 4 s a batch: 12 s have passed at batch 3 and again at batch 6; then the final line.
    assert len(lines) == 3, lines
    first, second, last = lines
    mean = sum(losses[:3]) / 3
    # 12 samples in 12 s; 3/8 done in 12 s leaves 5/8: 20 s.
    assert first == f"[progress] batch 3/8 (37.5%)  loss {mean:.4f}  1.0 samples/s  elapsed 12s  ETA 20s"
    assert second.startswith("[progress] batch 6/8 (75.0%)  loss ")
    assert second.endswith("1.0 samples/s  elapsed 24s  ETA 8s")
    assert float(re.search(r"loss (\S+)", second).group(1)) == pytest.approx(sum(losses[3:6]) / 3, abs=1e-4)
    assert last == (f"[progress] done: batch 8/8 (100.0%)  loss {sum(losses) / 8:.4f} (mean)  "
                    f"1.0 samples/s (mean)  elapsed 32s")


def test_epoch_durations_count_within_the_epoch():
    lines, _ = train("2ep", every_seconds=10, samples=16)  # 4 batches an epoch, 8 in all
    assert lines[0].startswith("[progress] epoch 0/2 (37.5%), batch 3  loss ")
    assert lines[0].endswith("ETA 20s")
    assert lines[-1].startswith("[progress] done: epoch 2/2 (100.0%), batch 8  loss ")


def test_other_ranks_print_nothing(monkeypatch):
    monkeypatch.setattr(progress.dist, "get_global_rank", lambda: 1)
    lines, _ = train("4ba", every_seconds=1)
    assert lines == []


def test_format_seconds():
    assert [format_seconds(s) for s in (0, 42.4, 185, 7620, -3)] == ["0s", "42s", "3m05s", "2h07m", "0s"]


def test_every_seconds_must_be_positive():
    with pytest.raises(ValueError, match="every_seconds"):
        ProgressLine(every_seconds=0)


def test_registered_and_enabled_in_the_cpu_yamls():
    components.check_kwargs("callbacks", "progress", {"every_seconds": 10})
    assert components.component_class("callbacks", "progress") is ProgressLine
    for name in ("yamls/tiny-cpu.yaml", "yamls/tiny-online-cpu.yaml"):
        with open(pathlib.Path(__file__).resolve().parents[3] / name) as f:
            assert "progress" in yaml.safe_load(f)["callbacks"], name


def test_the_loss_shown_is_the_batch_mean_over_microbatches(train_kit, tmp_path):
    """With 4 microbatches per batch the line shows the mean of the logged loss/train/total, not the last
    microbatch's loss (issue 25, item 4)."""
    import os
    from composer.core import Callback

    from diffusion.train.config import load_config
    from train_fixtures import fit_in_process, tiny_overrides, write_latent_mds

    class Totals(Callback):
        def __init__(self):
            self.values = []

        def batch_end(self, state, logger):
            self.values.append(state.total_loss_dict["loss/train/total"])

    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=16)
    root = pathlib.Path(__file__).resolve().parents[3]
    cfg = load_config(os.path.join(root, "yamls", "tiny-cpu.yaml"), tiny_overrides(
        train_kit, mds, batches=3, batch_size=8, extra=("trainer.device_train_microbatch_size=2",)))
    out, totals = io.StringIO(), Totals()
    fit_in_process(cfg, callbacks=[ProgressLine(every_seconds=1e9, stream=out), totals])
    shown = float(re.search(r"loss (\d+\.\d+)", out.getvalue().strip().splitlines()[-1]).group(1))
    assert shown == pytest.approx(sum(totals.values) / len(totals.values), abs=1e-4)
