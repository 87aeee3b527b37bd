"""MFU against both peaks (issue 25 item 7): the data sheet's, as Composer and the published anchors
report it, and the one measured on the device in the same run, as the bench measures it; each named."""

import time

import pytest
import torch
from composer import Trainer
from composer.loggers import InMemoryLogger
from composer.models import ComposerModel
from torch.utils.data import DataLoader, TensorDataset

from diffusion.train import components
from diffusion.train.callbacks.speed_monitor import MEASURED_MFU_KEY, SpeedMonitor

FLOPS_PER_BATCH = 4e9


class CountedLinear(ComposerModel):
    """A model that says each batch costs FLOPS_PER_BATCH (and takes a fixed time)."""

    def __init__(self):
        super().__init__()
        self.layer = torch.nn.Linear(2, 1)
        self.starts = []  # each training forward's start, to compare the logged rate with this run's own clock

    def forward(self, batch):
        if self.training:
            self.starts.append(time.perf_counter())
        time.sleep(0.02)
        return self.layer(batch[0])

    def loss(self, outputs, batch):
        return torch.nn.functional.mse_loss(outputs, batch[1])

    def get_metrics(self, is_train=False):
        return {}

    def flops_per_batch(self, batch):
        return FLOPS_PER_BATCH


def test_the_run_logs_mfu_against_the_spec_and_the_measured_peak_named_apart():
    assert components.component_class("callbacks", "speed_monitor") is SpeedMonitor  # what speed_monitor: names
    x = torch.randn(64, 2)
    model, memory = CountedLinear(), InMemoryLogger()
    monitor = SpeedMonitor(window_size=3, gpu_flops_available=1e12, measure_peak=256)
    Trainer(model=model, train_dataloader=DataLoader(TensorDataset(x, x[:, :1]), batch_size=8),
            max_duration="8ba", callbacks=[monitor], loggers=[memory], device="cpu", progress_bar=False,
            optimizers=torch.optim.SGD(model.parameters(), lr=0.01)).fit()
    flops_per_sec = [v for _, v in memory.data["throughput/device/flops_per_sec"]]
    spec = [v for _, v in memory.data["throughput/device/mfu"]]
    measured = [v for _, v in memory.data[MEASURED_MFU_KEY]]
    assert len(flops_per_sec) == len(spec) == len(measured) >= 4  # each batch once the window is full
    peak = memory.data["throughput/device/peak_tflops_measured"][0][1] * 1e12
    assert peak == pytest.approx(monitor.measured_flops) and peak > 0
    assert memory.data["throughput/device/peak_tflops_spec"][0][1] == pytest.approx(1.0)
    for rate, by_spec, by_measured in zip(flops_per_sec, spec, measured):
        assert by_spec == pytest.approx(rate / 1e12)
        assert by_measured == pytest.approx(rate / peak)
    assert flops_per_sec[-1] < 1.05 * FLOPS_PER_BATCH / 0.02  # never faster than the sleep allows
    # The last window's 3 batches, timed by the model itself (forward start to forward start): the logged rate
    # follows the run's real pace, whatever the machine's load, rather than an assumed 20 ms a batch.
    assert len(model.starts) == 8
    own_rate = 3 * FLOPS_PER_BATCH / (model.starts[-1] - model.starts[-4])
    assert 0.5 * own_rate < flops_per_sec[-1] < 2 * own_rate


def test_without_a_measured_peak_it_logs_what_composer_logs():
    x = torch.randn(32, 2)
    model, memory = CountedLinear(), InMemoryLogger()
    Trainer(model=model, train_dataloader=DataLoader(TensorDataset(x, x[:, :1]), batch_size=8),
            max_duration="4ba", callbacks=[SpeedMonitor(window_size=2, gpu_flops_available=1e12)], loggers=[memory],
            device="cpu", progress_bar=False, optimizers=torch.optim.SGD(model.parameters(), lr=0.01)).fit()
    assert "throughput/device/mfu" in memory.data and MEASURED_MFU_KEY not in memory.data  # CPU: not measured
