"""Helpers for the training tests: MDS shards written directly (as the converter would) and small configs.

The moments are learnable on purpose: each sample's latent mean is a smooth pattern chosen by its
caption class, so a few dozen CPU steps visibly lower the loss.
"""

from __future__ import annotations

import json
import os

import numpy as np

from diffusion import schema

SCALING_FACTOR = 0.18215
CLASSES = 4


def write_training_kit(out: str) -> str:
    """The tiny kit's UNet, text-encoder and scheduler configs without weights or the fitted VAE.

    Training builds the UNet from its config and never touches the VAE or text encoder, so the tests
    need seconds here where the full tiny kit (a fitted VAE) takes minutes on a loaded CPU.
    """
    import diffusers
    from diffusers import UNet2DConditionModel
    from transformers import CLIPTextConfig

    from diffusion.kit import build as kit
    root = os.path.abspath(out)
    with __import__("torch").device("meta"):
        UNet2DConditionModel(**kit.TINY_UNET).save_config(os.path.join(root, "unet"))
    CLIPTextConfig(**kit.TINY_TEXT).save_pretrained(os.path.join(root, "text_encoder"))
    getattr(diffusers, kit.SCHEDULER_CLASS)(**kit.SCHEDULER).save_config(os.path.join(root, "scheduler"))
    with open(os.path.join(root, "model_index.json"), "w") as f:
        json.dump(kit.model_index(), f)
    return root


def write_mmdit_training_kit(out: str) -> str:
    """The tiny MMDiT kit's transformer, text-encoder and flow scheduler configs, without weights (as
    :func:`write_training_kit` for the UNet)."""
    import diffusers
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextConfig

    from diffusion.kit import build as kit
    root = os.path.abspath(out)
    with __import__("torch").device("meta"):
        SD3Transformer2DModel(**kit.TINY_MMDIT).save_config(os.path.join(root, "transformer"))
    CLIPTextConfig(**kit.TINY_TEXT).save_pretrained(os.path.join(root, "text_encoder"))
    diffusers.FlowMatchEulerDiscreteScheduler(**kit.FLOW_SCHEDULER).save_config(os.path.join(root, "scheduler"))
    with open(os.path.join(root, "model_index.json"), "w") as f:
        json.dump({"_class_name": "StableDiffusion3Pipeline"}, f)
    return root


def kit_text_dim(kit: str) -> int:
    with open(os.path.join(kit, "text_encoder", "config.json")) as f:
        return int(json.load(f)["hidden_size"])


