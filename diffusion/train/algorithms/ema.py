"""EMA: an exponential moving average of the trainable weights, kept shard-local and updated in one fused op.

Why our own and not Composer's: under FSDP each rank holds only its shard of every parameter; this EMA
keeps a copy of exactly that local shard (no full gather per step), updates all of it with one
``torch._foreach_lerp_`` per step, and gathers full tensors only when a checkpoint is written.

    ema_t = decay_n * ema_{t-1} + (1 - decay_n) * weights_t            (every ``update_interval`` batches)
    decay_n = min(smoothing, (1 + n) / (10 + n)), 0 for n = 0    n = 0, 1, ...: the updates before this one

The EMA starts as a copy of the weights at ``start``: a batch count ("800000ba", or an int), samples
("...sp") or a fraction of ``trainer.max_duration`` ("0.95dur"), resolved at each fit start against
that launch's ``max_duration`` (0: at fit start).

The warm-up (``warmup=True``, the default) is the decay schedule of diffusers' ``EMAModel``, update for
update: its ``(1 + step) / (10 + step)`` capped at ``smoothing`` (``decay`` there), with ``step`` the
updates before this one, and 0 at the first (the first update takes the weights as they are: 2/11, 3/12,
... after it). Early updates follow the weights closely, so the average does not hold on to the weights
it started from; the decay reaches ``smoothing`` at update ``1 + (10 * smoothing - 1) / (1 - smoothing)``
(81 for 0.9, 891 for 0.99, ~100k for 0.9999). ``warmup=False`` uses ``smoothing`` from the first update, as Composer's EMA does.
The update count ``n`` is checkpointed, so a resumed run continues the warm-up exactly.

Evaluation: the raw weights are evaluated as always (label ``eval``: ``metrics/eval/loss``), and once
the EMA has started, the EMA weights too, by a second evaluator on the same held-out loader
(:meth:`EMA.evaluator`, label ``eval_ema``: ``metrics/eval_ema/loss``): the EMA is swapped in at that
evaluator's ``EVAL_START`` and the training weights back at its ``EVAL_END``, around it only. Image
loggers use ``with ema.ema_weights(model): ...``. ``state_dict()["ema_params"]`` maps the
ComposerModel's parameter names (``denoiser.conv_in.weight``) to full tensors; Composer stores it in the
checkpoint under ``state["algorithms"]``, and loading it restores the average exactly.

Swapping under FSDP: the swap writes the local shards, but FSDP computes with the *gathered* full
parameters, and it keeps those after a forward that no backward follows (an eval, an image grid):
always under SHARD_GRAD_OP, for the root unit under FULL_SHARD. Left alone, the next training
forward would reuse the gathered EMA (and the eval, the gathered training weights). So every swap
first drops what FSDP has gathered (FSDP1: each unit's handle is resharded, freeing the unsharded flat
parameter; FSDP2: ``FSDPModule.reshard()``); the next forward gathers the shards as they are now.
Sharded checkpoints (``state_dict_type: sharded``) under FSDP2: each rank writes its own EMA shards
beside the weights' and no rank gathers the EMA. Composer pickles ``state["algorithms"]`` into one entry
(rank 0's), so the shards go through a companion callback, :class:`EMAShards`, whose state Composer
flattens per key: ``state.callbacks.EMAShards.EMA.<parameter name>``, DTensors that torch's distributed
checkpoint writes per rank and re-shards on load. The algorithm's own entry keeps the update count and
start. A sharded checkpoint without those entries (written before the EMA started, or by a run without
EMA) loads as before (:func:`optional_shards_load_planner`, which Composer loads sharded checkpoints
with). FSDP1's local shards are flat slices, not DTensors: sharded checkpoints with FSDP1 are refused at
fit start (and when the config is read).
"""

from __future__ import annotations

import contextlib
import os
from typing import Any

import torch
from composer.core import Algorithm, Callback, Event, State, Time, TimeUnit
from composer.loggers import Logger

# Wrapper modules insert these components into parameter names; the saved names drop them.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod", "module")

EVAL_LABEL = "eval_ema"  # the evaluator whose batches run on the EMA weights: metrics/eval_ema/...


