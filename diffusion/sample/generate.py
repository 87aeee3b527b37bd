"""Generate a prompt grid from a trained model.

    python -m diffusion.generate --checkpoint CKPT --prompt "a red circle" [--prompt ...] --out grid.png

Any model the trainer writes samples: a UNet or an MMDiT, trained with ε, v or flow matching (the
checkpoint's model description says which, and picks the pipeline and scheduler).
``CKPT`` is a Composer checkpoint written by training (EMA weights unless ``--no-ema``) or a diffusers
pipeline directory (``python -m diffusion.export`` output, or the model kit). The VAE, text encoder and
tokenizer come from the training run's model reference unless ``--model`` says otherwise; the noise
schedule is the one training used, as the checkpoint records it. A model trained with zero terminal
SNR is sampled with "trailing" timestep spacing (the first step at pure noise) and guidance rescaled
by ``--guidance-rescale`` (default 0.7 for such models, 0 otherwise).
"""

from __future__ import annotations

import argparse
import errno
import math
import os
import re
import sys

import torch

from diffusion.sample import grid
from diffusion.errors import InputError, UserError
from diffusion.models import sampling
from diffusion import cli


def generate_images(checkpoint: str, prompts: list[str], *, model_ref: str | None = None, ema: bool = True,
                    scheduler: str | None = None, device=None, protocol: dict | None = None, **sample_kwargs) -> list:
    """Sample ``prompts`` from ``checkpoint``: PIL images, each prompt ``images_per_prompt`` times in a row.

    ``sample_kwargs`` go to :class:`~diffusion.models.sampling.Sampler` (steps, guidance_scale,
    guidance_rescale, negative_prompt, seed, size, images_per_prompt, batch_size); size defaults to the
    training resolution, the noise schedule is the checkpoint's. A ``protocol`` dict is given the
    sampler's class, timestep spacing and image size.
    """
    trained = sampling.load_trained(checkpoint, model_ref=model_ref, ema=ema)
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    trained.denoiser.to(device)
    if sample_kwargs.get("size") is None and trained.resolution:
        sample_kwargs["size"] = trained.resolution
    sampler = sampling.Sampler(trained.description, scheduler=scheduler)
    if ema and trained.ema_used is False:
        print(f"note: {checkpoint} holds no EMA weights: sampling its raw weights", file=sys.stderr, flush=True)
    images = sampler(trained.denoiser, prompts, progress=True, **sample_kwargs)
    if protocol is not None:  # what was sampled: the EMA only where the checkpoint had one, the rescale applied
        protocol.update(sampler=type(sampler.scheduler).__name__, size=sampler.size,
                        timestep_spacing=sampler.scheduler.config.get("timestep_spacing"), ema=trained.ema_used,
                        guidance_rescale=sampler.guidance_rescale)
    return images


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
    try:
        with open(path, encoding="utf-8") as f:
            prompts = [line.strip() for line in f if line.strip() and not line.lstrip().startswith("#")]
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not a text file of prompts (byte {e.start} is not UTF-8 text)") from None
    if not prompts:
        raise InputError(f"{path}: no prompts (one per line expected)")
    return prompts