def write_latent_mds(out: str, *, kit: str, n: int = 64, resolution: int = 64, seed: int = 0,
                     text_dim: int | None = None, logvar: float = -6.0, samples_per_shard: int = 16,
                     compression: str | None = None, text_encoder: str | None = None,
                     text_encoder_type: str | None = None,
                     text: str = schema.TEXT_BOTH, latent_space: schema.LatentSpace | None = None,
                     pooled: bool | None = None) -> str:
    """Write ``n`` samples of contract columns to ``out`` with dataset.json and empty_text_embeds.npy.

    The text columns (``text``: which of them) are stand-ins (random embeddings per class, token ids
    all the class number; the empty caption's embedding all -1, its ids all ``CLASSES``), or with
    ``text_encoder`` (a kit with text encoder weights) what the converter stores: the ids of
    "class C" and their embeddings from that encoder. ``latent_space``: the autoencoder the samples stand
    for (None: SD's 4-channel moments, /8), recorded in dataset.json; C channels of patterns, as moments or
    as deterministic latents. ``pooled`` (None: where ``kit`` has Flux's two text encoders) adds the second
    encoder's pooled vectors (``pooled_text_embeds``: stand-ins per class, the empty caption's all -1)."""
    from streaming import MDSWriter
    text_dim = text_dim or kit_text_dim(kit)
    rng = np.random.default_rng(seed)
    class_ids = np.repeat(np.arange(CLASSES, dtype=np.int32)[:, None], schema.MAX_TOKENS, axis=1)
    empty_ids = np.full(schema.MAX_TOKENS, CLASSES, dtype=np.int32)
    space = latent_space or schema.LatentSpace(scaling_factor=SCALING_FACTOR)
    h = resolution // space.downsample
    yy, xx = np.meshgrid(np.linspace(-1, 1, h), np.linspace(-1, 1, h), indexing="ij")
    patterns = np.stack([np.stack([np.sin((c + 1) * xx + k) * np.cos((k + 1) * yy) for k in range(space.channels)])
                         for c in range(CLASSES)]) * 4.0  # unscaled latents are ~5x the scaled ones
    class_embeds = rng.normal(size=(CLASSES, schema.MAX_TOKENS, text_dim))
    # A recognisable empty-caption embedding: every value -1 (real embeddings here are N(0, 1)).
    empty_embeds = np.full((schema.MAX_TOKENS, text_dim), -1.0, dtype=np.float16)
    probe = None
    if text_encoder:
        from diffusion.convert.encoders import TextEncoder
        from diffusion.models.text_encoder import empty_caption_ids, text_probe
        encoder = TextEncoder(text_encoder, device="cpu")
        class_ids = encoder.tokenizer([f"class {c}" for c in range(CLASSES)], padding="max_length",
                                      max_length=schema.MAX_TOKENS, truncation=True, return_tensors="np")["input_ids"]
        class_ids = class_ids.astype(np.int32)
        class_embeds = encoder.encode_ids(class_ids)
        empty_ids = empty_caption_ids(encoder.tokenizer)
        empty_embeds = encoder.encode_ids(empty_ids[None])[0]
        probe = text_probe(encoder.tokenizer, encoder.encode_ids)
    from diffusion.models import loading
    pooled_dim = loading.pooled_text_width(kit) if pooled is None or pooled else None
    class_pooled = np.random.default_rng(seed + 1000).normal(size=(CLASSES, pooled_dim or 1))  # its own draws
    columns = schema.mds_columns([resolution], text_dim, text=text, tokens=False, latent_space=space,  # no text_tokens
                                 pooled_dim=pooled_dim)
    # Bigger shards than real ones would be fine; several shards exercise the partitioning across ranks.
    # A shard holds samples_per_shard samples whichever text columns are stored (the same rows give the
    # same shards, so the same training order): array bytes plus a little for the strings and header.
    text_bytes = sum({schema.TEXT_EMBEDS: schema.MAX_TOKENS * text_dim * 2, schema.INPUT_IDS: schema.MAX_TOKENS * 4}
                     .get(name, 0) for name in schema.text_columns(text))
    size_limit = samples_per_shard * (space.stored_channels * h * h * 2 + text_bytes + 2 * (pooled_dim or 0) + 100)
    with MDSWriter(out=out, columns=columns, size_limit=size_limit, compression=compression) as writer:
        for i in range(n):
            c = i % CLASSES
            mean = patterns[c] + 0.1 * rng.normal(size=patterns[c].shape)
            moments = (np.concatenate([mean, np.full_like(mean, logvar)]) if space.stored == schema.MOMENTS
                       else mean).astype(np.float16)
            sample = {
                space.column(resolution): moments,
                schema.TEXT_EMBEDS: class_embeds[c].astype(np.float16),
                schema.INPUT_IDS: class_ids[c],
                schema.POOLED_TEXT_EMBEDS: class_pooled[c].astype(np.float16),
                schema.CAPTION: f"class {c}", schema.KEY: f"{i:06d}",
                schema.WIDTH: resolution, schema.HEIGHT: resolution,
            }
            writer.write({name: value for name, value in sample.items() if name in columns})
    info = schema.DatasetInfo(model=text_encoder or kit, scaling_factor=SCALING_FACTOR, resolutions=[resolution],
                              text_dim=text_dim, count=n, rows_in=n, text=text, text_encoder=text_encoder,
                              empty_input_ids=[int(i) for i in empty_ids], text_probe=probe,
                              text_encoder_type=text_encoder_type)  # the converter records its encoder's kind
    if latent_space is not None:
        info.set_latent_space(latent_space)
    if pooled_dim:
        info.pooled_text_dim, info.empty_pooled_text_embeds = pooled_dim, [-1.0] * pooled_dim
    info.save(out)
    np.save(os.path.join(out, schema.EMPTY_TEXT_EMBEDS), empty_embeds.astype(np.float16))
    return out


