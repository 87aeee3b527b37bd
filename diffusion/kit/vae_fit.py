"""Fit the tiny kit's VAE on procedural sample scenes, so its decoded images can be judged by eye.

A random VAE decodes everything to noise, which would make every image the tiny pipeline produces
meaningless. A few minutes of CPU training on the scenes of :mod:`diffusion.kit.sample` (flat shapes
on soft backgrounds) reaches a reconstruction PSNR above 22 dB at 64 px.

Training draws ``mean + sigma * eps`` from the posterior, as the training loop does from stored
moments, and a small KL term keeps the log-variance meaningful instead of collapsing to the clamp.

The fit is deterministic (fixed seeds), so it is done once and its result ships with the package in
``diffusion/kit/assets/tiny-vae`` (diffusers layout: ``config.json`` and float32
``diffusion_pytorch_model.safetensors``, plus ``fit.json``: the fit's steps, loss and time, the
held-out PSNR and the latent scaling factor); the ``tiny`` kit copies it. To regenerate it
(about 2.6 minutes on 2 CPU cores)::

    python -m diffusion.kit.vae_fit --out diffusion/kit/assets/tiny-vae

``python -m diffusion.kit --preset tiny --refit-vae --out DIR`` fits one into a kit instead.
"""

from __future__ import annotations

import argparse
import dataclasses
import errno
import json
import math
import pathlib
import time
from typing import TYPE_CHECKING

import numpy as np
from diffusion import cli
from PIL import Image

if TYPE_CHECKING:
    import torch  # each function imports it: --help and a refused --out start without torch

HELD_OUT_SEED = 1234  # sample scenes for judging the tiny VAE; fitting uses other seeds
VAE_SEED = 2  # the tiny VAE's initial weights, before fitting
TINY_VAE_ASSET = pathlib.Path(__file__).resolve().parent / "assets" / "tiny-vae"
FIT_INFO = "fit.json"  # beside the shipped VAE: how it was fitted and how well it reconstructs
TINY_VAE = dict(
    sample_size=64, in_channels=3, out_channels=3, latent_channels=4, layers_per_block=1,
    block_out_channels=(32, 64, 64, 64), norm_num_groups=8,  # not 32: per-channel groups erase colour
    down_block_types=("DownEncoderBlock2D",) * 4,
    up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=1.0,  # set from the fitted latents
)
FIT_SIZE = 64
# The other latent spaces' tiny autoencoders (the tiny-vae16/tiny-flux and tiny-dcae/tiny-sana kits), fitted the
# same way: a 16-channel AutoencoderKL at /8 whose latents get a shift and a scale (as SD3's and Flux's VAEs
# do), and DC-AE's shape at toy widths, six stages (/32), 32 channels, residual blocks, deterministic latents.
TINY_VAE16 = dict(sample_size=64, in_channels=3, out_channels=3, latent_channels=16, layers_per_block=1,
                  block_out_channels=(16, 32, 32, 32), norm_num_groups=8, down_block_types=("DownEncoderBlock2D",) * 4,
                  up_block_types=("UpDecoderBlock2D",) * 4, scaling_factor=1.0, shift_factor=0.0)
TINY_DCAE = dict(latent_channels=32, attention_head_dim=8, encoder_block_types="ResBlock",
                 decoder_block_types="ResBlock", encoder_block_out_channels=(8, 16, 16, 32, 32, 32),
                 decoder_block_out_channels=(8, 16, 16, 32, 32, 32), encoder_layers_per_block=(1,) * 6,
                 decoder_layers_per_block=(1,) * 6, encoder_qkv_multiscales=((),) * 6,
                 decoder_qkv_multiscales=((),) * 6, scaling_factor=1.0)
ASSETS = pathlib.Path(__file__).resolve().parent / "assets"
# name -> (diffusers class, config, shipped asset, fit crop): the crop covers at least one latent pixel's field
KINDS = {"tiny": ("AutoencoderKL", TINY_VAE, TINY_VAE_ASSET, 32),
         "vae16": ("AutoencoderKL", TINY_VAE16, ASSETS / "tiny-vae16", 32),
         "dcae": ("AutoencoderDC", TINY_DCAE, ASSETS / "tiny-dcae", 64)}


@dataclasses.dataclass
class FitConfig:
    steps: int = 1600
    batch_size: int = 8  # small batches, more updates: faster to converge for the same compute
    crop: int = 32  # the VAE is convolutional: random crops train it for full images at a quarter the cost
    lr: float = 1.5e-3
    kl_weight: float = 1e-4  # per latent element, relative to the per-pixel squared error
    train_images: int = 2048
    seed: int = 0