def add_sampling_args(parser: argparse.ArgumentParser) -> None:
    """The checkpoint and sampler options, shared with ``diffusion.evaluate``'s generate mode."""
    parser.add_argument("--checkpoint", metavar="CKPT",
                        help="Composer checkpoint file written by training (e.g. CKPT_FOLDER/latest-rank0.pt) "
                             "or a diffusers pipeline directory (diffusion.export output, a model kit)")
    parser.add_argument("--model", default=None, metavar="REF",
                        help="model reference (local diffusers directory or hub id) for the VAE, text encoder, "
                             "tokenizer and scheduler (default: the one the checkpoint was trained with)")
    parser.add_argument("--no-ema", dest="ema", action="store_false",
                        help="sample with the raw weights, not the EMA weights (Composer checkpoints)")
    parser.add_argument("--scheduler", choices=sampling.SCHEDULERS, default=None,
                        help="sampler: ddim, euler or dpm++ for epsilon/v models, euler or heun (flow matching) "
                             "for flow models; Flux's pipeline takes euler only (default: ddim, or euler for flow "
                             "models)")
    parser.add_argument("--steps", type=cli.positive_int, default=25, help="denoising steps (default: %(default)s)")
    parser.add_argument("--guidance-scale", type=finite_number, default=7.5,
                        help="classifier-free guidance scale; 1 turns guidance off (default: %(default)s)")
    parser.add_argument("--guidance-rescale", type=unit_interval, default=None, metavar="PHI",
                        help="rescale the guided prediction toward the conditional one's spread, 0 to 1 "
                             "(Lin et al. 2023, against over-exposure); 0 turns it off (default: "
                             f"{sampling.ZTSNR_GUIDANCE_RESCALE} for a model trained with zero terminal SNR, "
                             "else 0)")
    parser.add_argument("--negative-prompt", default=None, help="what to steer away from (default: none)")
    parser.add_argument("--seed", type=int, default=0, help="noise seed: same seed, same images (default: 0)")
    parser.add_argument("--size", type=cli.positive_int, default=None,
                        help="pixels per side (default: the training resolution)")
    parser.add_argument("--width", type=cli.positive_int, default=None,
                        help="image width in pixels, with --height: an aspect-ratio bucket's (default: --size)")
    parser.add_argument("--height", type=cli.positive_int, default=None, help="image height in pixels, with --width")
    parser.add_argument("--images-per-prompt", type=cli.positive_int, default=1,
                        help="images drawn for each prompt (default: %(default)s)")
    parser.add_argument("--batch-size", type=cli.positive_int, default=8,
                        help="images denoised together (default: %(default)s)")
    parser.add_argument("--device", default=None, help="torch device, e.g. cpu or cuda:0 (default: cuda when "
                                                       "available, else cpu)")


def finite_number(text: str) -> float:
    """An argparse type: a number, not nan or inf (which draw a blank image without a word)."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"{text} is not a finite number")
    return value


def unit_interval(text: str) -> float:
    """An argparse type: a number from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{text} is not between 0 and 1")
    return value


def check_sampling_args(args: argparse.Namespace) -> None:
    """The cheap checks of :func:`add_sampling_args`' inputs, before any model loads: the checkpoint is
    there and is one, the model reference resolves, the device exists."""
    from diffusion.models import checkpoint, loading
    checkpoint.check_checkpoint(args.checkpoint)
    if args.model:
        loading.resolve_model(args.model, components=("vae", "text_encoder", "tokenizer", "scheduler"))
    if args.device:
        try:
            device = torch.device(args.device)
        except RuntimeError as e:
            raise UserError(f"--device {args.device!r}: {e}") from None
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UserError(f"--device {args.device}: no CUDA device here; use --device cpu")


def sample_kwargs(args: argparse.Namespace) -> dict:
    width, height = getattr(args, "width", None), getattr(args, "height", None)
    if (width is None) != (height is None):
        raise UserError("give --width and --height together (or --size for a square)")
    size = (height, width) if width else args.size
    return dict(model_ref=args.model, ema=args.ema, scheduler=args.scheduler, steps=args.steps,
                guidance_scale=args.guidance_scale, guidance_rescale=args.guidance_rescale,
                negative_prompt=args.negative_prompt, seed=args.seed,
                size=size, images_per_prompt=args.images_per_prompt, batch_size=args.batch_size,
                device=args.device)