def tiny_overrides(kit: str, mds: str, *, batches: int = 8, batch_size: int = 8, save_folder: str | None = None,
                   extra: tuple[str, ...] = ()) -> list[str]:
    """Overrides of yamls/tiny-cpu.yaml for a fast, quiet test run on ``mds``."""
    overrides = [f"model.ref={kit}", f"data.train.path={mds}", f"data.train.batch_size={batch_size}",
                 f"trainer.max_duration={batches}ba", "trainer.autoresume=false", "loggers={}",
                 "callbacks={}", f"trainer.save_folder={save_folder or 'null'}", "scheduler.t_warmup=0ba",
                 # epsilon, as these tests were written for, not the demo's v-prediction colour recipe
                 "model.prediction_type=epsilon", "model.offset_noise=0.0"]
    return overrides + list(extra)


def muon_overrides(kit: str, mds: str, *extra, batches: int = 4, save_folder: str | None = None) -> list[str]:
    """Overrides of yamls/tiny-mmdit-flow-cpu.yaml training the MMDiT on ``mds`` with Muon and a fast EMA
    (tests/train/test_optimizers.py and its two-rank run in tests/train/test_fsdp_mmdit.py)."""
    return tiny_overrides(kit, mds, batches=batches, batch_size=8, save_folder=save_folder, extra=(
        "model.prediction_type=null", "model.objective=flow", "optimizer.name=muon", "optimizer.lr=0.02",
        "algorithms.ema.smoothing=0.9", "algorithms.ema.warmup=false", *extra))


def posthoc_overrides(kit: str, mds: str, *extra, batches: int = 6, save_folder: str | None = None) -> list[str]:
    """Overrides of yamls/tiny-mmdit-flow-cpu.yaml with post-hoc EMA (two widths, a snapshot every 3 batches) and
    every checkpoint kept (tests/train/algorithms/test_posthoc_ema.py and its two-rank runs in
    tests/train/test_fsdp_mmdit.py)."""
    return tiny_overrides(kit, mds, batches=batches, batch_size=8, save_folder=save_folder, extra=(
        "model.prediction_type=null", "model.objective=flow", "trainer.save_interval=2ba",
        "trainer.save_num_checkpoints_to_keep=-1",
        "algorithms.posthoc_ema={sigma_rels: [0.05, 0.10], snapshot_every: 3ba}", *extra))