def sample_images(n: int, seed: int, size: int = FIT_SIZE) -> torch.Tensor:
    """``n`` scenes, centre-cropped and resized to ``size``, as a float tensor (n, 3, size, size) in [-1, 1]."""
    import torch
    from diffusion.kit.sample import render_scene

    rng = np.random.default_rng(seed)
    arrays = []
    for _ in range(n):
        width, height = (int(v) for v in rng.integers(size, 4 * size + 1, size=2))
        image, _ = render_scene(rng, width, height)
        side = min(width, height)
        left, top = (width - side) // 2, (height - side) // 2
        square = image.crop((left, top, left + side, top + side)).resize((size, size), Image.BICUBIC)
        arrays.append(np.asarray(square))
    pixels = torch.from_numpy(np.stack(arrays)).permute(0, 3, 1, 2).float()
    return pixels / 127.5 - 1.0


def _loss(vae, x: torch.Tensor, generator: torch.Generator, kl_weight: float) -> torch.Tensor:
    import torch

    encoded = vae.encode(x)
    if not hasattr(encoded, "latent_dist"):  # a deterministic autoencoder (DC-AE): reconstruction only
        return (vae.decode(encoded.latent).sample - x).pow(2).mean()
    posterior = encoded.latent_dist
    eps = torch.randn(posterior.mean.shape, generator=generator)
    z = posterior.mean + posterior.std * eps
    reconstruction = vae.decode(z).sample
    kl = 0.5 * (posterior.mean.pow(2) + posterior.var - 1.0 - posterior.logvar).mean()
    return (reconstruction - x).pow(2).mean() + kl_weight * kl


def fit_vae(vae, config: FitConfig = FitConfig(), progress: bool = True) -> dict:
    """Train ``vae`` in place on sample scenes; returns timing and the final loss."""
    import torch
    from tqdm.auto import tqdm

    torch.manual_seed(config.seed)
    images = sample_images(config.train_images, seed=config.seed)
    generator = torch.Generator().manual_seed(config.seed)
    optimizer = torch.optim.AdamW(vae.parameters(), lr=config.lr, weight_decay=0.0)
    warmup = max(1, config.steps // 20)

    def lr_factor(step: int) -> float:  # linear warm-up, then cosine decay to 5%
        if step < warmup:
            return (step + 1) / warmup
        return 0.05 + 0.95 * 0.5 * (1 + math.cos(math.pi * (step - warmup) / (config.steps - warmup)))

    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, lr_factor)
    vae.train().requires_grad_(True)
    start = time.perf_counter()
    bar = tqdm(range(config.steps), desc="fitting tiny VAE", disable=not progress, mininterval=1.0)
    running = None
    for _ in bar:
        idx = torch.randint(len(images), (config.batch_size,), generator=generator)
        top, left = torch.randint(0, FIT_SIZE - config.crop + 1, (2,), generator=generator).tolist()
        x = images[idx, :, top:top + config.crop, left:left + config.crop]
        flip = torch.rand(config.batch_size, generator=generator) < 0.5
        x = torch.where(flip[:, None, None, None], x.flip(-1), x)
        loss = _loss(vae, x, generator, config.kl_weight)
        optimizer.zero_grad(set_to_none=True)
        loss.backward()
        optimizer.step()
        scheduler.step()
        running = loss.item() if running is None else 0.95 * running + 0.05 * loss.item()
        bar.set_postfix(loss=f"{running:.4f}", refresh=False)
    vae.eval().requires_grad_(False)
    return {"seconds": time.perf_counter() - start, "loss": running, "steps": config.steps}


def reconstruction_psnr(vae, images: torch.Tensor, batch_size: int = 32) -> float:
    """Mean PSNR (dB, 8-bit scale) of ``decode(encode(x).mean)`` (a deterministic autoencoder's latent) over
    ``images`` in [-1, 1]."""
    import torch

    scores = []
    with torch.no_grad():
        for batch in images.split(batch_size):
            encoded = vae.encode(batch)
            z = encoded.latent_dist.mean if hasattr(encoded, "latent_dist") else encoded.latent
            decoded = vae.decode(z).sample.clamp(-1, 1)
            mse = ((decoded - batch) / 2).pow(2).flatten(1).mean(1)  # on a [0, 1] scale
            scores.append(10 * torch.log10(1.0 / mse.clamp_min(1e-10)))
    return torch.cat(scores).mean().item()


