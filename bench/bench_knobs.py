"""The knob table: the tiny MMDiT recipe against each single change, measured in one run.

    python bench/bench_knobs.py [--batches 1500] [--out out/bench-knobs]
    python bench/bench_knobs.py --data digits --batches 2000 --every 500   # the real-data digits bench

Like PRX's single-knob ablations, at this repository's CPU scale. The baseline is
yamls/tiny-mmdit-flow-cpu.yaml (SD3's transformer, rectified flow, AdamW 1e-3, EMA 0.99, batch 32,
seed 17) on the demo's converted data; each other row changes one thing:

- ``muon``: ``optimizer.name=muon`` (timm's Muon on the hidden matrices, convolutions included (as 2-D), AdamW on the rest, same lr);
- ``qk-norm``: the transformer's queries and keys RMS-normalised (diffusers' ``qk_norm: rms_norm``, as the
  micro-budget kit has it; a copy of the tiny-mmdit kit with that one config key changed);
- ``decay-groups``: ``optimizer.decay=weights`` (norms, biases and embeddings not decayed);
- ``posthoc-ema``: the baseline's own run, which also tracks ``algorithms.posthoc_ema`` (sigma_rel 0.05
  and 0.10, a snapshot every ``batches / 15``), its average synthesised after training at each width of
  :data:`SWEEP`; the row is the width with the lowest held-out loss, the sweep printed below the table.
  Tracking changes no training weight, so the baseline and this row share one run (its CPU-seconds
  include the two extra averages, a few per cent of a step at this size).

Every row's scored weights are the ones generate samples: the EMA (the synthesised average for
``posthoc-ema``) of the last checkpoint. Adherence is bench_recipes' (the demo's six colour prompts x 16
images, guidance 3, 25 steps, seed 0: the colour score, and the scene judge's single-object and colour
categories); with ``--data digits`` it is bench_real's judged digit accuracy (ten prompts x 8 images).
The held-out loss is the mean of the eight fixed noise levels' losses (``model.eval_bins: 8`` with
``model.eval_protocol: all_levels``: every held-out sample at all eight bins' slice centres, pinned noise;
not MLPerf's one level a sample, which is noisier on this few samples) on a held-out set no run trains on: 256
sample rows of another seed (the digits' test split with ``--data digits``). CPU-seconds are the
training process's user + system time; sampling and scoring are not counted. With ``--every N`` each row
also scores a checkpoint every N batches and reports the first batch, and its CPU-seconds (allotted by
batch), at which adherence reached ``--target`` (the row's post-hoc EMA is scored at the end only).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

from bench_recipes import YAML, HeldOutLoss  # noqa: E402  (the knobs train the flow recipe; its held-out loss)
KNOBS = {"baseline": [], "muon": ["optimizer.name=muon"], "qk-norm": [], "decay-groups": ["optimizer.decay=weights"]}
TRACKED = (0.05, 0.10)
SWEEP = (0.02, 0.03, 0.05, 0.075, 0.10, 0.15, 0.20, 0.25)


def qk_norm_kit(base: str, out: str) -> str:
    """``base`` (the tiny-mmdit kit) with the transformer's ``qk_norm: rms_norm``; the rest linked."""
    from diffusers import SD3Transformer2DModel
    if os.path.exists(os.path.join(out, "transformer", "config.json")):
        return out
    os.makedirs(out, exist_ok=True)
    for entry in os.listdir(base):
        if entry != "transformer" and not os.path.exists(os.path.join(out, entry)):
            os.symlink(os.path.abspath(os.path.join(base, entry)), os.path.join(out, entry))
    config = dict(SD3Transformer2DModel.load_config(os.path.join(base, "transformer")))
    config = {k: v for k, v in config.items() if not k.startswith("_")}
    SD3Transformer2DModel(**dict(config, qk_norm="rms_norm")).save_pretrained(os.path.join(out, "transformer"))
    return out


