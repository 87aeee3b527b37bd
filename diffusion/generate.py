"""Generate a prompt grid from a trained model.

    python -m diffusion.generate --checkpoint CKPT --prompt "a red circle" [--prompt ...] --out grid.png

``CKPT`` is a Composer checkpoint written by training (EMA weights unless ``--no-ema``) or a diffusers
pipeline directory (``python -m diffusion.export`` output, or the model kit). The VAE, text encoder and
tokenizer come from the training run's model reference unless ``--model`` says otherwise.
"""

from __future__ import annotations

import argparse
import os

import torch

from diffusion import grid
from diffusion.models import sampling


def generate_images(checkpoint: str, prompts: list[str], *, model_ref: str | None = None, ema: bool = True,
                    scheduler: str = "ddim", device=None, **sample_kwargs) -> list:
    """Sample ``prompts`` from ``checkpoint``: PIL images, each prompt ``images_per_prompt`` times in a row.

    ``sample_kwargs`` go to :class:`~diffusion.models.sampling.Sampler` (steps, guidance_scale,
    negative_prompt, seed, size, images_per_prompt, batch_size); size defaults to the training resolution.
    """
    trained = sampling.load_trained(checkpoint, model_ref=model_ref, ema=ema)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    trained.unet.to(device)
    if sample_kwargs.get("size") is None and trained.resolution:
        sample_kwargs["size"] = trained.resolution
    sampler = sampling.Sampler(trained.model_ref, scheduler=scheduler, scaling_factor=trained.scaling_factor,
                               prediction_type=trained.prediction_type)
    return sampler(trained.unet, prompts, progress=True, **sample_kwargs)


def generate_grid(checkpoint: str, prompts: list[str], out: str, *, images_per_prompt: int = 1,
                  **kwargs) -> str:
    """Sample ``prompts`` from ``checkpoint`` and write a labelled PNG grid to ``out``.

    One row per prompt, one column per image of that prompt (a single prompt fills a square grid).
    """
    images = generate_images(checkpoint, prompts, images_per_prompt=images_per_prompt, **kwargs)
    labels = [p for p in prompts for _ in range(images_per_prompt)]
    picture = grid.make_grid(images, labels, columns=images_per_prompt if len(prompts) > 1 else None)
    return grid.save_grid(picture, out)


def read_prompts(path: str) -> list[str]:
    """Prompts from a text file, one per line; blank lines and lines starting with # are skipped."""
    with open(path) as f:
        prompts = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    if not prompts:
        raise ValueError(f"{path}: no prompts (one per line expected)")
    return prompts


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """The checkpoint and sampler options, shared with ``diffusion.evaluate``'s generate mode."""
    parser.add_argument("--checkpoint", help="Composer checkpoint file or diffusers pipeline directory")
    parser.add_argument("--model", default=None,
                        help="model reference for VAE/text encoder/tokenizer (default: the checkpoint's)")
    parser.add_argument("--no-ema", dest="ema", action="store_false", help="use the raw, not the EMA, weights")
    parser.add_argument("--scheduler", choices=sampling.SCHEDULERS, default="ddim")
    parser.add_argument("--steps", type=int, default=25)
    parser.add_argument("--guidance-scale", type=float, default=7.5)
    parser.add_argument("--negative-prompt", default=None)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--size", type=int, default=None, help="pixels per side (default: the model's)")
    parser.add_argument("--images-per-prompt", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--device", default=None, help="cuda when available, else cpu")


def sample_kwargs(args: argparse.Namespace) -> dict:
    return dict(model_ref=args.model, ema=args.ema, scheduler=args.scheduler, steps=args.steps,
                guidance_scale=args.guidance_scale, negative_prompt=args.negative_prompt, seed=args.seed,
                size=args.size, images_per_prompt=args.images_per_prompt, batch_size=args.batch_size,
                device=args.device)


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0],
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sampling_args(parser)
    parser.add_argument("--prompt", action="append", default=[], help="repeat for several prompts")
    parser.add_argument("--prompts-file", default=None, help="text file, one prompt per line")
    parser.add_argument("--out", default="grid.png")
    args = parser.parse_args(argv)
    if not args.checkpoint:
        parser.error("--checkpoint is required")
    prompts = args.prompt + (read_prompts(args.prompts_file) if args.prompts_file else [])
    if not prompts:
        parser.error("give at least one --prompt (or --prompts-file)")
    path = generate_grid(args.checkpoint, prompts, args.out, **sample_kwargs(args))
    print(f"wrote {os.path.abspath(path)} ({len(prompts)} prompts x {args.images_per_prompt})")


if __name__ == "__main__":
    from diffusion import cli
    cli.run(main, "generate")
