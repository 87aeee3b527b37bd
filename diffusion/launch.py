"""The training command: ``composer run.py yamls/x.yaml key=value ...`` (and ``python -m diffusion.online``).

Parses ``[config.yaml] [key=value ...]``, loads the config and trains from the batch source it names:
stored MDS shards in this process (:mod:`diffusion.train.trainer`), or the stream through Ray Train
ranks (:mod:`diffusion.stream.ray_workers`).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import signal
import sys

from diffusion import cpus
from diffusion.train.config import ONLINE_LOADER_KEYS, load_config, unread_online_keys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DEFAULT_YAML = os.path.join(ROOT, "yamls", "tiny-cpu.yaml")

TRAIN_HELP = """Train the Stable Diffusion UNet with Composer on MDS shards written by convert/laion_to_mds.py.

Input: a YAML config (sections model, data, optimizer, scheduler, algorithms, callbacks, loggers,
trainer; see diffusion/train/config.py) and any number of section.key=value overrides. Output: checkpoints
in trainer.save_folder (Composer format, EMA weights included), logs through the configured loggers."""
TRAIN_EXAMPLES = """examples:
  composer run.py yamls/sd2-base-256.yaml                       # every GPU of this node
  composer -n 8 --world_size 16 --node_rank 0 --master_addr HOST --master_port 29500 run.py yamls/sd2-base-256.yaml
  WORLD_SIZE=16 NODE_RANK=0 MASTER_ADDR=HOST MASTER_PORT=29500 composer -n 8 run.py yamls/sd2-base-256.yaml
  python run.py yamls/tiny-cpu.yaml trainer.max_duration=100ba  # one process, CPU"""


