"""Raw image-caption data -> MDS shards of VAE moments and text embeddings, as one Ray Data pipeline.

    read (tasks) -> ImageCaptionTransform (CPU actors) -> LatentTextEncoder (GPU or CPU actors) -> MDSPartSink

With ``--recaption MODEL_REF`` a Recaptioner stage (GPU or CPU actors) runs between the transform and
the encoder: an image-to-text model writes a new caption per image, stored as one more str column.

``run_conversion(ConvertConfig(...))`` is the whole job; ``convert/laion_to_mds.py`` is its command
line. Re-running after a kill skips every key already written or rejected, so the finished output
holds exactly what a clean run would.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import os
import shutil
import time

import numpy as np

from diffusion import schema
from diffusion.cluster import init_ray
from diffusion.errors import ConfigError
from diffusion.convert.summary import ConversionSummary, bucket_counts, done_keys, summarize
from diffusion.convert.encoders import LatentTextEncoder, describe_dataset
from diffusion.convert.config import ConvertConfig
from diffusion.convert.preflight import (  # noqa: F401 (the checks' old home: still importable here)
    MAX_T5_TOKENS, SETTINGS_JSON, Preflight, check_output_settings, check_pooled_text, check_text_length, preflight,
    recorded_settings, text_length_limit)
from diffusion.convert.sink import (INDEX_JSON, REJECTS_DIR, MDSPartSink, committed_parts, part_roots,
                                     migrate_records, remove_temporary_parts, write_json_atomic)
from diffusion.convert.progress import ConversionProgress, input_rows
from diffusion.convert.readers import input_files, read_raw
from diffusion.convert.dedupe import find_duplicates, later_copies
from diffusion.convert.neardup import REASONS, find_near_duplicates, first_pass_scores, removed_keys, visualize_duplicates
from diffusion.where import parse_where
from diffusion.convert.transforms import ImageCaptionTransform, ImageChecks
from diffusion.convert.recaption import Recaptioner
from diffusion.models import loading

# Encoder batch per largest resolution on a GPU (the reference ran A10Gs at 120 @ 256 and 40 @ 512).
GPU_BATCH = {256: 120, 512: 40}
CPU_BATCH = 8
RECAPTION_CPUS = 0.25  # a CPU captioning actor's share: with the other pools it still leaves the read tasks a CPU
CURATE_CPUS = 0.25  # a CPU --embed actor's share, likewise
CURATE_GPUS = 0.25  # a GPU --embed actor's share (a CLIP tower beside the VAE)
MIN_TASK_CPUS = 0.1  # a read or write task's least share; less on some node is refused (check_placement)


@dataclasses.dataclass
class PoolPlan:
    num_transformers: int
    cpus_per_transformer: float
    num_encoders: int
    cpus_per_encoder: float
    gpus_per_encoder: float
    encoder_batch: int
    num_recaptioners: int = 0  # --recaption's pool (none without it)
    cpus_per_recaptioner: float = 0.0
    gpus_per_recaptioner: float = 0.0
    recaption_batch: int = 0
    num_curators: int = 0  # --embed's pool (none without it)
    cpus_per_curator: float = 0.0
    gpus_per_curator: float = 0.0
    cpus_per_task: float = 1.0  # a read or write task's share: what some node keeps free beside the actors


def task_cpus(left: float, nodes: int) -> float:
    """The CPU share a read or write task asks for, given the ``left`` CPUs the actors leave free over
    ``nodes`` nodes: a whole one where that fits on some node whatever the layout, else an even share.
    However Ray spreads the actors, some node keeps at least ``left / nodes`` free (two 1-CPU nodes with
    a half-CPU actor each keep half a CPU each: a task wanting a whole one never starts, a silent hang)."""
    share = math.floor(100 * left / max(1, nodes)) / 100
    return max(min(1.0, share), MIN_TASK_CPUS)


def plan_pools(resources: dict, cfg: ConvertConfig, nodes: int = 1) -> PoolPlan:
    """Actor pools sized from the cluster (``resources`` in all, over ``nodes`` nodes), always leaving CPU
    for the read and write tasks; those ask for a whole CPU, or the share some node is sure to keep
    (:func:`task_cpus`) where the cluster is many small nodes.

    A pool holding every CPU starves the read tasks and Ray Data stalls, so ~10% (at least one CPU)
    stays free; on a 2-CPU machine that means one transformer and one encoder at half a CPU each.

    With ``--recaption`` the captioners come first: on GPUs they take half of them (at least one
    captioner; on one GPU a captioner and an encoder share it, half each), else a quarter CPU each.
    """
    cpus, gpus = float(resources.get("CPU", 1)), float(resources.get("GPU", 0))
    node_cpus = cpus / max(1, nodes)  # a node's CPUs, the cluster's nodes taken as alike
    free = max(cpus - max(1.0, 0.1 * cpus), 0.5)
    gpu_each = cfg.encoder_gpus if cfg.encoder_gpus is not None else (1.0 if gpus else 0.0)
    captioners, cap_cpus, cap_gpus = 0, 0.0, 0.0
    if cfg.recaption is not None:
        cap_gpus = (1.0 if gpus >= 2 else 0.5) if gpus else 0.0
        captioners = cfg.recaption_actors or (max(1, int(gpus // 2)) if gpus else 1)
        cap_cpus = min(1.0, free / (4 * captioners)) if gpus else RECAPTION_CPUS
        free = max(free - captioners * cap_cpus, 0.5)
        if gpus:
            if cfg.encoder_gpus is None and gpus < 2:
                gpu_each = 0.5  # one GPU: the encoder shares it with the captioner
            gpus = max(gpus - captioners * cap_gpus, gpu_each)
    curators, cur_cpus, cur_gpus = 0, 0.0, 0.0
    if cfg.embed is not None:  # --embed: a quarter CPU (or a quarter GPU, beside the encoder) per curator
        curators = max(1, int(gpus // 4)) if gpus else 1
        cur_gpus = CURATE_GPUS if gpus else 0.0
        cur_cpus = min(1.0, free / (8 * curators)) if gpus else min(CURATE_CPUS, free / 4)
        free -= curators * cur_cpus  # out of what is free, no more: online mode's training workers hold the rest
        if gpus:
            if cfg.encoder_gpus is None and gpus - curators * cur_gpus < gpu_each:
                gpu_each = max(gpus - curators * cur_gpus, CURATE_GPUS)
            gpus = max(gpus - curators * cur_gpus, gpu_each)
    if gpu_each:
        encoders = cfg.num_encoders or max(1, int(gpus // gpu_each))
        enc_cpus = min(1.0, free / (2 * encoders))
        batch = GPU_BATCH.get(max(cfg.resolutions), 120 if max(cfg.resolutions) < 512 else 40)
    else:  # CPU encoding is the bottleneck: give it half of what is free, in actors a node can hold
        encoders = cfg.num_encoders or max(1, int(free // 8), math.ceil(free / node_cpus - 1e-9) if nodes > 1 else 1)
        enc_cpus = free / 2 / encoders
        batch = CPU_BATCH
    others = encoders * enc_cpus + captioners * cap_cpus + curators * cur_cpus
    tr_cpus = cfg.cpus_per_transformer or min(1.0, (free - encoders * enc_cpus))
    if nodes > 1 and not cfg.cpus_per_transformer:  # on a node beside the largest other actor and its share
        tr_cpus = min(tr_cpus, node_cpus - max(enc_cpus, cap_cpus, cur_cpus, others / nodes))
    tr_cpus = max(tr_cpus, 0.125 if curators else 0.25)
    transformers = cfg.num_transformers or max(1, int((free - encoders * enc_cpus) // tr_cpus))
    held = transformers * tr_cpus + others
    return PoolPlan(transformers, tr_cpus, encoders, enc_cpus, gpu_each, cfg.encoder_batch_size or batch,
                    captioners, cap_cpus, cap_gpus, cfg.recaption_batch_size if captioners else 0,
                    curators, cur_cpus, cur_gpus, task_cpus(cpus - held, nodes))


def node_resources(ray) -> list[dict]:
    """Each live node's resources (``{"CPU": n, "GPU": n, ...}``)."""
    return [n.get("Resources", {}) for n in ray.nodes() if n.get("Alive")]


