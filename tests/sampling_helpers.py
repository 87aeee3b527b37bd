"""Helpers shared by the sampling, generate and export tests (plain functions; fixtures live in conftest)."""

import os

import numpy as np

PROMPTS = ["a red circle above a blue square", "a green triangle"]


def pixels(image) -> np.ndarray:
    return np.asarray(image, dtype=np.int16)


def kit_unet(kit):
    from diffusers import UNet2DConditionModel
    return UNet2DConditionModel.from_pretrained(os.path.join(kit, "unet")).eval()


def train_tiny_checkpoint(kit: str, out: str, *overrides: str, batches: int = 3, latent_space=None,
                          text_encoder_type: str | None = None, resolution: int = 64) -> str:
    """Train the tiny model ``batches`` batches (batch 4, ``resolution`` px, EMA on) on synthetic latents of ``kit``
    (in ``latent_space``, default SD's) with the product's trainer and return the path of its final
    Composer checkpoint."""
    import gc

    from diffusion.train.config import load_config
    from diffusion.train.trainer import build_trainer
    from train_fixtures import tiny_overrides, write_latent_mds
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    mds = write_latent_mds(os.path.join(out, "mds"), kit=kit, n=16, latent_space=latent_space,
                           text_encoder_type=text_encoder_type, resolution=resolution)
    folder = os.path.join(out, "checkpoints")
    cfg = load_config(os.path.join(root, "yamls", "tiny-cpu.yaml"),
                      tiny_overrides(kit, mds, batches=batches, batch_size=4, save_folder=folder,
                                     extra=(f"trainer.save_interval={batches}ba", f"model.resolution={resolution}",
                                            *overrides)))
    trainer = build_trainer(cfg)
    trainer.fit()
    trainer.close()
    del trainer
    gc.collect()  # releases the StreamingDataset's shared memory
    return os.path.join(folder, "latest-rank0.pt")


def run_printed_call(said: str, seed: int):
    """Run what an export printed, exactly as written: its ``load with diffusers.<Pipeline>.from_pretrained(...)``
    and then its indented lines (an import and ``image = pipe(...)``), the pipeline's noise drawn from torch's
    global generator seeded with ``seed`` (the printed call passes none; it draws what ``seed`` draws in our
    sampler). Returns the ``image`` they make."""
    import diffusers
    import torch
    load = said.split("load with ", 1)[1].splitlines()[0]
    namespace = {"pipe": eval(load, {"diffusers": diffusers})}
    code = "\n".join(line[4:] for line in said.splitlines() if line.startswith("    "))
    assert "image = pipe(" in code, said
    torch.manual_seed(seed)
    exec(code, namespace)
    return namespace["image"]
