"""Online vs offline training on the same tiny setup: steps/s, and where the time goes.

    python bench/bench_online.py [--rows 192] [--batches 20] [--batch-size 8] [--resolution 64]
    python bench/bench_online.py --kit /path/to/sd2-with-weights --resolution 256 --gpu   # on a GPU node

Offline = convert the raw sample data to MDS once (``diffusion.convert.pipeline``), then train with the
trainer ``run.py`` builds (one process, the whole global batch). Online = ``diffusion.online``: the same
transform and encode operators on Ray feeding 2 Ray Train workers (half the batch each). Both train the
same model for the same number of batches at the same global batch size.

Steps/s comes from the median step time after the first ``--warmup`` batches (a shared machine's load
spikes would dominate a mean). Where the time goes: transform and encode are actor-seconds per image
(the pipeline's own per-row timings), train is the step time less the median time a step waited for
its batch (data wait; offline, the MDS loader's wait is inside the step).
"""

from __future__ import annotations

import argparse
import os
import pathlib
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1]))

from diffusion.convert import encoders, transforms  # noqa: E402

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY_YAML = str(ROOT / "yamls" / "tiny-cpu.yaml")


def steady_rate(times: list[float], warmup: int) -> tuple[float, float]:
    """(steps/s, s/step) from the median step time after ``warmup`` batches (robust to load spikes)."""
    steps = np.diff(times[warmup:])
    if len(steps) == 0:
        return float("nan"), float("nan")
    per_step = float(np.median(steps))
    return 1.0 / per_step, per_step


def torch_threads() -> int:
    import torch
    return torch.get_num_threads()


def common_overrides(args, work: str) -> list[str]:
    return [f"model.ref={args.kit}", f"model.resolution={args.resolution}", f"data.train.batch_size={args.batch_size}",
            f"trainer.max_duration={args.batches}ba", "trainer.save_folder=null", "trainer.autoresume=false",
            "loggers={}", "callbacks={}", "scheduler.t_warmup=0ba",
            f"trainer.device={'gpu' if args.gpu else 'cpu'}"]


def run_offline(args, raw: str, work: str) -> dict:
    from diffusion.train.config import load_config
    from diffusion.convert.pipeline import ConvertConfig, run_conversion
    from diffusion.stream.ray_workers import LossHistory
    from diffusion.train.trainer import build_trainer

    mds = os.path.join(work, "mds")
    start = time.perf_counter()
    summary = run_conversion(ConvertConfig(input=raw, output=mds, model=args.kit, resolutions=(args.resolution,),
                                           progress=False))
    convert_seconds = time.perf_counter() - start
    cfg = load_config(TINY_YAML, common_overrides(args, work) + [f"data.train.path={mds}", "data.train.num_workers=0"])
    import torch
    torch.set_num_threads(args.offline_threads)
    history = LossHistory()
    trainer = build_trainer(cfg, extra_callbacks=[history])
    trainer.fit()
    trainer.close()
    steps_per_s, per_step = steady_rate(history.times, args.warmup)
    # The sink records the stage timings under their names without the underscores.
    per_image = {name: seconds / max(summary.written, 1) for name, seconds in summary.stage_seconds.items()}
    return {"steps_per_s": steps_per_s, "s_per_step": per_step, "wait_per_step": 0.0,
            "transform_ms": 1e3 * per_image.get(transforms.STAGE_SECONDS.strip("_"), float("nan")),
            "encode_ms": 1e3 * per_image.get(encoders.STAGE_SECONDS.strip("_"), float("nan")),
            "prep_seconds": convert_seconds, "losses": history.losses}