def free_port() -> int:
    """A TCP port the OS has free now (bound to port 0): a launch's master port, never a fixed number that
    another suite or job on the machine may hold."""
    import socket
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_group(command: list[str], *, timeout: float, **kwargs):
    """``subprocess.run(command, capture_output=True, text=True, timeout=timeout, **kwargs)`` in a process group
    of its own: on a timeout or an interrupt the whole group (Composer's launcher and every rank it started)
    is killed, not the launcher alone; a timeout fails naming the command's start and the seconds waited."""
    import signal
    import subprocess
    process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                               start_new_session=True, **kwargs)
    try:
        out, err = process.communicate(timeout=timeout)
    except BaseException as error:
        try:
            os.killpg(process.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        out, err = process.communicate()
        if isinstance(error, subprocess.TimeoutExpired):
            raise subprocess.TimeoutExpired(command, timeout, out, err) from None
        raise
    return subprocess.CompletedProcess(command, process.returncode, out, err)


def uploads_forked_from_one_server(setattr_=setattr):
    """Composer's ``RemoteUploader`` (a run saving to ``s3://...``) starts its processes (a Manager, upload and
    check workers) with ``spawn``: each worker imports Composer again to unpickle its task, about 13 CPU-s on a
    2-core VM, several a run. Here they fork instead from one forkserver of this process's own (never another
    part of the process's), started at its first use with the environment then (the test's S3 endpoint) and
    having imported Composer's uploader once. The tasks and their arguments are pickled as before. ``setattr_``:
    ``monkeypatch.setattr`` to undo it after a test. Returns a function that ends the server (it would wait for
    every process it forked: Composer never shuts its uploader's Manager down, which ends at this process's exit,
    as with spawn)."""
    import multiprocessing
    import multiprocessing.forkserver as forkserver
    import signal
    import types

    from composer.utils import remote_uploader
    server = forkserver.ForkServer()
    server.set_forkserver_preload(["composer.utils.remote_uploader"])
    context = multiprocessing.get_context("forkserver")
    setattr_(forkserver, "connect_to_new_process", server.connect_to_new_process)
    setattr_(forkserver, "ensure_running", server.ensure_running)
    setattr_(remote_uploader, "multiprocessing", types.SimpleNamespace(get_context=lambda method: context))

    def stop():
        if server._forkserver_pid is not None:
            os.kill(server._forkserver_pid, signal.SIGKILL)
            os.waitpid(server._forkserver_pid, 0)
            os.close(server._forkserver_alive_fd)
            server._forkserver_pid = server._forkserver_alive_fd = None
    return stop


class OpensWhenUnpickled:
    """Unpickling this runs ``open(path, "w")``: the payload a hostile checkpoint carries (the file at ``path``
    appearing is the sign it ran)."""

    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (open, (self.path, "w"))


def launch_composer(script_path, script: str, args: list[str], *, port: int | None = None, env: dict | None = None,
                    processes: int = 2, timeout: float = 600, launcher: str = "composer"):
    """Write ``script`` to ``script_path`` and run it on ``processes`` ranks from the repository root (one thread per
    rank, the repository importable), on a master port from the OS unless ``port`` is given, in process groups
    killed whole on a timeout or an interrupt; returns the ``subprocess.CompletedProcess`` (its stdout and stderr
    those of the launch: rank 0's, and a failed rank's output after it, as Composer's launcher prints them).

    ``launcher``: "composer" runs ``composer -n processes`` (Composer's launcher, for tests of the command a user
    runs); "plain" starts the ranks directly (:func:`launch_ranks`), sparing the launcher's own process, which
    imports Composer (~15 CPU-s) only to start them. The plain launch is enough for a harness script: its ranks
    are real processes with the environment Composer's launcher gives each one, and the launcher itself is
    exercised by the launches of run.py (tests/train/test_fsdp.py, tests/train/test_multinode.py)."""
    import sys
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    with open(script_path, "w") as f:
        f.write(script)
    full_env = dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1", **(env or {}))
    port = free_port() if port is None else port
    if launcher == "plain":
        return launch_ranks([sys.executable, str(script_path), *args], processes=processes, port=port,
                            timeout=timeout, cwd=root, env=full_env)
    assert launcher == "composer", launcher
    composer = os.path.join(os.path.dirname(sys.executable), "composer")
    return run_group([composer, "-n", str(processes), "--master_port", str(port), str(script_path), *args],
                     cwd=root, env=full_env, timeout=timeout)


# How long ranks still running when another fails have, after SIGTERM, before SIGKILL (Composer's launcher: 30 s).
RANK_CLEANUP_SECONDS = 30


def launch_ranks(command: list[str], *, processes: int, port: int, timeout: float, cwd: str, env: dict):
    """Start ``command`` as ranks 0..processes-1 of one node, each with the variables Composer's launcher
    (composer/cli/launcher.py) sets for a rank: RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, NODE_RANK,
    MASTER_ADDR (127.0.0.1) and MASTER_PORT (``port``), PYTHONUNBUFFERED=1 and TORCH_NCCL_ASYNC_ERROR_HANDLING=1,
    over ``env`` and what importing Composer adds to the launcher's environment. Waits for every rank; when one
    fails, the others get SIGTERM and, still running 30 s later, SIGKILL (as Composer's launcher does). Each rank
    is a process group of its own, killed whole on a timeout or an interrupt, and after the launch (whatever a
    rank left running). Returns a ``subprocess.CompletedProcess``: the exit status of the first rank in rank order
    that failed (not killed here; 0 when all succeeded), rank 0's stdout and stderr, and after rank 0's stdout
    each failed rank's exit status and (ranks above 0) output, as the launcher prints them."""
    import contextlib
    import signal
    import subprocess
    import tempfile
    import time
    # Composer's launcher expands ``$VAR`` and ``~`` in each argument with the rank's variables; ours carry none.
    assert not any("$" in arg or arg.startswith("~") for arg in command[2:]), command
    # The launcher's own environment after it imported Composer, which the ranks inherit: joblib and scikit-learn
    # (imported with Composer) set these two where unset, as each rank's own import of Composer then does.
    inherited = {"KMP_DUPLICATE_LIB_OK": "True", "KMP_INIT_AT_FORK": "FALSE", **env}
    ranks, logs, timed_out = [], [], False

    def read(rank, stream):
        logs[rank][stream].seek(0)
        return logs[rank][stream].read()

    with tempfile.TemporaryDirectory() as folder, contextlib.ExitStack() as files:
        try:
            for rank in range(processes):
                logs.append([files.enter_context(open(os.path.join(folder, f"rank{rank}.{name}.txt"), "w+"))
                             for name in ("stdout", "stderr")])
                rank_env = dict(inherited, RANK=str(rank), WORLD_SIZE=str(processes), LOCAL_RANK=str(rank),
                                LOCAL_WORLD_SIZE=str(processes), NODE_RANK="0", MASTER_ADDR="127.0.0.1",
                                MASTER_PORT=str(port), PYTHONUNBUFFERED="1", TORCH_NCCL_ASYNC_ERROR_HANDLING="1")
                ranks.append(subprocess.Popen(command, stdout=logs[rank][0], stderr=logs[rank][1], cwd=cwd,
                                              env=rank_env, start_new_session=True))
            deadline = time.monotonic() + timeout
            # until every rank has exited, or one has failed (each polled every time)
            while None in (codes := [p.poll() for p in ranks]) and not any(codes):
                if time.monotonic() > deadline:
                    timed_out = True
                    break
                time.sleep(0.1)
            else:
                if any(p.returncode is None for p in ranks):  # a rank failed: stop the others
                    for process in ranks:
                        if process.poll() is None:
                            process.send_signal(signal.SIGTERM)
                    cleanup = time.monotonic() + RANK_CLEANUP_SECONDS
                    while any(p.poll() is None for p in ranks) and time.monotonic() < cleanup:
                        time.sleep(0.1)
        finally:  # whatever is left of each rank's group (all of it on a timeout or an interrupt)
            for process in ranks:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
        if timed_out:
            raise subprocess.TimeoutExpired(command, timeout, read(0, 0), read(0, 1))
        # the ranks that failed on their own (not those stopped here after another failed)
        failed = [rank for rank, p in enumerate(ranks) if p.returncode and -p.returncode not in (signal.SIGKILL,
                                                                                                  signal.SIGTERM)]
        stdout = [read(0, 0)]
        for rank in failed:
            stdout.append(f"Global rank {rank} (PID {ranks[rank].pid}) exited with code {ranks[rank].returncode}")
            if rank:
                stdout += [f"----------Begin global rank {rank} STDOUT----------", read(rank, 0),
                           f"----------End global rank {rank} STDOUT----------",
                           f"----------Begin global rank {rank} STDERR----------", read(rank, 1),
                           f"----------End global rank {rank} STDERR----------"]
        stderr = read(0, 1)
    returncode = ranks[failed[0]].returncode if failed else next((p.returncode for p in ranks if p.returncode), 0)
    return subprocess.CompletedProcess(command, returncode, "\n".join(stdout), stderr)


def run_py_here(capfd, *args):
    """``run.py ARGS`` through its ``cli.run`` entry in this process (cli_helpers.run_entry: the exit status, stdout
    and stderr a process would give), for runs whose point is what the command does, not its process (a process
    pays ~15 CPU-s of Composer's imports); paths relative to the repository root as run.py's own; whatever the
    run opened (its dataset, a refused run's lock) is collected after it. Torch's threads stay this process's
    (OMP_NUM_THREADS set: run.py leaves them)."""
    import gc

    import torch
    from cli_helpers import run_entry
    from diffusion.launch import main
    root, cwd = os.path.dirname(os.path.dirname(os.path.abspath(__file__))), os.getcwd()
    env = {"OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS") or str(torch.get_num_threads())}
    # the one-rank world Composer fills in when it starts this process's group, and needs while the group lives (as
    # after fit_in_process); run_entry would take them away again with the rest of the run's environment
    for name, value in {"NODE_RANK": "0", "WORLD_SIZE": "1", "LOCAL_WORLD_SIZE": "1", "RANK": "0",
                        "LOCAL_RANK": "0"}.items():
        os.environ.setdefault(name, value)
    os.chdir(root)
    try:
        return run_entry(capfd, main, "run.py", *args, env=env)
    finally:
        os.chdir(cwd)
        gc.collect()


