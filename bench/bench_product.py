"""The product path timed: `run.py` on an sd2-base YAML over MDS shards, beside the bench loop (issue 52).

    python bench/bench_product.py --kit .cache/kit/sd2-base --resolution 256 --batch-size 64
    python bench/bench_product.py --kit .cache/kit/tiny --resolution 64 --batch-size 8 --batches 12 \
        --backend aot_eager --yaml yamls/sd2-base-256.yaml           # CPU smoke run

Writes synthetic MDS shards with the converter's columns (``bench_loader.write_synthetic``: random latents and
text embeddings, so no VAE or encoder runs) and a held-out set whose size leaves a partial last eval batch,
then trains each variant through ``composer -n 1 run.py YAML`` with the YAML's callbacks (speed monitor, cost
projection, ...; the image logger only with ``--image-logger``, as it needs VAE and text encoder weights), its
FSDP setting or none, eager or compiled per block. Images/s are the speed monitor's (Composer pauses its clock
during evals), read from the console log at the last logged batch; the first batches (compilation) fall outside
its window when ``--batches`` exceeds twice the window.
The bench loop (``bench_train.py``, eager, the same batch) runs in the same invocation, so the table ends with
the framework's cost as run.py's rate over the loop's. ``--profile VARIANT`` runs that variant under torch's profiler
(``bench/profile_run.py``) to say where the rest goes.
"""

from __future__ import annotations

import argparse
import contextlib
import os
import pathlib
import re
import shutil
import signal
import subprocess
import sys
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "bench"))

VARIANTS = {  # name -> run.py overrides on top of the YAML's
    "fsdp-eager": [],
    "fsdp-compile": ["trainer.compile=true"],
    "eager": ["trainer.fsdp=null"],
    "compile": ["trainer.fsdp=null", "trainer.compile=true"],
    # the FSDP eager run without the per-step extras: the optimizer and memory monitors, the pre-clip norm each step
    "fsdp-eager-lean": ["callbacks.optimizer_monitor=null", "callbacks.memory_monitor=null",
                        "trainer.grad_norm_log_interval=1000"],
}


def text_dim(kit: str) -> int:
    from diffusion.models import loading
    return loading.text_encoder_width(loading.load_text_encoder_config(kit))