def held_out_data(args, kit: str) -> tuple[str, str]:
    """(training MDS, held-out MDS) for ``--data``, converted once."""
    if args.data == "digits":
        import bench_real
        train = bench_real.ensure_data(str(ROOT / "out" / "bench-real"), kit)
        held = os.path.join(args.out, "digits-test")
        if not os.path.exists(os.path.join(held, "mds", "dataset.json")):
            bench_real._run([sys.executable, "-m", "diffusion.kit.digits", "--out", os.path.join(held, "raw"),
                             "--split", "test"])
            bench_real._run([sys.executable, "convert/laion_to_mds.py", "--input", os.path.join(held, "raw"),
                             "--output", os.path.join(held, "mds"), "--model", kit, "--resolutions", "64",
                             "--deterministic"])
        return train, os.path.join(held, "mds")
    import bench_recipes
    return bench_recipes.demo_held_out(args.out, kit)


def score(args, checkpoint: str, folder: str, judge) -> dict:
    if args.data == "digits":
        import bench_real
        return {"adherence": bench_real.judged_accuracy(checkpoint, judge, 8)}
    import bench_recipes
    scores = bench_recipes.adherence(checkpoint, os.path.join(folder, "grid.png"))
    return {"adherence": scores["adherence"], "single": scores["judge"].get("single_object"),
            "colour": scores["judge"].get("colors")}