def close_trainer(trainer) -> None:
    """Close ``trainer`` and collect it, releasing the streaming dataset's shared memory before the next
    run reuses the folder."""
    import gc
    trainer.close()
    del trainer
    gc.collect()


def fit_in_process(cfg, callbacks=()):
    """Train ``cfg`` (a loaded Config) in this process, with ``callbacks`` added: ({name: final weight},
    the sample indices of each batch in training order). The trainer is closed and collected."""
    from composer.core import Callback

    from diffusion.train.trainer import build_trainer

    class RecordBatches(Callback):
        def __init__(self):
            self.batches = []

        def batch_start(self, state, logger):
            self.batches.append(state.batch[schema.BATCH_SAMPLE_INDEX].tolist())

    trainer = build_trainer(cfg)
    record = RecordBatches()
    trainer.state.callbacks.extend([record, *callbacks])
    trainer.fit()
    weights = {k: v.detach().clone() for k, v in trainer.state.model.state_dict().items() if k != "_extra_state"}
    close_trainer(trainer)
    return weights, record.batches


def explain_training_step(model, batch):
    """torch._dynamo's account of compiling ``model``'s training step (forward and loss) on ``batch``: its
    ``graph_count``, ``graph_break_count`` and ``break_reasons``. A step that compiles whole has one graph."""
    import torch._dynamo
    model.train()
    torch._dynamo.reset()
    return torch._dynamo.explain(lambda b: model.loss(model(b), b))(batch)


