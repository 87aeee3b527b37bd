"""Config → Composer ``Trainer``: what ``composer run.py yamls/x.yaml key=value ...`` builds on each rank.

Read top to bottom: data description → model → loaders → optimizer and schedule → algorithms,
callbacks, loggers → Trainer. Parallelism (DDP or FSDP) is Composer's; the model knows nothing of it.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import posixpath
from unittest import mock

import torch
from composer import Trainer
from composer.core import Callback, Evaluator
from composer.optim import (ConstantWithWarmupScheduler, CosineAnnealingWithWarmupScheduler,
                            LinearWithWarmupScheduler)
from composer.utils import dist
from composer.utils.parallelism import FSDP2Config

from diffusion.train import components
from diffusion.train.optimizers import build_optimizer
from diffusion.train.algorithms.ema import EMA, EMAShards
from diffusion.train.callbacks.optimizer_monitor import LoggedGradientClipping
from diffusion.train.callbacks.checkpoint_pruning import forget_autoresume_download, local_pruner, remote_pruner
from diffusion.train.config import Config
from diffusion import cpus, schema
from diffusion.errors import ConfigError
from diffusion.loader import dataset_info, mds_source, shared_memory
from diffusion.loader.batches import NoiseDraws
from diffusion.train.callbacks.text_encoder_share import TextEncoderShare
from diffusion.train.callbacks.cpu_watch import CpuWatch
from diffusion.train import resume, save_folder
from diffusion.models import denoisers, objectives, safe_checkpoint
from diffusion.models.masking import PatchMask
from diffusion.models.repa import RepaSwitch
from diffusion.models.latent_diffusion import LatentDiffusion, build_model, objective_name
from diffusion.models.text_encoder import encoding_dtype, load_frozen_text_encoder



def noise_draws(cfg: Config) -> NoiseDraws:
    """The loader's per-sample draws for this run's model: the objective says how its level is drawn."""
    ref = cfg.model.ref
    objective = objectives.build_objective(objective_name(cfg.model, ref), cfg.model, ref)
    mask = route = None
    if cfg.model.masking.ratio or cfg.model.routing.ratio:
        adapter = denoisers.adapter(denoisers.resolve_class(ref, cfg.model.denoiser))
        patch = adapter.patch_size(adapter.load_config(ref))
        mask = PatchMask(cfg.model.masking.ratio, patch) if cfg.model.masking.ratio else None
        route = PatchMask(cfg.model.routing.ratio, patch) if cfg.model.routing.ratio else None
    return NoiseDraws(seed=cfg.trainer.seed, perturbation=cfg.model.input_perturbation > 0,
                      level=objective.level_draw(), mask=mask, route=route)


def build_scheduler(cfg: Config):
    s = cfg.scheduler
    if s.name == "constant_with_warmup":
        return ConstantWithWarmupScheduler(t_warmup=s.t_warmup)
    if s.name == "linear_with_warmup":
        return LinearWithWarmupScheduler(t_warmup=s.t_warmup, alpha_f=s.alpha_f)
    return CosineAnnealingWithWarmupScheduler(t_warmup=s.t_warmup, alpha_f=s.alpha_f)


def build_parallelism(cfg: Config) -> dict | None:
    """FSDP through Composer (FSDP1, SHARD_GRAD_OP by default; ``trainer.fsdp.version: 2`` for FSDP2);
    None means DDP (or a single process).

    The config object is built here, whichever version, so Composer's ``FSDP_VERSION`` environment
    variable cannot switch a run to FSDP2 and silently drop the FSDP1 settings it has no use for.
    """
    from composer.utils.parallelism import FSDP2Config, FSDPConfig
    fsdp = cfg.trainer.fsdp
    if fsdp is None:
        return None
    replicate, shard = mesh_degrees(cfg, dist.get_world_size(), dist.get_local_world_size())
    if fsdp.version == 2:
        # FSDP2 keeps the gathered parameters after forward when not resharding: SHARD_GRAD_OP.
        options = dict(reshard_after_forward=fsdp.sharding_strategy in ("FULL_SHARD", "HYBRID_SHARD"),
                       mixed_precision=fsdp.mixed_precision, state_dict_type=fsdp.state_dict_type,
                       activation_checkpointing=cfg.trainer.activation_checkpointing)
        # sharded: a checkpoint without EMA shards loads into a run with EMA (EMAShards' planner)
        config = _ShardedEMAFSDP2Config if fsdp.state_dict_type == "sharded" else FSDP2Config
        if replicate is None:
            return {"fsdp": config(**options)}
        if "data_parallel_shard_degree" in {f.name for f in dataclasses.fields(FSDP2Config)}:  # a later Composer
            return {"fsdp": config(data_parallel_shard_degree=shard, data_parallel_replicate_degree=replicate,
                                   **options)}
        return {"fsdp": _HybridFSDP2Config(replicate, shard, **options)}
    degrees = {} if replicate is None else {"data_parallel_replicate_degree": replicate,
                                            "data_parallel_shard_degree": shard}
    return {"fsdp": FSDPConfig(sharding_strategy=fsdp.sharding_strategy, mixed_precision=fsdp.mixed_precision,
                               state_dict_type=fsdp.state_dict_type, limit_all_gathers=fsdp.limit_all_gathers,
                               forward_prefetch=fsdp.forward_prefetch, backward_prefetch=fsdp.backward_prefetch,
                               activation_checkpointing=cfg.trainer.activation_checkpointing, use_orig_params=True,
                               **degrees)}


def mesh_degrees(cfg: Config, world_size: int, local_world_size: int) -> tuple[int | None, int]:
    """Hybrid sharding's (replicate, shard) degrees for ``world_size`` ranks, ``local_world_size`` a node, from
    ``trainer.fsdp``'s Composer keys (``data_parallel_replicate_degree``, ``data_parallel_shard_degree``); (None,
    -1), Composer's one flat mesh, for the other strategies. A shape that does not make the world size is
    refused in one line (Composer would fall back to full sharding, or fail in its mesh)."""
    fsdp = cfg.trainer.fsdp
    replicate, shard = fsdp.data_parallel_replicate_degree, fsdp.data_parallel_shard_degree
    keys = (f"trainer.fsdp.data_parallel_replicate_degree={replicate}, "
            f"trainer.fsdp.data_parallel_shard_degree={shard}")
    if fsdp.sharding_strategy not in ("HYBRID_SHARD", "_HYBRID_SHARD_ZERO2"):
        if shard not in (-1, world_size):
            raise ConfigError(f"trainer.fsdp.data_parallel_shard_degree={shard} with sharding_strategy="
                              f"{fsdp.sharding_strategy} must be the world size ({world_size} ranks): use "
                              f"HYBRID_SHARD to shard over fewer")
        return None, -1
    if replicate in (None, -1) and shard == -1:
        shard = local_world_size if world_size % local_world_size == 0 else world_size  # a node
    if replicate in (None, -1):
        replicate = world_size // shard if world_size % shard == 0 else 0
    elif shard == -1:
        shard = world_size // replicate if world_size % replicate == 0 else 0
    if replicate * shard != world_size:
        raise ConfigError(f"{keys}: a (replicate, shard) mesh must hold the world size, {world_size} ranks")
    if fsdp.version == 1 and shard == 1 and replicate > 1:
        # torch's FSDP1 runs a shard group of one rank as NO_SHARD, which all-reduces each gradient within that
        # group only: the replicas would never average their gradients, each rank training a model of its own
        why = "one rank a node, each node a shard group" if local_world_size == 1 else "shard degree 1"
        raise ConfigError(f"trainer.fsdp.sharding_strategy={fsdp.sharding_strategy} under FSDP1 with a (replicate "
                          f"{replicate}, shard 1) mesh ({why}) would not average gradients across the replicas "
                          f"(torch's FSDP1 runs a shard group of one rank as NO_SHARD): use trainer.fsdp.version=2, "
                          f"which replicates over (replicate, 1), or sharding_strategy=FULL_SHARD")
    return replicate, shard


class _ShardedEMAFSDP2Config(FSDP2Config):
    """FSDP2 with sharded checkpoints: Composer loads them with this planner, torch's own but for the EMA's
    shards (:class:`~diffusion.train.algorithms.ema.EMAShards`), which a checkpoint of before the EMA
    started, or of a run without EMA, does not hold."""

    @property
    def load_planner(self):
        from diffusion.train.algorithms.ema import optional_shards_load_planner
        return optional_shards_load_planner()

    @load_planner.setter
    def load_planner(self, value):  # a Composer whose config sets the field: ours stands
        pass


class _HybridFSDP2Config(_ShardedEMAFSDP2Config):
    """Composer 0.32's FSDP2Config with a (replicate, shard) mesh: Composer builds its device mesh from these two
    degrees (fixed to one flat mesh there, and a ``device_mesh`` passed in is replaced by it)."""

    def __init__(self, replicate: int, shard: int, **options):
        super().__init__(**options)
        self._degrees = (replicate, shard)

    @property
    def data_parallel_replicate_degree(self):
        return self._degrees[0]

    @property
    def data_parallel_shard_degree(self):
        return self._degrees[1]


def _fsdp_device(device: str, cfg: Config):
    """FSDP on CPU (gloo), as the tests run it: two work-arounds, both inert on GPUs.

    - Composer 0.32.1 hands FSDP ``device_id=torch.cuda.current_device()``, which fails without CUDA
      (FSDP itself takes the CPU device): while Composer wraps the model, that call answers the CPU.
    - Full checkpoints gather with ``offload_to_cpu``: torch's FSDP1 "moves" the full parameters to the
      CPU, which is a no-op there, then frees the storage they live in (a segfault on the first save).
      ``FlatParamHandle.to_cpu`` is made a no-op for parameters already on the CPU.
    - The full optimizer state is gathered into one buffer per parameter group, reused for each state
      (Adam's ``exp_avg``, then ``exp_avg_sq``), and "offloaded" with ``.cpu()``, a no-op there: every
      state ends up a view of the last one gathered (a resumed run restarts Adam with
      ``exp_avg = exp_avg_sq``). On the CPU each state is copied out of the buffer.
    - FSDP2 (torch 2.7) reduce-scatters fp32 gradients with ``ReduceOp.AVG``, which gloo carries out
      as a sum: gradients come out world-size times too large. On the CPU the average is made a sum
      and a division instead (the route FSDP2 itself takes for fp16 gradients). Under hybrid sharding
      FSDP2 asserts the replicas' all-reduce recorded a stream event, which the CPU's streams do not
      record: a stand-in event is handed on.

    Returns the context to build the Trainer in.
    """
    if device != "cpu" or cfg.trainer.fsdp is None:
        return contextlib.nullcontext()
    if cfg.trainer.fsdp.version == 2:
        _average_fsdp2_gradients_on_cpu()
    _copy_gathered_optimizer_state_on_cpu()
    from torch.distributed.fsdp._flat_param import FlatParamHandle
    if not getattr(FlatParamHandle.to_cpu, "cpu_safe", False):
        original = FlatParamHandle.to_cpu

        @contextlib.contextmanager
        def to_cpu(self):
            if self.flat_param.device.type == "cpu":
                yield
            else:
                with original(self):
                    yield
        to_cpu.cpu_safe = True
        FlatParamHandle.to_cpu = to_cpu
    return mock.patch.object(torch.cuda, "current_device", lambda: torch.device("cpu"))


def _copy_gathered_optimizer_state_on_cpu() -> None:
    from torch.distributed.fsdp import _optim_utils
    original = _optim_utils._unflatten_orig_param_states
    if getattr(original, "cpu_safe", False):
        return

    def unflatten(fsdp_param_info, output_states, state_name, shard_state, to_save, cpu_offload):
        original(fsdp_param_info, output_states, state_name, shard_state, to_save, cpu_offload)
        if to_save and cpu_offload:
            for states in output_states.values():
                value = states.get(state_name)
                if isinstance(value, torch.Tensor) and value.device.type == "cpu":
                    states[state_name] = value.clone()  # out of the buffer the next state reuses
    unflatten.cpu_safe = True
    _optim_utils._unflatten_orig_param_states = unflatten


def _average_fsdp2_gradients_on_cpu() -> None:
    from torch.distributed.fsdp._fully_shard import _fsdp_collectives as collectives
    original = collectives._get_gradient_divide_factors
    if getattr(original, "cpu_safe", False):
        return

    def divide_factors(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type="", *args, **kwargs):
        if device_type != "cpu":
            return original(reduce_scatter_group, all_reduce_group, reduce_dtype, device_type, *args, **kwargs)
        size = reduce_scatter_group.size() * (all_reduce_group.size() if all_reduce_group is not None else 1)
        return 1.0, float(size)  # no division before the sum, all of it after
    divide_factors.cpu_safe = True
    collectives._get_gradient_divide_factors = divide_factors

    # HSDP (a 2-D mesh): the all-reduce over the replicas records its "event" on the CPU stream, which
    # returns None, and FSDP2 asserts one exists; the CPU's streams never wait, so any event object serves.
    from torch.distributed.fsdp._fully_shard import _fsdp_param_group as param_group
    reduce = param_group.foreach_reduce

    def foreach_reduce(*args, **kwargs):
        out = reduce(*args, **kwargs)
        if out[3] is not None and out[4] is None:
            out = (*out[:4], torch.cpu.Event(), *out[5:])
        return out
    param_group.foreach_reduce = foreach_reduce


def prepare_model(cfg: Config, model: LatentDiffusion) -> LatentDiffusion:
    """Memory layout, (without FSDP, which does its own) activation checkpointing, and under FSDP
    :func:`compile_blocks`."""
    if cfg.trainer.channels_last and model.adapter.channels_last:
        model.denoiser.to(memory_format=torch.channels_last)
    if cfg.trainer.activation_checkpointing and cfg.trainer.fsdp is None:
        checkpoint_blocks(model)
    if cfg.trainer.compile and cfg.trainer.fsdp is not None:
        compile_blocks(model, cfg.trainer, buckets=_shape_buckets(cfg))
    return model


def checkpoint_blocks(model: LatentDiffusion) -> None:
    """``trainer.activation_checkpointing`` without FSDP: the per-block wrapper Composer applies under FSDP1 and
    FSDP2 (torch's non-reentrant ``checkpoint_wrapper`` around each of the adapter's blocks), so every path
    recomputes the same blocks the same way. A hook on a block (masking's and routing's token cut) then runs
    outside the recomputed region; diffusers' own gradient checkpointing recomputed the block inside the
    model's forward after those hooks were gone (``CheckpointError``: a different number of tensors saved).
    State dicts keep their names (the wrapper strips its prefix)."""
    from composer.distributed.activation_checkpointing import apply_ac, generate_composer_model_check_fn
    apply_ac(model, True, False, generate_composer_model_check_fn(model))


def _shape_buckets(cfg: Config) -> int:
    """How many latent shapes the run's batches come in: one, or the buckets of a bucketed dataset
    (train and held-out set)."""
    try:
        return sum(max(1, len(dataset_info.bucket_streams(section)))
                   for section in (cfg.data.train, cfg.data.eval) if section is not None and section.source == "mds")
    except Exception:  # the loaders report a dataset they cannot read, in their own words
        return 2


def _compile_options(t) -> dict:
    return {"backend": t.compile_backend, **({"mode": t.compile_mode} if t.compile_mode else {})}


# The (batch size, grad mode) pairs a block sees per latent shape in one run, at most: the train microbatch
# and its remainder (grad), the eval batch (no_grad; its last partial batch padded to it, the EMA's eval and the
# eval_bins levels reuse it), and the image logger's classifier-free-guidance batch (no_grad or inference
# mode), with room to spare. A finite set: every eval and every resume reuses the same graphs.
SHAPES_PER_BUCKET = 8


def compile_blocks(model: LatentDiffusion, t, buckets: int = 1) -> int:
    """``trainer.compile`` under FSDP: each block FSDP wraps is compiled in place, whole
    (``fullgraph=True``: a break inside one is an error, not a silent fallback), before FSDP wraps it, and
    the rest of the step runs eager. Compiling the whole model instead (Composer's ``compile_config``)
    breaks its graph at every FSDP unit. In place (``Module.compile``): parameter names, and so
    checkpoints, stay as they are. Returns the number of blocks compiled.

    Graphs are static (``dynamic=False``: a second shape does not turn the first graph dynamic, and the
    shapes differ between a UNet's stages anyway), one per distinct block, input shape and grad mode. All
    blocks share one code object (``Module._call_impl``), whose cache dynamo limits: it is sized for every
    block at each of the run's shapes (:data:`SHAPES_PER_BUCKET` per latent shape of ``buckets``), so the
    eval batch under ``no_grad`` and the image logger's batch compile once each instead of exceeding the
    limit (``FailOnRecompileLimitHit``, which ``fullgraph`` makes an error). A microbatch size that
    changes during the run (``auto``) is refused by the config."""
    import torch._dynamo
    blocks = [m for m in model.denoiser.modules() if type(m).__name__ in model.adapter.blocks]
    limit = len(blocks) * SHAPES_PER_BUCKET * max(1, buckets)
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, limit)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, limit)
    for block in blocks:
        block.compile(fullgraph=True, dynamic=False, **_compile_options(t))
    model.pad_eval_batches = True  # the eval's last, partial batch runs the full batch's graphs
    return len(blocks)


class DropGradientsBeforeEval(Callback):
    """``trainer.compile`` under FSDP1: the last step's gradients are let go before the evals (Composer sets
    them to None at the next batch's start anyway). FSDP1 keeps a flat parameter's sharded gradient beside
    its gathered whole value, and dynamo, compiling a block for the eval's shapes, refuses such a tensor
    (``attempting to assign a gradient of size ...``)."""

    def eval_before_all(self, state, logger) -> None:
        for optimizer in state.optimizers:
            optimizer.zero_grad(set_to_none=True)


def check_compiled_fsdp1_microbatches(cfg: Config, world_size: int) -> None:
    """FSDP1 holds the sharded gradient of earlier microbatches beside the gathered weights while the next
    microbatch's forward runs, which compiled blocks cannot read (the same dynamo error as above): compiled
    FSDP1 takes each rank's batch whole; FSDP2 accumulates microbatches compiled."""
    t = cfg.trainer
    per_rank = cfg.data.train.batch_size // max(1, world_size)
    micro = t.device_train_microbatch_size
    if t.compile and t.fsdp is not None and t.fsdp.version == 1 and isinstance(micro, int) and micro < per_rank:
        raise ConfigError(f"trainer.compile=true under trainer.fsdp.version=1 cannot accumulate microbatches "
                          f"(trainer.device_train_microbatch_size={micro} < {per_rank} samples a rank): use "
                          f"trainer.fsdp.version=2, or a microbatch of the rank's whole batch")


def check_weights_for(model: LatentDiffusion, path: str) -> None:
    """``trainer.load_path`` must hold weights for this model: a file without them (another model, an
    empty state) is refused in one line naming what it holds, instead of training from scratch."""
    from diffusion.errors import ConfigError
    from diffusion.models.description import ModelDescription
    from diffusion.models.latent_diffusion import LEGACY_PREFIX, PREFIX
    state = safe_checkpoint.load(path).get("state") or {}
    held = {k.replace(LEGACY_PREFIX, PREFIX, 1) if k.startswith(LEGACY_PREFIX) else k
            for k in (state.get("model") or {}) if k != "_extra_state"}
    wanted = [k for k in model.state_dict() if k.startswith(PREFIX)]
    found = sum(k in held for k in wanted)
    if found < len(wanted):
        prefixes = sorted({k.split(".")[0] for k in held}) or ["no weights"]
        extra = (state.get("model") or {}).get("_extra_state")
        try:  # what the checkpoint says it is, where it says
            what = f"a {ModelDescription.from_extra_state(extra).denoiser}: " if isinstance(extra, dict) else ""
        except KeyError:
            what = ""
        raise ConfigError(f"trainer.load_path={path}: holds {what}{len(held)} tensors ({', '.join(prefixes)}), and "
                          f"{found} of the {len(wanted)} this {model.adapter.class_name} needs; give a checkpoint "
                          f"of this model")


def _local_checkpoints_to_load(cfg: Config) -> list[str]:
    """The local checkpoints this run's Trainer will read: ``trainer.load_path`` and, with autoresume, the
    save folder's latest checkpoint (of this rank; a sharded checkpoint's folder is every rank's)."""
    t, paths = cfg.trainer, []
    if t.load_path and "://" not in t.load_path and os.path.exists(os.path.expanduser(t.load_path)):
        paths.append(t.load_path)
    latest = _autoresume_checkpoint(cfg)
    if latest is not None:
        paths.append(latest)
    return paths


def _autoresume_checkpoint(cfg: Config) -> str | None:
    """The checkpoint autoresume will load from a local save folder (a file, or a sharded folder), or None."""
    t = cfg.trainer
    if not (t.autoresume and t.save_folder and "://" not in t.save_folder):
        return None
    from composer.utils import format_name_with_dist
    folder = format_name_with_dist(t.save_folder, _run_name(cfg) or "")
    rank = 0 if t.fsdp is not None and t.fsdp.state_dict_type == "sharded" else dist.get_global_rank()
    latest = os.path.join(folder, f"latest-rank{rank}.pt")
    return latest if os.path.exists(latest) else None


def _check_checkpoint(path: str) -> None:
    """Refuse (one line) a checkpoint whose pickles would call anything outside our allow-list."""
    if os.path.isdir(os.path.expanduser(path)):
        safe_checkpoint.check_sharded(os.path.expanduser(path))
    else:
        safe_checkpoint.check(path)


def check_loads(cfg: Config, model: LatentDiffusion) -> str | None:
    """Before Composer reads a checkpoint: nothing in it may run code, a sharded one loads only into a
    sharded run (and a file only into one that is not), autoresume loads only this run's own checkpoint
    (:mod:`diffusion.train.resume`) and ``trainer.load_path`` holds this model's weights. Returns the
    checkpoint autoresume will load from a local save folder, or None."""
    t = cfg.trainer
    safe_checkpoint.guard_composer_loads()  # load_path and autoresume read weights-only: no code runs
    safe_checkpoint.guard_sharded_loads()
    for path in _local_checkpoints_to_load(cfg):  # named as the user gave them, before Composer copies them
        _check_checkpoint(path)
    latest = _autoresume_checkpoint(cfg)
    if latest is not None:
        check_checkpoint_kind(cfg, latest, f"trainer.save_folder={t.save_folder}: autoresume's "
                                           f"{os.path.basename(latest)}")
        resume.check_own_run(latest, t.save_folder, model, model.run_identity["data"],
                             model.run_identity["text_encoder"])
    elif t.load_path and t.load_path in _local_checkpoints_to_load(cfg):
        check_checkpoint_kind(cfg, t.load_path, "trainer.load_path")
        if not os.path.isdir(os.path.expanduser(t.load_path)):
            check_weights_for(model, t.load_path)
    return latest


@contextlib.contextmanager
def _own_remote_run(cfg: Config, model: LatentDiffusion, claimed: list):
    """A remote save folder's autoresume checks the checkpoint it loads is this run's own (as
    :func:`check_loads` does a local folder's). A full checkpoint: Composer downloads the ``latest`` one to
    every node in its constructor and loads it there, so the check runs between the two, on the downloaded
    file. A sharded one Composer reads in place, from the store: the check runs on the extra state it loaded,
    before anything trains. Refused, the folder is left unlocked."""
    t = cfg.trainer
    if not (t.autoresume and t.save_folder and "://" in t.save_folder):
        yield
        return
    from composer.utils import checkpoint as composer_checkpoint, parse_uri
    identity = (model, model.run_identity["data"], model.run_identity["text_encoder"])
    download, load = Trainer._get_autoresume_checkpoint, composer_checkpoint.load_checkpoint
    given = parse_uri(t.load_path)[2] if t.load_path else None

    def downloaded_and_checked(self, *args, **kwargs):
        path = download(self, *args, **kwargs)
        if path is not None:
            resume.check_own_run(path, t.save_folder, *identity)
        return path

    def loaded_and_checked(*args, **kwargs):  # a sharded checkpoint: autoresume's, not trainer.load_path's
        out = load(*args, **kwargs)
        path = str(kwargs.get("path") or "")
        if path and path != given and model.loaded_extra_state is not None:
            resume.check_own_state(model.loaded_extra_state, posixpath.basename(path.rstrip("/")), t.save_folder,
                                   *identity, loaded=True)
        return out

    sharded = t.fsdp is not None and t.fsdp.state_dict_type == "sharded"
    try:
        with mock.patch.object(Trainer, "_get_autoresume_checkpoint", downloaded_and_checked), \
                mock.patch.object(composer_checkpoint, "load_checkpoint", loaded_and_checked if sharded else load):
            yield
    except ConfigError:
        for lock in claimed:
            lock.release()
        raise


def check_checkpoint_kind(cfg: Config, path: str, where: str) -> None:
    """A sharded checkpoint (a folder) loads only into a run that saves sharded ones, and a file only
    into one that does not: Composer picks its reader by the run's ``state_dict_type``."""
    sharded = cfg.trainer.fsdp is not None and cfg.trainer.fsdp.state_dict_type == "sharded"
    folder = os.path.isdir(os.path.expanduser(path))
    if folder != sharded:
        kind, need = (("a sharded checkpoint (a folder)", "trainer.fsdp.state_dict_type=sharded") if folder else
                      ("a full checkpoint (one file)", "trainer.fsdp.state_dict_type=full (or no trainer.fsdp)"))
        raise ConfigError(f"{where}={path} is {kind}, which this run cannot read: load it with {need}")


def _run_name(cfg: Config) -> str | None:
    t = cfg.trainer
    if t.run_name:
        return t.run_name
    # autoresume finds the run's checkpoints by name: derive a stable one from the save folder.
    if t.autoresume and t.save_folder:
        return os.path.basename(os.path.normpath(t.save_folder)) or "diffusion"
    return None


def _console_logging(loggers: dict) -> tuple[dict, dict]:
    """``loggers.console`` as the Trainer arguments Composer wants for its console logging (it warns
    when handed a ConsoleLogger), and the other loggers."""
    loggers = dict(loggers)
    options = loggers.pop("console", None)
    console = {"log_to_console": options is not None}
    for key, argument in (("log_interval", "console_log_interval"), ("stream", "console_stream"),
                          ("log_traces", "log_traces")):
        if options and key in options:
            console[argument] = options[key]
    return loggers, console


def build_evaluators(cfg: Config, eval_loader, algorithms) -> list[Evaluator] | None:
    """The held-out loss of the raw weights (``metrics/eval/loss``) and, with the EMA algorithm and once
    it has started, of the EMA weights on the same batches (``metrics/eval_ema/loss``)."""
    if eval_loader is None:
        return None
    evaluators = [Evaluator(label="eval", dataloader=eval_loader)]
    evaluators += [a.evaluator(eval_loader, cfg.trainer.eval_interval) for a in algorithms if isinstance(a, EMA)]
    return evaluators


def attach_text_encoder(cfg: Config, model: LatentDiffusion, info: schema.DatasetInfo, empty_text_embeds) -> None:
    """Training from token ids: the frozen text encoder (``model.text_encoder``, else the one the dataset
    records), checked against the UNet and the dataset's empty-caption embedding before the first step."""
    ref, where = cfg.model.text_encoder, "model.text_encoder"
    if not ref:
        ref, where = info.text_encoder_ref, "the text encoder dataset.json records"
    if os.path.isdir(os.path.expanduser(ref)):
        ref = os.path.abspath(os.path.expanduser(ref))
    empty_ids = info.empty_input_ids
    if empty_ids is None:  # a dataset written before dataset.json recorded them: its tokenizer's
        empty_ids = dataset_info.load_empty_input_ids(cfg.data.train)
    model.text_encoder = load_frozen_text_encoder(ref, text_dim=model.text_dim, empty_input_ids=empty_ids,
                                                  empty_text_embeds=empty_text_embeds, probe=info.text_probe,
                                                  where=where, empty_tokens=info.empty_text_tokens,
                                                  dataset=cfg.data.train.path or "",
                                                  dtype=encoding_dtype("cuda" if _on_gpu(cfg) else "cpu"),
                                                  check_embeddings=dist.get_local_rank() == 0)


def _on_gpu(cfg: Config) -> bool:
    return (cfg.trainer.device or ("gpu" if torch.cuda.is_available() else "cpu")) == "gpu"


def _empty_embedding_or_none(loader_cfg):
    try:
        return dataset_info.load_empty_embedding(loader_cfg)
    except FileNotFoundError:
        return None


def build_trainer(cfg: Config, train_dataloader=None, info: schema.DatasetInfo | None = None,
                  extra_callbacks=(), text_column: str | None = None, empty_text_embeds=None) -> Trainer:
    """The Composer trainer for ``cfg``.

    Online mode (:mod:`diffusion.online`) passes its own ``train_dataloader`` (batches of the same
    contract), the data description ``info``, the ``text_column`` its batches hold and the empty
    caption's embedding in place of the MDS loader, ``dataset.json`` and ``empty_text_embeds.npy``,
    and ``extra_callbacks`` of its own; everything else is built exactly as for offline training.
    """
    t = cfg.trainer
    if t.device == "gpu" and not torch.cuda.is_available():  # Composer's DeviceGPU raised it as a traceback
        raise ConfigError("trainer.device=gpu: torch sees no CUDA device on this machine; use trainer.device=cpu, "
                          "or leave trainer.device unset to train on the GPU wherever there is one")
    device = t.device or ("gpu" if torch.cuda.is_available() else "cpu")
    dist.initialize_dist(device, timeout=t.dist_timeout)
    check_compiled_fsdp1_microbatches(cfg, dist.get_world_size())
    shared_memory.clean_shared_memory()  # every rank: local rank 0 cleans, then streaming's own barrier

    if info is None:
        info = dataset_info.read_loader_info(cfg.data.train, cfg.model.resolution)  # a mix's streams agree
    model = prepare_model(cfg, build_model(cfg.model, info, seed=t.seed))
    if text_column is None:  # stored embeddings, or token ids the model encodes (model.text)
        sections = [cfg.data.train] + ([cfg.data.eval] if cfg.data.eval else [])
        text_column = dataset_info.text_column(cfg.model.text, sections)
        if text_column == schema.INPUT_IDS:
            empty_text_embeds = _empty_embedding_or_none(cfg.data.train)
    elif cfg.data.eval:  # the stream's column: the held-out set must hold it too
        dataset_info.text_column("ids" if text_column == schema.INPUT_IDS else "embeds", [cfg.data.eval])
    if text_column == schema.INPUT_IDS:
        attach_text_encoder(cfg, model, info, empty_text_embeds)
    elif cfg.model.text_encoder:  # read only from token ids: refused, not ignored (issue 47 item 7)
        raise ConfigError(f"model.text_encoder={cfg.model.text_encoder} is read only when the run trains from token "
                          f"ids, and this run reads the stored text embeddings, which would ignore it: remove the "
                          f"key (or set model.text=ids on a dataset holding ids)")
    # the captions' token counts: attention masks for the denoiser, or for a text encoder that reads them
    # (a given train_dataloader, online mode's stream, carries them itself)
    tokens = model.text_mask or bool(model.text_encoder is not None and model.text_encoder.takes_mask)
    loader_args = dict(resolution=cfg.model.resolution, text_dim=model.text_dim,
                       world_size=dist.get_world_size(), seed=t.seed, text_column=text_column, tokens=tokens)
    train_loader = (train_dataloader if train_dataloader is not None
                    else mds_source.build_dataloader(cfg.data.train, noise=noise_draws(cfg), **loader_args))
    eval_loader = (mds_source.build_dataloader(cfg.data.eval, drop_last=False, **loader_args)  # the whole set
                   if cfg.data.eval else None)

    optimizer = build_optimizer(cfg, model)
    algorithms = components.build_components("algorithms", cfg.algorithms)
    if model.repa is not None:  # REPA's switch-off batch, from the trainer's batch count
        algorithms.append(RepaSwitch(model.repa))
    if t.grad_clip_norm:
        algorithms.append(LoggedGradientClipping(t.grad_clip_norm, t.grad_norm_log_interval))  # logs the pre-clip norm

    callbacks = components.build_components("callbacks", cfg.callbacks) + list(extra_callbacks)
    if t.fsdp is not None and t.fsdp.version == 2 and t.fsdp.state_dict_type == "sharded":
        averages = {type(a).__qualname__: a for a in algorithms if type(a) is EMA}
        for a in algorithms:  # post-hoc EMA's profiles
            averages.update(a.shard_groups() if hasattr(a, "shard_groups") else {})
        if averages:  # each rank writes its own EMA shards, beside the weights'
            callbacks.append(EMAShards(averages, model))
    if t.compile and t.fsdp is not None and t.fsdp.version == 1:
        callbacks.insert(0, DropGradientsBeforeEval())
    if model.text_encoder is not None and not any(isinstance(c, TextEncoderShare) for c in callbacks):
        callbacks.append(TextEncoderShare())  # every run that encodes text shows what it costs
    watch = cpus.spin_watch()
    if watch is not None:  # threads spinning since a quiet start step down while other work takes CPUs
        callbacks.append(CpuWatch(watch))
    loggers, console = _console_logging(cfg.loggers)
    if t.autoresume:
        forget_autoresume_download(t.save_folder, _run_name(cfg))  # resume from the remote latest, not a copy
    # one run per save folder; checkpoints written whole; a cut one set aside before autoresume looks
    model.run_identity = {"data": resume.data_identity(cfg),
                          "text_encoder": cfg.model.text_encoder or info.text_encoder_ref}
    claimed = save_folder.claim(t.save_folder, _run_name(cfg), t.autoresume, t.start_fresh)
    callbacks += claimed
    try:
        latest = check_loads(cfg, model)
    except BaseException:
        for lock in claimed:  # refused before training: the folder is left as it was, unlocked
            lock.release()
        raise
    # a local folder is pruned by the folder's contents, earlier runs' checkpoints counted (Composer's
    # own rotation counts only what this process saved); a remote one after each upload
    pruners = local_pruner(t.save_folder, t.save_num_checkpoints_to_keep)
    with _fsdp_device(device, cfg), _own_remote_run(cfg, model, claimed):
        trainer = Trainer(
            model=model, train_dataloader=train_loader, eval_dataloader=build_evaluators(cfg, eval_loader, algorithms),
            max_duration=t.max_duration,
            eval_interval=t.eval_interval if eval_loader else 1, eval_subset_num_batches=t.eval_subset_num_batches,
            optimizers=optimizer, schedulers=build_scheduler(cfg), step_schedulers_every_batch=True,
            algorithms=algorithms, callbacks=callbacks,
            loggers=components.build_components("loggers", loggers), progress_bar=False, **console,
            run_name=_run_name(cfg), seed=t.seed, device=device,
            precision=t.precision or ("amp_bf16" if device == "gpu" else "fp32"),
            device_train_microbatch_size=t.device_train_microbatch_size,
            parallelism_config=build_parallelism(cfg),
            compile_config=_compile_options(t) if t.compile and t.fsdp is None else None,
            save_folder=t.save_folder, save_interval=t.save_interval,
            save_num_checkpoints_to_keep=-1 if pruners else t.save_num_checkpoints_to_keep,
            save_overwrite=t.save_overwrite,
            autoresume=t.autoresume, load_path=t.load_path, load_weights_only=t.load_weights_only,
            load_strict_model_weights=t.load_strict, dist_timeout=t.dist_timeout)
    # Composer prunes local checkpoints only; this prunes a remote save_folder, after Composer's
    # CheckpointSaver (which the Trainer appends last) has uploaded.
    trainer.state.callbacks.extend(pruners + remote_pruner(t.save_folder, t.save_num_checkpoints_to_keep))
    set_phase(trainer, model, train_loader)
    trainer.resumed_from = None  # what this run continues, for its first line
    if int(trainer.state.timestamp.batch) > 0:
        trainer.resumed_from = os.path.realpath(latest) if latest else (t.save_folder if t.autoresume else t.load_path)
    return trainer


def checkpoint_path(cfg: Config) -> str | None:
    """The run's latest checkpoint: the file (or sharded folder) ``latest`` points to in a local save
    folder, the remote save folder itself, or None without one."""
    t = cfg.trainer
    if not t.save_folder:
        return None
    if "://" in t.save_folder:
        return t.save_folder
    from composer.utils import format_name_with_dist
    latest = os.path.join(format_name_with_dist(t.save_folder, _run_name(cfg) or ""), save_folder.LATEST)
    return os.path.realpath(latest) if os.path.lexists(latest) else None


def set_phase(trainer: Trainer, model: LatentDiffusion, loader) -> int:
    """The run's phase, once the Trainer has loaded what it loads: the checkpoint's own when this run
    resumes itself (its timestamp goes on), one more when it starts from another run's weights (a new
    phase: its schedule starts at 0), 0 from scratch. The model records it in checkpoints and the
    loader salts every per-sample draw with it, so phase 2 does not replay phase 1's noise, levels and
    caption dropout (:mod:`diffusion.loader.batches`); set before the loader's workers start."""
    loaded, phase = model.loaded_extra_state, 0
    if loaded is not None:
        phase = int(loaded.get("phase", 0)) + (int(trainer.state.timestamp.batch) == 0)
    model.phase = phase
    # the MDS loader's collate step, or the online stream's batches (ShardBatches.to_batch)
    to_batch = getattr(getattr(loader, "collate_fn", None), "to_batch", None) or getattr(loader, "to_batch", None)
    if to_batch is not None:
        to_batch.phase = phase
    return phase


def finished_message(trainer: Trainer) -> str | None:
    """Why ``trainer.fit()`` would have nothing to do (autoresume loaded a run that reached its
    ``max_duration``), or None. Re-running a finished run is then a report, not a crash."""
    state = trainer.state
    if state.max_duration is None or state.timestamp.get(state.max_duration.unit) < state.max_duration:
        return None
    return finished_line(state.timestamp.get(state.max_duration.unit), state.max_duration)


def finished_line(at, max_duration) -> str:
    """What a re-run of a finished run says: its checkpoint is ``at`` (e.g. ``6ba``) of ``max_duration``."""
    return (f"run already finished: the checkpoint is at {at} of trainer.max_duration={max_duration}; raise "
            f"trainer.max_duration to train further")