def smoothing_from_half_life(half_life: str, update_interval: int = 1) -> float:
    """The per-update smoothing whose weight halves after ``half_life`` (a batch count such as "1000ba")."""
    time = Time.from_timestring(half_life) if isinstance(half_life, str) else half_life
    if time.unit != TimeUnit.BATCH:
        raise ValueError(f"EMA half_life must be in batches (e.g. '1000ba'), got {half_life!r}")
    if time.value <= 0:
        raise ValueError(f"EMA half_life must be positive, got {half_life!r}")
    return 0.5 ** (update_interval / time.value)


def _parse_start(start: str | int) -> Time:
    """``start`` as a Time in batches, samples or a fraction of the run ("dur"); an int counts batches."""
    if isinstance(start, bool) or not isinstance(start, (int, str)):
        raise ValueError(f"EMA start must be a batch count or a time string ('1000ba', '0.05dur'), got {start!r}")
    try:
        time = Time(start, TimeUnit.BATCH) if isinstance(start, int) else Time.from_timestring(start.strip())
    except ValueError as e:
        raise ValueError(f"EMA start {start!r} is not a time: give batches ('1000ba'), samples ('...sp') or a "
                         f"fraction of trainer.max_duration ('0.05dur')") from e
    if time.unit not in (TimeUnit.BATCH, TimeUnit.SAMPLE, TimeUnit.DURATION):
        raise ValueError(f"EMA start {start!r} must be in batches ('1000ba'), samples ('...sp') or a fraction of "
                         f"trainer.max_duration ('0.05dur'): epochs change length on resumption")
    if time.value < 0 or (time.unit == TimeUnit.DURATION and time.value > 1):
        raise ValueError(f"EMA start {start!r} must be >= 0 (and a fraction of the run at most 1dur)")
    return time


def resolve_start(start: Time, max_duration: Time | None) -> Time:
    """``start`` in batches or samples; a fraction of the run becomes that fraction of ``max_duration``."""
    if start.unit != TimeUnit.DURATION:
        return start
    if max_duration is None or max_duration.unit not in (TimeUnit.BATCH, TimeUnit.SAMPLE):
        raise ValueError(f"EMA start {start} is a fraction of the run: trainer.max_duration must then be in "
                         f"batches or samples, not {max_duration}")
    return Time(int(round(start.value * max_duration.value)), max_duration.unit)


def parameter_name(name: str) -> str:
    """``_fsdp_wrapped_module.unet._orig_mod.conv_in.weight`` -> ``unet.conv_in.weight``."""
    return ".".join(part for part in name.split(".") if part not in _WRAPPER_PREFIXES)


def trainable_parameters(model: torch.nn.Module) -> dict[str, torch.nn.Parameter]:
    """Trainable parameters by clean name; under FSDP (use_orig_params) these are the local shards."""
    return {parameter_name(n): p for n, p in model.named_parameters() if p.requires_grad}


def _local(t: torch.Tensor) -> torch.Tensor:
    # FSDP2 parameters are DTensors; their local tensor is a view of the storage the optimizer updates.
    return t.to_local() if hasattr(t, "to_local") else t


def _uses_fsdp1(model: torch.nn.Module) -> bool:
    from torch.distributed.fsdp import FullyShardedDataParallel
    return any(isinstance(m, FullyShardedDataParallel) for m in model.modules())


def drop_gathered_parameters(model: torch.nn.Module) -> None:
    """Free every full parameter FSDP keeps gathered, so the next forward gathers the current shards.

    Call it before writing the local shards outside FSDP's own forward/backward (an EMA swap), or
    after: FSDP does not re-gather a unit it considers unsharded, and would compute with stale values.
    A no-op without FSDP, for NO_SHARD (nothing is gathered) and for units already sharded.
    """
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    for module in model.modules():
        if isinstance(module, FSDP):
            # FSDP1 has no public reshard: this is what its own post-forward/backward resharding does.
            from torch.distributed.fsdp._common_utils import TrainingState
            from torch.distributed.fsdp._flat_param import HandleTrainingState
            from torch.distributed.fsdp._runtime_utils import _reshard
            handle = module._handle
            if handle is None or not handle.uses_sharded_strategy or handle.needs_unshard():
                continue  # no parameters, nothing ever gathered, or not gathered now
            if (module.training_state != TrainingState.IDLE
                    or handle._training_state != HandleTrainingState.IDLE):
                raise RuntimeError("EMA weights swapped inside an FSDP forward/backward or summon_full_params")
            _reshard(module, handle, free_unsharded_flat_param=True)
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # torch without FSDP2
        return
    for module in model.modules():
        if isinstance(module, FSDPModule):
            module.reshard()