def explain_config_step(cfg):
    """:func:`explain_training_step` for the model ``cfg`` builds, on the first batch its loader gives."""
    from diffusion.loader import dataset_info, mds_source
    from diffusion.models.latent_diffusion import build_model
    model = build_model(cfg.model, dataset_info.read_loader_info(cfg.data.train, cfg.model.resolution))
    loader = mds_source.build_dataloader(cfg.data.train, resolution=cfg.model.resolution, text_dim=model.text_dim)
    return explain_training_step(model, next(iter(loader)))


def encoded_sample_rows(kit: str, sample_data: str, cfg, n: int = 24):
    """The first ``n`` sample rows through the stream's own transform and encode operators, as an online run's
    Ray pipeline hands them to a worker: (the transformed columns, the encoded columns)."""
    import itertools
    from diffusion.convert import transforms
    from diffusion.convert.encoders import LatentTextEncoder
    from diffusion.convert.readers import iter_rows
    from diffusion.stream.stream_source import stream_text
    rows = list(itertools.islice(iter_rows(sample_data), n))
    raw = {name: [r[name] for r in rows] for name in (schema.RAW_KEY, schema.RAW_CAPTION, schema.RAW_IMAGE)}
    transformed = transforms.ImageCaptionTransform(kit, [64])(raw)
    return transformed, LatentTextEncoder(kit, [64], text=stream_text(cfg))(transformed)


class RowsShard:
    """Encoded columns as a worker's Ray Data shard: whole batches of them, in order."""

    def __init__(self, columns: dict):
        self.columns = columns

    def iter_batches(self, batch_size, batch_format, drop_last, prefetch_batches):
        for start in range(0, len(self.columns[schema.KEY]) - batch_size + 1, batch_size):
            yield {name: value[start:start + batch_size] for name, value in self.columns.items()}


