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