def cpu_nodes(nodes: list[dict]) -> int:
    """How many of ``nodes`` have CPUs (where the actors and tasks can go)."""
    return max(1, sum(1 for n in nodes if float(n.get("CPU", 0)) > 0))


def check_placement(nodes: list[dict], plan: PoolPlan, what_to_change: str, who: str = "the conversion",
                    held: tuple = ()) -> None:
    """Refuse, in one line naming the resource and ``what_to_change``, a plan Ray cannot place on the
    cluster's ``nodes`` (each node's ``{"CPU": n, "GPU": n}``): every actor (``held``: more, as
    ``(name, cpus, gpus)``, placed first) must fit some node, and a node must keep a read task's share
    free. Ray would place what fits and wait for the rest without a word. Actors are placed largest
    first, each on the node with the most room that holds it, as Ray's default scheduling spreads them
    once a node is half used."""
    demands = list(held)
    demands += [("transformer", plan.cpus_per_transformer, 0.0)] * plan.num_transformers
    demands += [("encoder", plan.cpus_per_encoder, plan.gpus_per_encoder)] * plan.num_encoders
    demands += [("recaptioner", plan.cpus_per_recaptioner, plan.gpus_per_recaptioner)] * plan.num_recaptioners
    demands += [("curator", plan.cpus_per_curator, plan.gpus_per_curator)] * plan.num_curators
    free = [[float(n.get("CPU", 0)), float(n.get("GPU", 0))] for n in nodes]
    for name, cpu, gpu in sorted(demands, key=lambda d: (-d[2], -d[1])):
        fits = [room for room in free if room[0] >= cpu - 1e-9 and room[1] >= gpu - 1e-9]
        if not fits:
            rooms = ", ".join(f"{c:g} CPU/{g:g} GPU" for c, g in free)
            raise ConfigError(
                f"{who} cannot place a {name} ({cpu:g} CPU, {gpu:g} GPU) on this cluster: its nodes have "
                f"{rooms} left after the actors placed before it; {what_to_change}")
        room = max(fits, key=lambda r: (r[1] - gpu, r[0] - cpu))
        room[0] -= cpu
        room[1] -= gpu
    if not any(c >= plan.cpus_per_task - 1e-9 for c, _ in free):
        rooms = ", ".join(f"{c:g}" for c, _ in free)
        raise ConfigError(
            f"{who} cannot place its read tasks: each needs {plan.cpus_per_task:g} CPU on one node, and once "
            f"the actors are placed the nodes have {rooms} CPU left; {what_to_change}")


