"""Ray Train side of online mode: Composer's Trainer inside each ``TorchTrainer`` worker, fed by a shard.

Ray Train starts the workers (process group, RANK/LOCAL_RANK/WORLD_SIZE already set, which Composer's
``dist`` picks up) and splits the Ray Data stream between them (``streaming_split(equal=True)``, so
every rank gets the same number of batches and the collectives stay in step). Each worker wraps its
shard in :class:`ShardBatches` and hands it to the ordinary Composer trainer as its train dataloader.

Fault tolerance is two layers: Composer writes checkpoints to ``save_folder`` and ``autoresume`` loads
the latest one when a trainer is built; Ray Train's ``FailureConfig(max_failures)`` restarts the whole
worker group after one dies, and the restarted workers build their trainers again, so they resume.
"""

from __future__ import annotations

import collections
import dataclasses
import time
from typing import Any, Callable, Iterator, Optional

from composer.core import Callback, State
from composer.loggers import Logger

TRAIN_SPLIT = "train"  # the name of the dataset passed to TorchTrainer and fetched by each worker


class ShardBatches:
    """This worker's share of the stream as an endless iterable of training batches.

    Each pass over the shard is one run of the Ray Data pipeline (fresh order, rejects met again and
    counted once); the iterable starts the next pass when one ends, so Composer sees one endless epoch
    and durations are counted in batches. ``batch_size`` is how Composer learns the per-device batch.

    Where the time goes: columns named ``_*_seconds`` (the pipeline's per-row stage timings) are summed
    into ``stage_seconds`` rather than passed on, and ``waits`` holds how long training waited for each
    batch.

    Args:
        shard: ``ray.train.get_dataset_shard(...)`` (a ``ray.data.DataIterator``).
        batch_size: rows per batch on this worker; the last partial batch of a pass is dropped.
        to_batch: ``to_batch(columns, epoch)`` turns a dict of numpy columns into the batch (of tensors)
            the model consumes (:class:`~diffusion.train.batches.ToModelBatch`); the pass is its epoch.
        max_passes: stop after this many passes (None: never stop).
    """

    def __init__(self, shard, batch_size: int, to_batch: Callable[[dict, int], dict],
                 max_passes: Optional[int] = None, prefetch_batches: int = 1):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.shard, self.batch_size, self.to_batch = shard, int(batch_size), to_batch
        self.max_passes, self.prefetch_batches = max_passes, prefetch_batches
        self.passes = 0
        self.waits: list[float] = []
        self.stage_seconds: dict[str, float] = collections.defaultdict(float)

    def _columns(self) -> Iterator[dict]:
        # numpy batches, converted by ``to_batch``: the stream also carries columns training ignores
        # (keys, captions), and picking them out here saves a projection stage holding a CPU.
        return iter(self.shard.iter_batches(batch_size=self.batch_size, batch_format="numpy", drop_last=True,
                                            prefetch_batches=self.prefetch_batches))

    def __iter__(self) -> Iterator[dict]:
        while self.max_passes is None or self.passes < self.max_passes:
            yielded, columns_of_pass = 0, self._columns()
            while True:
                start = time.perf_counter()
                columns = next(columns_of_pass, None)
                if columns is None:
                    break
                self.waits.append(time.perf_counter() - start)
                for name in [c for c in columns if c.startswith("_") and c.endswith("_seconds")]:
                    self.stage_seconds[name] += float(columns.pop(name).sum())
                yielded += 1
                yield self.to_batch(columns, self.passes)
            self.passes += 1
            if yielded == 0:  # looping again would spin forever on an empty stream
                raise RuntimeError(
                    f"the online dataset gave this worker no full batch of {self.batch_size} rows in a whole "
                    f"pass: too few valid rows in the input for the number of workers and batch size?")


class LossHistory(Callback):
    """Keeps ``(batch, loss)`` and the wall time after each training batch, for the driver to see.

    The loss is the whole batch's: Composer's ``total_loss_dict`` (every microbatch's loss summed with
    its share of the batch, averaged over the ranks), not ``state.loss``, which holds only the last
    microbatch's.
    """

    def __init__(self):
        self.losses: list[tuple[int, float]] = []
        self.times: list[float] = []  # time.perf_counter() at the end of each batch

    def batch_end(self, state: State, logger: Logger) -> None:
        totals = getattr(state, "total_loss_dict", None) or {}
        if "loss/train/total" in totals:
            loss = float(totals["loss/train/total"])
        else:  # not Composer's training loop: the loss as the model returned it
            loss = state.loss
            if isinstance(loss, dict):
                loss = sum(loss.values())
            if isinstance(loss, (list, tuple)):
                loss = sum(loss)
            loss = float(loss)
        # The timestamp has advanced at BATCH_END: batches are numbered from 1, as durations count them.
        self.losses.append((int(state.timestamp.batch), loss))
        self.times.append(time.perf_counter())


