"""Gradient norms, right under FSDP: Composer's ``OptimizerMonitor`` with the reduction it lacks for torch's optimizers.

Composer 0.32's ``OptimizerMonitor`` takes the norm of each ``p.grad`` on every rank and relies on the
optimizer to combine ranks (``pre_reduce_metrics``/``dist_reduce_metrics``, which only Composer's own
optimizers have). Under FSDP each rank holds only its shard of every gradient, so with ``torch.optim.AdamW``
each rank logged the norm of its own shard (and the ranks' key sets differ: a parameter wholly on another
rank has no gradient here). This subclass sums the squared norms of the local gradient shards over the
ranks in one all-reduce (divided by the replicas under hybrid sharding), so every rank logs the norm of
the whole gradient:

- ``l2_norm/grad/global``: the L2 norm of all trainable parameters' gradients;
- ``l2_norm/grad/<name>``: per parameter, by the model's own names (``denoiser.conv_in.weight``, no wrapper
  prefixes).

Without FSDP (one process, or DDP with gradients already averaged) and with NO_SHARD, nothing is
summed. It logs at ``BATCH_END`` every ``batch_log_interval`` batches, as Composer's does: after
the optimizer step, and after ``GradientClipping`` (``trainer.grad_clip_norm``), so with clipping on the
global norm is at most the threshold. An optimizer with Composer's ``report_per_parameter_metrics``
(Composer's ``DecoupledAdamW``) is left to Composer's own code, which reduces its metrics itself.
"""

from __future__ import annotations

import torch
from composer.algorithms import GradientClipping
from composer.callbacks import OptimizerMonitor as ComposerOptimizerMonitor
from composer.core import Event, State
from composer.loggers import Logger
from composer.utils import dist

from diffusion.train.algorithms.ema import trainable_parameters


