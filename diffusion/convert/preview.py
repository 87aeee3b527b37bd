"""``--visualize N``: N input crops beside the VAE decodings of their stored latents, as one PNG.

The before/after view that shows at a glance whether the stored moments are right: a wrong
normalization, channel order or crop shows up as a colour shift, a swap or a misaligned picture.
"""

from __future__ import annotations

import os

import numpy as np
from PIL import Image

from diffusion import schema
from diffusion.convert.readers import RawColumns, iter_rows
from diffusion.convert.transforms import ImageCaptionTransform, ImageChecks

VISUALIZE_PNG = "visualize.png"


def input_crops(cfg, keys) -> dict[str, dict[int, np.ndarray]]:
    """{key: {resolution: uint8 crop}} for the input rows with ``keys``, read again from ``cfg.input``.

    The crops are made exactly as the conversion made them (same resolutions, so the same decode scale).
    """
    wanted = set(keys)
    checks = ImageChecks(cfg.min_size, cfg.max_aspect, cfg.max_pixels)
    transform = ImageCaptionTransform(cfg.model, cfg.resolutions, checks)
    crops = {}
    columns = RawColumns(cfg.image_column, cfg.caption_column, cfg.key_column)
    # files the conversion skipped hold none of its samples: skip them here too
    for row in iter_rows(cfg.input, columns, on_failed_file=lambda name, error: None):
        if row[schema.RAW_KEY] in wanted:
            images, _, _ = transform.transform_one(row[schema.RAW_IMAGE], row[schema.RAW_CAPTION])
            crops[row[schema.RAW_KEY]] = images
            if len(crops) == len(wanted):
                break
    return crops


def write_visualization(out: str, cfg, n: int, path: str | None = None) -> str:
    """Write ``out/visualize.png``: one row per sample, input crop left, decoded latent mean right."""
    from streaming import StreamingDataset

    from diffusion.convert.encoders import VaeEncoder
    resolution = max(cfg.resolutions)
    dataset = StreamingDataset(local=out, shuffle=False, batch_size=1)
    samples = [dataset[i] for i in range(min(n, len(dataset)))]
    if not samples:
        raise ValueError(f"{out} holds no samples to visualize")
    vae = VaeEncoder(cfg.model, device="cpu")
    moments = np.stack([s[vae.space.column(resolution)] for s in samples]).astype(np.float32)
    decoded = vae.decode_mean(moments)
    crops = input_crops(cfg, [s[schema.KEY] for s in samples])
    rows = [np.concatenate([crops[s[schema.KEY]][resolution], d], axis=1) for s, d in zip(samples, decoded)]
    path = path or os.path.join(out, VISUALIZE_PNG)
    Image.fromarray(np.concatenate(rows, axis=0)).save(path)
    return path
