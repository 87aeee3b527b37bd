"""The end-to-end demo on the embedded default: ``make demo`` / ``python -m diffusion.demo --out DIR``.

It runs the product's own commands, exactly as a user would type them, on this machine's CPU:
sample data → tiny model kit → Ray conversion to MDS → Composer training with EMA → a prompt grid,
then prints where everything is. Each step is skipped when its output is already complete, so a
re-run after an interruption picks up where it stopped.
"""

from __future__ import annotations

import argparse
import errno
import glob
import json
import os
import shlex
import subprocess
import sys
import time

from diffusion import cli
from diffusion.errors import UserError

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# LAION-style metadata filter and duplicate removal, as a user would convert LAION: mild, so the tiny
# model still sees most of the sample data (the sample's metadata follows LAION's distributions).
WHERE = "aesthetic >= 3.5 and punsafe < 0.5 and pwatermark < 0.8"
PROMPTS = ("a red circle", "a blue square", "a green triangle", "a yellow circle",
           "an orange square", "a purple triangle")
# 96 images: the adherence score's own sampling noise is then about 5 points (it was 10 with 24).
IMAGES_PER_PROMPT = 16


def _run(cmd: list[str], log: list) -> float:
    print("\n$ " + shlex.join(cmd), flush=True)
    start = time.time()
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    env.setdefault("WANDB_MODE", "offline")
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    done = subprocess.run(cmd, cwd=ROOT, env=env)
    if done.returncode:  # the step has said why (one line); the demo says which step stopped it
        raise UserError(f"step failed with exit status {done.returncode}: {shlex.join(cmd)}")
    seconds = time.time() - start
    log.append((shlex.join(cmd), seconds))
    return seconds


def _draw(cmd: list[str], grid: str, checkpoint: str, log: list) -> None:
    """Run a generate command, unless ``grid`` was already drawn by the same command from this checkpoint
    (a re-run of the demo: its record beside the grid names the command, and the grid is newer than the
    checkpoint), as every other step is skipped when its output is complete."""
    record = grid + ".command"
    command = shlex.join(cmd)
    try:
        with open(record) as f:
            drawn = f.read() == command and os.path.getmtime(grid) >= os.path.getmtime(checkpoint)
    except OSError:
        drawn = False
    if drawn:
        print(f"\n# {os.path.basename(grid)} is already drawn from {checkpoint} by the same command: kept",
              flush=True)
        return
    if os.path.exists(record):
        os.remove(record)  # drawn again below: the record is written once the new grid is complete
    _run(cmd, log)
    with open(record, "w") as f:
        f.write(command)


def latest_checkpoint(folder: str) -> str:
    """The newest Composer checkpoint in ``folder`` (the ``latest-rank0.pt`` symlink if present)."""
    latest = os.path.join(folder, "latest-rank0.pt")
    if os.path.exists(latest):
        return os.path.realpath(latest)
    found = sorted(glob.glob(os.path.join(folder, "*.pt")), key=os.path.getmtime)
    if not found:
        raise FileNotFoundError(f"no checkpoint in {folder}")
    return found[-1]


# With --buckets: the preset aspect-ratio buckets at 64 px (48x80, 64x64, 80x48), and grids at the two
# non-square ones beside the square grid.
BUCKET_GRIDS = ((48, 80), (80, 48))

# The recipes the demo can train: its YAML, the kit preset it trains from, its checkpoint folder under --out
# (each its own: autoresume continues only the run that wrote a folder) and how many batches it trains.
# The batch counts are what each recipe needs to reach the demo's quality on both of the project's judges
# (BENCHMARKS.md, "The demo's recipe"): the demo's scenes (the colour score and the scene judge) and real
# images nobody here drew (the digits bench, 80% read right).
RECIPES = {
    "unet": ("yamls/tiny-cpu.yaml", "tiny", "checkpoints", 4000),
    "mmdit-flow": ("yamls/tiny-mmdit-flow-cpu.yaml", "tiny-mmdit", "checkpoints-mmdit-flow", 2000),
}
DEFAULT_RECIPE = "mmdit-flow"


def demo_paths(out: str, recipe: str = DEFAULT_RECIPE, buckets: bool = False,
               curate: bool = False) -> tuple[str, str, str, str]:
    """The demo's sample rows, conversion, checkpoint folder and grid under ``out``. Each conversion (square,
    bucketed, curated) has its own folder, and each recipe on each its own checkpoints and grid: a --buckets run
    after a square one in the same --out converted nothing (the square conversion was found done) and trained and
    drew on square crops, and a recipe's finished run was taken as this one's."""
    checkpoints = RECIPES[recipe][2]
    variant = "".join(suffix for suffix, on in (("-buckets", buckets), ("-curated", curate)) if on)
    grid = ("grid" if recipe == "unet" else f"grid-{recipe}") + variant + ".png"
    return tuple(os.path.join(out, name) for name in ("raw", "mds" + variant, checkpoints + variant, grid))