def train(name: str, kit: str, mds: str, folder: str, batches: int, every: int, extra: list[str]) -> float:
    """Train one row into ``folder`` (its output in ``folder``.log); the run's CPU-seconds."""
    import resource
    import subprocess
    shutil.rmtree(folder, ignore_errors=True)  # snapshots of an earlier bench run would join the synthesis
    cmd = [sys.executable, "run.py", YAML, f"model.ref={kit}", f"data.train.path={mds}", f"trainer.save_folder={folder}",
           f"trainer.max_duration={batches}ba", f"trainer.save_interval={every}ba", "trainer.autoresume=false",
           "trainer.save_num_checkpoints_to_keep=-1", "callbacks.progress=null", *KNOBS[name], *extra]
    before = resource.getrusage(resource.RUSAGE_CHILDREN)
    with open(folder + ".log", "w") as log:
        subprocess.run(cmd, cwd=ROOT, check=True, stdout=log, stderr=subprocess.STDOUT)
    after = resource.getrusage(resource.RUSAGE_CHILDREN)
    return (after.ru_utime - before.ru_utime) + (after.ru_stime - before.ru_stime)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--batches", type=int, default=1500)
    p.add_argument("--data", choices=("demo", "digits"), default="demo")
    p.add_argument("--out", default=None, help="default: out/bench-knobs (out/bench-knobs-digits)")
    p.add_argument("--knobs", nargs="+", default=list(KNOBS), choices=list(KNOBS))
    p.add_argument("--every", type=int, default=None, help="also score a checkpoint every N batches (default: the end)")
    p.add_argument("--target", type=float, default=0.8, help="with --every: the adherence to report batches to")
    args = p.parse_args(argv)
    args.every = min(args.every or args.batches, args.batches)
    args.out = args.out or str(ROOT / "out" / ("bench-knobs-digits" if args.data == "digits" else "bench-knobs"))
    from diffusion.kit.build import ensure_kit
    from diffusion.posthoc_ema import write_checkpoint
    unet_kit = str(ensure_kit("tiny", ROOT / ".cache" / "kit" / "tiny", progress=False))
    mmdit_kit = str(ensure_kit("tiny-mmdit", ROOT / ".cache" / "kit" / "tiny-mmdit", progress=False))
    kits = {name: mmdit_kit for name in KNOBS}
    kits["qk-norm"] = qk_norm_kit(mmdit_kit, os.path.join(args.out, "kit-qk-norm"))
    mds, held_out = held_out_data(args, unet_kit)
    loss = HeldOutLoss(mds, held_out)
    judge = None
    if args.data == "digits":
        from diffusion.kit.digits import DigitJudge
        judge = DigitJudge()
    rows, sweep, start = {}, [], time.time()
    every = max(1, args.batches // 15)
    for name in args.knobs:
        folder = os.path.join(args.out, name)
        extra = ([f"algorithms.posthoc_ema={{sigma_rels: [{', '.join(map(str, TRACKED))}], snapshot_every: {every}ba}}"]
                 if name == "baseline" else [])
        cpu = train(name, kits[name], mds, folder, args.batches, args.every, extra)
        checkpoint = os.path.join(folder, "latest-rank0.pt")
        rows[name] = {"cpu_seconds": cpu, "loss": loss(checkpoint, kits[name])}
        points = []
        for batch in range(args.every, args.batches + 1, args.every):  # the last one is latest-rank0.pt
            at = next(str(c) for c in pathlib.Path(folder).glob(f"ep*-ba{batch}-rank0.pt"))
            points.append({"batch": batch, "cpu_seconds": cpu * batch / args.batches, **score(args, at, folder, judge)})
            print(f"{name:>13} batch {batch:>5}: adherence {points[-1]['adherence']:.0%}", flush=True)
        rows[name].update({k: v for k, v in points[-1].items() if k not in ("batch", "cpu_seconds")})
        if len(points) > 1:
            rows[name]["points"] = points
            rows[name]["to_target"] = next((pt for pt in points if pt["adherence"] >= args.target), None)
        print(f"{name:>13}: {cpu:,.0f} CPU-s, held-out loss {rows[name]['loss']:.4f}, adherence "
              f"{rows[name]['adherence']:.0%}", flush=True)
        if name == "baseline":
            for sigma_rel in SWEEP:
                out = os.path.join(args.out, "posthoc-ema", f"ema-{sigma_rel}.pt")
                info = write_checkpoint(folder, out, sigma_rel)
                sweep.append({"sigma_rel": sigma_rel, "loss": loss(out, mmdit_kit), "residual": info["residual"],
                              "checkpoint": out})
                print(f"  posthoc sigma_rel {sigma_rel}: held-out loss {sweep[-1]['loss']:.4f} (profile error "
                      f"{info['residual']:.1%})", flush=True)
            best = min(sweep, key=lambda s: s["loss"])
            rows["posthoc-ema"] = {"cpu_seconds": cpu, "loss": best["loss"], "sigma_rel": best["sigma_rel"],
                                   **score(args, best["checkpoint"], os.path.dirname(best["checkpoint"]), judge)}

    print(f"\n{args.batches} batches each, data {args.data}; adherence: "
          + ("judged digit accuracy (80 images, chance 10%)" if args.data == "digits"
             else "colour score of 96 images (chance 17%); single/colour: the scene judge's categories"))
    extra_cols = "" if args.data == "digits" else f" {'single':>7} {'colour':>7}"
    curves = any("points" in row for row in rows.values())
    extra_cols += f" {'to ' + format(args.target, '.0%') + ': batch':>16} {'CPU-s':>6}" if curves else ""
    print(f"{'knob':>28} {'CPU-s':>7} {'held-out loss':>14} {'adherence':>10}{extra_cols}")
    base = rows.get("baseline")
    for name, row in rows.items():
        label = name + (f" (sigma_rel {row['sigma_rel']})" if "sigma_rel" in row else "")
        delta = f" ({row['loss'] - base['loss']:+.4f})" if base and name != "baseline" else ""
        cols = "" if args.data == "digits" else f" {row['single']:>7.0%} {row['colour']:>7.0%}"
        hit = row.get("to_target")
        cols += ("" if not curves else f" {hit['batch']:>16} {hit['cpu_seconds']:>6,.0f}" if hit
                 else f" {'never' if 'points' in row else '-':>16} {'':>6}")
        print(f"{label:>28} {row['cpu_seconds']:>7,.0f} {row['loss']:>7.4f}{delta:>10} {row['adherence']:>7.0%}{cols}")
    if sweep:
        print("posthoc-ema sweep (held-out loss by sigma_rel): "
              + ", ".join(f"{s['sigma_rel']}: {s['loss']:.4f}" for s in sweep))
    print(f"wall {time.time() - start:,.0f} s")
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "knobs.json"), "w") as f:
        json.dump({"batches": args.batches, "data": args.data, "rows": rows, "sweep": sweep}, f, indent=1)
    return rows


if __name__ == "__main__":
    main()