DESCRIPTION = """Sample a prompt grid from a trained model with classifier-free guidance (DDIM, Euler or DPM-Solver++;
flow-matching Euler or Heun for flow models).

Input: a checkpoint (a Composer checkpoint written by run.py or diffusion.online, EMA weights unless
--no-ema, or a diffusers pipeline directory) and prompts (--prompt, --prompts-file). The VAE, text
encoder and tokenizer come from the model reference the checkpoint was trained with, unless --model;
the noise schedule is the one training used (a model trained with zero terminal SNR samples with
"trailing" timestep spacing and --guidance-rescale 0.7 by default).
Output: one PNG (--out): a row per prompt, a column per image, each labelled with its prompt; the
prompts are also stored in the PNG, so diffusion.evaluate can score the grid."""
EXAMPLES = """examples:
  python -m diffusion.generate --checkpoint out/demo/checkpoints/latest-rank0.pt \\
      --prompt "a red circle" --prompt "a blue square" --images-per-prompt 4 --out grid.png
  python -m diffusion.generate --checkpoint exported/ --prompts-file prompts.txt --scheduler dpm++ \\
      --steps 20 --guidance-scale 5 --size 512 --out grid.png"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m diffusion.generate", description=DESCRIPTION,
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_sampling_args(parser)
    parser.add_argument("--prompt", action="append", default=[], help="a prompt; repeat for several")
    parser.add_argument("--prompts-file", default=None, metavar="FILE",
                        help="text file of prompts, one a line (# starts a comment line)")
    parser.add_argument("--out", default="grid.png", metavar="PNG", help="the grid's path (default: %(default)s)")
    return parser


def main(argv=None) -> None:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not args.checkpoint:
        parser.error("--checkpoint is required")
    prompts = args.prompt + (read_prompts(args.prompts_file) if args.prompts_file else [])
    if not prompts:
        parser.error("give at least one --prompt (or --prompts-file)")
    check_output_file(args.out, ".png", "--out")
    check_sampling_args(args)
    kwargs = sample_kwargs(args)
    try:
        path = generate_grid(args.checkpoint, prompts, args.out, **kwargs)
    except (RuntimeError, MemoryError) as e:
        refused = out_of_memory(e, kwargs["size"], args.batch_size)
        if refused is None:
            raise
        raise refused from None
    print(f"wrote {os.path.abspath(path)} ({len(prompts)} prompts x {args.images_per_prompt})")


def out_of_memory(error: BaseException, size, batch_size: int) -> UserError | None:
    """The one-line refusal for an allocation torch could not make while sampling (on the CPU, or a GPU's
    ``OutOfMemoryError``, a RuntimeError too), naming the image size and batch asked for; None for any other
    error. A size far past what the model was trained at asks for memory no machine has."""
    text = str(error)
    if not (isinstance(error, MemoryError) or "can't allocate memory" in text or "not enough memory" in text
            or "out of memory" in text.lower()):
        return None
    height, width = size if isinstance(size, (tuple, list)) else (size, size)
    asked = re.search(r"tried to allocate (\d+) bytes", text)
    how_much = f" (an allocation of {int(asked.group(1)) / 2 ** 30:.1f} GiB failed)" if asked else ""
    drawn = f"{width}x{height} images" if height else "images"
    return UserError(f"not enough memory to draw {drawn} {batch_size} at a time{how_much}: lower "
                     f"--width/--height (or --size) or --batch-size")


def check_output_file(path: str, suffix: str | None, flag: str) -> None:
    """Before the work: ``path`` can be written as a file (not a directory, its folder exists or can be
    made) and, if ``suffix`` is given, ends with it."""
    if suffix and not path.lower().endswith(suffix):
        raise UserError(f"{flag} {path}: the output is {suffix.lstrip('.').upper()}; give a path ending in {suffix}")
    if os.path.isdir(path):
        raise IsADirectoryError(errno.EISDIR, f"{flag} is a directory; give a file path", path)
    parent = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(parent):  # save_grid makes missing folders: the first existing one must be one
        parent = os.path.dirname(parent)
    if not os.path.isdir(parent):
        raise NotADirectoryError(errno.ENOTDIR, f"cannot make the folder for {flag}: a file is in the way", parent)


if __name__ == "__main__":
    cli.run(main, "generate")
