"""Does curation help training? (issue 51 item 7): the tiny recipe trained on the sample data with planted
near-duplicates and mismatched captions, uncurated and curated, at equal batches, judged side by side.

    python bench/bench_curation_training.py [--n 256] [--batches 400] [--out out/bench-curation-training]

The input: the sample scenes (``diffusion.kit.sample``, seed 0, the good rows) with planted copies
(:func:`diffusion.convert.planted.planted_rows`: re-encoded, resized, cropped, mirrored, colour-jittered
copies of ``--dup-share`` of the originals) and ``--mismatch-share`` of all rows given another row's caption
(:func:`diffusion.convert.planted.mismatch_captions`). It is converted twice with the tiny kit at 64 px (in this process, one Ray instance):

- **uncurated**: what the demo did before issue 51, ``--dedupe bytes`` (no copy is byte-identical);
- **curated**: ``--embed CLIP --where "clip_score >= CUT" --dedupe near`` (the two-pass near dedupe keeps the
  highest ``clip_score`` of each group).

The tiny-clip kit's CLIP is random, so its ``clip_score`` cannot tell a mismatched caption. The bench fits
it first, contrastively on other sample scenes (seed 2, never trained on), as a team would use a public
CLIP; CUT is the 5th percentile of its matched pairs' scores on those scenes (a cut that keeps 95% of
right captions), not tuned on the bench's input.

Each arm trains the demo's MMDiT recipe (yamls/tiny-mmdit-flow-cpu.yaml: batch 32, seed 17) for the same
``--batches`` (bench_recipes.train_recipe), and its EMA weights are judged as bench_recipes judges them:
the binned held-out loss (bench_recipes.HeldOutLoss: 8 bins, every level, on clean sample rows of seed 1)
and the demo's grid (6 colour prompts x 16 images, guidance 3, 25 steps, seed 0) read by the colour score
and the scene judge. A 96-image score's sampling noise is about 5 points.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import time

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

RECIPE = "mmdit-flow"  # bench_recipes.RECIPES: the demo's recipe


def sample_rows(n: int, seed: int, folder: str) -> list[dict]:
    """The good rows (key, caption, jpg) of ``n`` sample rows of ``seed``, written under ``folder``."""
    from diffusion.convert.readers import iter_rows
    from diffusion.kit.sample import write_sample_data
    manifest = write_sample_data(folder, n=n, seed=seed, rows_per_shard=max(n, 1))
    return [{"key": r["key"], "caption": r["caption"], "jpg": r["jpg"]} for r in iter_rows(folder)
            if r["key"] not in manifest["bad_keys"]]


def write_raw(rows: list[dict], folder: str) -> str:
    import pyarrow as pa
    import pyarrow.parquet as pq
    os.makedirs(folder, exist_ok=True)
    pq.write_table(pa.table({c: [r[c] for r in rows] for c in ("key", "caption", "jpg", "url")}),
                   os.path.join(folder, "part-00000.parquet"))
    return folder


def _pixels(rows: list[dict], mean, std):
    import torch
    from diffusion.convert.transforms import ImageChecks, center_square_crops, decode_image
    crops = np.stack([center_square_crops(decode_image(r["jpg"], 64, ImageChecks())[0], [64])[64] for r in rows])
    return (torch.from_numpy(crops).permute(0, 3, 1, 2).float() / 255 - mean) / std


def fit_scene_clip(kit: str, out: str, rows: list[dict], steps: int, seed: int = 0) -> float:
    """Fit the tiny-clip kit's CLIP contrastively on ``rows`` (batches of 64, AdamW 2e-3), save it to ``out``
    as an ``--embed`` model; returns the 5th percentile of its matched pairs' cosine on ``rows``."""
    import torch
    from transformers import AutoTokenizer, CLIPImageProcessor, CLIPModel
    torch.manual_seed(seed)
    model, tokenizer = CLIPModel.from_pretrained(kit), AutoTokenizer.from_pretrained(kit)
    processor = CLIPImageProcessor.from_pretrained(kit)
    mean = torch.tensor(processor.image_mean).view(1, 3, 1, 1)
    std = torch.tensor(processor.image_std).view(1, 3, 1, 1)
    pixels, captions = _pixels(rows, mean, std), [r["caption"] for r in rows]
    optimizer = torch.optim.AdamW(model.parameters(), lr=2e-3, weight_decay=0.01)
    rng = np.random.default_rng(seed)
    for step in range(steps):
        idx = rng.choice(len(rows), min(64, len(rows)), replace=False)
        tokens = tokenizer([captions[i] for i in idx], padding=True, return_tensors="pt")
        loss = model(**tokens, pixel_values=pixels[idx], return_loss=True).loss
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
        if step % 100 == 0 or step == steps - 1:
            print(f"  scene CLIP step {step}: contrastive loss {float(loss):.3f}", flush=True)
    model.eval()
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    processor.save_pretrained(out)
    from diffusion.convert.curate import ClipEmbedder  # the stage's own embeddings of the fit rows
    from diffusion.convert.transforms import ImageChecks, center_square_crops, decode_image
    embedder = ClipEmbedder(out)
    crops = [center_square_crops(decode_image(r["jpg"], 64, ImageChecks())[0], [64])[64] for r in rows]
    matched = (embedder.images(crops) * embedder.texts(captions)).sum(axis=1)
    return round(float(np.percentile(matched, 5)), 4)