def run_demo(out: str, n: int = 1024, batches: int | None = None, kit: str | None = None,
             buckets: bool = False, recipe: str = DEFAULT_RECIPE, images_per_prompt: int = IMAGES_PER_PROMPT,
             curate: bool = False) -> dict:
    out = os.path.abspath(out)
    os.makedirs(out, exist_ok=True)
    py = sys.executable
    yaml, preset, _, recipe_batches = RECIPES[recipe]
    batches = batches or recipe_batches
    kit = kit or os.path.join(ROOT, ".cache", "kit", preset)
    raw, mds, ckpts, grid = demo_paths(out, recipe, buckets, curate)
    before_after = None if buckets else os.path.join(mds, "visualize.png")
    log: list = []
    start = time.time()

    if not os.path.exists(os.path.join(raw, "manifest.json")):
        _run([py, "-m", "diffusion.kit.sample", "--out", raw, "--n", str(n), "--seed", "0"], log)
    _run([py, "-m", "diffusion.kit.build", "--preset", preset, "--out", kit], log)
    curation = []
    if curate:  # issue 51's stages on the tiny-clip kit: scores, heads, --where on them, near dedupe
        clip = os.path.join(os.path.dirname(kit), "tiny-clip")
        _run([py, "-m", "diffusion.kit.build", "--preset", "tiny-clip", "--out", clip], log)
        curation = ["--embed", clip, *(a for k in ("aesthetic", "nsfw", "watermark")
                                       for a in (f"--{k}-head", os.path.join(clip, "heads", f"{k}.safetensors"))),
                    "--store-embeddings", "--visualize-duplicates", "4"]
    if not os.path.exists(os.path.join(mds, "dataset.json")):
        _run([py, "convert/laion_to_mds.py", "--input", raw, "--output", mds, "--model", kit,
              "--resolutions", "64", "--deterministic",
              "--where", WHERE + (" and nsfw < 0.5" if curate else ""),
              "--dedupe", "near" if curate else "bytes", *curation,
              # the before/after picture is of square crops
              *(["--buckets", "preset"] if buckets else ["--visualize", "8"])], log)
    train = [py, "run.py", yaml, f"model.ref={kit}", f"data.train.path={mds}",
             f"trainer.save_folder={ckpts}"]
    train.append(f"trainer.max_duration={batches}ba")
    finished = sorted(glob.glob(os.path.join(ckpts, f"ep*-ba{batches}-rank0.pt")))
    if finished:  # the run already trained this long (a longer --batches resumes it in run.py)
        print(f"\n# training is done: {finished[-1]} (delete {ckpts} to train again)", flush=True)
    else:
        _run(train, log)
    checkpoint = latest_checkpoint(ckpts)
    gen = [py, "-m", "diffusion.generate", "--checkpoint", checkpoint, "--out", grid, "--seed", "0",
           "--images-per-prompt", str(images_per_prompt), "--guidance-scale", "3"]
    for prompt in PROMPTS:
        gen += ["--prompt", prompt]
    _draw(gen, grid, checkpoint, log)
    grids = {"square": grid}
    if buckets:  # the same prompts at the buckets' aspect ratios
        for width, height in BUCKET_GRIDS:
            grids[f"{width}x{height}"] = grid.replace(".png", f"-{width}x{height}.png")
            at = gen[:gen.index("--out") + 1] + [grids[f"{width}x{height}"]] + gen[gen.index("--out") + 2:]
            _draw(at + ["--width", str(width), "--height", str(height)], grids[f"{width}x{height}"], checkpoint, log)

    from diffusion.sample.evaluate import prompt_adherence
    from diffusion.sample.grid import read_grid
    adherences = {name: prompt_adherence(*read_grid(path)) for name, path in grids.items()}
    adherence = adherences["square"]
    from diffusion.sample.judge import judge_pairs, noise_floor
    grid_images, grid_prompts = read_grid(grid)
    judged, _ = judge_pairs(zip(grid_images, grid_prompts))  # the colour prompts: single object and colours
    floor = noise_floor(list(PROMPTS), size=min(grid_images[0].size))  # what colour blobs score: an untrained model

    with open(os.path.join(mds, "dataset.json")) as f:
        info = json.load(f)
    summary = {"recipe": recipe, "sample_data": raw, "model_kit": kit, "mds": mds, "samples": info.get("count"),
               "rejects": info.get("rejects"), "checkpoint": checkpoint, "grid": grid,
               "before_after": before_after, "prompt_adherence": adherence,
               "judge": judged["accuracy"], "judge_floor": floor, "seconds": round(time.time() - start, 1),
               **({"buckets": info.get("buckets"), "grids": grids, "prompt_adherence_by_grid": adherences}
                  if buckets else {}),
               "steps": [{"command": c, "seconds": round(s, 1)} for c, s in log]}
    with open(os.path.join(out, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
    print("\n=== demo finished in {:.0f} s ===".format(summary["seconds"]))
    for c, s in log:
        print(f"  {s:7.1f} s  {c[:110]}")
    print(f"  samples written: {summary['samples']}   rejected (filter rules, duplicates, bad rows): "
          f"{summary['rejects']}")
    print(f"  prompt adherence: {adherence:.0%} of images show the colour their prompt names "
          f"(chance {1 / len(PROMPTS):.0%})")
    print("  scene judge:     " + ", ".join(f"{t} {a:.0%} (noise {floor.get(t, 0):.0%})"
                                            for t, a in judged["accuracy"].items())
          + " (the named shape is there; in the named colour; noise: what colour blobs, an untrained model's "
            "draws, score)")
    print(f"  checkpoint:      {checkpoint}")
    print(f"  prompt grid:     {grid}")
    for name, path in grids.items():
        if name != "square":
            print(f"  {name} grid:     {path} (prompt adherence {adherences[name]:.0%})")
    if before_after:
        print(f"  before/after:    {before_after}")
    return summary


DESCRIPTION = """Run the whole pipeline end to end on this machine's CPU, offline, in about 4 minutes.

It runs the product's own commands, printing each as it would be typed: sample data
(diffusion.kit.sample) -> tiny model kit (diffusion.kit) -> Ray conversion to MDS, filtered on the
LAION metadata and without duplicate images (convert/laion_to_mds.py --where ... --dedupe bytes) ->
Composer training with EMA (run.py yamls/tiny-mmdit-flow-cpu.yaml: the tiny SD3 MMDiT with rectified
flow, 2,000 batches) -> a prompt grid (diffusion.generate). A step whose output is already complete is
skipped, so a re-run after an interruption picks up where it stopped.
Input: nothing (the data and model are made here). Output: under --out, raw/ (sample data), mds/
(shards, visualize.png: input crops beside VAE decodings), checkpoints-mmdit-flow/, grid-mmdit-flow.png
and summary.json (paths, samples written and rejected, prompt adherence and the scene judge, seconds per
step); with --recipe unet, checkpoints/ and grid.png; with --buckets or --curate, each of mds/, the
checkpoint folder and the grid with -buckets or -curated after its name (mds-buckets/,
checkpoints-mmdit-flow-buckets/, grid-mmdit-flow-buckets.png), so
every variant keeps its own beside the others in one --out; the kit in --kit."""
EXAMPLES = """examples:
  python -m diffusion.demo                                   # = make demo, into out/demo
  python -m diffusion.demo --out /tmp/demo --n 256 --batches 200   # a quick, rougher run
  python -m diffusion.demo --recipe unet                      # = make demo RECIPE=unet
  python -m diffusion.demo --buckets                          # aspect-ratio buckets (mds-buckets/), grids at 48x80 and 80x48"""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="python -m diffusion.demo", description=DESCRIPTION, epilog=EXAMPLES,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default="out/demo", metavar="DIR",
                        help="where everything is written (default: %(default)s)")
    parser.add_argument("--n", type=cli.positive_int, default=1024,
                        help="sample rows to generate (default: %(default)s)")
    parser.add_argument("--batches", type=cli.positive_int, default=None,
                        help="training length in batches (default: the recipe's, 2,000 for mmdit-flow and 4,000 "
                             "for unet); fewer for a slow machine draws a rougher grid")
    parser.add_argument("--recipe", choices=sorted(RECIPES), default=DEFAULT_RECIPE,
                        help="what to train: the tiny SD3 MMDiT with rectified flow (default; "
                             "yamls/tiny-mmdit-flow-cpu.yaml) or the tiny SD2 UNet with v-prediction "
                             "(yamls/tiny-cpu.yaml), each into its own checkpoint folder under --out")
    parser.add_argument("--kit", default=None, metavar="DIR",
                        help="where the tiny kit lives (default: .cache/kit/PRESET, the recipe's preset)")
    parser.add_argument("--buckets", action="store_true",
                        help="convert into aspect-ratio buckets (--buckets preset: 48x80, 64x64, 80x48 at 64 px), "
                             "train on them, and draw grids at 48x80 and 80x48 beside the square one")
    parser.add_argument("--curate", action="store_true",
                        help="convert with the curation stages (the tiny-clip kit): --embed and its heads' scores "
                             "stored and filtered by --where, --dedupe near with duplicates.png")
    return parser


def main(argv=None) -> None:
    args = build_parser().parse_args(argv)
    if os.path.exists(args.out) and not os.path.isdir(args.out):
        raise FileExistsError(errno.EEXIST, "--out is a file; give a directory", args.out)
    if args.kit and os.path.exists(args.kit) and not os.path.isdir(args.kit):  # before the sample data is drawn
        raise FileExistsError(errno.EEXIST, "--kit is a file; give the kit's directory (built there if missing)",
                              args.kit)
    run_demo(args.out, n=args.n, batches=args.batches, kit=args.kit, buckets=args.buckets, recipe=args.recipe,
             curate=args.curate)


if __name__ == "__main__":
    cli.run(main, "demo")
