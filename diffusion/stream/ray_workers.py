"""Ray Train side of online mode: Composer's Trainer inside each ``TorchTrainer`` worker, fed by a shard.

Ray Train starts the workers (process group, RANK/LOCAL_RANK/WORLD_SIZE already set, which Composer's
``dist`` picks up) and splits the Ray Data stream between them (``streaming_split(equal=True)``, so
every rank gets the same number of batches and the collectives stay in step). Each worker wraps its
shard in :class:`ShardBatches` and hands it to the ordinary Composer trainer as its train dataloader.

Fault tolerance is two layers: Composer writes checkpoints to ``save_folder`` and ``autoresume`` loads
the latest one when a trainer is built; Ray Train's ``FailureConfig(max_failures)`` restarts the whole
worker group after one dies, and the restarted workers build their trainers again, so they resume.

The driver side, :func:`run_online`, is how the stream source launches its ranks: it plans the data
pools from what the training workers leave free, starts the stream and the worker group, and reports.
``run.py`` with ``data.train.source: stream`` and ``python -m diffusion.online`` both end up there.
"""

from __future__ import annotations

import collections
import contextlib
import copy
import dataclasses
import hashlib
import json
import logging
import os
import re
import signal
import threading
import time
from typing import Any, Callable, Iterator, Optional

from composer.core import Callback, State
from composer.loggers import Logger

from diffusion import schema
from diffusion.cluster import init_ray
from diffusion.train.config import Config
from diffusion.convert import pipeline
from diffusion.convert.pipeline import check_text_length, cpu_nodes, node_resources
from diffusion.errors import ConfigError
from diffusion.loader.batches import CaptionDropout, ToModelBatch
from diffusion.stream.stream_source import build_stream, count_rejects, plan_online_pools, stream_info

