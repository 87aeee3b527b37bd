"""Helpers shared by the sampling, generate and export tests (plain functions; fixtures live in conftest)."""

import os

import numpy as np

PROMPTS = ["a red circle above a blue square", "a green triangle"]


def pixels(image) -> np.ndarray:
    return np.asarray(image, dtype=np.int16)


def kit_unet(kit):
    from diffusers import UNet2DConditionModel
    return UNet2DConditionModel.from_pretrained(os.path.join(kit, "unet")).eval()