def parse_args(argv: list[str], prog: str = "run.py", description: str = TRAIN_HELP,
               examples: str = TRAIN_EXAMPLES, default_yaml: str = DEFAULT_YAML) -> tuple[str, list[str]]:
    """``[config.yaml] [key=value ...]``; without a YAML, ``default_yaml`` (run.py: tiny-cpu.yaml)."""
    parser = argparse.ArgumentParser(prog=prog, description=description, epilog=examples,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("config", nargs="?", default=default_yaml,
                        help=f"YAML config (default: {os.path.relpath(default_yaml, ROOT)})")
    parser.add_argument("overrides", nargs="*", metavar="section.key=value",
                        help="override any config key, e.g. optimizer.lr=2e-4 trainer.max_duration=1000ba")
    args = parser.parse_args(argv)
    if "=" in args.config:  # overrides only: the default YAML
        return default_yaml, [args.config, *args.overrides]
    return args.config, list(args.overrides)


def main(argv: list[str] | None = None):
    """``run.py``: parse ``[config.yaml] [key=value ...]`` and train."""
    return main_with(*parse_args(sys.argv[1:] if argv is None else argv))


def _size_pools(cfg) -> tuple[int, int]:
    """Torch's thread pools and the loaders' workers sized to this rank's share of the CPUs it may
    really use (affinity, cgroup quota), not the machine's count (:mod:`diffusion.cpus`); returns the
    train loader's (workers, workers asked for)."""
    cpus.size_torch()
    asked = cfg.data.train.num_workers
    for loader in (cfg.data.train, cfg.data.eval):
        if loader is not None:
            loader.num_workers = cpus.loader_workers(loader.num_workers)
    return cfg.data.train.num_workers, asked


def main_with(path: str, overrides: list[str]):
    """Train with the config at ``path`` plus ``overrides``, from the batch source it names:
    ``data.train.source: mds`` trains in this process (one rank of a Composer launch), ``stream``
    launches Ray Train ranks fed by the converter's operators (:func:`~diffusion.stream.ray_workers.run_online`)."""
    cfg = load_config(path, overrides)
    # torch, Composer and Ray load once the config holds: --help and a config error answer in a second
    from composer.utils import dist
    if cfg.data.train.source == "stream":
        # the driver trains nothing itself: Ctrl-C is Python's KeyboardInterrupt again, not the sys.exit(130)
        # of Composer's engine (imported just now), which Ray's waits swallowed (rc 1, no word)
        with contextlib.suppress(ValueError):  # not the main thread: no handler to set
            signal.signal(signal.SIGINT, signal.default_int_handler)
    unread = unread_online_keys(cfg.data.train) if cfg.data.train.source == "stream" else []
    workers = _size_pools(cfg)
    if unread and dist.get_global_rank() == 0:
        print(f"note: online mode reads raw rows from data.online.input and, of data.train, only "
              f"{', '.join(ONLINE_LOADER_KEYS[1:])}: {', '.join(unread)} "
              f"{'does' if len(unread) == 1 else 'do'} nothing here", file=sys.stderr, flush=True)
    if dist.get_global_rank() == 0:  # the whole config is logged with the hyperparameters
        print(f"# config: {path} {' '.join(overrides)}", flush=True)
        print(cpus.describe(workers), flush=True)
    if cfg.data.train.source == "stream":
        from diffusion.stream import ray_workers
        try:
            result = ray_workers.run_online(cfg)
        except (KeyboardInterrupt, SystemExit) as e:
            if isinstance(e, SystemExit) and e.code != 128 + signal.SIGINT:
                raise
            resumable = cfg.trainer.autoresume and cfg.trainer.save_folder
            raise KeyboardInterrupt(ray_workers.interrupted_at() + "; " + (
                "re-run the same command to resume from its last checkpoint" if resumable else
                "trainer.autoresume is off, so a re-run starts from the beginning")) from None
        ray_workers.report(result)
        return result
    from diffusion.train.trainer import build_trainer, finished_message
    trainer = build_trainer(cfg)
    finished = finished_message(trainer)
    if finished:
        if dist.get_global_rank() == 0:
            print(finished, flush=True)
        trainer.close()
        return trainer
    rank0 = dist.get_global_rank() == 0
    if rank0:
        print(model_line(trainer.state.model), flush=True)
    if rank0 and trainer.resumed_from:
        print(f"resuming from {trainer.resumed_from} at batch {int(trainer.state.timestamp.batch)}", flush=True)
    trainer.logger.log_hyperparameters(cfg.to_dict())
    try:
        trainer.fit()
    except (KeyboardInterrupt, SystemExit) as e:
        # Composer's engine turns SIGINT into sys.exit(130) (and SIGTERM into 143): Ctrl-C arrives as that
        if isinstance(e, SystemExit) and e.code != 128 + signal.SIGINT:
            raise
        batch = int(trainer.state.timestamp.batch)
        resumable = cfg.trainer.autoresume and cfg.trainer.save_folder
        raise KeyboardInterrupt(f"at batch {batch}; " + (
            "re-run the same command to resume from its last checkpoint" if resumable else
            "trainer.autoresume is off, so a re-run starts from the beginning")) from None
    trainer.close()
    if rank0:
        print(closing_line(cfg, trainer), flush=True)
    return trainer


OBJECTIVES = {"epsilon": "DDPM, predicting the noise (epsilon)", "v_prediction": "DDPM, predicting v",
              "flow": "rectified flow, predicting the velocity"}


def model_line(model) -> str:
    """What was built, in one line: ``model: <denoiser class> denoiser, N parameters; objective <name> (...)``;
    ``model.denoiser: auto`` picks the class the model reference holds, ``model.objective`` the objective.
    The count is the whole denoiser's (built again on the meta device: no memory, the same under FSDP)."""
    import torch
    model = getattr(model, "module", model)  # DDP's wrapper
    denoiser = model.denoiser
    with torch.device("meta"):
        whole = model.adapter.model_class.from_config(dict(denoiser.config))  # FSDP1 wraps the denoiser itself
    count = sum(p.numel() for p in whole.parameters())
    name = model.objective.name
    described = OBJECTIVES.get(name)
    return (f"model: {model.adapter.class_name} denoiser, {count:,} parameters; objective {name}"
            + (f" ({described})" if described else ""))


def closing_line(cfg, trainer) -> str:
    """The run's last line: how far it trained and where its checkpoint is."""
    from diffusion.train.trainer import checkpoint_path
    batch = int(trainer.state.timestamp.batch)
    path = checkpoint_path(cfg)
    where = f"checkpoint: {path}" if path else "no checkpoint saved (trainer.save_folder is not set)"
    return f"done: trained to batch {batch} of {cfg.trainer.max_duration}; {where}"