@dataclasses.dataclass
class WorkerPlan:
    """What every training worker needs: picklable, sent through ``train_loop_config``.

    ``make_trainer(train_dataloader, callbacks)`` builds the Composer trainer (the same builder the
    offline ``run.py`` uses, given this dataloader); ``to_batch`` maps shard columns to model batches.
    """

    make_trainer: Callable[[Any, list], Any]
    to_batch: Callable[[dict, int], dict]
    batch_size: int
    callbacks: list = dataclasses.field(default_factory=list)


def train_worker(loop_config: dict) -> dict:
    """The per-worker training function ``TorchTrainer`` runs (also after a restart).

    Returns this worker's summary since it (re)started: ``batch`` (where training ended),
    ``resumed_from`` (the checkpoint's batch, 0 if none), ``losses`` (``(batch, loss)`` pairs),
    ``batch_times`` (wall time at the end of each), ``passes``, ``rows``, ``batch_waits`` (seconds
    each batch was waited for: the first includes the pipeline's start) and ``stage_seconds``. Ray
    Train hands rank 0's to the driver as ``result.return_value``.
    """
    import ray.train

    plan: WorkerPlan = loop_config["plan"]
    loader = ShardBatches(ray.train.get_dataset_shard(TRAIN_SPLIT), plan.batch_size, plan.to_batch)
    history = LossHistory()
    trainer = plan.make_trainer(loader, [history, *plan.callbacks])
    resumed_from = int(trainer.state.timestamp.batch)  # > 0 when autoresume found a checkpoint
    from diffusion.train.trainer import finished_message
    finished = finished_message(trainer)
    # Spinning the stream forward to the checkpoint's batch would re-run the pipeline for data that is
    # thrown away; a stream has no order to preserve, so training just continues on fresh batches.
    if not finished:
        trainer.fit(spin_dataloaders=False)
    summary = {"finished": finished,"batch": int(trainer.state.timestamp.batch), "resumed_from": resumed_from,
               "losses": history.losses, "batch_times": history.times, "passes": loader.passes,
               "rows": len(history.losses) * loader.batch_size, "batch_waits": loader.waits,
               "stage_seconds": dict(loader.stage_seconds)}
    trainer.close()
    return summary


@dataclasses.dataclass
class TrainPlacement:
    """Where the training workers go: count, accelerator and resources per worker."""

    num_workers: int = 2
    use_gpu: bool = False
    cpus_per_worker: float = 0.5
    gpus_per_worker: float = 1.0
    accelerator_type: Optional[str] = None  # e.g. "H100", "A100" (Ray's accelerator type names)

    def scaling_config(self):
        from ray.train import ScalingConfig
        resources = {"CPU": self.cpus_per_worker}
        if self.use_gpu:
            resources["GPU"] = self.gpus_per_worker
        return ScalingConfig(num_workers=self.num_workers, use_gpu=self.use_gpu, resources_per_worker=resources,
                             accelerator_type=self.accelerator_type)


def fit_on_ray(dataset, plan: WorkerPlan, placement: TrainPlacement, *, storage_path: str, name: str,
               max_failures: int = 1):
    """Run ``train_worker`` on ``placement.num_workers`` Ray Train workers over ``dataset``.

    Returns Ray Train's ``Result``; ``result.return_value`` is rank 0's summary (see
    :func:`train_worker`). Ray Data's executor leaves the training workers' resources alone
    (Ray Train's default ``DataConfig``), so the pipeline's pools fit in what is left.
    """
    from ray.train import FailureConfig, RunConfig
    from ray.train.torch import TorchTrainer

    trainer = TorchTrainer(
        train_worker,
        train_loop_config={"plan": plan},
        scaling_config=placement.scaling_config(),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=max_failures)),
        datasets={TRAIN_SPLIT: dataset},
    )
    result = trainer.fit()
    if result.error is not None:
        raise result.error
    return result