CONVERT_PLACEMENT = ("give the nodes more CPUs (ray start --num-cpus) or pin smaller pools (--num-transformers, "
                     "--cpus-per-transformer, --num-encoders, --encoder-gpus)")


class _DatasetInfoWriter:
    """Runs after the index merge: dataset.json and empty_text_embeds.npy (the encoder run on "")."""

    def __init__(self, cfg: ConvertConfig, tokens: bool = True):
        self.cfg = cfg
        self.tokens = tokens

    def __call__(self, out: str) -> None:
        info, empty = describe_dataset(self.cfg.model, self.cfg.resolutions, self.cfg.text, self.cfg.text_length,
                                       tokens=self.tokens)
        np.save(os.path.join(out, schema.EMPTY_TEXT_EMBEDS), empty)
        summary = summarize(out)
        info.count, info.rows_in, info.rejects = summary.written, summary.rows_in, summary.rejects
        if self.cfg.extra_captions():
            info.captions = [schema.CAPTION, *self.cfg.extra_captions()]
            info.empty_captions = {n: summary.empty_captions.get(n, 0) for n in self.cfg.extra_captions()}
        info.extra = {"compression": self.cfg.compression, "min_size": self.cfg.min_size,
                      "max_aspect": self.cfg.max_aspect, "max_pixels": self.cfg.max_pixels,
                      "where": parse_where(self.cfg.where).text if self.cfg.where else None,
                      "dedupe": self.cfg.dedupe}
        if self.cfg.recaption is not None:
            info.extra["recaption"] = self.cfg.recaption_settings()
        if self.cfg.embed is not None:  # the model, its width, the heads and the written rows' score histograms
            from diffusion.convert.curate import check_embedder, histograms_of
            info.extra["curation"] = {**self.cfg.curation_settings(), "width": check_embedder(self.cfg.embed)[1],
                                      "histograms": histograms_of(summary.histograms)}
        if self.cfg.dedupe in ("near", "semantic"):
            info.extra["dedupe_threshold"] = self.cfg.threshold()
        if self.cfg.exclude:
            info.extra["exclude"] = [os.path.basename(p) for p in self.cfg.exclude]
        if summary.failed_inputs:  # skipped input files: the dataset lacks their unread rows
            info.extra["failed_inputs"] = dict(summary.failed_inputs)
        if self.cfg.buckets:
            self._describe_buckets(out, info, empty)
        info.save(out)

    def _describe_buckets(self, out: str, info: schema.DatasetInfo, empty: np.ndarray) -> None:
        """Each bucket is a dataset of its own (dataset.json, empty_text_embeds.npy); the root lists them."""
        empty_captions: dict[str, dict] = {}
        counts = bucket_counts(out, empty_captions)
        info.buckets = []
        for w, h in self.cfg.bucket_sizes():
            name = schema.bucket_name(w, h)
            info.buckets.append({"name": name, "width": w, "height": h, "count": counts.get(name, 0)})
            if name in counts:
                np.save(os.path.join(out, name, schema.EMPTY_TEXT_EMBEDS), empty)
                part = dataclasses.replace(info, buckets=None, count=counts[name], rows_in=counts[name], rejects={},
                                           extra={**info.extra, "bucket": [w, h]},
                                           empty_captions={c: empty_captions[name].get(c, 0)
                                                           for c in info.empty_captions})
                part.save(os.path.join(out, name))


