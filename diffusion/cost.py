"""Cost model: GPU-hours, days and dollars of a multi-phase training schedule at given throughputs.

    python -m diffusion.cost                                  # MosaicML's 8xA100 recipe (the defaults)
    python -m diffusion.cost --gpus 64 --price 1.5
    python -m diffusion.cost --per node --throughput-256 1100 --throughput-512 290
    python -m diffusion.cost --from-run 256=runs/phase1/log.txt --gpus 128

Throughputs are images/s **per GPU** unless ``--per node`` (then per node of ``--gpus-per-node``).
Wall-clock time assumes perfect scaling over ``--gpus``: days = GPU-hours / gpus / 24.
``--from-run RES=PATH`` reads the per-GPU throughput a training run measured (the last
``throughput/device/samples_per_sec`` Composer's SpeedMonitor logged, else the global
``throughput/samples_per_sec`` divided by ``--run-gpus``) from a text log, a JSON / JSON-lines metrics
file, or a run directory (wandb offline run dirs hold ``files/wandb-summary.json``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import re

# MosaicML's published SD2-base recipe on one 8xA100 node (node totals: 1,100 and 290 img/s).
RECIPE_SAMPLES = {256: 2048 * 550_000, 512: 2048 * 850_000}
RECIPE_PER_GPU = {256: 1100 / 8, 512: 290 / 8}

DEVICE_KEY = "throughput/device/samples_per_sec"  # SpeedMonitor, per device
GLOBAL_KEY = "throughput/samples_per_sec"  # SpeedMonitor, all devices together
OWN_KEY = "cost/samples_per_sec_per_gpu"  # what diffusion.callbacks.cost logs


@dataclasses.dataclass
class Phase:
    resolution: int
    samples: int
    samples_per_sec_per_gpu: float
    source: str = "given"  # where the throughput came from

    @property
    def gpu_hours(self) -> float:
        if self.samples_per_sec_per_gpu <= 0:
            raise ValueError(f"phase {self.resolution}px: throughput must be positive, got {self.samples_per_sec_per_gpu}")
        return self.samples / self.samples_per_sec_per_gpu / 3600


@dataclasses.dataclass
class CostProjection:
    phases: list[Phase]
    gpus: int
    price_per_gpu_hour: float

    @property
    def gpu_hours(self) -> float:
        return sum(p.gpu_hours for p in self.phases)

    @property
    def days(self) -> float:
        return self.gpu_hours / self.gpus / 24

    @property
    def dollars(self) -> float:
        return self.gpu_hours * self.price_per_gpu_hour

    def table(self) -> str:
        """The projection as a fixed-width table, one row per phase and a total."""
        head = f"{'phase':>7} {'samples':>15} {'img/s/GPU':>10} {'img/s total':>12} {'GPU-hours':>11} {'days':>8} {'$':>12}  throughput from"
        rows = [head, "-" * len(head)]
        for p in self.phases:
            rows.append(f"{p.resolution:>5}px {p.samples:>15,} {p.samples_per_sec_per_gpu:>10.2f} "
                        f"{p.samples_per_sec_per_gpu * self.gpus:>12,.1f} {p.gpu_hours:>11,.1f} "
                        f"{p.gpu_hours / self.gpus / 24:>8.2f} {p.gpu_hours * self.price_per_gpu_hour:>12,.0f}  {p.source}")
        total = sum(p.samples for p in self.phases)
        rows.append(f"{'total':>7} {total:>15,} {'':>10} {'':>12} {self.gpu_hours:>11,.1f} {self.days:>8.2f} "
                    f"{self.dollars:>12,.0f}")
        rows.append(f"{self.gpus} GPUs at ${self.price_per_gpu_hour:g}/GPU-hour: {self.days:.2f} days, "
                    f"{self.gpu_hours:,.0f} GPU-hours, ${self.dollars:,.0f}")
        return "\n".join(rows)


def project_cost(samples: dict[int, int], samples_per_sec_per_gpu: dict[int, float], gpus: int = 8,
                 price_per_gpu_hour: float = 2.0, sources: dict[int, str] | None = None) -> CostProjection:
    """Project the schedule ``{resolution: samples}`` at ``{resolution: img/s per GPU}`` on ``gpus`` GPUs."""
    if gpus < 1:
        raise ValueError(f"gpus must be >= 1, got {gpus}")
    missing = [r for r in samples if r not in samples_per_sec_per_gpu]
    if missing:
        raise ValueError(f"no throughput for the {', '.join(map(str, missing))}px phase")
    phases = [Phase(int(r), int(n), float(samples_per_sec_per_gpu[r]), (sources or {}).get(r, "given"))
              for r, n in sorted(samples.items())]
    return CostProjection(phases, int(gpus), float(price_per_gpu_hour))


# ---- reading a run's measured throughput -------------------------------------------------------
_NUMBER = r"([-+]?(?:\d+\.?\d*|\.\d+)(?:[eE][-+]?\d+)?)"


def _last_in_text(text: str, key: str) -> float | None:
    matches = re.findall(re.escape(key) + r"[\"']?\s*[:=,]?\s*" + _NUMBER, text)
    return float(matches[-1]) if matches else None


def _last_in_json(text: str, key: str) -> float | None:
    try:
        docs = [json.loads(text)]
    except json.JSONDecodeError:  # JSON lines
        docs = []
        for line in text.splitlines():
            try:
                docs.append(json.loads(line))
            except json.JSONDecodeError:
                continue
    found = None
    for doc in docs:
        for record in (doc if isinstance(doc, list) else [doc]):
            if isinstance(record, dict) and isinstance(record.get(key), (int, float)):
                found = float(record[key])
    return found


def _candidate_files(path: str) -> list[str]:
    if os.path.isfile(path):
        return [path]
    if not os.path.isdir(path):
        raise FileNotFoundError(f"--from-run: {path} is neither a file nor a directory")
    found = []
    for root, _, files in os.walk(path):
        found += [os.path.join(root, f) for f in files if f.endswith((".json", ".jsonl", ".log", ".txt"))]
    return sorted(found, key=os.path.getmtime, reverse=True)  # newest first


def throughput_from_run(path: str, run_gpus: int | None = None) -> float:
    """Per-GPU images/s measured by a training run (see the module docstring for what is read)."""
    for file in _candidate_files(path):
        with open(file, errors="replace") as f:
            text = f.read()
        read = _last_in_json if file.endswith((".json", ".jsonl")) else _last_in_text
        for key in (DEVICE_KEY, OWN_KEY):
            value = read(text, key)
            if value is not None:
                return value
        value = read(text, GLOBAL_KEY)
        if value is not None:
            if not run_gpus:
                raise ValueError(f"{file} logs only the global {GLOBAL_KEY}; pass --run-gpus (the run's GPU count)")
            return value / run_gpus
    raise ValueError(f"no {DEVICE_KEY}, {OWN_KEY} or {GLOBAL_KEY} value found in {path} "
                     f"(add Composer's SpeedMonitor or diffusion.callbacks.cost.CostProjection to the run)")


# ---- command line -----------------------------------------------------------------------------
def parse_count(text: str) -> int:
    """'2048x550k' -> 1,126,400,000; accepts k/M/B suffixes and 'x' or '*' products."""
    scale = {"k": 1e3, "m": 1e6, "b": 1e9}
    total = 1.0
    for part in re.split(r"[x*]", text.replace(",", "").replace("_", "").strip().lower()):
        if not part:
            raise ValueError(f"bad count {text!r}")
        mult = scale.get(part[-1], 1)
        total *= float(part[:-1] if part[-1] in scale else part) * mult
    return int(round(total))


DESCRIPTION = """Project GPU-hours, days and dollars of a two-phase training schedule (256 px, then 512 px).