def run_bounded(command: list[str], log, timeout: float):
    """``command``'s exit status, or "timeout" after ``timeout`` s: then its whole process group is stopped (the
    launcher's ranks too, which would otherwise go on training beside the next variant)."""
    process = subprocess.Popen(command, cwd=ROOT, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        return process.wait(timeout=timeout)
    except subprocess.TimeoutExpired:
        for sig, grace in ((signal.SIGTERM, 30), (signal.SIGKILL, 10)):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(process.pid, sig)
            with contextlib.suppress(subprocess.TimeoutExpired):
                process.wait(timeout=grace)
                break
        return "timeout"


def run_variant(name: str, args, train: str, heldout: str, out: str) -> dict:
    window = max(2, min(10, args.batches // 3))
    overrides = [
        f"model.ref={args.kit}", f"model.resolution={args.resolution}",
        f"data.train.path={train}", "data.train.local=null", f"data.train.batch_size={args.batch_size}",
        f"data.train.num_workers={args.workers}",
        f"data.eval.path={heldout}", "data.eval.local=null", f"data.eval.batch_size={args.batch_size}",
        "data.eval.num_samples=null",
        f"trainer.max_duration={args.batches}ba", f"trainer.eval_interval={args.eval_interval}ba",
        f"trainer.device_train_microbatch_size={args.batch_size}", "trainer.save_folder=null",
        "trainer.autoresume=false", f"trainer.run_name=product-{name}",
        "loggers.wandb=null", "loggers.progress_bar=null", f"loggers.console={{log_interval: {window}ba}}",
        f"callbacks.speed_monitor={{window_size: {window}}}", f"callbacks.cost_projection.resolution={args.resolution}",
        *VARIANTS[name], *([] if args.image_logger else ["callbacks.image_logger=null"]), *args.overrides,
    ]
    if args.device == "cpu":
        overrides.append("trainer.precision=fp32")  # Composer has no bf16 autocast on CPU
    if args.backend != "inductor":
        overrides.append(f"trainer.compile_backend={args.backend}")
    script = ["run.py"]
    if name in (args.profile or ()):  # the same run under torch's profiler (bench/profile_run.py)
        script = ["bench/profile_run.py", os.path.join(args.out, f"profile-{name}")]
    command = [sys.executable, "-m", "composer.cli.launcher", "-n", "1", *script, args.yaml, *overrides]
    log = os.path.join(out, f"run-{name}.log")
    start = time.perf_counter()
    with open(log, "w") as f:
        f.write(" ".join(command) + "\n")
        f.flush()
        rc = run_bounded(command, f, args.timeout)
    wall = time.perf_counter() - start
    text = pathlib.Path(log).read_text(errors="replace")
    rates = [float(x) for x in re.findall(r"throughput/device/samples_per_sec: ([0-9.eE+-]+)", text)]
    losses = re.findall(r"metrics/eval/\S*[Ll]oss\S*: ([0-9.eE+-]+)", text)
    return {"variant": name, "rc": rc, "wall_s": wall, "img_s": rates[-1] if rates else None,
            "evals": len(losses), "eval_loss": float(losses[-1]) if losses else None,
            "recompile_failures": text.count("FailOnRecompileLimitHit") + text.count("RecompileLimitExceeded")}


def bench_loop(args, out: str) -> float | None:
    log = os.path.join(out, "bench-train.log")
    command = [sys.executable, "bench/bench_train.py", "--kit", args.kit, "--resolutions", str(args.resolution),
               "--batch-size", str(args.batch_size), "--variants", "eager", "--steps", str(args.loop_steps),
               "--warmup", "3", *(["--device", "cpu"] if args.device == "cpu" else [])]
    with open(log, "w") as f:
        run_bounded(command, f, args.timeout)
    text = pathlib.Path(log).read_text(errors="replace")
    for line in text.splitlines():  # "  256 eager   64   516.0  ..." (resolution, variant, batch, img/s/GPU)
        cells = line.split()
        if len(cells) > 3 and cells[0] == str(args.resolution) and cells[1] == "eager":
            return float(cells[3])
    return None


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--kit", default=".cache/kit/sd2-base")
    p.add_argument("--yaml", default=None, help="default yamls/sd2-base-<resolution>.yaml (256 or 512)")
    p.add_argument("--resolution", type=int, default=256)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--batches", type=int, default=40)
    p.add_argument("--eval-interval", type=int, default=None, help="default batches // 2 (two evals)")
    p.add_argument("--eval-samples", type=int, default=None, help="default 1.5 batches (a partial last batch)")
    p.add_argument("--variants", nargs="+", default=list(VARIANTS), choices=list(VARIANTS))
    p.add_argument("--backend", default="inductor")
    p.add_argument("--workers", type=int, default=4)
    p.add_argument("--loop-steps", type=int, default=15)
    p.add_argument("--no-loop", action="store_true")
    p.add_argument("--device", default=None)
    p.add_argument("--timeout", type=float, default=600)
    p.add_argument("--profile", nargs="*", choices=list(VARIANTS), default=None,
                   help="these variants run under torch's profiler (bench/profile_run.py): OUT/profile-VARIANT/profile.txt "
                        "and trace.json (PROFILE_BATCHES=first:count, default 15:3)")
    p.add_argument("--image-logger", action="store_true",
                   help="keep the YAML's image logger (needs a model reference with VAE and text encoder weights; "
                        "the sd2-base kit has configs only)")
    p.add_argument("--overrides", nargs="*", default=[], help="more run.py key=value for every variant")
    p.add_argument("--out", default=os.environ.get("OUT", "out/product"))
    args = p.parse_args(argv)
    import torch
    args.device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    args.yaml = args.yaml or f"yamls/sd2-base-{512 if args.resolution >= 512 else 256}.yaml"
    args.eval_interval = args.eval_interval or max(1, args.batches // 2)
    args.kit, args.out = os.path.abspath(args.kit), os.path.abspath(args.out)  # the runs start in the repo root
    if args.yaml and not os.path.isabs(args.yaml) and os.path.exists(args.yaml):
        args.yaml = os.path.abspath(args.yaml)
    os.makedirs(args.out, exist_ok=True)
    if args.profile:  # 3 steady batches past the first eval (and its compilation), no eval after any of them
        def clear(first):  # an eval runs after the batches numbered k * eval_interval, inside the next one's time
            return all(b % args.eval_interval for b in range(first - 1, first + 2)) and first + 2 <= args.batches
        first = next((f for f in range(args.eval_interval + 2, args.batches) if clear(f)), max(2, args.batches - 2))
        os.environ.setdefault("PROFILE_BATCHES", f"{first}:3")

    from bench_loader import write_synthetic
    n = args.batch_size * min(args.batches, 24)  # the loader loops epochs; fewer rows, less writing
    held_out, width = args.eval_samples or args.batch_size * 3 // 2, text_dim(args.kit)
    data = os.path.join(args.out if args.device == "cpu" else "/tmp", f"product-data-{args.resolution}px-{width}-{n}-{held_out}")
    train, heldout = os.path.join(data, "train"), os.path.join(data, "heldout")
    if not os.path.exists(os.path.join(heldout, "index.json")):  # written last: a whole set
        shutil.rmtree(data, ignore_errors=True)
        write_synthetic(train, n, args.resolution, width, seed=0)
        write_synthetic(heldout, held_out, args.resolution, width, seed=1)

    loop = None if args.no_loop else bench_loop(args, args.out)
    print(f"run.py {args.yaml} on {args.kit}, {args.resolution} px, batch {args.batch_size}, {args.batches} batches, "
          f"evals every {args.eval_interval}; bench loop (eager): {loop if loop is not None else '-'} img/s", flush=True)
    print("| variant | exit | img/s (speed monitor) | / bench loop | evals | last eval loss | recompile failures | wall s |")
    print("|---|---|---:|---:|---:|---:|---:|---:|", flush=True)
    rows = []
    for name in args.variants:  # a row as each finishes: an outer timeout keeps what ran
        r = run_variant(name, args, train, heldout, args.out)
        rows.append(r)
        ratio = f"{r['img_s'] / loop:.2f}" if r["img_s"] and loop else "-"
        rate = f"{r['img_s']:.1f}" if r["img_s"] else "-"
        loss = f"{r['eval_loss']:.4f}" if r["eval_loss"] is not None else "-"
        print(f"| {r['variant']} | {r['rc']} | {rate} | {ratio} | {r['evals']} | {loss} | "
              f"{r['recompile_failures']} | {r['wall_s']:.0f} |", flush=True)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