def _phase_ema(path: str) -> dict:
    """The EMA state of the checkpoint ``path`` (an earlier phase: a local file or a URI such as
    ``s3://bucket/run/latest-rank0.pt``), read weights-only."""
    from diffusion.errors import ConfigError
    from diffusion.models import safe_checkpoint
    with _local_copy(path) as local:
        state = safe_checkpoint.load(local)["state"]
    for name, algorithm_state in state.get("algorithms") or []:
        if name == "EMA" and isinstance(algorithm_state, dict) and algorithm_state.get("ema_params"):
            return algorithm_state
    raise ConfigError(f"algorithms.ema.init_from={path}: the checkpoint holds no EMA to continue from")


@contextlib.contextmanager
def _local_copy(path: str):
    """``path`` as a local file: itself, or a remote checkpoint downloaded through :mod:`diffusion.storage`
    (the endpoint every stage uses) into a temporary folder. Composer's ``latest-rank0.pt`` on an object
    store is the object ``latest-rank0.pt.symlink`` holding the real key: it is followed, as load_path does."""
    import shutil
    import tempfile

    import pyarrow.fs as pafs

    from diffusion.errors import ConfigError
    from diffusion.storage import filesystem_for
    missing = ConfigError(f"algorithms.ema.init_from={path}: no such checkpoint (the earlier phase's, e.g. "
                          f"CKPT_FOLDER/latest-rank0.pt)")
    if "://" not in path:
        if not os.path.isfile(os.path.expanduser(path)):
            raise missing
        yield path
        return
    with tempfile.TemporaryDirectory(prefix="ema-init-") as folder:
        try:
            fs, inside = filesystem_for(path)
            if fs.get_file_info(inside).type != pafs.FileType.File:
                pointer = inside + ".symlink"
                if fs.get_file_info(pointer).type != pafs.FileType.File:
                    raise missing
                with fs.open_input_stream(pointer) as f:  # the key within the bucket
                    inside = inside.split("/", 1)[0] + "/" + f.read().decode().strip().lstrip("/")
            local = os.path.join(folder, os.path.basename(inside))
            with fs.open_input_stream(inside) as source, open(local, "wb") as target:
                shutil.copyfileobj(source, target, 1 << 24)
        except OSError as e:  # unreachable endpoint, no credentials, a pointer to a deleted object ...
            first = str(e).strip().splitlines()[0] if str(e).strip() else type(e).__name__
            raise ConfigError(f"algorithms.ema.init_from={path}: could not be read ({first})") from None
        yield local