def run_online(args, raw: str, work: str) -> dict:
    from diffusion.train.config import load_config
    from diffusion.stream.ray_workers import run_online as train_online

    overrides = common_overrides(args, work) + [
        f"data.online.input={raw}", f"data.online.work_dir={os.path.join(work, 'online')}",
        f"data.online.num_train_workers={args.workers}", f"data.online.num_encoders={args.encoders}"]
    if args.gpu:  # share one GPU between the training workers and the encoders
        share = round(1.0 / (args.workers + args.encoders), 3)
        overrides += [f"data.online.train_gpus={share}", f"data.online.encoder_gpus={share}"]
    start = time.perf_counter()
    result = train_online(load_config(TINY_YAML, overrides))
    wall = time.perf_counter() - start
    steps_per_s, per_step = steady_rate(result.batch_times, args.warmup)
    steady_waits = result.batch_waits[args.warmup:] or [float("nan")]
    rows = max(result.rows, 1)
    return {"steps_per_s": steps_per_s, "s_per_step": per_step, "wait_per_step": float(np.median(steady_waits)),
            "transform_ms": 1e3 * result.stage_seconds.get(transforms.STAGE_SECONDS, float("nan")) / rows,
            "encode_ms": 1e3 * result.stage_seconds.get(encoders.STAGE_SECONDS, float("nan")) / rows,
            "prep_seconds": wall - per_step * len(result.losses) if per_step == per_step else wall,
            "losses": result.losses, "rejects": result.rejects}


def table(rows: dict) -> str:
    head = ("| mode | steps/s | s/step | data wait/step (s) | train/step (s) | transform ms/img | encode ms/img "
            "| startup or convert (s) |")
    lines = [head, "|" + "---|" * 8]
    for mode, r in rows.items():
        train = r["s_per_step"] - r["wait_per_step"]
        lines.append(f"| {mode} | {r['steps_per_s']:.3f} | {r['s_per_step']:.2f} | {r['wait_per_step']:.2f} | "
                     f"{train:.2f} | {r['transform_ms']:.1f} | {r['encode_ms']:.1f} | {r['prep_seconds']:.0f} |")
    return "\n".join(lines)


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kit", default=None, help="model directory (default: the tiny kit, built if missing)")
    p.add_argument("--rows", type=int, default=192, help="raw sample rows (a few are bad on purpose)")
    p.add_argument("--resolution", type=int, default=64)
    p.add_argument("--batches", type=int, default=20)
    p.add_argument("--warmup", type=int, default=3, help="batches left out of the rate")
    p.add_argument("--batch-size", type=int, default=8, help="global batch")
    p.add_argument("--workers", type=int, default=2, help="online training workers")
    p.add_argument("--encoders", type=int, default=1)
    p.add_argument("--cpus", type=float, default=None, help="local Ray's CPUs (default: the machine's)")
    p.add_argument("--gpu", action="store_true", help="train and encode on GPUs")
    p.add_argument("--offline-threads", type=int, default=torch_threads(),
                   help="torch threads of the offline trainer (Ray Train gives each online worker "
                        "as many as its CPUs, rounded up: 1 here)")
    p.add_argument("--only", choices=("offline", "online"), default=None)
    args = p.parse_args(argv)

    import ray
    from diffusion.kit.sample import write_sample_data
    if args.kit is None:
        from diffusion.kit.build import ensure_kit
        args.kit = str(ensure_kit("tiny", ROOT / ".cache" / "kit" / "tiny"))
    if not ray.is_initialized():
        ray.init(num_cpus=args.cpus, include_dashboard=False, log_to_driver=False, configure_logging=False)
    ray.data.DataContext.get_current().enable_progress_bars = False

    rows = {}
    with tempfile.TemporaryDirectory(prefix="bench-online-") as work:
        raw = os.path.join(work, "raw")
        write_sample_data(raw, n=args.rows, seed=0, rows_per_shard=32)
        if args.only in (None, "offline"):
            rows[f"offline (MDS, 1 process, {args.offline_threads} threads)"] = run_offline(args, raw, work)
        if args.only in (None, "online"):
            rows[f"online ({args.workers} Ray Train workers)"] = run_online(args, raw, work)
    print(f"\n{args.batches} batches of {args.batch_size} at {args.resolution}px, {args.rows} raw rows, "
          f"rate over batches {args.warmup + 1}-{args.batches}")
    print(table(rows))
    if len(rows) == 2:
        offline, online = rows.values()
        print(f"\nonline / offline steps/s: {online['steps_per_s'] / offline['steps_per_s']:.2f}x")
    return rows


if __name__ == "__main__":
    main()
