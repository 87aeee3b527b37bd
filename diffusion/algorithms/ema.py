"""EMA: an exponential moving average of the trainable weights, kept shard-local and updated in one fused op.

Why our own and not Composer's: under FSDP each rank holds only its shard of every parameter; this EMA
keeps a copy of exactly that local shard (no full gather per step), updates all of it with one
``torch._foreach_lerp_`` per step, and gathers full tensors only when a checkpoint is written.

    ema_t = smoothing * ema_{t-1} + (1 - smoothing) * weights_t        (every ``update_interval`` batches)

The EMA starts as a copy of the weights once ``start_batch`` batches have run (at fit start when 0).
Evaluation runs on the EMA weights (swapped in before the evaluators, swapped back after); image
loggers use ``with ema.ema_weights(model): ...``. ``state_dict()["ema_params"]`` maps the
ComposerModel's parameter names (``unet.conv_in.weight``) to full tensors; Composer stores it in the
checkpoint under ``state["algorithms"]``, and loading it restores the average exactly.

Swapping under FSDP: the swap writes the local shards, but FSDP computes with the *gathered* full
parameters, and it keeps those after a forward that no backward follows (an eval, an image grid):
always under SHARD_GRAD_OP, for the root unit under FULL_SHARD. Left alone, the next training
forward would reuse the gathered EMA (and the eval, the gathered training weights). So every swap
first drops what FSDP has gathered (FSDP1: each unit's handle is resharded, freeing the unsharded flat
parameter; FSDP2: ``FSDPModule.reshard()``); the next forward gathers the shards as they are now.
Sharded checkpoints (``state_dict_type: sharded``) with FSDP1 are refused at fit start: the EMA is
saved as full tensors only.
"""

from __future__ import annotations

import contextlib
from typing import Any

import torch
from composer.core import Algorithm, Event, State, Time, TimeUnit
from composer.loggers import Logger

# Wrapper modules insert these components into parameter names; the saved names drop them.
_WRAPPER_PREFIXES = ("_fsdp_wrapped_module", "_checkpoint_wrapped_module", "_orig_mod", "module")

_SWAP_IN = (Event.EVAL_BEFORE_ALL, Event.EVAL_STANDALONE_START)
_SWAP_OUT = (Event.EVAL_AFTER_ALL, Event.EVAL_STANDALONE_END)


def smoothing_from_half_life(half_life: str, update_interval: int = 1) -> float:
    """The per-update smoothing whose weight halves after ``half_life`` (a batch count such as "1000ba")."""
    time = Time.from_timestring(half_life) if isinstance(half_life, str) else half_life
    if time.unit != TimeUnit.BATCH:
        raise ValueError(f"EMA half_life must be in batches (e.g. '1000ba'), got {half_life!r}")
    if time.value <= 0:
        raise ValueError(f"EMA half_life must be positive, got {half_life!r}")
    return 0.5 ** (update_interval / time.value)


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


