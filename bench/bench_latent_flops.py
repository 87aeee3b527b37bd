"""Training FLOPs and image tokens per image for each denoiser x autoencoder pair at 256, 512 and 1024 px (issue 38).

    python bench/bench_latent_flops.py

Counted by torch's ``FlopCounterMode`` on the meta device (``diffusion.models.flops``: forward x 3 for forward +
backward), so nothing is allocated. Denoisers at their published sizes: SD2-base's UNet, SD3-medium's MMDiT,
Flux.1-schnell's transformer, SANA-1.6B's; autoencoders by their latent shape: SD2's VAE (f8c4), a 16-channel
f8 VAE (SD3's, Flux's), DC-AE (f32c32). A denoiser reads another autoencoder's latents with its input and
output channels (and, for DC-AE's small grids, its patch) changed to fit: those rows are what-ifs, not
published models. Tokens are the image tokens the transformer attends over (the UNet: its latent pixels).
The text is each model's own (77 CLIP tokens of 1024; 333 of 4096; 256 T5 tokens of 4096; 300 Gemma-2 of 2304).
"""

from __future__ import annotations

import pathlib
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from diffusion.kit import build as kit  # noqa: E402
from diffusion.models.flops import training_gflop_per_image  # noqa: E402

RESOLUTIONS = (256, 512, 1024)
AUTOENCODERS = {"SD2 VAE f8c4": (4, 8), "KL f8c16 (SD3, Flux)": (16, 8), "DC-AE f32c32": (32, 32)}


def _unet(channels, f):
    return "UNet2DConditionModel", dict(kit.SD2_UNET, in_channels=channels, out_channels=channels), 1024, 77, 1


def _mmdit(channels, f):
    patch = 2 if f == 8 else 1
    config = dict(kit.SD3_MEDIUM, in_channels=channels, out_channels=channels, patch_size=patch,
                  pooled_projection_dim=4096)
    return "SD3Transformer2DModel", config, 4096, kit.SD3_TEXT_TOKENS, patch


def _flux(channels, f):
    config = dict(kit.FLUX_SCHNELL, in_channels=4 * channels, pooled_projection_dim=4096)
    return "FluxTransformer2DModel", config, 4096, kit.FLUX_TEXT_TOKENS, 2


def _sana(channels, f):
    config = dict(kit.SANA_1600M, in_channels=channels, out_channels=channels)
    return "SanaTransformer2DModel", config, kit.SANA_1600M["caption_channels"], kit.SANA_TEXT_TOKENS, 1


DENOISERS = {"SD2 UNet": (_unet, ("SD2 VAE f8c4", "KL f8c16 (SD3, Flux)")),
             "SD3-medium MMDiT": (_mmdit, ("KL f8c16 (SD3, Flux)", "DC-AE f32c32")),
             "Flux.1-schnell": (_flux, ("KL f8c16 (SD3, Flux)", "DC-AE f32c32")),
             "SANA-1.6B": (_sana, ("DC-AE f32c32", "KL f8c16 (SD3, Flux)"))}
PUBLISHED = {("SD2 UNet", "SD2 VAE f8c4"), ("SD3-medium MMDiT", "KL f8c16 (SD3, Flux)"),
             ("Flux.1-schnell", "KL f8c16 (SD3, Flux)"), ("SANA-1.6B", "DC-AE f32c32")}


def main() -> list[dict]:
    start = time.perf_counter()
    rows = []
    head = f"{'denoiser':<18}{'autoencoder':<23}{'':<9}"
    head += "".join(f"{f'{r} px tokens':>16}{'TFLOP':>9}" for r in RESOLUTIONS)
    print(head)
    print("-" * len(head))
    for name, (make, autoencoders) in DENOISERS.items():
        for ae in autoencoders:
            channels, f = AUTOENCODERS[ae]
            class_name, config, text_dim, text_length, patch = make(channels, f)
            cells, row = "", {"denoiser": name, "autoencoder": ae, "published": (name, ae) in PUBLISHED}
            for r in RESOLUTIONS:
                tokens = (r // f // patch) ** 2
                tflop = training_gflop_per_image(class_name, config, r, text_dim, text_length, downsample=f) / 1000
                row[r] = (tokens, tflop)
                cells += f"{tokens:>16,}{tflop:>9.2f}"
            print(f"{name:<18}{ae:<23}{'' if row['published'] else '(what-if)':<9}{cells}", flush=True)
            rows.append(row)
    print(f"counted in {time.perf_counter() - start:.0f}s; training = 3 x forward, per image")
    return rows


if __name__ == "__main__":
    main()
