"""SpeedMonitor: Composer's throughput and MFU, with MFU against both peaks, named.

MFU is published against a device's data-sheet dense peak (MosaicML's SD2 anchors against the A100's
312 TFLOP/s, Composer's SpeedMonitor against the H100's 989); a benchmark may divide by the peak a large
matmul reaches on the machine instead (≈800 on our H100s), which reads ~25% higher. This callback is
Composer's SpeedMonitor (every metric it logs, ``throughput/device/mfu`` against the data sheet or
``gpu_flops_available``) plus the other one, so a run's logs compare with the bench's tables and the
published anchors alike:

    throughput/device/mfu_measured_peak   device FLOP/s / the peak measured on this device at fit start
    throughput/device/peak_tflops_spec    the data-sheet peak MFU divides by (once)
    throughput/device/peak_tflops_measured  the measured peak (once)

The peak is measured with an ``measure_peak``³ matmul in the run's precision (bf16 under amp_bf16) at fit
start, on a GPU by default (8192); on the CPU only when asked.
"""

from __future__ import annotations

import torch
from composer.callbacks import SpeedMonitor as ComposerSpeedMonitor
from composer.core import State
from composer.loggers import Logger
from composer.utils import dist

from diffusion.models.flops import measure_peak_tflops

MEASURED_MFU_KEY = "throughput/device/mfu_measured_peak"


class SpeedMonitor(ComposerSpeedMonitor):
    """Composer's SpeedMonitor, also logging MFU against the measured peak (see the module docstring).

    Args:
        window_size, gpu_flops_available, time_unit: Composer's (``gpu_flops_available`` overrides the
            data-sheet peak, in FLOP/s).
        measure_peak: matmul size for the measured peak; None: 8192 on a GPU, none on the CPU; 0: none.
    """

    def __init__(self, window_size: int = 100, gpu_flops_available: float | None = None, time_unit: str = "hours",
                 measure_peak: int | None = None):
        super().__init__(window_size=window_size, gpu_flops_available=gpu_flops_available, time_unit=time_unit)
        self.measure_peak = measure_peak
        self.measured_flops: float | None = None

    def fit_start(self, state: State, logger: Logger) -> None:
        size = self.measure_peak
        if size is None:
            size = 8192 if state.device.name == "gpu" else 0
        if size:
            dtype = {"amp_bf16": torch.bfloat16, "amp_fp16": torch.float16}.get(state.precision.value, torch.float32)
            self.measured_flops = measure_peak_tflops(state.device._device, size, dtype=dtype) * 1e12
        peaks = {}
        if self.gpu_flops_available:
            peaks["throughput/device/peak_tflops_spec"] = self.gpu_flops_available / 1e12
        if self.measured_flops:
            peaks["throughput/device/peak_tflops_measured"] = self.measured_flops / 1e12
        if peaks:
            logger.log_metrics(peaks)

    def batch_end(self, state: State, logger: Logger) -> None:
        super().batch_end(state, logger)
        if self.measured_flops and len(self.history_flops) == self.history_flops.maxlen:
            # the same window Composer's MFU is computed over
            flops = sum(self.history_flops) - self.history_flops[0]
            seconds = self.history_wct[-1] - self.history_wct[0]
            device_flops_per_sec = flops / seconds / dist.get_world_size()
            logger.log_metrics({MEASURED_MFU_KEY: device_flops_per_sec / self.measured_flops})
