"""Cost model: GPU-hours, days and dollars of a multi-phase training schedule at given throughputs.

    python -m diffusion.cost                                  # MosaicML's 8xA100 recipe (the defaults)
    python -m diffusion.cost --gpus 64 --price 1.5
    python -m diffusion.cost --per node --throughput-256 1100 --throughput-512 290
    python -m diffusion.cost --from-run 256=runs/phase1/log.txt --gpus 128
    python -m diffusion.cost --text ids --stored-samples 2B   # shards of token ids: training encodes text
    python -m diffusion.cost --flops sd3-medium               # another denoiser at MosaicML's MFU
    python -m diffusion.cost --gflop-per-image 256=120 --gflop-per-image 512=480

Any recipe's training FLOPs per image (``--flops`` a named denoiser, counted by torch;
``--gflop-per-image RES=G`` any other) turn the default throughputs into that recipe's: MosaicML's
measured SD2 rate scaled by SD2's FLOPs over the recipe's, i.e. the same MFU on the same GPUs.
Throughputs are images/s **per GPU** unless ``--per node`` (then per node of ``--gpus-per-node``).
Wall-clock time assumes perfect scaling over ``--gpus``: days = GPU-hours / gpus / 24.
``--from-run RES=PATH`` reads the per-GPU throughput a training run measured (the last
``throughput/device/samples_per_sec`` Composer's SpeedMonitor logged, else the global
``throughput/samples_per_sec`` divided by ``--run-gpus``) from a text log, a JSON / JSON-lines metrics
file, or a run directory (wandb offline run dirs hold ``files/wandb-summary.json``).

Below the table, the text storage of the shards (the converter's ``--text``): bytes per
sample, TB stored and TB streamed per epoch and over the schedule for ``embeds`` (the text encoder's
output, 77x1024 float16) vs ``ids`` (the 77 token ids, int32), from SD2's shapes
(:func:`sample_bytes`), and the GPU time that encoding the text during training adds with ``ids``: an
estimate from FLOPs (:func:`text_encode_overhead`: SD2's text encoder over the training step of the denoiser
``--flops`` or ``--gflop-per-image`` names, SD2's UNet by default) until measured. ``--text ids`` also puts that
estimate into the table's throughputs (not into those a ``--from-run`` measured).
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import json
import math
import os
import re

from diffusion import schema

# MosaicML's published SD2-base recipe on one 8xA100 node (node totals: 1,100 and 290 img/s).
RECIPE_SAMPLES = {256: 2048 * 550_000, 512: 2048 * 850_000}
RECIPE_PER_GPU = {256: 1100 / 8, 512: 290 / 8}

DEVICE_KEY = "throughput/device/samples_per_sec"  # SpeedMonitor, per device
GLOBAL_KEY = "throughput/samples_per_sec"  # SpeedMonitor, all devices together
OWN_KEY = "cost/samples_per_sec_per_gpu"  # what diffusion.train.callbacks.cost logs


@dataclasses.dataclass
class Phase:
    resolution: int
    samples: int
    samples_per_sec_per_gpu: float
    source: str = "given"  # where the throughput came from
    name: str | None = None  # a recipe's phase label (default: the resolution)

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
    text_storage: "TextStorageProjection | None" = dataclasses.field(default=None, repr=False)  # set by main()

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
        head = f"{'phase':>16} {'samples':>15} {'img/s/GPU':>10} {'img/s total':>12} {'GPU-hours':>11} {'days':>8} {'$':>12}  throughput from"
        rows = [head, "-" * len(head)]
        for p in self.phases:
            label = (p.name or f"{p.resolution}px")[:16]
            rows.append(f"{label:>16} {p.samples:>15,} {p.samples_per_sec_per_gpu:>10.2f} "
                        f"{p.samples_per_sec_per_gpu * self.gpus:>12,.1f} {p.gpu_hours:>11,.1f} "
                        f"{p.gpu_hours / self.gpus / 24:>8.2f} {p.gpu_hours * self.price_per_gpu_hour:>12,.0f}  {p.source}")
        total = sum(p.samples for p in self.phases)
        rows.append(f"{'total':>16} {total:>15,} {'':>10} {'':>12} {self.gpu_hours:>11,.1f} {self.days:>8.2f} "
                    f"{self.dollars:>12,.0f}")
        rows.append(f"{self.gpus} GPUs at ${self.price_per_gpu_hour:g}/GPU-hour: {self.days:.2f} days, "
                    f"{self.gpu_hours:,.0f} GPU-hours, ${self.dollars:,.0f}")
        return "\n".join(rows)


def project_recipe(path: str) -> CostProjection:
    """A recipe file's projection: ``name``, ``gpus``, ``price_per_gpu_hour`` and ``phases``, each with
    ``resolution``, ``samples`` and ``samples_per_sec_per_gpu`` (and a ``name``); see yamls/cost/."""
    from diffusion.errors import InputError
    from diffusion.yaml_file import parse_yaml  # the training YAMLs' reader: one line naming line and column
    with open(path) as f:
        recipe = parse_yaml(f, path) or {}
    if not isinstance(recipe, dict) or not isinstance(recipe.get("phases") or [], list):
        raise InputError(f"{path}: expected a mapping with phases: a list of {{resolution, samples, "
                         f"samples_per_sec_per_gpu}}")

    def number(where: str, value, kind, positive: bool):
        """``value`` as a ``kind`` (YAML 1.1 reads 1e9 as a string), finite, above 0 or at least 0."""
        try:
            found = None if isinstance(value, bool) else value if isinstance(value, int) else float(value)
        except (TypeError, ValueError):
            found = None
        if (found is None or not math.isfinite(found) or not (found > 0 if positive else found >= 0)
                or kind is int and found != int(found)):
            raise InputError(f"{path}: {where}={value!r} must be a {'whole ' if kind is int else ''}number "
                             f"{'above 0' if positive else '>= 0'}")
        return kind(found)

    phases = []
    for i, phase in enumerate(recipe.get("phases") or []):
        if not isinstance(phase, dict):
            raise InputError(f"{path}: phases[{i}] is {phase!r}, not a mapping of resolution, samples, "
                             f"samples_per_sec_per_gpu")
        missing = [k for k in ("resolution", "samples", "samples_per_sec_per_gpu") if k not in phase]
        if missing:
            raise InputError(f"{path}: phases[{i}] lacks {', '.join(missing)}")
        phases.append(Phase(number(f"phases[{i}].resolution", phase["resolution"], int, True),
                            number(f"phases[{i}].samples", phase["samples"], int, False),
                            number(f"phases[{i}].samples_per_sec_per_gpu", phase["samples_per_sec_per_gpu"], float,
                                   True),
                            source=str(phase.get("source", recipe.get("name", path))),
                            name=str(phase["name"]) if phase.get("name") is not None else None))
    if not phases:
        raise InputError(f"{path}: no phases (a list of {{resolution, samples, samples_per_sec_per_gpu}})")
    return CostProjection(phases, number("gpus", recipe.get("gpus", 8), int, True),
                          number("price_per_gpu_hour", recipe.get("price_per_gpu_hour", 2.0), float, False))


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


# ---- any recipe's FLOPs per image (issue 26) ---------------------------------------------------------
RECIPES = ("sd2-unet", "sd3-medium", "flux-schnell", "sana-1.6b")


@functools.lru_cache(maxsize=16)
def recipe_gflop_per_image(recipe: str, resolution: int) -> float:
    """Training GFLOP per image of a published denoiser, counted by torch: ``sd2-unet`` (SD2-base's UNet,
    4-channel latents, 77 CLIP tokens of 1024) or ``sd3-medium`` (SD3-medium's MMDiT: 24 joint blocks of
    width 1536, 16-channel latents, 77 CLIP + 256 T5 tokens of 4096). The MMDiT's pooled text here is
    its text states' mean, 4096 wide where SD3 pools two CLIPs' 2048: one linear layer, < 0.01%.
    ``flux-schnell``: Flux.1-schnell's transformer (19 double- and 38 single-stream blocks of width 3072,
    16-channel latents packed 2x2, 256 T5 tokens of 4096; pooled likewise, 4096 wide where CLIP's is 768).
    ``sana-1.6b``: SANA-1.6B's linear-attention DiT (20 blocks of width 2240) on DC-AE's 32-channel latents at
    /32, 300 Gemma-2 tokens of 2304."""
    from diffusion.kit.build import (FLUX_SCHNELL, FLUX_TEXT_TOKENS, SANA_1600M, SANA_TEXT_TOKENS, SD2_UNET,
                                     SD3_MEDIUM, SD3_TEXT_TOKENS)
    from diffusion.models.flops import training_gflop_per_image
    recipes = {"sd2-unet": ("UNet2DConditionModel", SD2_UNET, 1024, 77),
               "sd3-medium": ("SD3Transformer2DModel", dict(SD3_MEDIUM, pooled_projection_dim=4096),
                              SD3_MEDIUM["joint_attention_dim"], SD3_TEXT_TOKENS),
               "flux-schnell": ("FluxTransformer2DModel", dict(FLUX_SCHNELL, pooled_projection_dim=4096),
                                FLUX_SCHNELL["joint_attention_dim"], FLUX_TEXT_TOKENS),
               "sana-1.6b": ("SanaTransformer2DModel", SANA_1600M, SANA_1600M["caption_channels"], SANA_TEXT_TOKENS,
                             32)}
    if recipe not in recipes:
        raise ValueError(f"unknown recipe {recipe!r}; choose one of {', '.join(recipes)}")
    return training_gflop_per_image(*recipes[recipe][:2], resolution, *recipes[recipe][2:])


# ---- text storage: token ids vs embeddings (issue 16) -----------------------------------------------
SD2_TEXT_DIM = 1024  # SD2's text encoder hidden size: text_embeds is 77 x 1024
SD2_DOWNSAMPLE = 8  # VAE: moments are 8 x R/8 x R/8
OTHER_BYTES = 100  # a sample's caption, key, width, height and MDS offsets, ~100 B (LAION captions: ~60 characters)
TEXT_STORAGES = (schema.TEXT_EMBEDS_ONLY, schema.TEXT_IDS_ONLY)
# LAION scale: LAION-2B-en lists 2.32B url+caption rows, about 2B of them download and convert.
DEFAULT_STORED_SAMPLES = 2_000_000_000
# DESIGN.md's FLOPs per image: SD2's text encoder forward, and the UNet's forward + backward.
TEXT_ENCODE_GFLOP = 45.0
UNET_TRAIN_GFLOP = {256: 539.0, 512: 2409.0}
TB = 1e12


def column_bytes(encoding: str) -> int:
    """Bytes of one ``ndarray:DTYPE:SHAPE`` MDS column (``ndarray:float16:77,1024`` -> 157,696)."""
    import numpy as np
    kind, dtype, shape = encoding.split(":")
    if kind != "ndarray":
        raise ValueError(f"{encoding!r} is no fixed-shape ndarray encoding")
    count = 1
    for dim in shape.split(","):
        count *= int(dim)
    return np.dtype(dtype).itemsize * count


def sample_bytes(resolutions, text: str, text_dim: int = SD2_TEXT_DIM, downsample: int = SD2_DOWNSAMPLE,
                 other: int = OTHER_BYTES) -> int:
    """Bytes of one stored sample, before compression: the converter's array columns for ``resolutions``
    and text storage ``text`` (:func:`diffusion.schema.mds_columns`) plus ``other`` for the caption, key,
    sizes and offsets."""
    columns = schema.mds_columns(resolutions, text_dim, downsample, text)
    return sum(column_bytes(e) for e in columns.values() if e.startswith("ndarray:")) + int(other)


def text_encode_overhead(resolution: int, step_gflop: dict | None = None) -> float:
    """GPU time that running the text encoder on the training GPU adds, as a share of the denoiser's training
    step at ``resolution``: FLOPs per sample, text encoder forward / denoiser forward + backward, the
    denoiser's from ``step_gflop`` ({resolution: GFLOP per image}: ``--flops``, ``--gflop-per-image``) where it
    has the resolution, else SD2's UNet's. An estimate (it assumes the encoder runs at the denoiser's MFU) until
    measured."""
    step = {**UNET_TRAIN_GFLOP, **(step_gflop or {})}
    if int(resolution) not in step:
        raise ValueError(f"no UNet FLOPs for {resolution}px (known: {', '.join(map(str, UNET_TRAIN_GFLOP))})")
    return TEXT_ENCODE_GFLOP / step[int(resolution)]


@dataclasses.dataclass
class TextStorageProjection:
    """Bytes stored and streamed for each text storage of ``stored_samples`` samples holding moments at
    ``resolutions``, and the GPU time ``ids`` adds to the ``schedule`` (its throughputs: with embeddings)."""

    stored_samples: int
    resolutions: tuple[int, ...]
    schedule: CostProjection = dataclasses.field(repr=False)
    text_dim: int = SD2_TEXT_DIM
    other_bytes: int = OTHER_BYTES
    step_gflop: dict = dataclasses.field(default_factory=dict)  # the denoiser's, where not SD2's UNet's

    def bytes_per_sample(self, text: str) -> int:
        return sample_bytes(self.resolutions, text, self.text_dim, other=self.other_bytes)

    def tb_stored(self, text: str) -> float:
        """TB the shards hold; also what one epoch streams (a pass reads whole shards: every column)."""
        return self.stored_samples * self.bytes_per_sample(text) / TB

    @property
    def samples_seen(self) -> int:
        return sum(p.samples for p in self.schedule.phases)

    @property
    def epochs(self) -> float:
        return self.samples_seen / self.stored_samples if self.stored_samples else float("inf")

    def tb_streamed(self, text: str) -> float:
        """TB the schedule streams: every sample it draws brings its whole stored row."""
        return self.samples_seen * self.bytes_per_sample(text) / TB

    @property
    def ratio(self) -> float:
        """How many times smaller a sample is stored with ids than with embeddings."""
        return self.bytes_per_sample(schema.TEXT_EMBEDS_ONLY) / self.bytes_per_sample(schema.TEXT_IDS_ONLY)

    @property
    def text_encode_gpu_hours(self) -> float:
        """GPU-hours encoding text on the training GPUs adds over the schedule (ids; estimate)."""
        return sum(p.gpu_hours * text_encode_overhead(p.resolution, self.step_gflop) for p in self.schedule.phases)

    def table(self) -> str:
        res = "+".join(map(str, self.resolutions))
        moments = ", ".join(f"{2 * schema.LATENT_CHANNELS}x{r // SD2_DOWNSAMPLE}x{r // SD2_DOWNSAMPLE}"
                            for r in self.resolutions)
        head = (f"{'--text':<8} {'bytes/sample':>12} {'TB stored':>10} {'TB/epoch':>9} {'TB streamed':>12}  "
                f"text encoder on the training GPUs (estimate)")
        rows = [f"Text storage: {self.stored_samples:,} stored samples with moments at {res} px; "
                f"SD2 shapes before compression: moments {moments} float16, text_embeds {schema.MAX_TOKENS}x"
                f"{self.text_dim} float16 or input_ids {schema.MAX_TOKENS} int32, "
                f"~{self.other_bytes} B caption/key/sizes",
                head, "-" * len(head)]
        s = self.schedule
        extra = self.text_encode_gpu_hours
        share = extra / s.gpu_hours if s.gpu_hours else 0.0
        cost = {schema.TEXT_EMBEDS_ONLY: "none: the embeddings were computed at conversion",
                schema.TEXT_IDS_ONLY: f"+{extra:,.0f} GPU-hours (+{share:.1%}), +{extra / s.gpus / 24:.2f} days, "
                                      f"+${extra * s.price_per_gpu_hour:,.0f}"}
        for text in TEXT_STORAGES:
            rows.append(f"{text:<8} {self.bytes_per_sample(text):>12,} {self.tb_stored(text):>10,.2f} "
                        f"{self.tb_stored(text):>9,.2f} {self.tb_streamed(text):>12,.2f}  {cost[text]}")
        only_256 = sample_bytes([256], schema.TEXT_EMBEDS_ONLY, self.text_dim, other=self.other_bytes) / \
            sample_bytes([256], schema.TEXT_IDS_ONLY, self.text_dim, other=self.other_bytes)
        rows.append(f"ids store {self.ratio:.2f}x smaller than embeds at {res} px "
                    f"(moments at 256 px only: {only_256:.2f}x); TB/epoch = TB stored (a pass streams whole shards), "
                    f"TB streamed = the schedule's {self.samples_seen:,} samples ({self.epochs:.2f} epochs)")
        step = {**UNET_TRAIN_GFLOP, **self.step_gflop}
        per_res = ", ".join(f"+{text_encode_overhead(p.resolution, step):.1%} at {p.resolution} px "
                            f"({step[p.resolution]:,.0f} GFLOP)" for p in s.phases if p.samples)
        denoiser = "the denoiser" if self.step_gflop else "the UNet"
        rows.append(f"text encoder: {TEXT_ENCODE_GFLOP:g} GFLOP/caption forward vs {denoiser}'s forward+backward: "
                    f"{per_res} of GPU time; an estimate from FLOPs (the encoder assumed at {denoiser}'s MFU) "
                    f"until measured")
        return "\n".join(rows)


def project_text_storage(schedule: CostProjection, stored_samples: int = DEFAULT_STORED_SAMPLES,
                         resolutions=None, step_gflop: dict | None = None) -> TextStorageProjection:
    """Text storage of ``stored_samples`` samples; ``resolutions`` (default: the schedule's phases that
    draw samples) are those whose moments the shards hold; ``step_gflop``: the denoiser's training GFLOP per
    image where not SD2's UNet's (:func:`text_encode_overhead`)."""
    if resolutions is None:
        resolutions = [p.resolution for p in schedule.phases if p.samples] or [p.resolution for p in schedule.phases]
    return TextStorageProjection(int(stored_samples), tuple(sorted({int(r) for r in resolutions})), schedule,
                                 step_gflop=dict(step_gflop or {}))


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
                     f"(add Composer's SpeedMonitor or diffusion.train.callbacks.cost.CostProjection to the run)")


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
throughput, GPU-hours, days (assuming perfect scaling over --gpus) and dollars, and the total; then
the text storage of the shards (--text embeds vs ids): bytes/sample, TB stored and streamed
per epoch and over the schedule (SD2 shapes, --stored-samples), and the GPU time that encoding text
during training adds with ids (an estimate from FLOPs until measured)."""
EXAMPLES = """examples:
  python -m diffusion.cost                                  # MosaicML's 8xA100 recipe: 81.33 days, $31,230
  python -m diffusion.cost --gpus 64 --price 1.5
  python -m diffusion.cost --per node --throughput-256 1100 --throughput-512 290
  python -m diffusion.cost --from-run 256=runs/phase1/log.txt --run-gpus 8 --gpus 128
  python -m diffusion.cost --text ids                       # token-id shards: text encoded on the GPUs
  python -m diffusion.cost --samples-512 0 --stored-samples 1B   # one 256 px phase over 1B stored samples"""


def _positive(kind, allow_zero: bool = False):
    """An argparse type: a number of ``kind`` above zero (or at least zero)."""
    def convert(text: str):
        try:
            value = kind(text)
        except (ValueError, OverflowError):  # 1e400: infinity, as a count
            raise argparse.ArgumentTypeError(f"{text!r} is not a number") from None
        if not math.isfinite(value):
            raise argparse.ArgumentTypeError(f"{text} is not a finite number")
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
    p.add_argument("--text", choices=TEXT_STORAGES, default=schema.TEXT_EMBEDS_ONLY,
                   help="what the shards hold of the caption (the converter's --text): 'embeds' (default: the "
                        "throughputs as given) or 'ids' (the training GPUs run the text encoder: given and default "
                        "throughputs are lowered by the FLOPs estimate; --from-run ones are taken as measured)")
    p.add_argument("--stored-samples", type=_positive(parse_count), default=DEFAULT_STORED_SAMPLES,
                   help="samples the shards hold, for TB stored and streamed (default: 2B, LAION-2B-en scale)")
    p.add_argument("--stored-resolutions", type=_positive(int), nargs="+", metavar="RES",
                   help="resolutions whose moments the shards hold (default: the phases with samples)")
    p.add_argument("--flops", choices=RECIPES, default=None,
                   help="the denoiser whose training FLOPs per image set the default throughputs (counted by "
                        "torch; default: SD2's UNet, as MosaicML's row measured it)")
    p.add_argument("--gflop-per-image", action="append", default=[], metavar="RES=G",
                   help="training GFLOP per image at RES of any other recipe (forward + backward)")
    p.add_argument("--recipe", metavar="YAML", default=None,
                   help="project a recipe file's phases instead (yamls/cost/microdit.yaml, sd2-mosaicml.yaml)")
    args = p.parse_args(argv)
    if args.recipe:
        projection = project_recipe(args.recipe)
        print(projection.table())
        return projection

    per_gpu, sources = dict(RECIPE_PER_GPU), {r: "MosaicML 8xA100" for r in RECIPE_PER_GPU}
    gflop = {res: recipe_gflop_per_image(args.flops, res) for res in per_gpu} if args.flops else {}
    for spec in args.gflop_per_image:
        res, sep, value = spec.partition("=")
        try:
            gflop[int(res)] = float(value)
        except ValueError:
            p.error(f"--gflop-per-image takes RES=GFLOP, e.g. 256=539, got {spec!r}")
        if int(res) not in per_gpu or not 0 < float(value) < math.inf:
            p.error(f"--gflop-per-image {spec}: RES is 256 or 512 and GFLOP a positive number")
    for res, g in gflop.items():  # the same MFU as MosaicML's SD2 row, at this recipe's FLOPs per image
        per_gpu[res] = RECIPE_PER_GPU[res] * UNET_TRAIN_GFLOP[res] / g
        sources[res] = f"MosaicML 8xA100 MFU at {g:,.0f} GFLOP/img" + (f" ({args.flops})" if args.flops else "")
    divisor = args.gpus_per_node if args.per == "node" else 1
    for res, value in ((256, args.throughput_256), (512, args.throughput_512)):
        if value is not None:
            per_gpu[res], sources[res] = value / divisor, f"--throughput-{res} (per {args.per})"
    measured = set()  # resolutions whose throughput a run measured
    for spec in args.from_run:
        res, sep, path = spec.partition("=")
        if not sep or not res.isdigit() or int(res) not in (256, 512):
            p.error(f"--from-run takes RES=PATH with RES 256 or 512, got {spec!r}")
        try:
            per_gpu[int(res)], sources[int(res)] = throughput_from_run(path, args.run_gpus), path
            measured.add(int(res))
        except (OSError, ValueError) as e:
            p.error(str(e))
    schedule = {256: args.samples_256, 512: args.samples_512}
    if not any(schedule.values()):
        p.error("--samples-256 and --samples-512 are both 0: no phase to project")
    if args.stored_resolutions and any(r % SD2_DOWNSAMPLE for r in args.stored_resolutions):
        p.error(f"--stored-resolutions must be multiples of {SD2_DOWNSAMPLE}, got {args.stored_resolutions}")
    with_embeds = project_cost(schedule, per_gpu, args.gpus, args.price, sources)
    storage = project_text_storage(with_embeds, args.stored_samples, args.stored_resolutions, gflop)
    projection = with_embeds
    if args.text == schema.TEXT_IDS_ONLY:  # the text encoder runs beside the denoiser: fewer images/s
        for res in per_gpu:
            if res not in measured:
                per_gpu[res] /= 1 + text_encode_overhead(res, gflop)
                sources[res] += f", - text encode {text_encode_overhead(res, gflop):.1%} (estimate)"
        projection = project_cost(schedule, per_gpu, args.gpus, args.price, sources)
    projection.text_storage = storage
    print(projection.table())
    print()
    print(storage.table())
    return projection


if __name__ == "__main__":
    from diffusion import cli
    cli.run(main, "cost")
