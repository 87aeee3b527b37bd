"""Deferred patch masking (Sony's MicroDiT, 2025): a masked training step shows the backbone only a random
subset of each sample's latent patches, after a light patch mixer has seen them all, and takes the loss
on the kept patches alone. :class:`PatchMask` is the per-sample draw (made in the loader from the
sample's own generator, like every other random number); :func:`patch_mask` the loss's pixel mask.
The routing itself is the denoiser adapter's (``diffusion.models.denoisers.sd3_transformer``).
"""

from __future__ import annotations

import dataclasses
import math

import torch


@dataclasses.dataclass(frozen=True)
class PatchMask:
    """Deferred patch masking's per-sample draw (MicroDiT): of the latent's N patches of ``patch_size``²,
    keep ⌈(1 − ratio)·N⌉, chosen uniformly from the sample's own generator, in ascending order."""

    ratio: float
    patch_size: int

    def patches(self, latent_shape) -> int:
        _, height, width = latent_shape
        return (height // self.patch_size) * (width // self.patch_size)

    def kept(self, latent_shape) -> int:
        return math.ceil((1.0 - self.ratio) * self.patches(latent_shape) - 1e-9)

    def __call__(self, latent_shape, generator: torch.Generator) -> torch.Tensor:
        order = torch.randperm(self.patches(latent_shape), generator=generator)
        return order[:self.kept(latent_shape)].sort().values


def patch_mask(keep: torch.Tensor, shape, patch_size: int) -> torch.Tensor:
    """(B, 1, H, W) float: 1 on the latent pixels of the kept patches, 0 elsewhere."""
    height, width = shape[-2] // patch_size, shape[-1] // patch_size
    mask = torch.zeros(keep.shape[0], height * width, device=keep.device)
    mask.scatter_(1, keep.to(torch.long), 1.0)
    mask = mask.view(-1, 1, height, 1, width, 1).expand(-1, -1, -1, patch_size, -1, patch_size)
    return mask.reshape(keep.shape[0], 1, height * patch_size, width * patch_size)
