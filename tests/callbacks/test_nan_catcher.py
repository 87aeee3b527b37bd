"""NaNCatcher stops at the batch whose loss goes NaN and names it."""

import pytest
import torch
from composer import Trainer
from composer.models import ComposerModel
from torch.utils.data import DataLoader, TensorDataset

from diffusion.callbacks.nan_catcher import NaNCatcher, NonFiniteLossError


class BreaksAtBatch(ComposerModel):
    """A linear model whose loss turns to ``bad`` on its ``k``-th training batch (1-based)."""

    def __init__(self, k: int, bad: float = float("nan")):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.k, self.bad, self.calls = k, bad, 0

    def forward(self, batch):
        return self.layer(batch[0])

    def loss(self, outputs, batch):
        self.calls += 1
        loss = torch.nn.functional.mse_loss(outputs, batch[1])
        return loss * self.bad if self.calls == self.k else loss

    def get_metrics(self, is_train=False):
        return {}


def run(model, callbacks):
    x = torch.randn(40, 2)
    data = DataLoader(TensorDataset(x, x[:, :1]), batch_size=4)
    trainer = Trainer(model=model, train_dataloader=data, max_duration="8ba", callbacks=callbacks,
                      optimizers=torch.optim.SGD(model.parameters(), lr=0.01), device="cpu",
                      progress_bar=False, log_to_console=False)
    trainer.fit()
    return trainer


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
