"""Prompt adherence against CPU-seconds for the two tiny recipes, side by side in one run.

    python bench/bench_recipes.py [--batches 4000] [--every 1000] [--out out/bench-recipes]

The UNet recipe (yamls/tiny-cpu.yaml: v-prediction, offset noise, DDIM) and the MMDiT recipe
(yamls/tiny-mmdit-flow-cpu.yaml: SD3's transformer, rectified flow, flow-matching Euler) train on the
same converted demo data (the demo's sample rows, filter and dedupe; converted here if out/demo/mds is
missing) with the same batch size, EMA, optimizer and seed, one after the other. Every ``--every``
batches a checkpoint is kept and sampled as the demo samples (six colour prompts x 16 images, guidance
3, 25 steps); adherence is the demo's score (the share of images whose dominant colour is the prompt's,
chance 1 in 6). CPU-seconds are the training processes' user + system time (resource usage of the
child), allotted to checkpoints in proportion to their batch (the step cost is flat after the first
batches). Sampling is not counted. The table ends with the headline: the CPU-seconds each recipe needed
to reach the UNet's final adherence, and their ratio.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import resource
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

RECIPES = {"unet-v": ("yamls/tiny-cpu.yaml", "tiny"), "mmdit-flow": ("yamls/tiny-mmdit-flow-cpu.yaml", "tiny-mmdit")}


def _run(cmd: list[str]) -> float:
    """Run ``cmd``; its CPU-seconds (user + system of the child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, cwd=ROOT, check=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                   stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def ensure_data(mds: str, kit: str) -> str:
    if os.path.exists(os.path.join(mds, "dataset.json")):
        return mds
    from diffusion.demo import WHERE
    raw = os.path.join(os.path.dirname(mds), "raw")
    py = sys.executable
    _run([py, "-m", "diffusion.kit.sample", "--out", raw, "--n", "1024", "--seed", "0"])
    _run([py, "convert/laion_to_mds.py", "--input", raw, "--output", mds, "--model", kit, "--resolutions", "64",
          "--deterministic", "--where", WHERE, "--dedupe", "bytes"])
    return mds


def adherence(checkpoint: str, grid: str) -> float:
    from diffusion.demo import IMAGES_PER_PROMPT, PROMPTS
    from diffusion.sample.evaluate import prompt_adherence
    from diffusion.sample.grid import read_grid
    cmd = [sys.executable, "-m", "diffusion.generate", "--checkpoint", checkpoint, "--out", grid, "--seed", "0",
           "--images-per-prompt", str(IMAGES_PER_PROMPT), "--guidance-scale", "3"]
    for prompt in PROMPTS:
        cmd += ["--prompt", prompt]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    images, prompts = read_grid(grid)
    return prompt_adherence(images, prompts)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=4000)
    p.add_argument("--every", type=int, default=1000)
    p.add_argument("--out", default=str(ROOT / "out" / "bench-recipes"))
    p.add_argument("--data", default=str(ROOT / "out" / "demo" / "mds"), help="converted demo data (made if missing)")
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    args = p.parse_args(argv)
    from diffusion.kit.build import ensure_kit
    kits = {name: str(ensure_kit(preset, ROOT / ".cache" / "kit" / preset, progress=False))
            for name, (_, preset) in RECIPES.items()}
    mds = ensure_data(args.data, kits["unet-v"])
    curves = {}
    for name in args.recipes:
        yaml, _ = RECIPES[name]
        folder = os.path.join(args.out, name)
        start = time.time()
        cpu = _run([sys.executable, "run.py", yaml, f"model.ref={kits[name]}", f"data.train.path={mds}",
                    f"trainer.save_folder={folder}", f"trainer.max_duration={args.batches}ba",
                    f"trainer.save_interval={args.every}ba", "trainer.save_num_checkpoints_to_keep=-1",
                    "trainer.autoresume=false", "trainer.save_overwrite=true", "callbacks.progress=null"])
        wall = time.time() - start
        points = []
        for batch in range(args.every, args.batches + 1, args.every):
            checkpoint = os.path.join(folder, f"ep0-ba{batch}-rank0.pt")
            if not os.path.exists(checkpoint):
                checkpoint = next(str(c) for c in pathlib.Path(folder).glob(f"ep*-ba{batch}-rank0.pt"))
            score = adherence(checkpoint, os.path.join(folder, f"grid-{batch}.png"))
            points.append({"batch": batch, "cpu_seconds": cpu * batch / args.batches, "adherence": score})
            print(f"{name:>11} batch {batch:>5}: {score:.0%} at {cpu * batch / args.batches:,.0f} CPU-s", flush=True)
        curves[name] = {"cpu_seconds": cpu, "wall_seconds": wall, "points": points}

    print(f"\n{'recipe':>11} {'batch':>6} {'CPU-s':>8} {'adherence':>10}")
    for name, curve in curves.items():
        for point in curve["points"]:
            print(f"{name:>11} {point['batch']:>6} {point['cpu_seconds']:>8,.0f} {point['adherence']:>10.0%}")
        print(f"{name:>11} trained {args.batches} batches in {curve['cpu_seconds']:,.0f} CPU-s "
              f"({curve['wall_seconds']:,.0f} s wall)")
    if {"unet-v", "mmdit-flow"} <= set(curves):
        target = curves["unet-v"]["points"][-1]["adherence"]
        reach = {name: next((pt["cpu_seconds"] for pt in curve["points"] if pt["adherence"] >= target), None)
                 for name, curve in curves.items()}
        unet, mmdit = reach["unet-v"], reach["mmdit-flow"]
        best = max(pt["adherence"] for pt in curves["mmdit-flow"]["points"])
        if mmdit is None:
            print(f"headline: the MMDiT never reached the UNet's final {target:.0%} (best {best:.0%}) in "
                  f"{curves['mmdit-flow']['cpu_seconds']:,.0f} CPU-s")
        else:
            print(f"headline: the UNet's final adherence {target:.0%}: UNet at {unet:,.0f} CPU-s, MMDiT at "
                  f"{mmdit:,.0f} CPU-s ({mmdit / unet:.2f}x)")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "curves.json"), "w") as f:
        json.dump(curves, f, indent=1)
    return curves


if __name__ == "__main__":
    main()