def convert(raw: str, out: str, kit: str, **options) -> None:
    """The conversion (``convert/laion_to_mds.py``'s own function, in this process: the three share one
    local Ray instance), at 64 px, ``--deterministic``, unless ``out`` is complete."""
    from diffusion.convert.pipeline import ConvertConfig, run_conversion
    if not os.path.exists(os.path.join(out, "dataset.json")):
        run_conversion(ConvertConfig(input=raw, output=out, model=kit, resolutions=(64,), deterministic=True,
                                     progress=False, **options))


def what_was_kept(mds: str, keys: list[str], truth: dict, mismatched: set) -> dict:
    """Of the planted rows: copies whose group still has two members written, mismatched rows written."""
    from diffusion.convert.summary import done_keys
    written = done_keys(mds)[0]
    return {"rows": len(written & set(keys)),
            "copies_left": sum(1 for c, (o, _) in truth.items() if c in written and o in written),
            "mismatched_left": len(mismatched & written)}


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--n", type=int, default=256, help="sample rows before planting (seed 0)")
    p.add_argument("--dup-share", type=float, default=0.25, help="planted copies per original row")
    p.add_argument("--mismatch-share", type=float, default=0.25, help="share of rows given another's caption")
    p.add_argument("--batches", type=int, default=400, help="training batches of each arm (batch 32)")
    p.add_argument("--held-out", type=int, default=96, help="clean sample rows (seed 1) for the held-out loss")
    p.add_argument("--clip-rows", type=int, default=384, help="sample rows (seed 2) the scene CLIP is fitted on")
    p.add_argument("--clip-steps", type=int, default=250)
    p.add_argument("--out", default=str(ROOT / "out" / "bench-curation-training"))
    args = p.parse_args(argv)
    start = time.time()
    from bench_recipes import HeldOutLoss, adherence, train_recipe
    from diffusion.convert.planted import TRANSFORMS, mismatch_captions, planted_rows
    from diffusion.kit.build import ensure_kit
    kits = {preset: str(ensure_kit(preset, ROOT / ".cache" / "kit" / preset, progress=False))
            for preset in ("tiny", "tiny-mmdit", "tiny-clip")}
    out = os.path.abspath(args.out)
    os.makedirs(out, exist_ok=True)

    good = sample_rows(args.n, 0, os.path.join(out, "sample"))
    rows, truth = planted_rows(good, max(1, int(round(args.dup_share * len(good) / len(TRANSFORMS)))), seed=0)
    mismatched = mismatch_captions(rows, args.mismatch_share, seed=0)
    raw = write_raw(rows, os.path.join(out, "raw"))
    print(f"input: {len(good)} scenes + {len(truth)} planted copies, {len(mismatched)} of {len(rows)} rows "
          f"with another row's caption", flush=True)

    clip = os.path.join(out, "scene-clip")
    cut_file = os.path.join(clip, "cut.json")
    if not os.path.exists(cut_file):
        t = time.time()
        cut = fit_scene_clip(kits["tiny-clip"], clip, sample_rows(args.clip_rows, 2, os.path.join(out, "clip-rows")),
                             args.clip_steps)
        with open(cut_file, "w") as f:
            json.dump({"cut": cut, "seconds": round(time.time() - t, 1)}, f)
    with open(cut_file) as f:
        cut = json.load(f)["cut"]
    print(f"scene CLIP fitted; cut clip_score >= {cut} (5th percentile of its matched pairs)", flush=True)

    t = time.time()
    mds = {"uncurated": os.path.join(out, "uncurated", "mds"), "curated": os.path.join(out, "curated", "mds")}
    convert(raw, mds["uncurated"], kits["tiny"], dedupe="bytes")
    convert(raw, mds["curated"], kits["tiny"], dedupe="near", embed=clip, where=f"clip_score >= {cut}")
    held_raw = os.path.join(out, "held-out", "raw")
    if not os.path.isdir(held_raw):
        write_raw([{**r, "url": f"https://example.com/{r['key']}.jpg"}
                   for r in sample_rows(args.held_out, 1, os.path.join(out, "held-out", "sample"))], held_raw)
    held = os.path.join(out, "held-out", "mds")
    convert(held_raw, held, kits["tiny"], dedupe="bytes")
    import ray
    ray.shutdown()  # the training and sampling processes have the CPUs to themselves
    print(f"converted in {time.time() - t:.0f} s", flush=True)

    keys = [r["key"] for r in rows]
    loss = HeldOutLoss(mds["uncurated"], held)
    results = {}
    for arm, data in mds.items():
        kept = what_was_kept(data, keys, truth, mismatched)

        def score(checkpoint):
            grid = os.path.join(os.path.dirname(checkpoint), "grid.png")
            return {**adherence(checkpoint, grid), "held_out_loss": loss(checkpoint, kits["tiny-mmdit"])}

        def describe(s):
            return (f"held-out loss {s['held_out_loss']:.4f}; colour {s['adherence']:.0%}; judge "
                    + ", ".join(f"{k} {v:.0%}" for k, v in s["judge"].items()))
        curve = train_recipe(RECIPE, kits["tiny-mmdit"], data, os.path.join(out, arm), args.batches, args.batches,
                             score, describe)
        results[arm] = {**kept, **curve["points"][-1], "train_cpu_seconds": round(curve["cpu_seconds"], 1)}

    u, c = results["uncurated"], results["curated"]
    tags = list(u["judge"])
    print(f"\n{'arm':>10} {'rows':>5} {'copies':>7} {'mismatched':>10} {'held-out':>9} {'colour':>7}"
          + "".join(f" {t:>14}" for t in tags) + f" {'train CPU-s':>11}")
    for arm, r in results.items():
        print(f"{arm:>10} {r['rows']:>5} {r['copies_left']:>7} {r['mismatched_left']:>10} {r['held_out_loss']:>9.4f} "
              f"{r['adherence']:>7.0%}" + "".join(f" {r['judge'][t]:>14.0%}" for t in tags)
              + f" {r['train_cpu_seconds']:>11,.0f}")
    print(f"curated / uncurated at {args.batches} batches: held-out loss {c['held_out_loss'] / u['held_out_loss']:.3f}x; "
          f"colour {100 * (c['adherence'] - u['adherence']):+.0f} points; "
          + ", ".join(f"{t} {100 * (c['judge'][t] - u['judge'][t]):+.0f} points" for t in tags)
          + f" (a 96-image score's noise: ~5 points); {time.time() - start:.0f} s in all")
    results["settings"] = {**vars(args), "cut": cut, "seconds": round(time.time() - start, 1)}
    with open(os.path.join(out, "results.json"), "w") as f:
        json.dump(results, f, indent=1, default=str)
    return results


if __name__ == "__main__":
    main()