def build_pipeline(cfg: ConvertConfig, out: str, skip_keys, plan: PoolPlan, duplicates_dir: str | None = None,
                   removed_dir: str | None = None, blocklist=None):
    """The Ray Dataset from raw rows to encoded rows (not yet executed). ``removed_dir``: --dedupe near or
    semantic's decision; ``blocklist``: --exclude's keys and image hashes."""
    from ray.data import ActorPoolStrategy
    if blocklist is None and cfg.exclude:  # online mode builds the pipeline from its settings alone
        from diffusion.convert.exclude import load_blocklists
        blocklist = load_blocklists(cfg.exclude)
    checks = ImageChecks(min_size=cfg.min_size, max_aspect=cfg.max_aspect, max_pixels=cfg.max_pixels,
                         max_scans=cfg.max_scans)
    ds = read_raw(cfg.input, cfg.raw_columns(), skip_keys=skip_keys, limit=cfg.limit, num_cpus=plan.cpus_per_task,
                  rejects_dir=os.path.join(out, REJECTS_DIR),
                  duplicates=(functools.partial(later_copies, duplicates_dir) if duplicates_dir else
                              functools.partial(removed_keys, removed_dir, reason=REASONS[cfg.dedupe]) if removed_dir
                              else None), blocklist=blocklist)
    ds = ds.map_batches(
        ImageCaptionTransform, batch_size=cfg.transform_batch_size, batch_format="numpy",
        fn_constructor_kwargs=dict(model=cfg.model, resolutions=cfg.resolutions, checks=checks,
                                   rejects_dir=os.path.join(out, REJECTS_DIR), record_timing=True,
                                   buckets=cfg.bucket_sizes(), captions=cfg.input_captions(),
                                   text_length=cfg.text_length),
        compute=ActorPoolStrategy(size=plan.num_transformers), num_cpus=plan.cpus_per_transformer)
    if cfg.recaption is not None:
        ds = ds.map_batches(
            Recaptioner, batch_size=plan.recaption_batch, batch_format="numpy",
            fn_constructor_kwargs=dict(model=cfg.recaption, resolution=max(cfg.resolutions),
                                       column=cfg.recaption_column, tokenizer=cfg.model, max_new_tokens=cfg.recaption_max_tokens,
                                       prompt=cfg.recaption_prompt, record_timing=True, text_length=cfg.text_length,
                                       cpu_threads=None if plan.gpus_per_recaptioner else 1),
            compute=ActorPoolStrategy(size=plan.num_recaptioners), num_cpus=plan.cpus_per_recaptioner,
            **({"num_gpus": plan.gpus_per_recaptioner} if plan.gpus_per_recaptioner else {}))
    if cfg.embed is not None:
        from diffusion.convert.curate import Curator
        ds = ds.map_batches(
            Curator, batch_size=plan.encoder_batch, batch_format="numpy",
            fn_constructor_kwargs=dict(embed=cfg.embed, resolution=max(cfg.resolutions), heads=cfg.heads(),
                                       where=cfg.split_where()[1] if cfg.where else None,
                                       rejects_dir=os.path.join(out, REJECTS_DIR),
                                       store_embeddings=cfg.store_embeddings, record_timing=True,
                                       cpu_threads=None if plan.gpus_per_curator else 1,
                                       # --dedupe near/semantic's first pass scored these rows: no second model pass
                                       reuse=first_pass_scores(removed_dir, cfg)),
            compute=ActorPoolStrategy(size=plan.num_curators), num_cpus=plan.cpus_per_curator,
            **({"num_gpus": plan.gpus_per_curator} if plan.gpus_per_curator else {}))
    encoder_options = dict(compute=ActorPoolStrategy(size=plan.num_encoders), num_cpus=plan.cpus_per_encoder)
    if plan.gpus_per_encoder:
        encoder_options["num_gpus"] = plan.gpus_per_encoder
        if cfg.encoder_accelerator_type:
            encoder_options["accelerator_type"] = cfg.encoder_accelerator_type
    threads = None if plan.gpus_per_encoder else max(1, math.ceil(plan.cpus_per_encoder))
    return ds.map_batches(
        LatentTextEncoder, batch_size=plan.encoder_batch, batch_format="numpy",
        fn_constructor_kwargs=dict(model=cfg.model, resolutions=cfg.resolutions, cpu_threads=threads,
                                   record_timing=True, text=cfg.text, captions=cfg.extra_captions(),
                                   text_length=cfg.text_length),
        **encoder_options)


