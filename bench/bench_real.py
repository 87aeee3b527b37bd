"""The real-data bench: the tiny recipes side by side on scikit-learn's handwritten digits, judged by a
classifier fitted on the real images only.

    python bench/bench_real.py [--batches 2000] [--every 250] [--target 0.8] [--out out/bench-real]
    python bench/bench_real.py --recipes unet-v mmdit-flow
    python bench/bench_real.py --recipes unet-v flux-flow sana-flow   # Flux and SANA, on their own latents

The 1,437 training digits (``python -m diffusion.kit.digits``: 8x8 scans from UCI's set that
scikit-learn ships, upscaled to 64 px, captioned "a handwritten digit N") are converted with the
ordinary converter and the tiny kit's VAE, once. Each recipe of bench_recipes.py on that latent space
(``unet-v``: yamls/tiny-cpu.yaml; ``mmdit-flow``: yamls/tiny-mmdit-flow-cpu.yaml; ``mmdit-masked``: the
micro-budget recipe, 3/4 of the batches 75% masked, then 1/4 unmasked from its weights and EMA; with
``--recipes``, ``flux-flow`` and ``sana-flow``, the flow recipe on the tiny-flux and tiny-sana kits, on the same
digits converted with their own autoencoders into ``mds-tiny-flux`` / ``mds-tiny-sana``) trains on
them with its own YAML's settings, one after the other, keeping a checkpoint every ``--every`` batches.
Each checkpoint samples the ten class prompts ``--images-per-prompt`` times (EMA weights, the recipe's
default sampler, 25 steps, guidance 3, seed 0, the demo's protocol) and
:class:`diffusion.kit.digits.DigitJudge` (logistic regression on 8x8 pixels, fitted on the real training
digits, never on generated ones) reads each image's class: judged accuracy is the share read as the
prompt's digit (chance 10%; the judge's own accuracy on the real held-out digits is printed as the
ceiling). CPU-seconds are the training processes' user + system time, allotted to checkpoints in
proportion to their batch; sampling is not counted. The table ends with each recipe's batches and
CPU-seconds to the ``--target`` accuracy.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

sys.path.insert(0, str(ROOT / "bench"))
from bench_recipes import OWN_LATENTS, RECIPES as ALL_RECIPES, _run, train_recipe  # noqa: E402  (one table of recipes, one way to train them)

# the default: the recipes of the tiny kit's latent space; flux-flow and sana-flow (--recipes) train on the digits
# converted with their own autoencoder (the 16-channel VAE, DC-AE), beside the others' in --out
RECIPES = {name: ALL_RECIPES[name] for name in ("unet-v", "mmdit-flow", "mmdit-masked", "flux-flow", "sana-flow")}
DEFAULT_RECIPES = ["unet-v", "mmdit-flow", "mmdit-masked"]
GUIDANCE, STEPS, SEED = 3.0, 25, 0


def ensure_data(out: str, kit: str, mds: str = "mds") -> str:
    mds = os.path.join(out, mds)
    if os.path.exists(os.path.join(mds, "dataset.json")):
        return mds
    raw = os.path.join(out, "raw")
    if os.path.exists(os.path.join(raw, "manifest.json")):  # another autoencoder's conversion of the same digits
        _run([sys.executable, "convert/laion_to_mds.py", "--input", raw, "--output", mds, "--model", kit,
              "--resolutions", "64", "--deterministic"])
        return mds
    _run([sys.executable, "-m", "diffusion.kit.digits", "--out", raw])
    _run([sys.executable, "convert/laion_to_mds.py", "--input", raw, "--output", mds, "--model", kit,
          "--resolutions", "64", "--deterministic"])
    return mds


def judged_accuracy(checkpoint: str, judge, images_per_prompt: int) -> float:
    from diffusion.kit.digits import prompt
    from diffusion.sample.generate import generate_images
    prompts = [prompt(k) for k in range(10)]
    images = generate_images(checkpoint, prompts, images_per_prompt=images_per_prompt, guidance_scale=GUIDANCE,
                             steps=STEPS, seed=SEED, device="cpu")
    return judge.accuracy(images, [k for k in range(10) for _ in range(images_per_prompt)])


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=2000)
    p.add_argument("--every", type=int, default=250)
    p.add_argument("--target", type=float, default=0.8, help="judged accuracy the headline asks for")
    p.add_argument("--images-per-prompt", type=int, default=8)
    p.add_argument("--out", default=str(ROOT / "out" / "bench-real"))
    p.add_argument("--recipes", nargs="+", default=DEFAULT_RECIPES, choices=list(RECIPES))
    args = p.parse_args(argv)
    from diffusion.kit.build import ensure_kit
    from diffusion.kit.digits import DigitJudge
    kits = {name: str(ensure_kit(preset, ROOT / ".cache" / "kit" / preset, progress=False))
            for name, (preset, _) in RECIPES.items() if name in args.recipes or preset == "tiny"}
    mds = ensure_data(args.out, kits["unet-v"])
    judge = DigitJudge()
    ceiling = judge.real_accuracy()
    print(f"judge: logistic regression on the real training digits; {ceiling:.1%} on the real held-out digits",
          flush=True)

    def score(checkpoint: str) -> dict:
        return {"accuracy": judged_accuracy(checkpoint, judge, args.images_per_prompt)}

    data = {name: ensure_data(args.out, kits[name], f"mds-{RECIPES[name][0]}") if RECIPES[name][0] in OWN_LATENTS
            else mds for name in args.recipes}
    curves = {name: train_recipe(name, kits[name], data[name], args.out, args.batches, args.every, score,
                                 lambda scores: f"{scores['accuracy']:.0%} judged right")
              for name in args.recipes}

    print(f"\n{'recipe':>12} {'batch':>6} {'CPU-s':>8} {'judged':>7}   ({10 * args.images_per_prompt} images a point,"
          f" chance 10%, judge on real held-out digits {ceiling:.0%})")
    for name, curve in curves.items():
        for point in curve["points"]:
            print(f"{name:>12} {point['batch']:>6} {point['cpu_seconds']:>8,.0f} {point['accuracy']:>7.0%}")
    for name, curve in curves.items():
        hit = next((pt for pt in curve["points"] if pt["accuracy"] >= args.target), None)
        best = max(pt["accuracy"] for pt in curve["points"])
        curve["to_target"] = hit
        if hit:
            print(f"headline {name}: {args.target:.0%} judged right at batch {hit['batch']}, {hit['cpu_seconds']:,.0f} "
                  f"CPU-s (best {best:.0%}; {curve['cpu_seconds']:,.0f} CPU-s, {curve['wall_seconds']:,.0f} s wall in all)")
        else:
            print(f"headline {name}: never {args.target:.0%} in {curve['points'][-1]['batch']} batches "
                  f"({curve['cpu_seconds']:,.0f} CPU-s; best {best:.0%})")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "curves.json"), "w") as f:
        json.dump({"judge_real_accuracy": ceiling, "target": args.target, "curves": curves}, f, indent=1)
    return curves


if __name__ == "__main__":
    main()
