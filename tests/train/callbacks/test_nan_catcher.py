"""NaNCatcher stops at the batch whose loss goes NaN (in any microbatch) and names it; nothing
non-finite is checkpointed. (Two ranks under FSDP: tests/train/test_fsdp.py.)"""

import os

import pytest
import torch
from composer import Trainer
from composer.models import ComposerModel
from torch.utils.data import DataLoader, TensorDataset

from diffusion.train.callbacks.nan_catcher import NaNCatcher, NonFiniteLossError
from diffusion.stream.ray_workers import LossHistory


class BreaksAtBatch(ComposerModel):
    """A linear model whose loss turns to ``bad`` on its ``k``-th training batch (1-based)."""

    def __init__(self, k: int, bad: float = float("nan"), nan_gradient: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.layer = torch.nn.Linear(2, 1)
        self.k, self.bad, self.calls, self.nan_gradient = k, bad, 0, nan_gradient
        self.losses = []

    def forward(self, batch):
        return self.layer(batch[0])

    def loss(self, outputs, batch):
        self.calls += 1
        loss = torch.nn.functional.mse_loss(outputs, batch[1])
        self.losses.append(float(loss))
        if self.calls != self.k:
            return loss
        if self.nan_gradient:  # the loss stays finite; d sqrt(x)/dx at 0 is inf, times 0: NaN gradients
            w = self.layer.weight
            return loss + 0.0 * torch.sqrt(w - w.detach()).sum()
        return loss * self.bad

    def get_metrics(self, is_train=False):
        return {}


def run(model, callbacks, **kwargs):
    x = torch.randn(40, 2, generator=torch.Generator().manual_seed(0))
    data = DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)
    trainer = Trainer(model=model, train_dataloader=data, max_duration="8ba", callbacks=callbacks,
                      optimizers=torch.optim.SGD(model.parameters(), lr=0.01), device="cpu",
                      progress_bar=False, log_to_console=False, **kwargs)
    trainer.fit()
    return trainer


def saved(folder):
    names = sorted(n for n in os.listdir(folder) if n.startswith("ep"))
    return names, os.readlink(os.path.join(folder, "latest-rank0.pt"))


@pytest.mark.parametrize("bad, word", [(float("nan"), "NaN"), (float("inf"), "infinite")])
def test_stops_at_the_bad_batch_and_names_it(bad, word):
    model = BreaksAtBatch(k=3, bad=bad)
    with pytest.raises(NonFiniteLossError, match=rf"loss is {word} .* at batch index 2 \(batch 3 of the run, epoch 0"):
        run(model, [NaNCatcher()])
    assert model.calls == 3  # no further batch ran


def test_finite_losses_run_to_the_end():
    model = BreaksAtBatch(k=10**9)
    trainer = run(model, [NaNCatcher()])
    assert int(trainer.state.timestamp.batch) == 8


def test_a_nan_in_a_non_last_microbatch_stops_before_its_checkpoint(tmp_path):
    # Batches of 4 in microbatches of 2: loss call 5 is batch 3's first microbatch. Composer's state.loss
    # ends up as the (finite) second microbatch's; the NaN must still stop the run.
    model = BreaksAtBatch(k=5)
    with pytest.raises(NonFiniteLossError, match=r"loss is NaN .* at batch index 2 \(batch 3 of the run, epoch 0, "
                                                 r".*: first in microbatch 1 of 2 on rank 0; stopping before"):
        run(model, [NaNCatcher()], device_train_microbatch_size=2, save_folder=str(tmp_path), save_interval="1ba")
    assert model.calls == 6  # the batch's microbatches ran, no further batch
    assert saved(tmp_path) == (["ep0-ba1-rank0.pt", "ep0-ba2-rank0.pt"], "ep0-ba2-rank0.pt")
    weights = torch.load(tmp_path / "ep0-ba2-rank0.pt", weights_only=False)["state"]["model"]
    assert all(torch.isfinite(w).all() for w in weights.values())


def test_nan_weights_behind_a_finite_loss_are_not_saved(tmp_path):
    model = BreaksAtBatch(k=3, nan_gradient=True)
    with pytest.raises(NonFiniteLossError, match=r"weights are not finite after batch index 2 \(batch 3 of the run\): "
                                                 r"1 tensor\(s\) on rank 0, e\.g\. layer\.weight\. Every loss was"):
        run(model, [NaNCatcher()], save_folder=str(tmp_path), save_interval="1ba")
    assert saved(tmp_path) == (["ep0-ba1-rank0.pt", "ep0-ba2-rank0.pt"], "ep0-ba2-rank0.pt")


def test_loss_history_records_the_whole_batch_not_its_last_microbatch():
    # ray_workers.LossHistory (online mode) had the same flaw: it read state.loss.
    model, history = BreaksAtBatch(k=10**9), LossHistory()
    run(model, [history], device_train_microbatch_size=2)
    assert [b for b, _ in history.losses] == list(range(1, 9))
    per_batch = [(model.losses[i] + model.losses[i + 1]) / 2 for i in range(0, 16, 2)]
    assert [loss for _, loss in history.losses] == pytest.approx(per_batch, rel=1e-6)
    assert per_batch != pytest.approx(model.losses[1::2], rel=1e-6)  # the last microbatches alone differ