def run_conversion(cfg: ConvertConfig, checked: Preflight | None = None) -> ConversionSummary:
    """Convert ``cfg.input`` into MDS at ``cfg.output``; resumes if the output holds earlier parts.
    ``checked``: :func:`~diffusion.convert.preflight.preflight`'s answer for ``cfg``, where the caller
    already asked (the command does, before this module's imports)."""
    start = time.perf_counter()
    checked = checked or preflight(cfg)
    out, settings = checked.out, checked.settings
    columns = schema.mds_columns(cfg.resolutions, checked.text_dim, checked.space.downsample, cfg.text,
                                 captions=cfg.extra_captions(), text_length=cfg.text_length,
                                 tokens=settings["text_tokens"], latent_space=checked.space,
                                 pooled_dim=checked.pooled_dim)
    from diffusion.convert.curate import curation_columns
    curated = curation_columns(cfg.computed_columns(), checked.embed_width, cfg.store_embeddings)
    columns.update(curated)

    _check_writer_settings(cfg)
    created = not os.path.exists(out)
    os.makedirs(out, exist_ok=True)
    try:
        summary = _convert_into(cfg, out, settings, columns, curated)
    except BaseException:
        if created and not _holds_progress(out):  # a failed first run leaves nothing behind
            shutil.rmtree(out, ignore_errors=True)
        raise
    summary.wall_seconds = time.perf_counter() - start
    return summary