class EMA(Algorithm):
    """Exponential moving average of the trainable weights (see the module docstring).

    Args:
        half_life: a batch count ("1000ba"); when given it sets ``smoothing`` from ``update_interval``.
        smoothing: weight of the old average at each update.
        start_batch: the EMA starts as a copy of the weights after this many batches.
        update_interval: update every this many batches.
    """

    def __init__(self, half_life: str | None = None, smoothing: float = 0.9999, start_batch: int = 0,
                 update_interval: int = 1):
        if update_interval < 1:
            raise ValueError(f"EMA update_interval must be >= 1, got {update_interval}")
        if start_batch < 0:
            raise ValueError(f"EMA start_batch must be >= 0, got {start_batch}")
        self.half_life = half_life
        self.smoothing = smoothing_from_half_life(half_life, update_interval) if half_life else float(smoothing)
        if not 0.0 <= self.smoothing <= 1.0:
            raise ValueError(f"EMA smoothing must be in [0, 1], got {self.smoothing}")
        self.start_batch = int(start_batch)
        self.update_interval = int(update_interval)
        self.num_updates = 0
        self._model: torch.nn.Module | None = None
        self._sharded_checkpoints = False
        self._names: list[str] = []
        self._params: list[torch.Tensor] = []  # local views of the live weights
        self._ema: list[torch.Tensor] | None = None  # local EMA shards, parallel to _params; None before start
        self._pending: dict[str, Any] | None = None  # loaded before the model was ready
        self._swapped: list[torch.Tensor] | None = None  # training weights while the EMA is swapped in

    def __repr__(self) -> str:
        return (f"EMA(half_life={self.half_life!r}, smoothing={self.smoothing}, start_batch={self.start_batch}, "
                f"update_interval={self.update_interval})")

    @property
    def started(self) -> bool:
        return self._ema is not None

    # ---- Composer hooks ----------------------------------------------------------------------
    def match(self, event: Event, state: State) -> bool:
        return event in (Event.FIT_START, Event.BATCH_END, *_SWAP_IN, *_SWAP_OUT)

    def apply(self, event: Event, state: State, logger: Logger) -> None:
        self._bind(state.model, sharded=bool(getattr(state, "fsdp_sharded_state_dict_enabled", False)))
        batch = int(state.timestamp.batch)
        if event == Event.FIT_START:
            if self._sharded_checkpoints and _uses_fsdp1(self._model):
                # Refuse now rather than at the first checkpoint, hours in.
                raise NotImplementedError("EMA with FSDP1 sharded checkpoints is not supported: use "
                                          "state_dict_type 'full' (trainer.fsdp.state_dict_type=full)")
            self._maybe_start(batch)
        elif event == Event.BATCH_END:
            if self.started and (batch - self.start_batch) % self.update_interval == 0:
                self.update()
            else:
                self._maybe_start(batch)
        elif event in _SWAP_IN:
            self._swap_in()
        elif event in _SWAP_OUT:
            self._swap_out()

    # ---- the average -------------------------------------------------------------------------
    def _bind(self, model: torch.nn.Module, sharded: bool = False) -> None:
        """Build the parameter lists once per (wrapped) model; apply any state loaded before."""
        if model is self._model:
            return
        if self._ema is not None and self._model is not None:
            # The model was re-wrapped (e.g. DDP/FSDP after INIT): keep the average, re-point the views.
            self._pending = self._pending or self.state_dict()
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

    def _maybe_start(self, batch: int) -> None:
        if not self.started and batch >= self.start_batch:
            self._ema = [p.clone() for p in self._params]
            self.num_updates = 0

    def local_averages(self) -> list[tuple[str, torch.Tensor]]:
        """This rank's EMA tensors (its shards under FSDP) by parameter name; empty before the start."""
        return list(zip(self._names, self._ema)) if self.started else []

    @torch.no_grad()
    def update(self) -> None:
        """One EMA step over every local shard, fused."""
        torch._foreach_lerp_(self._ema, self._params, 1.0 - self.smoothing)
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
        state = super().state_dict()
        state.update(num_updates=self.num_updates, smoothing=self.smoothing, start_batch=self.start_batch,
                     update_interval=self.update_interval, ema_params=self._ema_params())
        return state

    def load_state_dict(self, state: dict[str, Any], strict: bool = False) -> None:
        if self._model is None:  # Composer loads checkpoints before FIT_START binds the model
            self._pending = dict(state)
        else:
            self._restore(state)

    def _restore(self, state: dict[str, Any]) -> None:
        self.num_updates = int(state.get("num_updates", 0))
        saved = state.get("ema_params") or {}
        if not saved:
            self._ema = None  # the checkpoint was written before the EMA started
            return
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
            saved = saved.to_local()
        elif hasattr(param, "device_mesh") and saved.shape == param.shape:  # full tensor, FSDP2 shard wanted
            from torch.distributed.tensor import distribute_tensor
            saved = distribute_tensor(saved.to(local.device), param.device_mesh, param.placements).to_local()
        if saved.shape != local.shape:
            raise ValueError(f"EMA checkpoint tensor of shape {tuple(saved.shape)} does not fit a parameter "
                             f"of local shape {tuple(local.shape)}")
        return saved.detach().to(device=local.device, dtype=local.dtype).clone()

    def _ema_params(self) -> dict[str, torch.Tensor]:
        """Full tensors by name (gathered once here under FSDP), or DTensors for sharded checkpoints."""
        if not self.started:
            return {}
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
                out[name] = full if self._sharded_checkpoints else full.full_tensor().cpu()
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
