"""Training beside other work: samples per CPU-second of the tiny UNet alone and beside a competing load.

    python bench/bench_contention.py                       # before and after, alone and beside 1 busy loop per CPU
    python bench/bench_contention.py --load training       # the competing load: a second identical training
    python bench/bench_contention.py --variants after --seconds 30
    python bench/bench_contention.py --alone-nice -20      # the rows alone as on a quiet machine (root)

Each row trains yamls/tiny-cpu.yaml's tiny UNet (64 px, batch 32, fp32, CPU, loading in the training
process) on synthetic MDS shards, through the command's own start (:func:`diffusion.cli.run`, then the
pool sizing of ``run.py``), in a fresh process. After ``--warmup`` batches it measures wall time and the
process's CPU time (every thread) over the next batches, for at most ``--seconds``. Variants:

- ``before``: ``DIFFUSION_CPUS=off``, torch's defaults (one intra-op thread per CPU of the affinity
  mask; libgomp's threads spin at every barrier before they sleep), as every run was before.
- ``after``: the CPUs this process may use (:mod:`diffusion.cpus`), and the wait policy it chooses from the
  CPU pressure at start: ``OMP_WAIT_POLICY=PASSIVE`` where the machine is busy, libgomp's short spin where
  it is quiet (one run measures both sides: the row alone and the row beside the load).
- ``passive``: ``OMP_WAIT_POLICY=PASSIVE`` whatever the load (the policy before the choice at start).
- ``spin-N``: ``GOMP_SPINCOUNT=N``, a bounded spin of N iterations (about N/100 microseconds) then sleep.
- ``one-thread`` (on request): ``OMP_NUM_THREADS=1``, a user's own setting (it wins over the sizing).
- ``after-nowatch``: ``after`` without the watch that steps a spinning pool down while other work takes the
  CPUs (``DIFFUSION_CPU_WATCH=off``): threads chosen at start for the whole run.

Loads: ``alone``, and beside a competing load as large as the machine: one busy-loop process per usable
CPU (``--load busy``), or a second training of the same variant (``--load training``), or busy loops that
arrive once the measurement starts (``--load late``: a run that started on a quiet machine, then meets
other work; ``--assume-quiet-start`` has the command choose as on a quiet machine when this one is not). The headline is
samples per CPU-second beside the load over the same figure alone (goal: at least 0.5; a fair share of
the CPU changes samples/s, not the work a CPU-second buys).
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import subprocess
import sys
import tempfile
import time

ROOT = pathlib.Path(__file__).resolve().parents[1]
TINY_YAML = str(ROOT / "yamls" / "tiny-cpu.yaml")
VARIANTS = {"before": {"DIFFUSION_CPUS": "off"}, "after": {}, "one-thread": {"OMP_NUM_THREADS": "1"},
            "passive": {"OMP_WAIT_POLICY": "PASSIVE"}, "after-nowatch": {"DIFFUSION_CPU_WATCH": "off"}}
SPIN = "spin-"  # spin-N: GOMP_SPINCOUNT=N, the wait policy left to libgomp (a bounded spin, then sleep)


def variant_env(variant: str) -> dict:
    if variant.startswith(SPIN):
        return {"GOMP_SPINCOUNT": str(int(variant[len(SPIN):])), "OMP_WAIT_POLICY": ""}
    return VARIANTS[variant]
DEFAULT_VARIANTS = ["before", "after"]
RESULT = "RESULT "


def worker(data: str, batches: int, warmup: int, seconds: float) -> None:
    """One measured training, started as ``run.py`` starts one (in a fresh process); prints a RESULT line.
    Touches ``$BENCH_STARTED`` when the measurement starts (``--load late`` starts its loops then)."""
    from diffusion import cli, cpus
    if os.environ.get("BENCH_QUIET_START"):  # the choice a quiet machine gets, on a machine that is not
        cpus.busy_at_start = lambda: (False, "assumed by the bench")

    def main(argv):
        from diffusion import launch
        from diffusion.train.config import load_config
        cfg = load_config(TINY_YAML, [f"model.ref={data}/kit", f"data.train.path={data}/mds",
                                      f"trainer.max_duration={batches}ba", "trainer.save_folder=null",
                                      "trainer.autoresume=false", "loggers={}", "callbacks={}"])
        from composer.core import Callback

        import torch

        from diffusion.train.trainer import build_trainer
        launch._size_pools(cfg)  # what run.py does before it builds the trainer

        class Clock(Callback):
            def __init__(self):
                self.marks, self.losses, self.threads = [], [], []

            def batch_end(self, state, logger):
                self.marks.append((time.perf_counter(), time.process_time()))
                self.losses.append(float(state.loss))
                measured = len(self.marks) - 1 - warmup
                if measured == 0 and os.environ.get("BENCH_STARTED"):
                    open(os.environ["BENCH_STARTED"], "w").close()
                if measured >= 0:
                    self.threads.append(torch.get_num_threads())
                if measured >= 3 and self.marks[-1][0] - self.marks[warmup][0] > seconds:
                    state.stop_training()

        trainer = build_trainer(cfg)
        clock = Clock()
        trainer.state.callbacks.append(clock)
        trainer.fit()
        (w0, c0), (w1, c1) = clock.marks[warmup], clock.marks[-1]
        n = (len(clock.marks) - 1 - warmup) * cfg.data.train.batch_size
        print(RESULT + json.dumps({"samples": n, "wall": w1 - w0, "cpu": c1 - c0, "losses": clock.losses,
                                   "threads": "–".join(str(n) for n in sorted({min(clock.threads),
                                                                               max(clock.threads)})),
                                   "wait_policy": os.environ.get("OMP_WAIT_POLICY", "default") + (
                                       f", GOMP_SPINCOUNT={os.environ['GOMP_SPINCOUNT']}"
                                       if os.environ.get("GOMP_SPINCOUNT") else "") + (
                                       f" ({os.environ['DIFFUSION_OMP_WAIT']})"
                                       if os.environ.get("DIFFUSION_OMP_WAIT") else "")}), flush=True)
        trainer.close()

    cli.run(main, "bench_contention")


def _variant(text: str) -> str:
    if text in VARIANTS or (text.startswith(SPIN) and text[len(SPIN):].isdigit()):
        return text
    raise argparse.ArgumentTypeError(f"{text!r}: one of {', '.join(VARIANTS)}, or {SPIN}N")


def _env(variant: str) -> dict:
    env = {k: v for k, v in os.environ.items()
           if k not in ("OMP_NUM_THREADS", "OMP_WAIT_POLICY", "DIFFUSION_CPUS", "GOMP_SPINCOUNT")}
    return {**env, **variant_env(variant), "PYTHONPATH": str(ROOT)}


def _start(variant: str, data: str, batches: int, warmup: int, seconds: float, nice: int = 0,
           extra_env: dict | None = None) -> subprocess.Popen:
    def priority():
        if nice:
            os.setpriority(os.PRIO_PROCESS, 0, nice)
    return subprocess.Popen([sys.executable, __file__, "--worker", data, str(batches), str(warmup), str(seconds)],
                            env={**_env(variant), **(extra_env or {})}, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            preexec_fn=priority)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate()
    for line in out.splitlines():
        if line.startswith(RESULT):
            return json.loads(line[len(RESULT):])
    raise RuntimeError(f"the training failed (exit status {proc.returncode}):\n{err[-3000:]}")


def busy_loops(n: int) -> list[subprocess.Popen]:
    return [subprocess.Popen([sys.executable, "-c", "while True: pass"]) for _ in range(n)]


def measure(variant: str, load: str, args, data: str) -> dict:
    """One row: the measured training, alone or beside the competing load (stopped once it is done)."""
    competing, load_average = [], os.getloadavg()[0]
    if load == "busy":
        competing = busy_loops(args.cpus)
    elif load == "training":  # the same training, started first and running for longer than the measured one
        competing = [_start(variant, data, 100_000, 0, 1e9)]
    if not competing:  # the previous row's load has left the CPU pressure the command reads at start
        from diffusion import cpus
        deadline = time.monotonic() + 30
        while (cpus.cpu_pressure() or 0) >= cpus.BUSY_PRESSURE and time.monotonic() < deadline:
            time.sleep(1)
        load_average = os.getloadavg()[0]
    extra = {"BENCH_QUIET_START": "1"} if args.assume_quiet_start else {}
    try:
        time.sleep(3 if competing else 0)  # the load shows in the CPU pressure the command reads at start
        nice = args.alone_nice if load == "alone" else 0
        if load == "late":  # busy loops from the first measured batch: quiet at start, busy after
            started = os.path.join(data, f"started-{variant}")
            proc = _start(variant, data, args.batches, args.warmup, args.seconds, nice,
                          {**extra, "BENCH_STARTED": started})
            while not os.path.exists(started) and proc.poll() is None:
                time.sleep(0.05)
            competing = busy_loops(args.cpus)
            result = _result(proc)
            os.remove(started)
        else:
            result = _result(_start(variant, data, args.batches, args.warmup, args.seconds, nice, extra))
    finally:
        for proc in competing:
            proc.kill()
            proc.wait()
    result.update(variant=variant, load=load, load_average=load_average)
    return result


def table(rows: list[dict], load_name: str, at: int) -> str:
    head = (f"| variant | load | machine's load average at the start | threads | OMP_WAIT_POLICY | samples/s | "
            f"CPU-s | samples per CPU-s | loss at batch {at} |")
    lines = [head, "|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        lines.append(f"| {r['variant']} | {'alone' if r['load'] == 'alone' else load_name} | {r['load_average']:.1f} | "
                     f"{r['threads']} | {r['wait_policy']} | {r['samples'] / r['wall']:.1f} | {r['cpu']:.1f} | "
                     f"{r['samples'] / r['cpu']:.1f} | {r['losses'][at - 1]:.6f} |")
    return "\n".join(lines)


def headline(rows: list[dict]) -> list[str]:
    per_cpu = {(r["variant"], r["load"]): r["samples"] / r["cpu"] for r in rows}
    rate = {(r["variant"], r["load"]): r["samples"] / r["wall"] for r in rows}
    lines = []
    for variant in dict.fromkeys(r["variant"] for r in rows):
        alone = per_cpu.get((variant, "alone"))
        loaded = next((v for (var, load), v in per_cpu.items() if var == variant and load != "alone"), None)
        if alone and loaded:
            verdict = "goal met" if loaded / alone >= 0.5 else f"goal missed by {0.5 / (loaded / alone):.1f}x"
            lines.append(f"{variant}: samples per CPU-s beside the load / alone = {loaded / alone:.2f} "
                         f"(goal >= 0.5: {verdict})")
    spin = rate.get(("after-nowatch", "alone"))
    for variant in dict.fromkeys(r["variant"] for r in rows):
        if spin and (variant, "alone") in rate and variant != "after-nowatch":
            lines.append(f"{variant}: samples/s alone / after-nowatch's alone = {rate[(variant, 'alone')] / spin:.2f} "
                         f"(issue 48's goal on a quiet machine: >= 0.95)")
    loaded = {var: v for (var, load), v in rate.items() if load != "alone"}
    if "before" in loaded and "after" in loaded:
        lines.append(f"beside the load, after / before: {loaded['after'] / loaded['before']:.1f}x samples/s")
    return lines


def main(argv=None) -> list[dict]:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--variants", nargs="+", type=_variant, default=DEFAULT_VARIANTS,
                   help=f"{', '.join(VARIANTS)} or {SPIN}N; one-thread: OMP_NUM_THREADS=1, the user's own setting; "
                        f"passive: OMP_WAIT_POLICY=PASSIVE; {SPIN}N: GOMP_SPINCOUNT=N")
    p.add_argument("--load", choices=("busy", "training", "late", "none"), default="busy",
                   help="the competing load (late: busy loops from the first measured batch; none: alone only)")
    p.add_argument("--assume-quiet-start", action="store_true",
                   help="the command chooses its wait policy as on a quiet machine, whatever the load at start")
    p.add_argument("--samples", type=int, default=512, help="synthetic MDS samples (an epoch is samples/32 batches)")
    p.add_argument("--batches", type=int, default=200, help="at most this many batches per run")
    p.add_argument("--warmup", type=int, default=10, help="batches before the measurement starts")
    p.add_argument("--seconds", type=float, default=20.0, help="measure for about this long per run")
    p.add_argument("--alone-nice", type=int, default=0,
                   help="niceness of the rows alone: -20 (root) stands in for a quiet machine on a shared one, "
                        "where other users' work would otherwise compete with the row 'alone'")
    args = p.parse_args(argv)
    sys.path.insert(0, str(ROOT))
    sys.path.insert(0, str(ROOT / "tests"))
    from diffusion import cpus
    from train_fixtures import write_latent_mds, write_training_kit
    args.cpus = cpus.usable_cpus()
    load_name = (f"beside {args.cpus} busy loop{'s' * (args.cpus > 1)}" if args.load == "busy"
                 else f"{args.cpus} busy loops arriving at the first measured batch" if args.load == "late"
                 else "beside a second training")

    rows, load_average = [], os.getloadavg()[0]
    with tempfile.TemporaryDirectory(prefix="bench-contention-") as data:
        kit = write_training_kit(os.path.join(data, "kit"))
        write_latent_mds(os.path.join(data, "mds"), kit=kit, n=args.samples, resolution=64)
        for variant in args.variants:
            for load in ("alone", args.load)[:1 if args.load == "none" else 2]:
                rows.append(measure(variant, load, args, data))
                print(f"# {variant}, {load}: {rows[-1]['samples'] / rows[-1]['cpu']:.1f} samples per CPU-s", flush=True)
    print(f"\ntiny UNet, 64 px, batch 32, {args.cpus} usable CPUs (nproc {os.cpu_count()}), "
          f"load average at the start {load_average:.1f}; measured after {args.warmup} batches, "
          f"about {args.seconds:g} s per row" + (f"; the rows alone at niceness {args.alone_nice}" if args.alone_nice else ""))
    print(table(rows, load_name, args.warmup + 3))
    print()
    print("\n".join(headline(rows)))
    return rows


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--worker":
        sys.path.insert(0, str(ROOT))
        worker(sys.argv[2], int(sys.argv[3]), int(sys.argv[4]), float(sys.argv[5]))
    else:
        main()