# Run under ``launch_composer`` with VARIANTS (a JSON list of {"name", "blocks", "overrides"}) and RECORD_DIR:
# each variant trains in turn in the one launch, and each rank saves ``NAME-rankR.pt``: how many of the
# denoiser's ``blocks`` are FSDP units of their own (FSDP1's wrappers or FSDP2's ``FSDP<Block>`` classes), every
# parameter gathered whole ("final"), the EMA's weights ("ema", where the run has an EMA) and the (replicate, shard)
# degrees ("mesh"). A variant without FSDP trains under DDP (its weights are whole on each rank). A variant's
# optional "resume_from" [SOURCE, CHECKPOINT, FOLDER]: before it, rank 0 makes FOLDER hold what a run into SOURCE
# killed after CHECKPOINT (a file, or a sharded checkpoint's folder, "ep0-baN...") left: that checkpoint, ``latest``
# naming it, and its post-hoc EMA snapshots up to batch N.
FSDP_VARIANTS_HARNESS = r'''
import gc, json, os, shutil, sys
import torch
from composer.utils import dist
from diffusion.train.algorithms.ema import EMA, parameter_name
from diffusion.train.config import load_config
from diffusion.launch import parse_args
from diffusion.train.trainer import build_trainer

path, overrides = parse_args(sys.argv[1:])
for variant in json.loads(os.environ["VARIANTS"]):
    if variant.get("resume_from"):
        source, saved, folder = variant["resume_from"]
        if dist.get_global_rank() == 0:
            os.makedirs(folder)
            (shutil.copytree if os.path.isdir(os.path.join(source, saved)) else shutil.copy)(
                os.path.join(source, saved), os.path.join(folder, saved))
            os.symlink(saved, os.path.join(folder, "latest-rank0.pt"))
            upto = saved.split("-ba")[1].split("-")[0]
            if os.path.isdir(os.path.join(source, "posthoc")):  # the snapshots it had written by then
                shutil.copytree(os.path.join(source, "posthoc"), os.path.join(folder, "posthoc"),
                                ignore=lambda d, names: [n for n in names if f"-ba{upto}." not in n])
        dist.barrier()
    trainer = build_trainer(load_config(path, overrides + variant["overrides"]))
    model = trainer.state.model
    denoiser = getattr(model, "module", model).denoiser  # DDP wraps the whole model
    blocks = variant["blocks"]
    wrapped_blocks = sum(1 for m in denoiser.modules()
                         if type(m).__name__ == "FullyShardedDataParallel"
                         and type(m._fsdp_wrapped_module).__name__ in blocks)
    fsdp2_blocks = sum(1 for m in denoiser.modules() if type(m).__name__ in {"FSDP" + b for b in blocks})
    trainer.fit()
    record = {"blocks": wrapped_blocks + fsdp2_blocks}
    units = [m for m in denoiser.modules() if type(m).__name__ == "FullyShardedDataParallel"]
    meshes = [p.device_mesh for p in model.parameters() if hasattr(p, "device_mesh")]
    shard = units[0].process_group.size() if units else meshes[0].shape[-1] if meshes else 1
    record["mesh"] = (dist.get_world_size() // shard, shard)  # (replicate, shard): each weight's shard group
    if wrapped_blocks:  # Composer's FSDP1 wraps each child of the model (REPA's projector is a unit of its own)
        from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
        with FSDP.summon_full_params(model):
            record["final"] = {parameter_name(n): p.detach().clone() for n, p in model.named_parameters()}
    else:
        record["final"] = {parameter_name(n): (p.full_tensor() if hasattr(p, "full_tensor") else p).detach().clone()
                           for n, p in model.named_parameters()}
    for ema in [a for a in trainer.state.algorithms if isinstance(a, EMA)][:1]:
        record["ema"] = ema._ema_params(every_rank=False)  # gathered on rank 0, whatever the checkpoints' kind
        record["ema_state"] = {k: v for k, v in ema.state_dict().items() if k != "ema_params"}
    torch.save(record, os.path.join(os.environ["RECORD_DIR"], f"{variant['name']}-rank{dist.get_global_rank()}.pt"))
    trainer.close()
    del trainer, model, denoiser
    gc.collect()
'''