def gradient_replicas(model: torch.nn.Module) -> int | None:
    """How many ranks hold each gradient element when gradients are sharded (FSDP); None when every rank
    holds whole gradients (no FSDP, DDP, NO_SHARD) and nothing is to be summed."""
    from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
    from torch.distributed.fsdp import ShardingStrategy
    fsdp1 = [m for m in model.modules() if isinstance(m, FSDP)]
    if fsdp1:
        strategy = fsdp1[0].sharding_strategy
        if strategy == ShardingStrategy.NO_SHARD:
            return None
        if strategy in (ShardingStrategy.HYBRID_SHARD, ShardingStrategy._HYBRID_SHARD_ZERO2):
            # sharded within its shard group (a node, or trainer.fsdp.data_parallel_shard_degree ranks)
            return max(1, dist.get_world_size() // fsdp1[0].process_group.size())
        return 1
    meshes = [p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")]
    if meshes:  # FSDP2: a 2-D mesh is (replicate, shard)
        return meshes[0].size(0) if meshes[0].ndim == 2 else 1
    return None


class OptimizerMonitor(ComposerOptimizerMonitor):
    """Gradient L2 norms, global and per parameter, summed over the ranks' shards (see the module docstring).

    Args:
        log_optimizer_metrics: with Composer's optimizers, also their per-parameter metrics (as Composer).
        batch_log_interval: log every this many batches.
    """

    def batch_end(self, state: State, logger: Logger) -> None:
        if state.timestamp.batch.value % self.batch_log_interval != 0:
            return
        if callable(getattr(state.optimizers[0], "report_per_parameter_metrics", None)):
            super().batch_end(state, logger)  # Composer's optimizers reduce their own metrics
            return
        logger.log_metrics(self.gradient_norms(state.model))

    @staticmethod
    @torch.no_grad()
    def gradient_norms(model: torch.nn.Module) -> dict[str, float]:
        """``l2_norm/grad/<name>`` and ``l2_norm/grad/global`` of the whole gradient (a collective under FSDP)."""
        params = trainable_parameters(model)
        if not params:
            return {"l2_norm/grad/global": 0.0}
        squares = _squares(model, params)
        metrics = {f"l2_norm/grad/{name}": value for name, value in zip(params, squares.sqrt().tolist())}
        metrics["l2_norm/grad/global"] = squares.sum().sqrt().item()
        return metrics

    @staticmethod
    @torch.no_grad()
    def global_norm(model: torch.nn.Module) -> torch.Tensor:
        """The whole gradient's L2 norm as a tensor on the gradients' device (no host sync; a collective
        under FSDP)."""
        params = trainable_parameters(model)
        return _squares(model, params).sum().sqrt() if params else torch.zeros(())


def _squares(model: torch.nn.Module, params: dict) -> torch.Tensor:
    """Each parameter's squared gradient norm, summed over the ranks that hold parts of it."""
    device = next(iter(params.values())).device
    squares = torch.stack([
        _local(p.grad).detach().float().pow(2).sum() if p.grad is not None else torch.zeros((), device=device)
        for p in params.values()]).to(device)
    replicas = gradient_replicas(model)
    if replicas is not None:
        dist.all_reduce(squares, reduce_operation="SUM")
        squares /= replicas
    return squares


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


class LoggedGradientClipping(GradientClipping):
    """Norm clipping that measures the gradient once (issue 25 item 3, issue 49 item 4), logging what it
    clipped every ``log_interval`` batches: ``l2_norm/grad/global_before_clip`` (the whole gradient's
    norm, FSDP-aware as above: the spikes users watch for) and ``l2_norm/grad/clip_ratio`` (the factor
    clipping scaled the gradient by, 1 when it did not clip). ``l2_norm/grad/global`` (the monitor's)
    stays the norm after clipping, as applied.

    The norm is the one clipping uses: torch's ``clip_grad_norm_`` for one process or DDP (whole
    gradients), and under FSDP one foreach pass over the local shards, one all-reduce of the squared sum
    and one foreach scale, as torch's own clipping computes it. The norm stays a tensor on the device:
    the host waits for it only on the batches that log it."""

    def __init__(self, clipping_threshold: float, log_interval: int = 1):
        super().__init__(clipping_type="norm", clipping_threshold=clipping_threshold)
        self.log_interval = max(1, int(log_interval))

    def apply(self, event, state, logger):
        if event != Event.AFTER_TRAIN_BATCH:
            return super().apply(event, state, logger)
        if state.fsdp_enabled:
            before = clip_sharded_gradients(state.model, self.clipping_threshold)
        else:
            before = torch.nn.utils.clip_grad_norm_(state.model.parameters(), self.clipping_threshold)
        if (int(state.timestamp.batch) + 1) % self.log_interval == 0:  # the batch being finished, 1-based
            before = float(before)
            ratio = min(1.0, self.clipping_threshold / before) if before > 0 else 1.0
            logger.log_metrics({"l2_norm/grad/global_before_clip": before, "l2_norm/grad/clip_ratio": ratio})


@torch.no_grad()
def clip_sharded_gradients(model: torch.nn.Module, max_norm: float) -> torch.Tensor:
    """Scale the (FSDP-sharded) gradients of ``model`` so that the whole gradient's L2 norm is at most
    ``max_norm``; returns that norm before clipping, a tensor (no host sync). Torch's formula: the
    gradient times ``min(1, max_norm / (norm + 1e-6))``."""
    grads = [_local(p.grad) for p in trainable_parameters(model).values() if p.grad is not None]
    device = grads[0].device if grads else next(model.parameters()).device
    squares = torch.zeros((), device=device, dtype=torch.float32)
    groups: dict = {}
    for g in grads:
        groups.setdefault((g.device, g.dtype), []).append(g)
    for group in groups.values():
        squares = squares + torch.stack(torch._foreach_norm(group)).float().pow(2).sum().to(device)
    replicas = gradient_replicas(model)
    if replicas is not None:
        dist.all_reduce(squares, reduce_operation="SUM")
        squares = squares / replicas
    norm = squares.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)
    for group in groups.values():
        torch._foreach_mul_(group, scale.to(group[0].dtype))
    return norm