def _check_writer_settings(cfg: ConvertConfig) -> None:
    """--shard-size and --compression as streaming's MDS writer reads them, before any worker starts (each
    was a RayTaskError traceback from the first write task, a minute into the conversion)."""
    from streaming.base.compression import get_compressions, is_compression
    from streaming.base.util import bytes_to_int
    try:
        size = bytes_to_int(cfg.shard_size)
    except ValueError as e:
        raise ConfigError(f"--shard-size {cfg.shard_size!r}: {e}") from None
    if size <= 0:
        raise ConfigError(f"--shard-size {cfg.shard_size!r}: must be above 0 bytes")
    if cfg.compression is not None and not is_compression(cfg.compression):
        names = sorted({name.partition(":")[0] for name in get_compressions()})
        raise ConfigError(f"--compression {cfg.compression!r}: not one streaming writes; choose one of "
                          f"{', '.join(names)} (with :LEVEL, e.g. zstd:7), or none")


def _bucket_columns(resolutions, text_dim: int, space: schema.LatentSpace, text: str, captions, text_length: int,
                    tokens: bool, name: str, pooled_dim: int | None = None, extra: dict | None = None) -> dict[str, str]:
    columns = schema.mds_columns(resolutions, text_dim, space.downsample, text, bucket=schema.bucket_size(name),
                                 captions=captions, text_length=text_length, tokens=tokens, latent_space=space,
                                 pooled_dim=pooled_dim)
    return {**columns, **(extra or {})}


def _holds_progress(out: str) -> bool:
    """Whether ``out`` holds work a re-run would keep: committed parts or recorded rejects."""
    rejects = os.path.join(out, REJECTS_DIR)
    return (any(committed_parts(root) for root in part_roots(out))
            or (os.path.isdir(rejects) and bool(os.listdir(rejects))))


def _convert_into(cfg: ConvertConfig, out: str, settings: dict, columns: dict,
                  curated: dict | None = None) -> ConversionSummary:
    if not os.path.exists(os.path.join(out, SETTINGS_JSON)):
        write_json_atomic(os.path.join(out, SETTINGS_JSON), settings)
    migrate_records(out)  # an output of the old layout: its records renamed before anything reads them
    for root in part_roots(out):
        remove_temporary_parts(root)
    written, rejected = done_keys(out)
    before = summarize(out).written
    bucket_columns = None
    if cfg.buckets:
        text_dim = loading.text_encoder_width(loading.load_text_encoder_config(cfg.model))
        space = loading.latent_space_of(loading.load_vae_config(cfg.model))
        bucket_columns = functools.partial(_bucket_columns, cfg.resolutions, text_dim, space, cfg.text,
                                           cfg.extra_captions(), cfg.text_length, settings["text_tokens"],
                                           pooled_dim=loading.pooled_text_width(cfg.model), extra=curated)
    from diffusion.convert.curate import HISTOGRAMS
    sink = MDSPartSink(out, columns, compression=cfg.compression, size_limit=cfg.shard_size,
                       on_complete=_DatasetInfoWriter(cfg, settings["text_tokens"]), bucket_columns=bucket_columns,
                       histograms={c: HISTOGRAMS[c] for c in cfg.computed_columns()})

    ray = init_ray(cfg.address)
    ctx = ray.data.DataContext.get_current()
    ctx.enable_progress_bars = False  # the progress line (below) replaces Ray's bars, so Ray's warning
    from ray.util.debug import log_once  # that they are off is expected: marked as said, it is not shown
    log_once("ray_data_progress_manager_disabled")
    # The first N rows must be the same N on every run; --deterministic also fixes which rows share a
    # part, hence the training order. Both hold blocks back until their predecessors are done.
    if cfg.limit is not None or cfg.deterministic:
        ctx.execution_options.preserve_order = True
    nodes = node_resources(ray)
    plan = plan_pools(ray.cluster_resources(), cfg, cpu_nodes(nodes))
    check_placement(nodes, plan, CONVERT_PLACEMENT)
    duplicates = removed = None
    blocklist = None
    if cfg.exclude:
        from diffusion.convert.exclude import load_blocklists
        blocklist = load_blocklists(cfg.exclude)
    if cfg.dedupe == "bytes":
        duplicates = find_duplicates(cfg.input, cfg.raw_columns(), out, blocklist, cfg.exclude_settings())
        wait_for_free_cpus(ray)
    elif cfg.dedupe in ("near", "semantic"):  # the first pass: decode, embed, decide; then convert the rest
        removed = find_near_duplicates(cfg, out, blocklist)
        wait_for_free_cpus(ray)
    progress = contextlib.nullcontext()
    if cfg.progress:
        columns = cfg.raw_columns()
        progress = ConversionProgress(out, total=lambda: input_rows(input_files(cfg.input, columns), columns),
                                      limit=cfg.limit)
    with _storage_errors_in_one_line(cfg), progress:
        build_pipeline(cfg, out, written | set(rejected), plan, duplicates, removed, blocklist).write_datasink(
            sink, ray_remote_args={"num_cpus": plan.cpus_per_task})
    if not sink.completed:  # nothing left to write: still (re)build the index and dataset.json
        sink.finalize()

    summary = summarize(out)
    summary.written_this_run = summary.written - before
    if cfg.visualize_duplicates and removed:
        visualize_duplicates(cfg, removed, os.path.join(out, "duplicates.png"), cfg.visualize_duplicates)
    if cfg.visualize:
        from diffusion.convert.preview import write_visualization
        write_visualization(out, cfg, cfg.visualize)
    if cfg.is_remote:
        upload_directory(out, cfg.output)
    return summary