Input: samples per phase, throughput per phase (images/s per GPU, or per node with --per node; or
measured: --from-run reads what a training run logged), GPUs and $ per GPU-hour; the defaults are
MosaicML's published SD2-base recipe on 8xA100. Output: a table on stdout of each phase's samples,
throughput, GPU-hours, days (assuming perfect scaling over --gpus) and dollars, and the total."""
EXAMPLES = """examples:
  python -m diffusion.cost                                  # MosaicML's 8xA100 recipe: 81.33 days, $31,230
  python -m diffusion.cost --gpus 64 --price 1.5
  python -m diffusion.cost --per node --throughput-256 1100 --throughput-512 290
  python -m diffusion.cost --from-run 256=runs/phase1/log.txt --run-gpus 8 --gpus 128"""


def _positive(kind, allow_zero: bool = False):
    """An argparse type: a number of ``kind`` above zero (or at least zero)."""
    def convert(text: str):
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not (value >= 0 if allow_zero else value > 0):  # NaN fails both
            raise argparse.ArgumentTypeError(f"{text} must be {'0 or more' if allow_zero else 'above 0'}")
        return value
    convert.__name__ = kind.__name__
    return convert


def main(argv=None) -> CostProjection:
    p = argparse.ArgumentParser(prog="python -m diffusion.cost", description=DESCRIPTION, epilog=EXAMPLES,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--samples-256", type=_positive(parse_count, allow_zero=True), default=RECIPE_SAMPLES[256],
                   help="samples seen at 256 px, e.g. 2048x550k (default) or 1.13e9")
    p.add_argument("--samples-512", type=_positive(parse_count, allow_zero=True), default=RECIPE_SAMPLES[512],
                   help="samples seen at 512 px, e.g. 2048x850k (default)")
    p.add_argument("--throughput-256", type=_positive(float),
                   help="img/s at 256 (default: MosaicML's 1,100 per 8xA100 node)")
    p.add_argument("--throughput-512", type=_positive(float),
                   help="img/s at 512 (default: MosaicML's 290 per 8xA100 node)")
    p.add_argument("--per", choices=("gpu", "node"), default="gpu", help="the throughputs are per GPU or per node")
    p.add_argument("--gpus-per-node", type=_positive(int), default=8,
                   help="GPUs in a node, for --per node (default: 8)")
    p.add_argument("--gpus", type=_positive(int), default=8, help="GPUs the schedule runs on (default: 8)")
    p.add_argument("--price", type=_positive(float, allow_zero=True), default=2.0,
                   help="$ per GPU-hour (default: 2.0)")
    p.add_argument("--from-run", action="append", default=[], metavar="RES=PATH",
                   help="take the per-GPU throughput at RES from a training run's log/metrics file or dir")
    p.add_argument("--run-gpus", type=_positive(int),
                   help="GPUs of the --from-run run (when it logged only global img/s)")
    args = p.parse_args(argv)

    per_gpu, sources = dict(RECIPE_PER_GPU), {r: "MosaicML 8xA100" for r in RECIPE_PER_GPU}
    divisor = args.gpus_per_node if args.per == "node" else 1
    for res, value in ((256, args.throughput_256), (512, args.throughput_512)):
        if value is not None:
            per_gpu[res], sources[res] = value / divisor, f"--throughput-{res} (per {args.per})"
    for spec in args.from_run:
        res, sep, path = spec.partition("=")
        if not sep or not res.isdigit() or int(res) not in (256, 512):
            p.error(f"--from-run takes RES=PATH with RES 256 or 512, got {spec!r}")
        try:
            per_gpu[int(res)], sources[int(res)] = throughput_from_run(path, args.run_gpus), path
        except (OSError, ValueError) as e:
            p.error(str(e))
    projection = project_cost({256: args.samples_256, 512: args.samples_512}, per_gpu, args.gpus, args.price, sources)
    print(projection.table())
    return projection


if __name__ == "__main__":
    from diffusion import cli
    cli.run(main, "cost")
