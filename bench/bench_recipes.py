"""Prompt adherence against CPU-seconds for the tiny recipes, side by side in one run, with a plot.

    python bench/bench_recipes.py [--batches 4000] [--every 1000] [--out out/bench-recipes]
    python bench/bench_recipes.py --recipes unet-v mmdit-flow mmdit-masked   # + the micro-budget recipe

``mmdit-masked`` is the micro-budget recipe (issue 28) in two phases, 3/4 of the batches with 75% of the
patches masked (yamls/tiny-mmdit-masked-cpu.yaml), then 1/4 unmasked from its weights and EMA
(yamls/tiny-mmdit-finetune-cpu.yaml); its CPU-seconds add up over both phases.

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

# name: (kit preset, [(yaml, share of the batches), ...]): phases run in order, each from the last one's weights
RECIPES = {"unet-v": ("tiny", [("yamls/tiny-cpu.yaml", 1.0)]),
           "mmdit-flow": ("tiny-mmdit", [("yamls/tiny-mmdit-flow-cpu.yaml", 1.0)]),
           "mmdit-masked": ("tiny-mmdit", [("yamls/tiny-mmdit-masked-cpu.yaml", 0.75),
                                           ("yamls/tiny-mmdit-finetune-cpu.yaml", 0.25)])}


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
            for name, (preset, _) in RECIPES.items() if name in args.recipes or preset == "tiny"}
    mds = ensure_data(args.data, kits["unet-v"])
    curves = {}
    for name in args.recipes:
        _, phases = RECIPES[name]
        start, cpu_before, points, previous = time.time(), 0.0, [], None
        for phase, (yaml, share) in enumerate(phases):
            batches = int(round(args.batches * share))
            folder = os.path.join(args.out, name if len(phases) == 1 else f"{name}-{phase + 1}")
            extra = []
            if previous:  # the next phase starts from the last one's weights and EMA
                extra = [f"trainer.load_path={previous}", "trainer.load_weights_only=true",
                         f"algorithms.ema.init_from={previous}"]
            cpu = _run([sys.executable, "run.py", yaml, f"model.ref={kits[name]}", f"data.train.path={mds}",
                        f"trainer.save_folder={folder}", f"trainer.max_duration={batches}ba",
                        f"trainer.save_interval={args.every}ba", "trainer.save_num_checkpoints_to_keep=-1",
                        "trainer.autoresume=false", "trainer.save_overwrite=true", "callbacks.progress=null", *extra])
            done = sum(int(round(args.batches * s)) for _, s in phases[:phase])
            for batch in range(args.every, batches + 1, args.every):
                checkpoint = next(str(c) for c in pathlib.Path(folder).glob(f"ep*-ba{batch}-rank0.pt"))
                score = adherence(checkpoint, os.path.join(folder, f"grid-{batch}.png"))
                cpu_at = cpu_before + cpu * batch / batches
                points.append({"batch": done + batch, "cpu_seconds": cpu_at, "adherence": score, "phase": phase + 1})
                print(f"{name:>12} batch {done + batch:>5}: {score:.0%} at {cpu_at:,.0f} CPU-s", flush=True)
                previous = checkpoint
            cpu_before += cpu
        curves[name] = {"cpu_seconds": cpu_before, "wall_seconds": time.time() - start, "points": points}

    print(f"\n{'recipe':>11} {'batch':>6} {'CPU-s':>8} {'adherence':>10}")
    for name, curve in curves.items():
        for point in curve["points"]:
            print(f"{name:>11} {point['batch']:>6} {point['cpu_seconds']:>8,.0f} {point['adherence']:>10.0%}")
        print(f"{name:>11} trained {curve['points'][-1]['batch']} batches in {curve['cpu_seconds']:,.0f} CPU-s "
              f"({curve['wall_seconds']:,.0f} s wall)")
    if "unet-v" in curves and len(curves) > 1:
        target = curves["unet-v"]["points"][-1]["adherence"]
        reach = {name: next((pt["cpu_seconds"] for pt in curve["points"] if pt["adherence"] >= target), None)
                 for name, curve in curves.items()}
        unet = reach["unet-v"]
        for name, curve in curves.items():
            if name == "unet-v":
                continue
            best = max(pt["adherence"] for pt in curve["points"])
            if reach[name] is None:
                print(f"headline {name}: never reached the UNet's final {target:.0%} (best {best:.0%}) in "
                      f"{curve['cpu_seconds']:,.0f} CPU-s")
            else:
                print(f"headline {name}: the UNet's final adherence {target:.0%} at {reach[name]:,.0f} CPU-s, the "
                      f"UNet at {unet:,.0f} ({reach[name] / unet:.2f}x); best {best:.0%}")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "curves.json"), "w") as f:
        json.dump(curves, f, indent=1)
    plot(curves, os.path.join(args.out, "adherence-vs-cpu.png"))
    return curves


def plot(curves: dict, path: str) -> str:
    """The curves as a PNG: adherence against training CPU-seconds, one line per recipe."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    figure, axes = plt.subplots(figsize=(7, 4.2), dpi=110)
    for name, curve in curves.items():
        xs = [p["cpu_seconds"] for p in curve["points"]]
        axes.plot(xs, [100 * p["adherence"] for p in curve["points"]], marker="o", label=name)
    axes.axhline(100 / 6, color="grey", linestyle=":", label="chance")
    axes.set_xlabel("training CPU-seconds (2-core VM)")
    axes.set_ylabel("prompt adherence, % of 96 images")
    axes.set_ylim(0, 100)
    axes.grid(alpha=0.3)
    axes.legend()
    figure.tight_layout()
    figure.savefig(path)
    print(f"plot: {path}")
    return path


if __name__ == "__main__":
    main()