TRAIN_SPLIT = "train"  # the name of the dataset passed to TorchTrainer and fetched by each worker
DEFAULT_RUN_NAME = "online"
ABORT_WAIT_S = 10.0  # how long Ctrl-C waits for Ray Train to abort its workers before killing its controller
log = logging.getLogger(__name__)


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
            the model consumes (:class:`~diffusion.loader.batches.ToModelBatch`); the pass is its epoch, after
            :attr:`first_epoch` (a restarted worker group's: the checkpoint's batch, so its passes draw noise,
            levels and caption dropout anew instead of replaying the first run's).
        max_passes: stop after this many passes (None: never stop).
    """

    def __init__(self, shard, batch_size: int, to_batch: Callable[[dict, int], dict],
                 max_passes: Optional[int] = None, prefetch_batches: int = 1):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        self.shard, self.batch_size, self.to_batch = shard, int(batch_size), to_batch
        self.max_passes, self.prefetch_batches = max_passes, prefetch_batches
        self.passes = 0
        self.first_epoch = 0
        self.waits: list[float] = []
        self.stage_seconds: dict[str, float] = collections.defaultdict(float)
        self._early: Optional[tuple] = None  # (the first pass's iterator, its fetching thread, what it got)

    def _columns(self) -> Iterator[dict]:
        # numpy batches, converted by ``to_batch``: the stream also carries columns training ignores
        # (keys, captions), and picking them out here saves a projection stage holding a CPU.
        return iter(self.shard.iter_batches(batch_size=self.batch_size, batch_format="numpy", drop_last=True,
                                            prefetch_batches=self.prefetch_batches))

    def start(self) -> None:
        """Start the stream now: a thread fetches the first pass's first batch, so the pipeline's actors load
        their models (the encoders' VAE and text encoder) while this worker builds its trainer, rather than
        after it. The first pass of :meth:`__iter__` takes that batch; its wait is what is left of the start."""
        if self._early is not None or self.passes:
            return
        columns_of_pass, got = self._columns(), {}

        def fetch():
            try:
                got["columns"] = next(columns_of_pass, None)
            except BaseException as e:  # raised where training asks for the batch
                got["error"] = e

        thread = threading.Thread(target=fetch, name="online-first-batch", daemon=True)
        thread.start()
        self._early = (columns_of_pass, thread, got)

    def _first_of_pass(self) -> tuple[Iterator[dict], Optional[dict]]:
        """The pass's iterator and its first columns (None: the pass is empty), started early or now."""
        if self._early is None:
            columns_of_pass = self._columns()
            return columns_of_pass, next(columns_of_pass, None)
        (columns_of_pass, thread, got), self._early = self._early, None
        thread.join()
        if "error" in got:
            raise got["error"]
        return columns_of_pass, got["columns"]

    def __iter__(self) -> Iterator[dict]:
        while self.max_passes is None or self.passes < self.max_passes:
            yielded = 0
            start = time.perf_counter()
            columns_of_pass, columns = self._first_of_pass()
            while columns is not None:
                self.waits.append(time.perf_counter() - start)
                for name in [c for c in columns if c.startswith("_") and c.endswith("_seconds")]:
                    self.stage_seconds[name] += float(columns.pop(name).sum())
                yielded += 1
                yield self.to_batch(columns, self.first_epoch + self.passes)
                start = time.perf_counter()
                columns = next(columns_of_pass, None)
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
    """What every training worker needs: picklable, put in Ray's object store and sent through
    ``train_loop_config`` as its reference (:func:`fit_on_ray`).

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
    each batch was waited for: the first includes what is left of the pipeline's start once the trainer is
    built) and ``stage_seconds``. Ray Train hands rank 0's to the driver as ``result.return_value``.
    """
    import ray.train

    plan: WorkerPlan = ray.get(loop_config["plan"])
    loader = ShardBatches(ray.train.get_dataset_shard(TRAIN_SPLIT), plan.batch_size, plan.to_batch)
    loader.start()  # the pipeline starts while the trainer is built
    history = LossHistory()
    trainer = plan.make_trainer(loader, [history, *plan.callbacks])
    resumed_from = int(trainer.state.timestamp.batch)  # > 0 when autoresume found a checkpoint
    # the stream starts again from its first rows: their per-sample draws are salted anew. Each pass before the
    # checkpoint gave at least one of its batches, so its epochs (0 to resumed_from - 1) are not drawn again
    loader.first_epoch = resumed_from
    from diffusion.train.trainer import finished_message
    finished = finished_message(trainer)
    # Spinning the stream forward to the checkpoint's batch would re-run the pipeline for data that is
    # thrown away; a stream has no order to preserve, so training continues from the stream's start, as a new
    # pass of it with draws of its own (first_epoch above).
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
    import ray
    from ray.exceptions import GetTimeoutError, RayActorError
    from ray.train import FailureConfig, RunConfig
    from ray.train.torch import TorchTrainer

    class InterruptibleTrainer(TorchTrainer):
        """Ctrl-C aborts the workers and ends ``fit`` with KeyboardInterrupt, so the command says where it
        stopped, within :data:`ABORT_WAIT_S`. Ray Train's own handler waits for its controller's abort with
        no bound (then exits with status 1 and no word), and the controller cannot abort while it blocks on a
        worker group that is still starting: up to Ray Train's 60 s start timeout, again and again on a
        cluster another job fills (a conversion on the same two small nodes: over 180 s). After the bound, or
        at a second Ctrl-C, the controller is killed; its workers go with it."""

        def _register_sigint_handler(self, controller):
            def interrupt(signum, frame):
                signal.signal(signal.SIGINT, signal.default_int_handler)  # a second Ctrl-C stops the wait
                log.info("Ctrl-C: aborting the training workers (at most %g s)", ABORT_WAIT_S)
                try:
                    ray.get(controller.abort.remote(), timeout=ABORT_WAIT_S)
                except RayActorError:
                    pass  # the controller ends itself once its workers are aborted
                except (GetTimeoutError, KeyboardInterrupt):
                    ray.kill(controller)
                raise KeyboardInterrupt

            signal.signal(signal.SIGINT, interrupt)

    previous = signal.getsignal(signal.SIGINT)
    trainer = InterruptibleTrainer(
        train_worker,
        # a reference, not the plan: Ray Train's controller unpickles the loop config, and the plan's classes
        # would import this module there, Composer and torch with it (11 s on one CPU before any worker started)
        train_loop_config={"plan": ray.put(plan)},
        scaling_config=placement.scaling_config(),
        run_config=RunConfig(name=name, storage_path=storage_path,
                             failure_config=FailureConfig(max_failures=max_failures)),
        datasets={TRAIN_SPLIT: dataset},
    )
    try:
        result = trainer.fit()
    except Exception as e:  # Ray Train 2.60 raises the worker group's failure from fit()
        raise users_error(e) or e
    finally:  # the handler would outlive the run
        with contextlib.suppress(ValueError, TypeError):  # not the main thread; a handler set outside Python
            signal.signal(signal.SIGINT, previous)
    if result.error is not None:
        raise users_error(result.error) or result.error
    return result


def users_error(error: BaseException | None):
    """The user's error (:class:`~diffusion.errors.UserError`, e.g. a config a worker's ``build_trainer`` refused)
    behind a failed worker group, or None: Ray Train wraps it in ``WorkerGroupError`` (each rank's in
    ``worker_failures``, as ``UserExceptionWithTraceback``) or Ray's task error, and the command would print
    those tracebacks, not its one line."""
    from diffusion.cli import causes
    from diffusion.errors import UserError
    return next((e for e in causes(error)  # a Ray task error that is a UserError holds the user's as its cause
                 if isinstance(e, UserError) and not isinstance(getattr(e, "cause", None), UserError)), None)


# ---- the driver: launching the stream source's training ranks ------------------------------------

class OnlineTrainer:
    """Builds the offline trainer in a Ray Train worker, with the stream as its train dataloader."""

    def __init__(self, cfg: Config, info, empty_text_embeds=None):
        self.cfg, self.info, self.empty_text_embeds = cfg, info, empty_text_embeds

    def __call__(self, train_dataloader, callbacks):
        from diffusion.train.trainer import build_trainer
        text_column = schema.INPUT_IDS if self.info.text == schema.TEXT_IDS_ONLY else schema.TEXT_EMBEDS
        return build_trainer(self.cfg, train_dataloader=train_dataloader, info=self.info, extra_callbacks=callbacks,
                             text_column=text_column, empty_text_embeds=self.empty_text_embeds)


@dataclasses.dataclass
class OnlineResult:
    """What a finished online run reports: rank 0's view (see ``train_worker``) and the reject counts."""

    batch: int = 0  # the batch training ended at
    resumed_from: int = 0  # the checkpoint batch the last worker group started from (0: none)
    losses: list = dataclasses.field(default_factory=list)  # (batch, loss) of the last worker group, rank 0
    batch_times: list = dataclasses.field(default_factory=list)  # perf_counter at the end of each of those
    batch_waits: list = dataclasses.field(default_factory=list)  # seconds rank 0 waited for each batch
    passes: int = 0  # full passes over the stream
    rows: int = 0  # rows rank 0 trained on since its last start
    stage_seconds: dict = dataclasses.field(default_factory=dict)  # summed per-row stage times on rank 0
    rejects: dict = dataclasses.field(default_factory=dict)  # reason -> rows skipped
    checkpoint_folder: str | None = None
    finished: str | None = None  # set when the checkpoint had already reached max_duration: nothing ran


def check_online(cfg: Config) -> None:
    """Fail before anything starts if the config cannot run online."""
    o = cfg.data.online
    if o is None or not o.input:
        raise ConfigError("online mode needs data.online.input (raw parquet, webdataset tars or an image folder)")
    if o.num_train_workers < 1:
        raise ConfigError(f"data.online.num_train_workers must be >= 1, got {o.num_train_workers}")
    if cfg.data.train.batch_size % o.num_train_workers:
        raise ConfigError(f"data.train.batch_size={cfg.data.train.batch_size} does not divide evenly across "
                          f"data.online.num_train_workers={o.num_train_workers}")
    if o.text_length < 2:
        raise ConfigError(f"data.online.text_length must be at least 2 (a caption's start and end tokens), got "
                          f"{o.text_length}")
    if o.text_length > schema.MAX_TOKENS:  # longer than CLIP's context: the text encoder must read that far
        check_text_length(cfg.model.ref, o.text_length, name="data.online.text_length")
    if cfg.model.text == "ids":  # Flux's two text encoders: refused here, not in a worker
        from diffusion.models.latent_diffusion import reads_two_text_encoders
        reads_two_text_encoders(cfg.model, cfg.model.ref)


def _absolute(path: str | None, must_exist: bool = False) -> str | None:
    """Ray workers do not share the driver's working directory: local paths must be absolute."""
    if not path or "://" in path:
        return path
    full = os.path.abspath(os.path.expanduser(path))
    return full if not must_exist or os.path.exists(full) else path


def with_absolute_paths(cfg: Config) -> Config:
    cfg = copy.deepcopy(cfg)
    cfg.model.ref = _absolute(cfg.model.ref, must_exist=True)  # a hub id stays a hub id
    cfg.model.pretrained = _absolute(cfg.model.pretrained, must_exist=True)
    cfg.trainer.save_folder = _absolute(cfg.trainer.save_folder)
    cfg.trainer.load_path = _absolute(cfg.trainer.load_path)
    cfg.data.online.input = _absolute(cfg.data.online.input)
    cfg.data.online.work_dir = _absolute(cfg.data.online.work_dir)
    if cfg.data.eval is not None:
        cfg.data.eval.path = _absolute(cfg.data.eval.path)
    return cfg


ONLINE_PLACEMENT = ("lower data.online.num_train_workers or train_cpus/train_gpus, or pin the pools "
                    "(data.online.num_transformers, num_encoders)")


def check_placement(nodes: list[dict], pools, cfg: Config) -> None:
    """Refuse, in one line naming the resource, a plan whose training workers and actors cannot all be
    placed on the cluster's ``nodes`` with a read task's share left on some node
    (:func:`diffusion.convert.pipeline.check_placement`): Ray would wait without a word (a read task
    wanting a whole CPU on two nodes with 0.5 left each hung for 20 minutes)."""
    o = cfg.data.online
    pipeline.check_placement(nodes, pools, ONLINE_PLACEMENT, who="online mode",
                             held=[("training worker", o.train_cpus, o.train_gpus)] * o.num_train_workers)


def placement(cfg: Config) -> TrainPlacement:
    o = cfg.data.online
    return TrainPlacement(num_workers=o.num_train_workers, use_gpu=o.train_gpus > 0, cpus_per_worker=o.train_cpus,
                          gpus_per_worker=o.train_gpus or 1.0, accelerator_type=o.train_accelerator_type)


_BATCH = re.compile(r"\bbatch (\d+)")  # where a progress line says training is
last_progress: dict = {}  # "batch": the batch the last forwarded progress line named (for Ctrl-C's line)


def print_progress_lines(data: dict) -> None:
    """Ray's printer of forwarded worker output (``data["lines"]``), here: the progress lines, bare, and
    the batch the last one names (:func:`interrupted_at`)."""
    from diffusion.train.callbacks.progress import LINE_PREFIX
    if data.get("is_err"):
        return
    for line in data.get("lines", ()):
        if line.startswith(LINE_PREFIX):
            print(line, flush=True)
            seen = _BATCH.search(line)
            if seen:
                last_progress["batch"] = int(seen.group(1))


def interrupted_at() -> str:
    """Where Ctrl-C stopped an online run, as the driver saw it: ``at batch N`` from the workers' last
    progress line, else ``before its first batch`` (none printed yet: Ray starting, the plan, the workers
    building their trainers)."""
    batch = last_progress.get("batch")
    return f"at batch {batch}" if batch is not None else "before its first batch"


def _init_ray_with_progress():
    """The converter's quiet Ray start (RAY_ADDRESS or a new local cluster; see its docstring), plus the
    training workers' progress lines (:mod:`diffusion.train.callbacks.progress`) on this console.

    Ray forwards the workers' output to the driver, and this driver prints only those lines, bare;
    everything else (Ray Data's progress bars, Ray Train's notes, Composer's console logger of every
    rank) stays in the workers' log files, as without forwarding. A worker's error still reaches the
    driver as the exception ``fit_on_ray`` raises.
    """
    import ray

    if ray.is_initialized():
        return init_ray(None)  # joins nothing; quiets Ray Data's console as for a new start
    try:  # where Ray 2.60 hands forwarded worker output to printers (ray.init(log_to_driver=True) adds one)
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        dispatcher = None
    if not (hasattr(dispatcher, "add_handler") and hasattr(dispatcher, "remove_handler")):
        dispatcher = None  # another Ray: no forwarding at all rather than all of it
    init_ray(os.environ.get("RAY_ADDRESS"), log_to_driver=dispatcher is not None)
    if dispatcher is not None:
        dispatcher.remove_handler("ray_print_logs")
        dispatcher.add_handler("ray_print_logs", print_progress_lines)
    return ray


def stream_to_batch(cfg: Config, info, empty_text_embeds) -> ToModelBatch:
    """How a worker turns the stream's columns into the model's batch: offline's :class:`ToModelBatch` with the
    stream's description (``info``, ``empty_text_embeds``: :func:`~diffusion.stream.stream_source.stream_info`)."""
    from diffusion.train.trainer import noise_draws
    ids = info.text == schema.TEXT_IDS_ONLY  # the workers encode the stream's token ids (model.text=ids)
    return ToModelBatch(cfg.model.resolution, info.empty_input_ids if ids else empty_text_embeds,
                        CaptionDropout(cfg.data.train.caption_dropout, cfg.trainer.seed), noise_draws(cfg),
                        text_column=schema.INPUT_IDS if ids else schema.TEXT_EMBEDS,
                        empty_tokens=info.empty_text_tokens,  # the stream's rows carry token counts
                        latent_space=info.latent_space,
                        empty_pooled=None if ids else info.empty_pooled())  # Flux's CLIP beside T5


# ---- a finished run, re-run: told from the driver, before Ray starts ---------------------------------

FINISHED_RECORD = "finished-run.json"  # in the run's work dir: the checkpoint a finished run ended on


def _config_digest(cfg: Config) -> str | None:
    """The run's config (paths absolute), ``trainer.max_duration`` left out, as a digest; None if it
    cannot be written down."""
    try:
        plain = dataclasses.asdict(cfg)
        plain["trainer"]["max_duration"] = None
        return hashlib.sha256(json.dumps(plain, sort_keys=True, default=repr).encode()).hexdigest()
    except Exception:  # not written down: the run starts as usual
        return None


def _latest_file(cfg: Config) -> tuple[str, int] | None:
    """The local checkpoint file autoresume would load and its batch (from Composer's default name), when
    no later complete checkpoint sits beside it (autoresume's recovery would move ``latest`` there); else
    None: a remote or sharded save folder, another layout, no checkpoint."""
    t = cfg.trainer
    if not (t.autoresume and t.save_folder and "://" not in t.save_folder):
        return None
    from diffusion.train import save_folder
    from diffusion.train.trainer import checkpoint_path
    latest = checkpoint_path(cfg)
    if latest is None or not os.path.isfile(latest):
        return None
    folder, name = os.path.split(latest)
    named = save_folder.CHECKPOINT_FILE.match(name)  # Composer's default save_filename, rank 0
    if named is None or not save_folder.is_complete(latest):
        return None
    batch = int(named.group(2))
    for other in os.listdir(folder):
        later = save_folder.CHECKPOINT_FILE.match(other)
        if later and int(later.group(2)) > batch:
            return None
    return latest, batch


def _max_batches(cfg: Config) -> int | None:
    duration = str(cfg.trainer.max_duration).strip()
    return int(duration[:-2]) if duration.endswith("ba") and duration[:-2].isdigit() else None


def _record_finished(cfg: Config, work_dir: str, batch: int) -> None:
    """After a run that reached ``max_duration``: which checkpoint (name, size, time) it ended on and under
    which config, so a re-run of the same command can say so without starting Ray (:func:`already_finished`)."""
    latest, digest, max_batches = _latest_file(cfg), _config_digest(cfg), _max_batches(cfg)
    if latest is None or digest is None or max_batches is None or latest[1] != batch or batch < max_batches:
        return
    stat = os.stat(latest[0])
    record = {"checkpoint": latest[0], "batch": batch, "size": stat.st_size, "mtime_ns": stat.st_mtime_ns,
              "config": digest}
    with contextlib.suppress(OSError):
        os.makedirs(work_dir, exist_ok=True)
        partial = os.path.join(work_dir, f".partial-{FINISHED_RECORD}")
        with open(partial, "w") as f:
            json.dump(record, f)
        os.replace(partial, os.path.join(work_dir, FINISHED_RECORD))


def already_finished(cfg: Config, work_dir: str) -> OnlineResult | None:
    """What re-running a finished run reports, found without Ray or a checkpoint load: autoresume's latest
    checkpoint (a local file under Composer's default name, whole, none later beside it) is at or past
    ``trainer.max_duration`` (in batches), and it is the very file a run of this same config (but for
    ``max_duration``) recorded when it finished. Anything else is None, and the run starts as usual: its
    workers load the checkpoint and say what it holds."""
    max_batches = _max_batches(cfg)
    if max_batches is None:
        return None
    latest = _latest_file(cfg)
    if latest is None or latest[1] < max_batches:
        return None
    try:
        with open(os.path.join(work_dir, FINISHED_RECORD)) as f:
            record = json.load(f)
        stat = os.stat(latest[0])
    except (OSError, ValueError):
        return None
    if not isinstance(record, dict) or record != {"checkpoint": latest[0], "batch": latest[1], "size": stat.st_size,
                                                  "mtime_ns": stat.st_mtime_ns, "config": _config_digest(cfg)}:
        return None
    from diffusion.train.trainer import finished_line
    batch = latest[1]
    return OnlineResult(batch=batch, resumed_from=batch, rejects=count_rejects(work_dir),
                        checkpoint_folder=cfg.trainer.save_folder,
                        finished=finished_line(f"{batch}ba", f"{max_batches}ba"))


def run_online(cfg: Config, extra_callbacks=()) -> OnlineResult:
    """Train from raw data on the current Ray cluster (a local one if none); ``extra_callbacks`` go
    to every worker's trainer (tests pass a fault injector)."""
    check_online(cfg)
    cfg = with_absolute_paths(cfg)
    o, t = cfg.data.online, cfg.trainer
    if o.max_failures and not (t.save_folder and t.autoresume):
        log.warning("trainer.save_folder and trainer.autoresume are not both set: a restarted worker group "
                    "will start training over instead of resuming")
    run_name = t.run_name or DEFAULT_RUN_NAME
    work_dir = os.path.join(o.work_dir, run_name)
    finished = already_finished(cfg, work_dir)
    if finished is not None:
        return finished
    last_progress.clear()
    ray = _init_ray_with_progress()

    nodes = node_resources(ray)
    pools = plan_online_pools(ray.cluster_resources(), cfg, cpu_nodes(nodes))
    check_placement(nodes, pools, cfg)
    print(f"online pools: {pools.num_transformers} transformer(s) x {pools.cpus_per_transformer:g} CPU; "
          f"{pools.num_encoders} encoder(s) x {pools.cpus_per_encoder:g} CPU, {pools.gpus_per_encoder:g} GPU, batch "
          f"{pools.encoder_batch}; {o.num_train_workers} train worker(s) x {o.train_cpus:g} CPU, {o.train_gpus:g} GPU; "
          f"read tasks {pools.cpus_per_task:g} CPU; {len(nodes)} node(s)", flush=True)
    info, empty_text_embeds = stream_info(cfg)
    plan = WorkerPlan(
        make_trainer=OnlineTrainer(cfg, info, empty_text_embeds),
        to_batch=stream_to_batch(cfg, info, empty_text_embeds),
        batch_size=cfg.data.train.batch_size // o.num_train_workers,
        callbacks=list(extra_callbacks))
    result = fit_on_ray(build_stream(cfg, pools, work_dir), plan, placement(cfg),
                        storage_path=o.work_dir, name=run_name, max_failures=o.max_failures)
    summary = result.return_value or {}
    rejects = count_rejects(work_dir)
    log.info("online training ended at batch %s; rows rejected: %s", summary.get("batch"),
             ", ".join(f"{k}={v}" for k, v in sorted(rejects.items())) or "none")
    _record_finished(cfg, work_dir, int(summary.get("batch") or 0))
    known = {f.name for f in dataclasses.fields(OnlineResult)}
    return OnlineResult(rejects=rejects, checkpoint_folder=t.save_folder,
                        **{k: v for k, v in summary.items() if k in known})


def report(result: OnlineResult) -> None:
    """What the driver prints when an online run ends."""
    if result.finished:
        print(result.finished)
    if result.losses:
        (first_batch, first), (last_batch, last) = result.losses[0], result.losses[-1]
        print(f"trained to batch {result.batch}: loss {first:.4f} (batch {first_batch}) -> {last:.4f} "
              f"(batch {last_batch})")
    print("rejected rows: " + (", ".join(f"{k}={v}" for k, v in sorted(result.rejects.items())) or "none"))
    if result.checkpoint_folder:
        print(f"checkpoints: {result.checkpoint_folder}")