class EMA(Algorithm):
    """Exponential moving average of the trainable weights (see the module docstring).

    Args:
        half_life: a batch count ("1000ba"); when given it sets ``smoothing`` from ``update_interval``.
        smoothing: weight of the old average at each update (once warmed up).
        start: when the EMA starts as a copy of the weights: batches ("800000ba", or an int), samples
            ("...sp") or a fraction of ``trainer.max_duration`` ("0.95dur"); 0 starts at fit start.
        update_interval: update every this many batches, counted from the start.
        warmup: diffusers' EMA warm-up: the decay of an update after ``n`` others is
            ``min(smoothing, (1+n)/(10+n))``, and 0 for the first (``EMAModel.get_decay``).
            False: ``smoothing`` from the first update.
        init_from: a checkpoint of an earlier phase (a staged recipe): a run that does not resume starts
            its average from that checkpoint's EMA (and update count), not from its own first weights.
        restart: with ``init_from``, the update count starts again at 0: this phase's ``smoothing`` and
            warm-up apply from its first batch to the earlier phase's average, as a new phase's own
            average would (a warm-up then follows the new weights closely at once; without one, the
            earlier average fades at ``smoothing`` per batch). False: the count goes on, and a phase whose
            predecessor had warmed up averages at ``smoothing`` from its first batch.
    """

    eval_label = EVAL_LABEL

    def __init__(self, half_life: str | None = None, smoothing: float = 0.9999, start: str | int = 0,
                 update_interval: int = 1, warmup: bool = True, init_from: str | None = None,
                 restart: bool = False):
        if isinstance(update_interval, bool) or not isinstance(update_interval, int) or update_interval < 1:
            raise ValueError(f"EMA update_interval must be a whole number of batches >= 1, got {update_interval!r}")
        self.half_life = half_life
        self.smoothing = smoothing_from_half_life(half_life, update_interval) if half_life else float(smoothing)
        if not 0.0 <= self.smoothing <= 1.0:
            raise ValueError(f"EMA smoothing must be in [0, 1], got {self.smoothing}")
        self.start = start
        self._start = _parse_start(start)  # resolved against max_duration at fit start
        self.update_interval = int(update_interval)
        self.warmup = bool(warmup)
        self.init_from = init_from
        if restart and not init_from:
            raise ValueError("EMA restart restarts the average of init_from: give algorithms.ema.init_from too")
        self.restart = bool(restart)
        self.num_updates = 0  # updates since the start: the warm-up's n, checkpointed
        self.started_at_batch: int | None = None  # the batch count at the start (update_interval counts from it)
        self._resolved_start: Time | None = None  # ``start`` in batches or samples, set at fit start
        self._model: torch.nn.Module | None = None
        self._sharded_checkpoints = False
        self._names: list[str] = []
        self._params: list[torch.Tensor] = []  # local views of the live weights
        self._ema: list[torch.Tensor] | None = None  # local EMA shards, parallel to _params; None before start
        self._pending: dict[str, Any] | None = None  # loaded before the model was ready
        self._shards_beside = False  # FSDP2 sharded checkpoints: the shards are EMAShards' state, not ours
        self._loaded_shards: dict[str, torch.Tensor] | None = None  # what EMAShards loaded, until _restore
        self._swapped: list[torch.Tensor] | None = None  # training weights while the EMA is swapped in

    def __repr__(self) -> str:
        return (f"EMA(half_life={self.half_life!r}, smoothing={self.smoothing}, start={self.start!r}, "
                f"update_interval={self.update_interval}, warmup={self.warmup})")

    @property
    def started(self) -> bool:
        return self._ema is not None

    @property
    def decay(self) -> float:
        """The weight of the old average in the next update (the warm-up's, then ``smoothing``)."""
        if not self.warmup:
            return self.smoothing
        n = self.num_updates  # diffusers' step: the updates before this one; the first takes the weights
        return min(self.smoothing, (1 + n) / (10 + n)) if n else 0.0

    def evaluator(self, dataloader, eval_interval: str | int | Time):
        """A Composer ``Evaluator`` (label ``eval_ema``) of ``dataloader`` on the EMA weights, every
        ``eval_interval`` and at fit end as the plain evaluator, from the first eval after the start on.

        Give the same loader as the raw-weights evaluator: both see the same batches (and noise).
        A standalone ``trainer.eval()`` runs every evaluator: before the start this one then reports
        the raw weights (there is no average yet).
        """
        from composer.core import Evaluator
        from composer.utils import create_interval_scheduler
        due = create_interval_scheduler(eval_interval, checkpoint_events=False, final_events={Event.FIT_END})

        def eval_interval_fn(state: State, event: Event) -> bool:
            return due(state, event) and self.started

        return Evaluator(label=self.eval_label, dataloader=dataloader, eval_interval=eval_interval_fn)

    # ---- Composer hooks ----------------------------------------------------------------------
    def match(self, event: Event, state: State) -> bool:
        return event in (Event.FIT_START, Event.BATCH_END, Event.EVAL_START, Event.EVAL_END)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        self._bind(state.model, sharded=bool(getattr(state, "fsdp_sharded_state_dict_enabled", False)))
        if event == Event.FIT_START:
            if self._sharded_checkpoints and _uses_fsdp1(self._model):
                # Refuse now rather than at the first checkpoint, hours in.
                raise NotImplementedError("EMA with FSDP1 sharded checkpoints is not supported: use "
                                          "state_dict_type 'full' (trainer.fsdp.state_dict_type=full)")
            self._resolved_start = resolve_start(self._start, state.max_duration)
            if self.init_from and not self.started and int(state.timestamp.batch) == 0:
                earlier = dict(_phase_ema(self.init_from), started_at_batch=0)
                if self.restart:
                    earlier["num_updates"] = 0
                self._restore(earlier)
            self._maybe_start(state)
        elif event == Event.BATCH_END:
            batch = int(state.timestamp.batch)
            if self.started and (batch - self.started_at_batch) % self.update_interval == 0:
                self.update()
            else:
                self._maybe_start(state)
        elif state.dataloader_label == self.eval_label:  # around the EMA evaluator only
            if event == Event.EVAL_START:
                self._swap_in()
            else:
                self._swap_out()

    # ---- the average -------------------------------------------------------------------------
    def _bind(self, model: torch.nn.Module, sharded: bool = False) -> None:
        """Build the parameter lists once per (wrapped) model; apply any state loaded before."""
        if model is self._model:
            return
        if self._ema is not None and self._model is not None:
            # The model was re-wrapped (e.g. DDP/FSDP after INIT): keep the average, re-point the views.
            self._pending = self._pending or self._state(every_rank=True, local=self._sharded_checkpoints)
        self._model, self._sharded_checkpoints = model, sharded
        params = trainable_parameters(model)
        if any("_flat_param" in n for n in params):
            raise ValueError("EMA needs FSDP with use_orig_params=True (it averages the original parameters)")
        self._names = list(params)
        self._params = [_local(p.detach()) for p in params.values()]
        self._ema = None
        if self._pending is not None:
            pending, self._pending = self._pending, None
            self._restore(pending)
        self._loaded_shards = None  # loaded for a checkpoint without an EMA state of ours: let it go

    def _maybe_start(self, state: State) -> None:
        if self.started:
            return
        if self._resolved_start is None:
            self._resolved_start = resolve_start(self._start, state.max_duration)
        if state.timestamp.get(self._resolved_start.unit) >= self._resolved_start:
            self._start_now(int(state.timestamp.batch))

    def _start_now(self, batch: int = 0) -> None:
        """The EMA becomes a copy of the weights, after ``batch`` batches."""
        self._ema = [p.clone() for p in self._params]
        self.num_updates = 0
        self.started_at_batch = batch

    def local_averages(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's EMA tensors (its shards under FSDP) by parameter name; empty before the start."""
        return list(zip(self._names, self._ema)) if self.started else []

    @torch.no_grad()
    def update(self) -> None:
        """One EMA step over every local shard, fused."""
        torch._foreach_lerp_(self._ema, self._params, 1.0 - self.decay)
        self.num_updates += 1

    # ---- swapping the EMA into the model -----------------------------------------------------
    # Both directions drop FSDP's gathered parameters first (see the module docstring): the
    # swap writes shards, and what is gathered holds the weights of before the swap.
    @torch.no_grad()
    def _swap_in(self) -> bool:
        if not self.started or self._swapped is not None:
            return False  # nothing to swap yet, or already swapped (nested use during eval)
        drop_gathered_parameters(self._model)
        self._swapped = [p.clone() for p in self._params]
        torch._foreach_copy_(self._params, self._ema)
        return True

    @torch.no_grad()
    def _swap_out(self) -> None:
        if self._swapped is not None:
            drop_gathered_parameters(self._model)
            torch._foreach_copy_(self._params, self._swapped)
            self._swapped = None

    @contextlib.contextmanager
    def ema_weights(self, model: torch.nn.Module | None = None):
        """Run the block with the EMA weights in ``model`` (the trainer's model); restores them after.

        A no-op before the EMA has started, and when the EMA is already swapped in (during eval).
        """
        if model is not None:
            self._bind(model, self._sharded_checkpoints)
        swapped = self._swap_in()
        try:
            yield
        finally:
            if swapped:
                self._swap_out()

    # ---- checkpoints -------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """What a checkpoint holds. Under FSDP2 with full checkpoints (written by rank 0 alone) only rank 0 keeps
        the gathered EMA: each tensor is gathered in turn by every rank (a collective) and the other ranks
        let it go at once, so no other rank holds a whole copy of the EMA in host memory (at 12B, 48 GB a
        rank in fp32). Their ``ema_params`` hold empty tensors under the same names. With sharded
        checkpoints under FSDP2 ``ema_params`` is empty and ``ema_params_beside`` true: :class:`EMAShards`
        holds the shards."""
        if self._shards_beside and self._sharded_checkpoints and self._model is not None \
                and not _uses_fsdp1(self._model):
            state = self._state(every_rank=False, params=False)
            state["ema_params_beside"] = True
            return state
        return self._state(every_rank=False)

    def _state(self, every_rank: bool, local: bool = False, params: bool = True) -> dict[str, Any]:
        state = super().state_dict()
        state.update(num_updates=self.num_updates, smoothing=self.smoothing, start=str(self.start),
                     started_at_batch=self.started_at_batch, update_interval=self.update_interval,
                     warmup=self.warmup, ema_params=self._ema_params(every_rank, local) if params else {})
        return state

    def load_state_dict(self, state: dict[str, Any], strict: bool = False) -> None:
        if self._model is None:  # Composer loads checkpoints before FIT_START binds the model
            self._pending = dict(state)
        else:
            self._restore(state)

    def _restore(self, state: dict[str, Any]) -> None:
        self.num_updates = int(state.get("num_updates", 0))
        saved = state.get("ema_params") or {}
        loaded, self._loaded_shards = self._loaded_shards, None
        if state.get("ema_params_beside"):  # a sharded checkpoint: the shards were loaded by EMAShards
            started = state.get("started_at_batch") is not None
            saved = (loaded or {}) if started else {}
            if started and not saved:
                raise KeyError("the sharded checkpoint's EMA state says the EMA had started, but no EMA shards "
                               "(state.callbacks.EMAShards) were loaded with it")
        if not saved:
            self._ema = None  # the checkpoint was written before the EMA started
            self.started_at_batch = None
            return
        # Checkpoints of before ``start`` had the start batch only (the EMA started there).
        started_at = state.get("started_at_batch", state.get("start_batch"))
        self.started_at_batch = int(started_at) if started_at is not None else 0
        missing = [n for n in self._names if n not in saved]
        if missing:
            raise KeyError(f"EMA checkpoint state has no entry for {len(missing)} trainable parameter(s), "
                           f"e.g. {missing[:3]}; was it written for a different model?")
        if self._model is not None and _uses_fsdp1(self._model) and not self._sharded_checkpoints:
            self._ema = self._scatter_fsdp1([saved[n] for n in self._names])
            return
        self._ema = [self._local_part(saved[n], p) for n, p in zip(self._names, self._live_params())]

    def _live_params(self) -> list[torch.Tensor]:
        return list(trainable_parameters(self._model).values())

    @staticmethod
    def _local_part(saved: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
        local = _local(param)
        if hasattr(saved, "to_local"):
            saved = saved.to_local().detach()
            if saved.shape == local.shape and saved.device == local.device and saved.dtype == local.dtype:
                return saved  # loaded into a tensor of its own (EMAShards' template): no second copy
        elif hasattr(param, "device_mesh") and saved.shape == param.shape:  # full tensor, FSDP2 shard wanted
            from torch.distributed.tensor import distribute_tensor
            saved = distribute_tensor(saved.to(local.device), param.device_mesh, param.placements).to_local()
        if saved.shape != local.shape:
            raise ValueError(f"EMA checkpoint tensor of shape {tuple(saved.shape)} does not fit a parameter "
                             f"of local shape {tuple(local.shape)}")
        return saved.detach().to(device=local.device, dtype=local.dtype).clone()

    def _ema_params(self, every_rank: bool = True, local: bool = False) -> dict[str, torch.Tensor]:
        """Full tensors by name (gathered once here under FSDP), or with ``local`` (FSDP2) the local shards as
        DTensors, nothing gathered; under FSDP2, unless ``every_rank``, full tensors on global rank 0 only
        (empty ones elsewhere)."""
        if not self.started:
            return {}
        from composer.utils import dist
        keep = every_rank or dist.get_global_rank() == 0
        if _uses_fsdp1(self._model):
            if self._sharded_checkpoints:
                raise NotImplementedError("EMA with FSDP1 sharded checkpoints is not supported: use "
                                          "state_dict_type 'full', or FSDP2 (parameters as DTensors)")
            return self._gather_fsdp1()
        out = {}
        for name, ema, param in zip(self._names, self._ema, self._live_params()):
            if hasattr(param, "device_mesh"):
                from torch.distributed.tensor import DTensor
                full = DTensor.from_local(ema, param.device_mesh, param.placements, shape=param.shape,
                                          stride=param.stride())
                if local:
                    out[name] = full
                else:
                    gathered = full.full_tensor()  # a collective: every rank gathers, rank 0 keeps it
                    out[name] = gathered.cpu() if keep else torch.empty(0, dtype=gathered.dtype)
                    del gathered
            else:
                out[name] = ema.detach().cpu().clone()
        return out

    @torch.no_grad()
    def _gather_fsdp1(self) -> dict[str, torch.Tensor]:
        # Let FSDP do the gather: swap the EMA shards in, summon full parameters, read them, swap back.
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        # offload_to_cpu only off the CPU: on CPU, FSDP's "move" is a no-op and it then frees the
        # storage the full parameters live in (reading them segfaults).
        offload = any(p.device.type != "cpu" for p in self._params)
        with self.ema_weights(), FSDP.summon_full_params(self._model, writeback=False, rank0_only=True,
                                                         offload_to_cpu=offload):
            return {n: p.detach().cpu().clone() for n, p in trainable_parameters(self._model).items()}

    @torch.no_grad()
    def _scatter_fsdp1(self, full: list[torch.Tensor]) -> list[torch.Tensor]:
        # The reverse: write the full EMA through summon_full_params, keep the local shards, restore weights.
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        backup = [p.clone() for p in self._params]
        drop_gathered_parameters(self._model)  # else summon reuses (and keeps) a stale gathered copy
        with FSDP.summon_full_params(self._model, writeback=True):
            for p, f in zip(trainable_parameters(self._model).values(), full):
                p.copy_(f.to(p.device, p.dtype))
        shards = [p.clone() for p in self._params]
        drop_gathered_parameters(self._model)
        torch._foreach_copy_(self._params, backup)
        return shards


class EMAShards(Callback):
    """The EMA's shards in FSDP2 sharded checkpoints (see the module docstring): Composer checkpoints a
    callback's state per key, so every rank writes its own shards, where it pickles an algorithm's state
    whole. ``averages`` maps a group name (the entries' ``state.callbacks.EMAShards.<group>.``) to its
    :class:`EMA`; ``model`` is the trainer's model, whose parameters give the shapes to load into before
    the EMA has bound to it (Composer loads a checkpoint before the fit starts)."""

    def __init__(self, averages: dict[str, EMA], model: torch.nn.Module):
        self.averages, self.model = dict(averages), model
        for ema in self.averages.values():
            ema._shards_beside = True

    def state_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for group, ema in self.averages.items():
            if ema._model is None:  # Composer asks what to load into: a shard like each parameter's
                out[group] = {n: torch.empty_like(p, requires_grad=False)
                              for n, p in trainable_parameters(self.model).items()}
            elif ema.started:  # a save: the local shards as DTensors, nothing gathered
                out[group] = ema._ema_params(local=True)
        return out

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # The EMA restores from them at its fit start if its own state says they were saved.
        for group, ema in self.averages.items():
            ema._loaded_shards = dict(state.get(group) or {})


def _shards_prefix() -> str:
    return f"state.callbacks.{EMAShards.__qualname__}."


def optional_shards_load_planner():
    """Torch's default load planner, except that a group of :class:`EMAShards` entries absent from the
    checkpoint as a whole (a checkpoint of before the EMA started, or of a run without EMA) is not loaded
    rather than refused; a group the checkpoint holds only in part is still refused, by torch."""
    from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner

    class OptionalShardsLoadPlanner(DefaultLoadPlanner):
        def create_local_plan(self):
            prefix, saved = _shards_prefix(), self.metadata.state_dict_metadata
            groups: dict[str, list[str]] = {}
            for key in self.state_dict:
                if key.startswith(prefix):
                    groups.setdefault(key[len(prefix):].split(".", 1)[0], []).append(key)
            for keys in groups.values():
                if not any(k in saved for k in keys):
                    for k in keys:
                        del self.state_dict[k]
            return super().create_local_plan()

    return OptionalShardsLoadPlanner()
