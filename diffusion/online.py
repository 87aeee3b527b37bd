"""Online mode: raw images and captions stream through transform and encode straight into training.

    python -m diffusion.online yamls/tiny-online-cpu.yaml [section.key=value ...]

Same config as ``run.py`` plus a ``data.online`` section. One Ray job: the converter's pipeline (read
tasks → transform actors on CPUs → encoder actors on their own GPUs, or CPUs) feeds Ray Train workers,
each running the Composer trainer that ``run.py`` builds, on batches of the same data contract. No MDS
is written. A worker that dies takes the group down; Ray Train restarts it (``data.online.max_failures``)
and Composer's ``autoresume`` resumes from the last checkpoint in ``trainer.save_folder``, which
``run.py`` can also load for further offline training.
"""

from __future__ import annotations

import copy
import dataclasses
import logging
import os
import sys

from diffusion.config import Config, load_config
from diffusion.errors import ConfigError
from diffusion.train.batches import CaptionDropout, ToModelBatch
from diffusion.train.stream_source import build_stream, count_rejects, plan_online_pools, stream_info
from diffusion.train.ray_workers import TrainPlacement, WorkerPlan, fit_on_ray

log = logging.getLogger(__name__)
DEFAULT_RUN_NAME = "online"


class OnlineTrainer:
    """Builds the offline trainer in a Ray Train worker, with the stream as its train dataloader."""

    def __init__(self, cfg: Config, info):
        self.cfg, self.info = cfg, info

    def __call__(self, train_dataloader, callbacks):
        from diffusion.train.trainer import build_trainer
        return build_trainer(self.cfg, train_dataloader=train_dataloader, info=self.info, extra_callbacks=callbacks)


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


def placement(cfg: Config) -> TrainPlacement:
    o = cfg.data.online
    return TrainPlacement(num_workers=o.num_train_workers, use_gpu=o.train_gpus > 0, cpus_per_worker=o.train_cpus,
                          gpus_per_worker=o.train_gpus or 1.0, accelerator_type=o.train_accelerator_type)


def _init_ray():
    """The converter's quiet Ray start (RAY_ADDRESS or a new local cluster; see its docstring), plus the
    training workers' progress lines (:mod:`diffusion.callbacks.progress`) on this console.

    Ray forwards the workers' output to the driver, and this driver prints only those lines, bare;
    everything else (Ray Data's progress bars, Ray Train's notes, Composer's console logger of every
    rank) stays in the workers' log files, as without forwarding. A worker's error still reaches the
    driver as the exception ``fit_on_ray`` raises.
    """
    import ray

    from diffusion.callbacks.progress import LINE_PREFIX
    from diffusion.convert.pipeline import _init_ray as init_ray_quietly
    if ray.is_initialized():
        return init_ray_quietly(None)  # joins nothing; quiets Ray Data's console as for a new start
    try:  # where Ray 2.60 hands forwarded worker output to printers (ray.init(log_to_driver=True) adds one)
        from ray._private.ray_logging import global_worker_stdstream_dispatcher as dispatcher
    except ImportError:
        dispatcher = None
    if not (hasattr(dispatcher, "add_handler") and hasattr(dispatcher, "remove_handler")):
        dispatcher = None  # another Ray: no forwarding at all rather than all of it
    init_ray_quietly(os.environ.get("RAY_ADDRESS"), log_to_driver=dispatcher is not None)
    if dispatcher is not None:
        def print_progress_lines(data: dict) -> None:
            if data.get("is_err"):
                return
            for line in data.get("lines", ()):
                if line.startswith(LINE_PREFIX):
                    print(line, flush=True)
        dispatcher.remove_handler("ray_print_logs")
        dispatcher.add_handler("ray_print_logs", print_progress_lines)
    return ray


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
    ray = _init_ray()

    pools = plan_online_pools(ray.cluster_resources(), cfg)
    log.info("online pools: %d transformer(s) x %.2f CPU; %d encoder(s) x %.2f CPU, %.2f GPU, batch %d; "
             "%d train worker(s) x %.2f CPU, %.2f GPU", pools.num_transformers, pools.cpus_per_transformer,
             pools.num_encoders, pools.cpus_per_encoder, pools.gpus_per_encoder, pools.encoder_batch,
             o.num_train_workers, o.train_cpus, o.train_gpus)
    info, empty_text_embeds = stream_info(cfg)
    plan = WorkerPlan(
        make_trainer=OnlineTrainer(cfg, info),
        to_batch=ToModelBatch(cfg.model.resolution, empty_text_embeds,
                              CaptionDropout(cfg.data.train.caption_dropout, t.seed)),
        batch_size=cfg.data.train.batch_size // o.num_train_workers,
        callbacks=list(extra_callbacks))
    result = fit_on_ray(build_stream(cfg, pools, work_dir), plan, placement(cfg),
                        storage_path=o.work_dir, name=run_name, max_failures=o.max_failures)
    summary = result.return_value or {}
    rejects = count_rejects(work_dir)
    log.info("online training ended at batch %s; rows rejected: %s", summary.get("batch"),
             ", ".join(f"{k}={v}" for k, v in sorted(rejects.items())) or "none")
    known = {f.name for f in dataclasses.fields(OnlineResult)}
    return OnlineResult(rejects=rejects, checkpoint_folder=t.save_folder,
                        **{k: v for k, v in summary.items() if k in known})


ONLINE_HELP = """Train from raw image-caption data with no MDS step: Ray Data reads, transforms and encodes
rows (the converter's operators) and streams them into Ray Train workers, each running run.py's trainer.

Input: a YAML config like run.py's, plus a data.online section (raw input, work_dir, pools, workers).
Output: checkpoints in trainer.save_folder (loadable by run.py), reject records in data.online.work_dir."""
ONLINE_EXAMPLES = """examples:
  python -m diffusion.kit.sample --out out/demo/raw --n 2048
  python -m diffusion.online yamls/tiny-online-cpu.yaml trainer.max_duration=50ba"""


def main(argv: list[str] | None = None) -> OnlineResult:
    from diffusion.train.trainer import parse_args
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    path, overrides = parse_args(sys.argv[1:] if argv is None else argv, prog="python -m diffusion.online",
                                 description=ONLINE_HELP, examples=ONLINE_EXAMPLES)
    result = run_online(load_config(path, overrides))
    losses = result.losses
    if result.finished:
        print(result.finished)
    if losses:
        print(f"trained to batch {result.batch}: loss {losses[0][1]:.4f} (batch {losses[0][0]}) -> "
              f"{losses[-1][1]:.4f} (batch {losses[-1][0]})")
    print("rejected rows: " + (", ".join(f"{k}={v}" for k, v in sorted(result.rejects.items())) or "none"))
    if result.checkpoint_folder:
        print(f"checkpoints: {result.checkpoint_folder}")
    return result


if __name__ == "__main__":
    from diffusion import cli
    cli.run(main, "online")
