"""Transform-stage throughput per core: our decode-once transform vs the straightforward baseline.

    python bench/bench_transform.py [--n 1000] [--resolution 256]

Generates JPEGs of LAION-like sizes (400-1500 px a side) with the sample-data renderer, then times on
one thread, in the same run: decoding alone (PIL full decode to RGB, the floor), the baseline (PIL full
decode, torchvision Resize + CenterCrop, ToTensor + Normalize to float32, per image) and
diffusion.convert.transforms (draft-mode decode, EXIF, checks, centre crop, uint8 out). Goals: >= 2x the
baseline, and within 1.25x the decode-alone time.
"""

from __future__ import annotations

import argparse
import io
import time

import numpy as np
import torch
from PIL import Image

from diffusion.kit.sample import render_scene
from diffusion.convert.transforms import ImageChecks, center_square_crops, decode_image


def make_jpegs(n: int, seed: int = 0) -> list[bytes]:
    out = []
    for i in range(n):
        rng = np.random.default_rng([seed, i])
        w, h = (int(v) for v in rng.integers(400, 1501, size=2))
        image, _ = render_scene(rng, w, h)
        buf = io.BytesIO()
        image.save(buf, "JPEG", quality=int(rng.integers(80, 96)))
        out.append(buf.getvalue())
    return out


def decode_only(data: bytes, resolution: int):
    return Image.open(io.BytesIO(data)).convert("RGB")


def make_baseline(resolution: int):
    from torchvision import transforms as T
    pipeline = T.Compose([T.Resize(resolution), T.CenterCrop(resolution), T.ToTensor(),
                          T.Normalize([0.5, 0.5, 0.5], [0.5, 0.5, 0.5])])
    return lambda data, r: pipeline(Image.open(io.BytesIO(data)).convert("RGB"))


def ours(data: bytes, resolution: int, checks=ImageChecks(max_aspect=float("inf"))):  # every image, like the baseline
    image, _, _ = decode_image(data, resolution, checks)
    return center_square_crops(image, [resolution])


def images_per_second(fn, jpegs, resolution: int) -> float:
    fn(jpegs[0], resolution)  # warm-up
    start = time.perf_counter()
    for data in jpegs:
        fn(data, resolution)
    return len(jpegs) / (time.perf_counter() - start)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--n", type=int, default=1000, help="number of JPEGs")
    p.add_argument("--resolution", type=int, default=256)
    a = p.parse_args(argv)
    torch.set_num_threads(1)  # per core: one thread for every contender
    jpegs = make_jpegs(a.n)
    floor = images_per_second(decode_only, jpegs, a.resolution)
    base = images_per_second(make_baseline(a.resolution), jpegs, a.resolution)
    mine = images_per_second(ours, jpegs, a.resolution)
    rates = {"decode alone (floor)": floor, "baseline (PIL + torchvision, float32)": base,
             "ours (draft decode, uint8)": mine}
    print(f"{a.n} JPEGs, {sum(map(len, jpegs)) / a.n / 1024:.0f} KiB mean, crop {a.resolution}, 1 thread")
    print(f"{'pipeline':<40}{'img/s/core':>12}{'vs baseline':>13}{'time vs decode':>16}")
    for name, rate in rates.items():
        print(f"{name:<40}{rate:>12.1f}{rate / base:>12.2f}x{floor / rate:>15.2f}x")
    print(f"headline: transform = {mine / base:.2f}x the baseline (goal >= 2x); "
          f"{floor / mine:.2f}x the decode-alone time (goal <= 1.25x)")
    return rates


if __name__ == "__main__":
    main()
