"""Encode-stage throughput: the converter's own LatentTextEncoder, images/s and MFU per device.

    python bench/bench_encode.py                       # SD2-base VAE + text encoder (GPU: bf16)
    python bench/bench_encode.py --kit tiny --batches 3   # CPU smoke run on the tiny kit

Throughput does not depend on the weights, so the SD2 encoders are built from the sd2-base kit's
configs with random weights (nothing to download). MFU = (VAE encode FLOPs per image + text encode FLOPs
per caption, DESIGN.md's 273 / 1,117 GFLOP at 256 / 512 and 45 GFLOP) x rate / peak.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import sys
import tempfile
import time

import numpy as np
import torch

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from diffusion import schema  # noqa: E402
from diffusion.convert.encoders import LatentTextEncoder  # noqa: E402
from diffusion.kit.build import ensure_kit  # noqa: E402

SD2_VAE_GFLOP = {256: 273.0, 512: 1117.0}
SD2_TEXT_GFLOP = 45.0


def encoder_dir(kit: str, tmp: str) -> str:
    """A model directory whose VAE and text encoder have weights (random ones for the sd2-base configs)."""
    path = ensure_kit(kit, ROOT / ".cache" / "kit" / kit, progress=False)
    if kit != "sd2-base":
        return str(path)
    from diffusers import AutoencoderKL
    from transformers import CLIPTextConfig, CLIPTextModel
    out = pathlib.Path(tmp) / "sd2-random"
    shutil.copytree(path, out)
    AutoencoderKL.from_config(AutoencoderKL.load_config(path / "vae")).save_pretrained(out / "vae")
    CLIPTextModel(CLIPTextConfig.from_pretrained(path / "text_encoder")).save_pretrained(out / "text_encoder")
    return str(out)


def batch_for(resolution: int, n: int, tokenizer) -> dict:
    rng = np.random.default_rng(0)
    captions = [f"a photo number {i} of a red circle above a blue square" for i in range(n)]
    ids = tokenizer(captions, padding="max_length", max_length=schema.MAX_TOKENS, truncation=True,
                    return_tensors="np")["input_ids"].astype(np.int32)
    return {schema.KEY: np.array([str(i) for i in range(n)]), schema.CAPTION: np.array(captions),
            schema.WIDTH: np.full(n, resolution), schema.HEIGHT: np.full(n, resolution),
            schema.INPUT_IDS: ids,
            schema.image_column(resolution): rng.integers(0, 256, (n, resolution, resolution, 3), np.uint8)}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kit", default="sd2-base", choices=["sd2-base", "tiny"])
    p.add_argument("--resolutions", type=int, nargs="+", default=[256, 512])
    p.add_argument("--batch-size", type=int, default=None, help="default: 32 on GPU, 2 on CPU")
    p.add_argument("--batches", type=int, default=5, help="timed batches per resolution (after one warm-up)")
    p.add_argument("--peak-tflops", type=float, default=800.0, help="dense bf16 peak (A100 312, H100 ~800)")
    args = p.parse_args(argv)
    gpu = torch.cuda.is_available()
    batch_size = args.batch_size or (32 if gpu else 2)

    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        model = encoder_dir(args.kit, tmp)
        for r in args.resolutions:
            encoder = LatentTextEncoder(model, [r])
            batch = batch_for(r, batch_size, encoder.text.tokenizer)
            encoder(batch)  # warm-up: kernels, allocator
            if gpu:
                torch.cuda.synchronize()
            start = time.perf_counter()
            for _ in range(args.batches):
                encoder(batch)
            if gpu:
                torch.cuda.synchronize()
            rate = args.batches * batch_size / (time.perf_counter() - start)
            mfu = None
            if args.kit == "sd2-base" and r in SD2_VAE_GFLOP and gpu:
                mfu = (SD2_VAE_GFLOP[r] + SD2_TEXT_GFLOP) * 1e9 * rate / (args.peak_tflops * 1e12)
            rows.append((r, batch_size, str(encoder.vae.dtype).replace("torch.", ""), rate, mfu))
            del encoder
            if gpu:
                torch.cuda.empty_cache()

    device = torch.cuda.get_device_name() if gpu else f"CPU ({os.cpu_count()} cores)"
    print(f"\nencode stage: {args.kit} VAE + text encoder on {device}")
    print(f"{'res':>5} {'batch':>6} {'dtype':>9} {'images/s':>10} {'MFU':>7}")
    for r, b, dtype, rate, mfu in rows:
        print(f"{r:>5} {b:>6} {dtype:>9} {rate:>10.2f} {'n/a' if mfu is None else f'{mfu:.1%}':>7}")
    r, _, _, rate, mfu = rows[0]
    print(f"headline: {rate:.1f} images/s per device at {r}px" + (f", {mfu:.1%} MFU" if mfu is not None else ""))


if __name__ == "__main__":
    main()
