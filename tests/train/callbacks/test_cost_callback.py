"""The CostProjection callback logs a projection of the configured schedule at the measured rate."""

import time

import pytest
import torch
from composer import Trainer
from composer.loggers import InMemoryLogger
from composer.models import ComposerModel
from torch.utils.data import DataLoader, TensorDataset

from diffusion.train.callbacks.cost import CostProjection


class SlowLinear(ComposerModel):
    """Each forward sleeps a fixed time, so the throughput is known (about batch_size / delay)."""

    def __init__(self, delay: float):
        super().__init__()
        self.layer, self.delay = torch.nn.Linear(2, 1), delay

    def forward(self, batch):
        time.sleep(self.delay)
        return self.layer(batch[0])

    def loss(self, outputs, batch):
        return torch.nn.functional.mse_loss(outputs, batch[1])

    def get_metrics(self, is_train=False):
        return {}


def test_projects_the_run_schedule_at_measured_throughput():
    x = torch.randn(64, 2)
    model, memory = SlowLinear(delay=0.05), InMemoryLogger()
    callback = CostProjection(price_per_gpu_hour=3.0, interval="4ba", gpus=16,
                              extra_phases=[{"resolution": 512, "samples": 1000, "samples_per_sec_per_gpu": 10.0}])
    Trainer(model=model, train_dataloader=DataLoader(TensorDataset(x, x[:, :1]), batch_size=8),
            max_duration="10ba", callbacks=[callback], loggers=[memory], device="cpu", progress_bar=False,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.01)).fit()
    projection = callback.last
    phase256, phase512 = projection.phases
    assert phase256.samples == 80  # max_duration 10 batches x global batch 8
    assert phase256.source == "measured"
    assert 8 / 0.05 * 0.5 < phase256.samples_per_sec_per_gpu < 8 / 0.05 * 1.05  # ~160 img/s, sleep-bound
    assert projection.gpus == 16 and projection.price_per_gpu_hour == 3.0
    expected_hours = 80 / phase256.samples_per_sec_per_gpu / 3600 + 1000 / 10.0 / 3600
    assert projection.gpu_hours == pytest.approx(expected_hours, rel=1e-6)
    assert projection.dollars == pytest.approx(3.0 * expected_hours, rel=1e-6)
    logged = memory.data["cost/dollars"]
    assert len(logged) >= 2  # periodically and at fit end
    assert logged[-1][1] == pytest.approx(projection.dollars)


def test_bad_extra_phase_is_named():
    with pytest.raises(ValueError, match="samples_per_sec_per_gpu"):
        CostProjection(extra_phases=[{"resolution": 512, "samples": 10}])
