"""Training FLOPs per image of a denoiser, counted by torch (``FlopCounterMode`` on the meta device).

Named recipes for the cost model and the benches: ``sd2-unet`` (SD2-base's UNet, 4-channel latents, 77
CLIP tokens of 1024) and ``sd3-medium`` (SD3-medium's MMDiT as published: 24 joint blocks of width 1536,
16-channel latents at /8, 77 CLIP + 256 T5 tokens of 4096). Training = 3 × forward (the backward
costs twice the forward), as SpeedMonitor's MFU counts it.
"""

from __future__ import annotations

import functools

# SD3-medium's transformer config (stabilityai/stable-diffusion-3-medium-diffusers, transformer/config.json)
SD3_MEDIUM = dict(sample_size=128, patch_size=2, in_channels=16, out_channels=16, num_layers=24,
                  attention_head_dim=64, num_attention_heads=24, joint_attention_dim=4096,
                  caption_projection_dim=1536, pooled_projection_dim=2048, pos_embed_max_size=192)
SD3_TEXT_TOKENS = 77 + 256  # CLIP tokens and T5 tokens, concatenated along the sequence


def _recipes() -> dict:
    from diffusion.kit.build import SD2_UNET
    return {
        "sd2-unet": ("UNet2DConditionModel", SD2_UNET, 1024, 77),
        # pooled from the text states here (the MMDiT adapter's conditioning), so 4096 wide where SD3 pools
        # two CLIPs' 2048: the one linear layer that reads it differs by < 0.01% of the FLOPs
        "sd3-medium": ("SD3Transformer2DModel", dict(SD3_MEDIUM, pooled_projection_dim=4096),
                       SD3_MEDIUM["joint_attention_dim"], SD3_TEXT_TOKENS),
    }


RECIPES = ("sd2-unet", "sd3-medium")


@functools.lru_cache(maxsize=32)
def recipe_gflop_per_image(recipe: str, resolution: int, downsample: int = 8) -> float:
    """Training GFLOP per image (forward + backward) of ``recipe`` at ``resolution`` pixels."""
    from diffusion.models import denoisers
    recipes = _recipes()
    if recipe not in recipes:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {', '.join(recipes)}")
    class_name, config, text_dim, text_length = recipes[recipe]
    forward = denoisers.adapter(class_name).forward_flops(dict(config), resolution // downsample, text_dim, text_length)
    return 3 * forward / 1e9