def wait_for_free_cpus(ray, seconds: float = 30.0) -> None:
    """Wait (at most ``seconds``) until the cluster shows a free CPU. Ray Data warns that a job "will
    hang unless more CPUs are freed up" when it starts while none shows free; right after the
    ``--dedupe`` pass none does for a moment (its tasks are done, but their CPUs are reported back a
    little later, the more so on a busy machine), and the warning was a false alarm. Past ``seconds``
    the CPUs are really taken (by other jobs on the cluster), and Ray's warning says so."""
    deadline = time.monotonic() + seconds
    while not ray.available_resources().get("CPU") and time.monotonic() < deadline:
        time.sleep(0.1)


@contextlib.contextmanager
def _storage_errors_in_one_line(cfg: ConvertConfig):
    """A full (or read-only) disk under the output is the user's to fix: one line naming the output, not
    Ray Data's three tracebacks of the write task. Ray Data's own error log is held back meanwhile; any
    other error is re-raised as it came, and the command shows its traceback."""
    import logging

    from diffusion.cli import storage_error
    ray_data = logging.getLogger("ray.data")
    level = ray_data.level
    ray_data.setLevel(logging.CRITICAL)
    try:
        yield
    except Exception as e:
        full = storage_error(e)
        if full is None:
            raise
        raise OSError(full.errno, f"{full.strerror} while writing the output (what was written is kept: make room, "
                                  f"then re-run the same command to resume)", cfg.output) from None
    finally:
        ray_data.setLevel(level)


def upload_directory(local: str, remote: str) -> None:
    """Upload a finished local output (parts, index, dataset.json) with streaming's uploader."""
    from streaming.base.storage.upload import CloudUploader
    uploader = CloudUploader.get((local, remote), keep_local=True, exist_ok=True)
    files = []
    for root, dirs, names in os.walk(local):
        dirs[:] = [d for d in dirs if not d.startswith(".")]
        files += [os.path.relpath(os.path.join(root, n), local) for n in names if not n.endswith(".tmp")]
    # index.json last: a reader that sees the index finds every shard it lists.
    for name in sorted(files, key=lambda f: f == INDEX_JSON):
        uploader.upload_file(name)