def latent_scaling_factor(vae, images: torch.Tensor, seed: int = 0) -> float:
    """1 / std of sampled latents, as SD chose its 0.18215, so scaled latents have unit variance."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        posterior = vae.encode(images).latent_dist
        z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
    return 1.0 / z.std().item()


def latent_shift_and_scale(vae, images: torch.Tensor, seed: int = 0) -> tuple[float, float]:
    """(shift, scale) making ``(z - shift) * scale`` zero-mean with unit variance over sampled latents (a
    KL autoencoder's draws, a deterministic one's latents), as SD3's and Flux's VAEs record them."""
    import torch

    with torch.no_grad():
        encoded = vae.encode(images)
        if hasattr(encoded, "latent_dist"):
            generator = torch.Generator().manual_seed(seed)
            posterior = encoded.latent_dist
            z = posterior.mean + posterior.std * torch.randn(posterior.mean.shape, generator=generator)
        else:
            z = encoded.latent
    return z.mean().item(), 1.0 / z.std().item()


def fit_tiny_vae(out, config: FitConfig = FitConfig(), progress: bool = True, kind: str = "tiny") -> dict:
    """Fit a tiny autoencoder of ``kind`` (:data:`KINDS`: the tiny kit's 4-channel VAE, the 16-channel one,
    the DC-AE) from its seeded initial weights and save it to ``out`` (diffusers layout, float32
    safetensors) with its latent scaling factor (and, but for ``tiny``, the shift); returns the fit info."""
    import diffusers
    import torch

    class_name, vae_config, _, crop = KINDS[kind]
    torch.manual_seed(VAE_SEED)
    vae = getattr(diffusers, class_name)(**vae_config)
    fit = fit_vae(vae, dataclasses.replace(config, crop=crop), progress=progress)
    held_out = sample_images(64, seed=HELD_OUT_SEED)
    fit["psnr_held_out"] = round(reconstruction_psnr(vae, held_out), 2)
    statistics = sample_images(256, seed=HELD_OUT_SEED + 1)
    if kind == "tiny":  # the shipped 4-channel VAE's recipe, SD's: a scale only
        vae.register_to_config(scaling_factor=round(latent_scaling_factor(vae, statistics), 5))
    else:
        shift, scale = latent_shift_and_scale(vae, statistics)
        vae.register_to_config(scaling_factor=round(scale, 5))
        if "shift_factor" in vae_config:
            vae.register_to_config(shift_factor=round(shift, 5))
            fit["shift_factor"] = vae.config.shift_factor
    vae.save_pretrained(out, safe_serialization=True)  # float32: the weights were never cast
    fit["scaling_factor"] = vae.config.scaling_factor
    fit["seconds"] = round(fit["seconds"], 1)
    fit.update(init_seed=VAE_SEED, fit_seed=config.seed, held_out_seed=HELD_OUT_SEED)
    return fit


DESCRIPTION = """Fit the tiny kit's VAE on procedural sample scenes and save it with its fit info.

A random VAE decodes everything to noise; a few minutes of CPU training on the scenes of
diffusion.kit.sample (fixed seeds: the fit is deterministic) makes the tiny model's images legible.
Input: nothing but the step count. Output: --out with config.json and
diffusion_pytorch_model.safetensors (diffusers AutoencoderKL, float32, with its latent scaling factor)
and fit.json (steps, loss, seconds, held-out PSNR, scaling factor, seeds); the same JSON on stdout.
The tiny kit copies the shipped result (diffusion/kit/assets/tiny-vae); this regenerates it."""
EXAMPLES = """examples:
  python -m diffusion.kit.vae_fit --out diffusion/kit/assets/tiny-vae   # regenerate the shipped VAE (~2.6 min)
  python -m diffusion.kit.vae_fit --out /tmp/vae --steps 200 --quiet    # a quick, rougher fit
  python -m diffusion.kit.vae_fit --kind vae16   # regenerate diffusion/kit/assets/tiny-vae16 (16 channels, shift)
  python -m diffusion.kit.vae_fit --kind dcae    # regenerate diffusion/kit/assets/tiny-dcae (DC-AE, /32)"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m diffusion.kit.vae_fit", description=DESCRIPTION,
                                     epilog=EXAMPLES, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--kind", choices=sorted(KINDS), default="tiny",
                        help="which autoencoder: the tiny kit's 4-channel VAE, the 16-channel one (tiny-vae16, "
                             "tiny-flux) or the DC-AE (tiny-dcae, tiny-sana) (default: %(default)s)")
    parser.add_argument("--out", default=None, metavar="DIR",
                        help="folder for config.json, diffusion_pytorch_model.safetensors and fit.json "
                             "(default: the kind's shipped asset)")
    parser.add_argument("--steps", type=cli.positive_int, default=FitConfig.steps,
                        help="training steps (default: %(default)s)")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    out = pathlib.Path(args.out or KINDS[args.kind][2])
    if out.exists() and not out.is_dir():
        raise FileExistsError(errno.EEXIST, "--out is a file; give a directory", str(out))
    out.mkdir(parents=True, exist_ok=True)
    fit = fit_tiny_vae(out, FitConfig(steps=args.steps), progress=not args.quiet, kind=args.kind)
    with open(out / FIT_INFO, "w") as f:
        json.dump(fit, f, indent=2)
        f.write("\n")
    print(json.dumps({"vae": str(out), **fit}, indent=2))


if __name__ == "__main__":
    cli.run(main, "vae_fit")
