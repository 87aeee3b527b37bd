"""Prompt adherence against CPU-seconds for the tiny recipes, side by side in one run, with a plot.

    python bench/bench_recipes.py [--batches 4000] [--every 1000] [--out out/bench-recipes]
    python bench/bench_recipes.py --recipes unet-v mmdit-flow mmdit-masked   # + the micro-budget recipe
    python bench/bench_recipes.py --recipes unet-v mmdit-flow flux-flow sana-flow   # + Flux and SANA
    python bench/bench_recipes.py --scenes geneval --batches 2000   # GenEval's six categories, held out
    python bench/bench_recipes.py --recipes mmdit-flow mmdit-repa --batches 1500 --every 500 --held-out  # REPA

``mmdit-masked`` is the micro-budget recipe (issue 28) in two phases, 3/4 of the batches with 75% of the
patches masked (yamls/tiny-mmdit-masked-cpu.yaml), then 1/4 unmasked from its weights and EMA
(yamls/tiny-mmdit-finetune-cpu.yaml); its CPU-seconds add up over both phases.

``mmdit-repa`` is the flow recipe with representation alignment (yamls/tiny-mmdit-repa-cpu.yaml: ``model.repa``
to the kit's tiny ViT fitted on the scenes, block 2 of 4, weight 0.5, off from batch 1,000).

``--held-out`` adds, for the recipes on the tiny-mmdit kit, the binned held-out loss of every point's
weights (the EMA, as sampled): bench_knobs' measure (``model.eval_bins: 8`` with ``model.eval_protocol:
all_levels``: every held-out sample at all 8 bins, lower-variance than MLPerf's one level a sample on 256 sample
rows of another seed no run trains on; in ``--out``/held-out, converted once); not counted in CPU-seconds.

``flux-flow`` and ``sana-flow`` are the flow recipe (yamls/tiny-mmdit-flow-cpu.yaml) on the tiny-flux kit
(Flux's transformer, 16-channel latents) and the tiny-sana kit (SANA's linear-attention DiT, DC-AE's 32-channel
latents at /32), each over its autoencoder fitted on the scenes (diffusion/kit/assets/tiny-vae16, tiny-dcae), on
the same demo rows converted with that autoencoder (``--data`` + ``-tiny-flux`` / ``-tiny-sana``, made if missing).

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

Beside the colour score, every point has the scene judge's categories (:mod:`diffusion.sample.judge`): on
the colour prompts, single object (the named shape is there) and colours (in the named colour). With
``--scenes geneval`` the data is the sample scenes in GenEval's six categories' forms without the
held-out colour-shape pairs (``diffusion.kit.sample --scenes geneval --hold-out``, 1,024 rows, into
``out/demo-geneval``), and each point samples the held-out prompt set (``diffusion.kit.scenes``: 4 prompts
per category x 4 images = 96 images, guidance 3, 25 steps, seed 0): single object, two objects, counting,
colours, position and colour attribution on combinations training never saw, and GenEval's overall
score (their mean).
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
           # the flow recipe + REPA to the kit's fitted tiny ViT (block 2, weight 0.5, off from batch 1,000)
           "mmdit-repa": ("tiny-mmdit", [("yamls/tiny-mmdit-repa-cpu.yaml", 1.0)]),
           "mmdit-masked": ("tiny-mmdit", [("yamls/tiny-mmdit-masked-cpu.yaml", 0.75),
                                           ("yamls/tiny-mmdit-finetune-cpu.yaml", 0.25)]),
           # the flow recipe on Flux's transformer over 16-channel latents, and on SANA's over DC-AE's (/32)
           "flux-flow": ("tiny-flux", [("yamls/tiny-mmdit-flow-cpu.yaml", 1.0)]),
           "sana-flow": ("tiny-sana", [("yamls/tiny-mmdit-flow-cpu.yaml", 1.0)])}
# kits of another latent space train on the demo rows converted with their own autoencoder, beside --data
OWN_LATENTS = ("tiny-flux", "tiny-sana")


def _run(cmd: list[str]) -> float:
    """Run ``cmd``; its CPU-seconds (user + system of the child)."""
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    subprocess.run(cmd, cwd=ROOT, check=True, env=dict(os.environ, PYTHONUNBUFFERED="1"),
                   stdout=subprocess.DEVNULL)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def ensure_data(mds: str, kit: str, scenes: str = "default") -> str:
    if os.path.exists(os.path.join(mds, "dataset.json")):
        return mds
    from diffusion.demo import WHERE
    raw = os.path.join(os.path.dirname(mds), "raw")
    py = sys.executable
    options = ["--scenes", "geneval", "--hold-out"] if scenes == "geneval" else []
    if not os.path.isdir(raw):  # another latent space's conversion reuses the rows
        _run([py, "-m", "diffusion.kit.sample", "--out", raw, "--n", "1024", "--seed", "0", *options])
    _run([py, "convert/laion_to_mds.py", "--input", raw, "--output", mds, "--model", kit, "--resolutions", "64",
          "--deterministic", "--where", WHERE, "--dedupe", "bytes"])
    return mds


HELD_OUT_PER_CATEGORY, HELD_OUT_IMAGES = 4, 4  # --scenes geneval: 24 prompts x 4 images


def adherence(checkpoint: str, grid: str, scenes: str = "default") -> dict:
    """The checkpoint's colour score and the scene judge's per-category accuracy on one grid."""
    from diffusion.demo import IMAGES_PER_PROMPT, PROMPTS
    from diffusion.kit.scenes import prompt_set
    from diffusion.sample import judge
    from diffusion.sample.evaluate import prompt_adherence
    from diffusion.sample.grid import read_grid
    lines = prompt_set(HELD_OUT_PER_CATEGORY, seed=0) if scenes == "geneval" else None
    prompts = [line["prompt"] for line in lines] if lines else list(PROMPTS)
    per_prompt = HELD_OUT_IMAGES if lines else IMAGES_PER_PROMPT
    cmd = [sys.executable, "-m", "diffusion.generate", "--checkpoint", checkpoint, "--out", grid, "--seed", "0",
           "--images-per-prompt", str(per_prompt), "--guidance-scale", "3"]
    for prompt in prompts:
        cmd += ["--prompt", prompt]
    subprocess.run(cmd, cwd=ROOT, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    images, labels = read_grid(grid)
    by_prompt = {line["prompt"]: line for line in lines or ()}
    judged, _ = judge.judge_pairs([(im, by_prompt.get(p, p)) for im, p in zip(images, labels)])
    return {"adherence": prompt_adherence(images, labels), "judge": judged["accuracy"], "overall": judged["overall"]}


# The binned held-out loss (bench_recipes --held-out, every knob of bench_knobs): the flow YAML's denoiser, eval only
YAML = "yamls/tiny-mmdit-flow-cpu.yaml"
EVAL_BINS = 8


def demo_held_out(out: str, kit: str) -> tuple[str, str]:
    """(the demo's training MDS, a held-out MDS of 256 other sample rows converted alike), converted once."""
    from diffusion.demo import WHERE
    train = ensure_data(str(ROOT / "out" / "demo" / "mds"), kit)
    held = os.path.join(out, "held-out")
    if not os.path.exists(os.path.join(held, "mds", "dataset.json")):
        _run([sys.executable, "-m", "diffusion.kit.sample", "--out", os.path.join(held, "raw"), "--n", "256", "--seed", "1"])
        _run([sys.executable, "convert/laion_to_mds.py", "--input", os.path.join(held, "raw"),
              "--output", os.path.join(held, "mds"), "--model", kit, "--resolutions", "64",
              "--deterministic", "--where", WHERE, "--dedupe", "bytes"])
    return train, os.path.join(held, "mds")


class HeldOutLoss:
    """The binned held-out loss of a checkpoint's EMA weights: an eval-only trainer per kit, weights swapped in."""

    def __init__(self, train: str, held_out: str):
        self.train, self.held_out, self.trainers = train, held_out, {}

    def __call__(self, checkpoint: str, kit: str) -> float:
        from diffusion.models.checkpoint import load_denoiser
        from diffusion.train.config import load_config
        from diffusion.train.trainer import build_trainer
        if kit not in self.trainers:
            self.trainers[kit] = build_trainer(load_config(YAML, [
                f"model.ref={kit}", f"data.train.path={self.train}", f"data.eval.path={self.held_out}",
                "data.eval.num_workers=0", f"model.eval_bins={EVAL_BINS}", "model.eval_protocol=all_levels",
                "trainer.save_folder=null",
                "trainer.autoresume=false", "algorithms={}", "callbacks={}", "loggers={}"]))
        trainer = self.trainers[kit]
        denoiser, _, _ = load_denoiser(checkpoint)
        trainer.state.model.denoiser.load_state_dict(denoiser.state_dict())
        trainer.eval()
        metrics = trainer.state.eval_metrics["eval"]
        return sum(float(metrics[f"loss_bin{k}"].compute()) for k in range(EVAL_BINS)) / EVAL_BINS



def train_recipe(name: str, kit: str, data: str, out: str, batches: int, every: int, score, describe) -> dict:
    """Train recipe ``name`` (its phases one after the other, each from the last one's weights and EMA) on
    ``data`` into ``out``/``name`` (``name``-1, -2 for phases), keeping a checkpoint every ``every`` batches;
    each is scored by ``score(checkpoint) -> dict`` and printed with ``describe(scores)``. Returns the
    curve: its CPU-seconds, wall seconds and points (batch, CPU-seconds allotted by batch, phase, scores)."""
    _, phases = RECIPES[name]
    start, cpu_before, points, previous = time.time(), 0.0, [], None
    for phase, (yaml, share) in enumerate(phases):
        phase_batches = int(round(batches * share))
        folder = os.path.join(out, name if len(phases) == 1 else f"{name}-{phase + 1}")
        extra = []
        if previous:  # the next phase starts from the last one's weights and EMA
            extra = [f"trainer.load_path={previous}", "trainer.load_weights_only=true",
                     f"algorithms.ema.init_from={previous}"]
        cpu = _run([sys.executable, "run.py", yaml, f"model.ref={kit}", f"data.train.path={data}",
                    f"trainer.save_folder={folder}", f"trainer.max_duration={phase_batches}ba",
                    f"trainer.save_interval={every}ba", "trainer.save_num_checkpoints_to_keep=-1",
                    "trainer.autoresume=false", "trainer.save_overwrite=true", "callbacks.progress=null", *extra])
        done = sum(int(round(batches * s)) for _, s in phases[:phase])
        for batch in range(every, phase_batches + 1, every):
            checkpoint = next(str(c) for c in pathlib.Path(folder).glob(f"ep*-ba{batch}-rank0.pt"))
            scores = score(checkpoint)
            cpu_at = cpu_before + cpu * batch / phase_batches
            points.append({"batch": done + batch, "cpu_seconds": cpu_at, **scores, "phase": phase + 1})
            print(f"{name:>12} batch {done + batch:>5}: {describe(scores)} at {cpu_at:,.0f} CPU-s", flush=True)
            previous = checkpoint
        cpu_before += cpu
    return {"cpu_seconds": cpu_before, "wall_seconds": time.time() - start, "points": points}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=4000)
    p.add_argument("--every", type=int, default=1000)
    p.add_argument("--out", default=str(ROOT / "out" / "bench-recipes"))
    p.add_argument("--data", default=str(ROOT / "out" / "demo" / "mds"), help="converted demo data (made if missing)")
    p.add_argument("--recipes", nargs="+", default=list(RECIPES), choices=list(RECIPES))
    p.add_argument("--scenes", choices=("default", "geneval"), default="default",
                   help="geneval: train on the six categories' scenes without the held-out pairs, judge held-out prompts")
    p.add_argument("--held-out", action="store_true",
                   help="also the binned held-out loss of every point (the tiny-mmdit kit's recipes)")
    args = p.parse_args(argv)
    if args.scenes == "geneval" and args.data == p.get_default("data"):
        args.data = str(ROOT / "out" / "demo-geneval" / "mds")
    if args.scenes == "geneval" and args.out == p.get_default("out"):
        args.out = str(ROOT / "out" / "bench-recipes-geneval")
    from diffusion.kit.build import ensure_kit
    kits = {name: str(ensure_kit(preset, ROOT / ".cache" / "kit" / preset, progress=False))
            for name, (preset, _) in RECIPES.items() if name in args.recipes or preset == "tiny"}
    mds = ensure_data(args.data, kits["unet-v"], args.scenes)
    held_out = None
    if args.held_out:  # bench_knobs' binned held-out loss (its flow YAML: the same denoiser, evaluated unaligned)
        held_out = HeldOutLoss(*demo_held_out(args.out, kits["unet-v"]))
    curves = {}
    for name in args.recipes:
        preset, phases = RECIPES[name]
        data = ensure_data(f"{args.data}-{preset}", kits[name], args.scenes) if preset in OWN_LATENTS else mds

        def score(checkpoint, preset=preset, kit=kits[name]):
            batch = pathlib.Path(checkpoint).name.split("-ba")[1].split("-")[0]
            scores = adherence(checkpoint, os.path.join(os.path.dirname(checkpoint), f"grid-{batch}.png"), args.scenes)
            if held_out is not None and preset == "tiny-mmdit":
                scores["held_out_loss"] = held_out(checkpoint, kit)
            return scores

        def describe(scores):
            return (f"{scores['adherence']:.0%}; judge " + ", ".join(f"{t} {a:.0%}" for t, a in scores["judge"].items())
                    + (f"; held-out loss {scores['held_out_loss']:.4f}" if "held_out_loss" in scores else ""))
        curves[name] = train_recipe(name, kits[name], data, args.out, args.batches, args.every, score, describe)

    tags = list(curves[args.recipes[0]]["points"][0]["judge"]) if curves else []
    short = {"single_object": "single", "two_object": "two", "counting": "count", "colors": "colour",
             "position": "position", "color_attr": "attrib"}
    print(f"\n{'recipe':>11} {'batch':>6} {'CPU-s':>8} {'adherence':>10}" + "".join(f" {short[t]:>8}" for t in tags)
          + (f" {'overall':>8}" if args.scenes == "geneval" else "") + (f" {'held-out':>9}" if args.held_out else ""))
    for name, curve in curves.items():
        for point in curve["points"]:
            loss = point.get("held_out_loss")
            print(f"{name:>11} {point['batch']:>6} {point['cpu_seconds']:>8,.0f} {point['adherence']:>10.0%}"
                  + "".join(f" {point['judge'].get(t, 0):>8.0%}" for t in tags)
                  + (f" {point['overall']:>8.0%}" if args.scenes == "geneval" else "")
                  + ((f" {loss:>9.4f}" if loss is not None else f" {'-':>9}") if args.held_out else ""))
        print(f"{name:>11} trained {curve['points'][-1]['batch']} batches in {curve['cpu_seconds']:,.0f} CPU-s "
              f"({curve['wall_seconds']:,.0f} s wall)")
    key, what = ("overall", "GenEval overall") if args.scenes == "geneval" else ("adherence", "adherence")
    if "unet-v" in curves and len(curves) > 1:
        target = curves["unet-v"]["points"][-1][key]
        reach = {name: next((pt["cpu_seconds"] for pt in curve["points"] if pt[key] >= target), None)
                 for name, curve in curves.items()}
        unet = reach["unet-v"]
        for name, curve in curves.items():
            if name == "unet-v":
                continue
            best = max(pt[key] for pt in curve["points"])
            if reach[name] is None:
                print(f"headline {name}: never reached the UNet's final {what} {target:.0%} (best {best:.0%}) in "
                      f"{curve['cpu_seconds']:,.0f} CPU-s")
            else:
                print(f"headline {name}: the UNet's final {what} {target:.0%} at {reach[name]:,.0f} CPU-s, the "
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
