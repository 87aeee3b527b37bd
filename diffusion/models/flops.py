"""Training FLOPs per image of a denoiser, counted by torch (``FlopCounterMode`` on the meta device).

Training = 3 × forward (the backward costs twice the forward), as SpeedMonitor's MFU counts it. The
named published denoisers (SD2's UNet, SD3-medium's MMDiT) are :mod:`diffusion.cost`'s.
"""

from __future__ import annotations


def training_gflop_per_image(class_name: str, config: dict, resolution: int, text_dim: int, text_length: int,
                             downsample: int = 8) -> float:
    """Training GFLOP per image (forward + backward) of the diffusers ``class_name`` built from ``config``,
    at ``resolution`` pixels with ``text_length`` text tokens of ``text_dim``."""
    from diffusion.models import denoisers
    forward = denoisers.adapter(class_name).forward_flops(dict(config), resolution // downsample, text_dim,
                                                          text_length)
    return 3 * forward / 1e9


# Dense (not sparse) peak FLOP/s per GPU from the vendors' data sheets, in bf16/fp16, the numbers MFU
# is published against (MosaicML's SD2 anchors against the A100's 312; Composer's SpeedMonitor uses
# the same table). Matched against the device name, first match wins.
SPEC_PEAK_TFLOPS = (("H100 PCIe", 756.0), ("H100", 989.4), ("H200", 989.4), ("A100", 312.0), ("L40S", 362.0),
                    ("A10G", 70.0), ("L4", 121.0))


def spec_peak_tflops(device_name: str) -> float | None:
    """The data-sheet dense bf16 peak of ``device_name`` (``torch.cuda.get_device_name``), or None."""
    return next((v for k, v in SPEC_PEAK_TFLOPS if k in device_name), None)


def measure_peak_tflops(device, n: int = 8192, iters: int = 20, dtype=None) -> float:
    """Dense matmul TFLOP/s measured on ``device``: an n×n×n matmul (2n³ FLOPs) in ``dtype`` (bf16 on a
    GPU, fp32 on the CPU by default), best of ``iters`` after a warm-up: the peak this machine reaches,
    the MFU denominator from the same run."""
    import time

    import torch
    device = torch.device(device)
    dtype = dtype or (torch.bfloat16 if device.type == "cuda" else torch.float32)
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    for _ in range(3):
        a @ b
    sync()
    best = float("inf")
    for _ in range(iters):
        start = time.perf_counter()
        a @ b
        sync()
        best = min(best, time.perf_counter() - start)
    return 2 * n ** 3 / best / 1e12
