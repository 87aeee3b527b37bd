"""Real FSDP on CPU: `composer -n 2` (gloo) with the product's trainer, tiny UNet, EMA and microbatches; and in
the same launch, last, two DDP ranks and ``run.py`` itself under FSDP2 (once test_multiprocess.py's own launch),
then ``run.py``'s sharded-checkpoint runs: autoresume, incomplete folders, refusals (once
test_sharded_checkpoints.py's own launch; see the section at the end).

One launch trains every variant in turn (startup dominates on 2 cores): FULL_SHARD and SHARD_GRAD_OP,
each without eval and with an eval of the raw and of the EMA weights after every batch, then a run whose rank 1 gets a NaN in the
first of its two microbatches; last, the same EMA check on a small model under FSDP2 (torch's
``fully_shard``, which Composer does not use here), straight from torch. A recorder hooks the UNet's
``conv_in`` and keeps the weight every forward computed with (inside FSDP's forward that is the
gathered, full parameter), so the test sees exactly what FSDP trained and evaluated on:

- with evals between steps, every training forward and the final weights equal the run without
  eval (the EMA is not left in FSDP's gathered parameters); the ``eval`` evaluator's forwards ran on
  the training weights, the ``eval_ema`` evaluator's on the EMA of the weights training saw;
- ``callbacks.optimizer_monitor`` logs, on both ranks, the norm of the whole gradient (as FSDP
  gathers it), not of the rank's shard;
- a NaN in a non-last microbatch on one rank stops both ranks at that batch, naming it, before its
  checkpoint: ``latest`` stays on the last finite one.

The harness is ``run.py``'s own path (``build_trainer`` on the YAML and overrides) plus the recorder;
``trainer.device=cpu`` with ``trainer.fsdp`` is FSDP over gloo (see ``trainer._fsdp_device``).
"""

import json
import os
import pickle
import shutil

import pytest
import torch

from diffusion.train.config import load_config
from train_fixtures import OpensWhenUnpickled, fit_in_process, launch_composer, tiny_overrides, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "yamls", "tiny-cpu.yaml")

HARNESS = r'''
import gc, json, os, shutil, sys, torch
from composer.core import Callback
from composer.loggers import InMemoryLogger
from composer.utils import dist
from torch.distributed.fsdp import FullyShardedDataParallel as FSDP
from diffusion.train.algorithms.ema import EMA, parameter_name
from diffusion.train.callbacks.nan_catcher import NonFiniteLossError
from diffusion.train.config import load_config
from diffusion.launch import parse_args
from diffusion.train.trainer import build_trainer

class Recorder(Callback):
    """The conv_in weight each forward computes with; a NaN into one microbatch's outputs on one rank."""
    def __init__(self, nan_at=None):
        self.forwards, self.nan_at, self.microbatch, self.full_grad_norms = [], nan_at, 0, []
    def hook(self, state):
        def pre_forward(module, args):
            mode = "train" if module.training else state.dataloader_label  # eval (raw) or eval_ema
            self.forwards.append((mode, int(state.timestamp.batch), module.weight.detach().clone()))
        return pre_forward
    def batch_start(self, state, logger):
        self.microbatch = 0
    def batch_end(self, state, logger):
        # the norm of the whole gradient of this batch, gathered by FSDP
        with FSDP.summon_full_params(state.model.denoiser, writeback=False, with_grads=True):
            grads = [p.grad.float().pow(2).sum() for p in state.model.denoiser.parameters() if p.grad is not None]
            self.full_grad_norms.append(torch.stack(grads).sum().sqrt().item())
    def after_forward(self, state, logger):
        self.microbatch += 1
        if self.nan_at and [int(state.timestamp.batch) + 1, self.microbatch, dist.get_global_rank()] == self.nan_at:
            state.outputs["prediction"] = state.outputs["prediction"] * float("nan")

def fsdp2(evaluate):
    """FSDP2 (torch's fully_shard; Composer here wraps with FSDP1) without resharding after forward,
    the EMA swapped in for an eval forward after every step: the weight each forward computed with."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.Tanh(), torch.nn.Linear(8, 1))
    mesh = init_device_mesh("cpu", (2,))
    fully_shard(model[0], mesh=mesh, reshard_after_forward=False)
    fully_shard(model, mesh=mesh, reshard_after_forward=False)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    x = torch.randn(4, 4, generator=torch.Generator().manual_seed(dist.get_global_rank()))
    ema, seen = EMA(smoothing=0.9, warmup=False), []
    ema._bind(model)
    ema._start_now()
    def record(module, args):
        weight = module.weight  # the unsharded tensor inside forward (a DTensor would be gathered)
        seen.append((weight.full_tensor() if hasattr(weight, "full_tensor") else weight).detach().clone())
    model[0].register_forward_pre_hook(record)
    for _ in range(3):
        ((model(x) - x.sum(1, keepdim=True)) ** 2).mean().backward()
        optimizer.step()
        optimizer.zero_grad()
        ema.update()
        if evaluate:
            with torch.no_grad(), ema.ema_weights(model):
                model(x)
    return seen

path, overrides = parse_args(sys.argv[1:])
out = os.environ["RECORD_DIR"]
for variant in json.loads(os.environ["VARIANTS"]):
    if variant.get("resume_from"):  # a "killed" run: its folder holds only an earlier run's checkpoint
        source, first, folder = variant["resume_from"]
        if dist.get_global_rank() == 0:
            os.makedirs(folder)
            shutil.copy(os.path.join(source, first), os.path.join(folder, first))
            os.symlink(first, os.path.join(folder, "latest-rank0.pt"))
        dist.barrier()
    trainer = build_trainer(load_config(path, overrides + variant["overrides"]))
    rank = dist.get_global_rank()
    model = trainer.state.model
    assert isinstance(model.denoiser, FSDP), type(model.denoiser)
    recorder = Recorder(variant.get("nan_at"))
    trainer.state.callbacks.insert(0, recorder)
    model.denoiser.conv_in.register_forward_pre_hook(recorder.hook(trainer.state))
    logged = InMemoryLogger()
    logged.init(trainer.state, trainer.logger)
    trainer.logger.destinations = (*trainer.logger.destinations, logged)
    record = {"error": None}
    try:
        trainer.fit()
    except NonFiniteLossError as e:
        record["error"] = str(e)
    if record["error"] is None:
        # the grad norms callbacks.optimizer_monitor logged, and the norm of the whole last gradient
        record["grad_norms"] = [v for _, v in logged.data["l2_norm/grad/global"]]
        record["grad_keys"] = sorted(k for k in logged.data if k.startswith("l2_norm/grad/"))
        record["full_grad_norms"] = recorder.full_grad_norms
        with FSDP.summon_full_params(model.denoiser):
            record["final"] = {parameter_name(n): p.detach().clone() for n, p in model.denoiser.named_parameters()}
        ema = [a for a in trainer.state.algorithms if isinstance(a, EMA)][0]
        record["ema"] = ema.state_dict()["ema_params"]
    record["forwards"] = recorder.forwards
    record["encodes_text"] = model.text_encoder is not None
    torch.save(record, os.path.join(out, f"{variant['name']}-rank{rank}.pt"))
    trainer.close()
    del trainer, model
    gc.collect()
torch.save({"plain": fsdp2(False), "eval": fsdp2(True)}, os.path.join(out, f"fsdp2-rank{rank}.pt"))

# Last, without FSDP: the entry point as above under DDP (DDP_ARGS, a JSON list) with a recorder of the sample
# indices each rank trains on; then run.py itself, executed as the launcher runs a script (as __main__, its sys.argv
# the command's: RUN_PY_ARGS, a JSON list).
import runpy
from diffusion import schema

class Seen(Callback):
    seen = []
    def before_forward(self, state, logger):
        self.seen += state.batch[schema.BATCH_SAMPLE_INDEX].tolist()

trainer = build_trainer(load_config(*parse_args(json.loads(os.environ["DDP_ARGS"]))))
seen = Seen()
trainer.state.callbacks.append(seen)
trainer.fit()
torch.save({"seen": seen.seen, "weights": trainer.state.model.module.state_dict()},
           os.path.join(out, f"ddp-rank{rank}.pt"))
trainer.close()
del trainer
gc.collect()
sys.argv = ["run.py", *json.loads(os.environ["RUN_PY_ARGS"])]
runpy.run_path(os.path.join(os.environ["ROOT"], "run.py"), run_name="__main__")

# Last, the sharded-checkpoint runs (``state_dict_type: sharded``): each rank runs ``run.py``'s own
# ``cli.run(main, "run.py", argv)`` for each step of STEPS (a JSON list of {"name", "argv", "before"}) in turn, its
# stdout and stderr (file descriptors 1 and 2: every print, warning and log line) in ``NAME-rankR.out``/``.err`` and
# its exit code (0, or the ``sys.exit`` code of a refusal) in ``NAME-rankR.rc``, and the step's save folder's listing
# after it in ``NAME.listing``, all in STEPS_DIR; ``before`` is done by rank 0 alone, between barriers (what a user
# would do between separate launches). A refused run's lock on its folder is closed after it, as its process's exit
# would (its file stays).
import contextlib, subprocess
from diffusion import cli
from diffusion.launch import main
from diffusion.train.save_folder import SaveFolderLock

steps_dir = os.environ["STEPS_DIR"]
holder = None


def cut(tmp):  # the first run's folder copied as "straight" (its newest two); then batch 4's folder: a shard
    folder = os.path.join(tmp, "resumed")  # cut short; batch 5's: a save killed before its index was written
    shutil.copytree(folder, os.path.join(tmp, "straight"), symlinks=True, ignore=shutil.ignore_patterns("ep0-ba3"))
    shard = os.path.join(folder, "ep0-ba4", "__1_0.distcp")
    with open(shard, "r+b") as f:
        f.truncate(os.path.getsize(shard) // 2)
    shutil.rmtree(os.path.join(folder, "ep0-ba5"))
    os.mkdir(os.path.join(folder, "ep0-ba5"))
    shutil.copy(os.path.join(folder, "ep0-ba3", "__0_0.distcp"), os.path.join(folder, "ep0-ba5", "__0_0.distcp"))


def unreadable(tmp):  # the straight folder's checkpoints, none with its index
    folder = os.path.join(tmp, "cut")
    shutil.copytree(os.path.join(tmp, "straight"), folder, symlinks=True)
    for name in os.listdir(folder):
        if name.startswith("ep0-ba"):
            os.remove(os.path.join(folder, name, ".metadata"))


def hold(tmp):  # a live process holding the straight folder's lock
    global holder
    holder = subprocess.Popen([sys.executable, "-c", (
        "import fcntl, json, os, socket, sys, time\n"
        f"fd = os.open({os.path.join(tmp, 'straight', '.run.lock')!r}, os.O_RDWR | os.O_CREAT)\n"
        "fcntl.flock(fd, fcntl.LOCK_EX)\n"
        "os.write(fd, json.dumps({'pid': os.getpid(), 'host': socket.gethostname(), 'command': 'holder'}).encode())\n"
        "print('held', flush=True)\n"
        "time.sleep(300)\n")], stdout=subprocess.PIPE, text=True)
    assert holder.stdout.readline().strip() == "held"
    with open(os.path.join(steps_dir, "holder.pid"), "w") as f:
        f.write(str(holder.pid))


@contextlib.contextmanager
def recorded(name):
    sys.stdout.flush(), sys.stderr.flush()
    saved = os.dup(1), os.dup(2)
    path = os.path.join(steps_dir, f"{name}-rank{rank}")
    with open(path + ".out", "w") as o, open(path + ".err", "w") as e:
        os.dup2(o.fileno(), 1), os.dup2(e.fileno(), 2)
        try:
            yield
        finally:
            sys.stdout.flush(), sys.stderr.flush()
            os.dup2(saved[0], 1), os.dup2(saved[1], 2)
            os.close(saved[0]), os.close(saved[1])


try:
    for step in json.loads(os.environ["STEPS"]):
        if step.get("before"):
            if rank == 0:
                globals()[step["before"]](steps_dir)
            dist.barrier()
        code = 0
        with recorded(step["name"]):
            try:
                cli.run(main, "run.py", step["argv"])
            except SystemExit as e:
                code = e.code if isinstance(e.code, int) else 1
        with open(os.path.join(steps_dir, f"{step['name']}-rank{rank}.rc"), "w") as f:
            f.write(str(code))
        for lock in [o for o in gc.get_objects() if isinstance(o, SaveFolderLock) and o._fd is not None]:
            os.close(lock._fd)
            lock._fd = None
        folder = [a.split("=", 1)[1] for a in step["argv"] if a.startswith("trainer.save_folder=")][-1]
        if rank == 0 and folder != "null":
            with open(os.path.join(steps_dir, f"{step['name']}.listing"), "w") as f:
                json.dump(sorted(os.listdir(folder)), f)
        dist.barrier()
finally:
    if holder is not None:
        holder.kill()
        holder.wait()
'''

STRATEGIES = ("FULL_SHARD", "SHARD_GRAD_OP")
# the first test runs the file's one launch (11 runs and 6 sharded steps in turn): 5-8 min beside the other
# worker, more in a loaded CI
pytestmark = pytest.mark.timeout(2100)


@pytest.fixture(scope="module")
def fsdp_runs(train_kit, tiny_kit, tmp_path_factory):
    """Launch once: every variant, both ranks; returns (record dir, checkpoint folder of the NaN run)."""
    tmp = tmp_path_factory.mktemp("fsdp")
    mds = write_latent_mds(str(tmp / "mds"), kit=train_kit, n=48)
    # the same rows stored as token ids (--text ids): the kill-and-resume runs encode text in the step
    ids = write_latent_mds(str(tmp / "ids"), kit=train_kit, n=48, text_encoder=tiny_kit, text="ids")
    held_out = write_latent_mds(str(tmp / "eval"), kit=train_kit, n=8, seed=1)
    ckpt = tmp / "ckpt"
    # 3 batches of 8 (4 per rank, 2 microbatches of 2); lr high and EMA slow so that the EMA and the
    # training weights are far apart after one step.
    common = tiny_overrides(train_kit, mds, batches=3, batch_size=8, extra=(
        "trainer.device_train_microbatch_size=2", "optimizer.lr=1e-2", "algorithms.ema.smoothing=0.9",
        "algorithms.ema.start=0ba", "algorithms.ema.warmup=false",
        "callbacks={nan_catcher: {}, optimizer_monitor: {batch_log_interval: 1}}"))
    evaluated = [f"data.eval={{path: {held_out}, batch_size: 4, num_workers: 0}}", "trainer.eval_interval=1ba",
                 "trainer.eval_subset_num_batches=1"]
    variants = []
    for strategy in STRATEGIES:
        fsdp = f"trainer.fsdp={{sharding_strategy: {strategy}}}"
        variants += [{"name": f"{strategy}-plain", "overrides": [fsdp]},
                     {"name": f"{strategy}-eval", "overrides": [fsdp, *evaluated]}]
    # Rank 1's first microbatch of batch 3 turns NaN; a checkpoint after every batch.
    variants.append({"name": "nan", "nan_at": [3, 1, 1], "overrides": [
        "trainer.fsdp={sharding_strategy: SHARD_GRAD_OP}", f"trainer.save_folder={ckpt}", "trainer.save_interval=1ba"]})
    # Kill-and-resume: 4 batches straight (checkpoints at 2 and 4), and a run that autoresumes from the
    # straight run's batch-2 checkpoint alone (as if killed after it) to batch 4.
    for name, folder in (("straight", tmp / "straight"), ("resumed", tmp / "resumed")):
        variants.append({"name": name, "resume_from": [str(tmp / "straight"), "ep0-ba2-rank0.pt", str(folder)]
                         if name == "resumed" else None, "overrides": [
            "trainer.fsdp={sharding_strategy: FULL_SHARD}", f"trainer.save_folder={folder}", f"data.train.path={ids}",
            "trainer.save_interval=2ba", "trainer.max_duration=4ba", "trainer.autoresume=true"]})
    ddp_args, run_py_args = _ddp_args(train_kit, tmp), _run_py_args(train_kit, tmp)
    (tmp / "ddp-args.json").write_text(json.dumps(ddp_args))
    (tmp / "run-py-args.json").write_text(json.dumps(run_py_args))
    steps = _sharded_steps(train_kit, tmp / "sharded")
    result = launch_composer(tmp / "harness.py", HARNESS, ["yamls/tiny-cpu.yaml", *common], timeout=1800,
                             env={"RECORD_DIR": str(tmp), "VARIANTS": json.dumps(variants), "ROOT": ROOT,
                                  "DDP_ARGS": json.dumps(ddp_args), "RUN_PY_ARGS": json.dumps(run_py_args),
                                  "STEPS_DIR": str(tmp / "sharded"), "STEPS": json.dumps(steps)})
    assert result.returncode == 0, result.stdout[-4000:] + result.stderr[-4000:]
    return tmp, ckpt


def _ddp_args(train_kit, tmp):
    """The DDP run's command line: a mix of two datasets, 4 global batches of 16, a checkpoint at the end."""
    mds = write_latent_mds(str(tmp / "ddp-mds"), kit=train_kit, n=32)
    other = write_latent_mds(str(tmp / "ddp-other"), kit=train_kit, n=32, seed=1)
    # input perturbation and offset noise on: every kind of draw takes part
    return ["yamls/tiny-cpu.yaml", *tiny_overrides(train_kit, mds, batches=4, batch_size=16,
                                                  save_folder=str(tmp / "ddp-ckpt"),
                                                  extra=("model.offset_noise=0.1", "model.input_perturbation=0.1",
                                                         "data.train.shuffle=false", "algorithms={}",
                                                         # Adam with a large eps: smooth in the gradient
                                                         # (see below), so float error stays float error
                                                         "optimizer.eps=1.0", "optimizer.lr=0.1",
                                                         "data.train.path=null",
                                                         f"data.train.streams=[{{path: {mds}}}, {{path: {other}}}]")),
            "trainer.save_interval=4ba"]


def _run_py_args(train_kit, tmp):
    """run.py's command line under FSDP2: 3 global batches of 8, two microbatches a rank, EMA, a full checkpoint."""
    mds = write_latent_mds(str(tmp / "run-py-mds"), kit=train_kit, n=32)
    # Adam with eps = 1: smooth in the gradient (see test_two_ranks_read_disjoint_samples_and_agree), and
    # no clipping, which would hide gradients of the wrong size
    return ["yamls/tiny-cpu.yaml", *tiny_overrides(train_kit, mds, batches=3, batch_size=8,
                                                   extra=("data.train.shuffle=false", "optimizer.eps=1.0",
                                                          "optimizer.lr=0.1", "trainer.grad_clip_norm=null")),
            "trainer.fsdp.version=2", "trainer.fsdp.sharding_strategy=SHARD_GRAD_OP",
            "trainer.device_train_microbatch_size=2", f"trainer.save_folder={tmp / 'run-py-ckpt'}",
            "trainer.save_interval=3ba"]


def _sharded_steps(train_kit, tmp):
    """The sharded-checkpoint steps, in turn: a 5-batch sharded run keeping 3 checkpoints (its batch 5 is the straight
    run's weights; a copy keeping the newest two is the "straight" folder), then cut: batch 4's shard cut short,
    batch 5's save never finished; resumed to 5 under the same command, keeping 2. Then a copy of the straight
    folder without the checkpoints' indexes, refused and then started fresh; a run into the straight folder while
    another process holds its lock; last, a run whose ``trainer.load_path`` is a sharded checkpoint whose index
    would run code when unpickled (``tmp/hostile/ep0-ba5``; its payload would create ``tmp/ran``)."""
    tmp.mkdir()
    mds = write_latent_mds(str(tmp / "mds"), kit=train_kit, n=48)
    # a refused run's dataset is never closed (streaming refuses its folder to a second dataset in the process)
    copies = [str(shutil.copytree(mds, tmp / name)) for name in ("mds-refused", "mds-locked", "mds-hostile")]
    import torch.distributed.checkpoint as dcp
    hostile = tmp / "hostile" / "ep0-ba5"  # a .metadata that calls open() when unpickled, beside real shards
    dcp.save({"weight": torch.ones(2), "step": 5}, checkpoint_id=str(hostile))
    with open(hostile / ".metadata", "wb") as f:
        pickle.dump(OpensWhenUnpickled(str(tmp / "ran")), f)
    keep3 = "trainer.save_num_checkpoints_to_keep=3"
    return [{"name": "first", "argv": _sharded_args(train_kit, mds, tmp / "resumed", 5, keep3)},
            {"name": "resumed", "argv": _sharded_args(train_kit, mds, tmp / "resumed", 5), "before": "cut"},
            {"name": "refused", "argv": _sharded_args(train_kit, copies[0], tmp / "cut", 6), "before": "unreadable"},
            {"name": "fresh", "argv": _sharded_args(train_kit, mds, tmp / "cut", 1, "trainer.start_fresh=true")},
            {"name": "second", "argv": _sharded_args(train_kit, copies[1], tmp / "straight", 6), "before": "hold"},
            {"name": "hostile", "argv": [TINY, "trainer.device=cpu", f"trainer.load_path={hostile}",
                                         "trainer.max_duration=1ba", "trainer.save_folder=null",
                                         "trainer.autoresume=false", f"data.train.path={copies[2]}",
                                         "data.train.batch_size=8", f"model.ref={train_kit}", "algorithms={}",
                                         "callbacks={}", "loggers={}"]}]


def _sharded_args(kit, mds, folder, batches, *extra):
    return [TINY, *tiny_overrides(kit, mds, batches=batches, save_folder=str(folder), extra=(
        "trainer.device=cpu", "trainer.fsdp={state_dict_type: sharded, sharding_strategy: FULL_SHARD}",
        "algorithms={}", "trainer.autoresume=true", "trainer.save_interval=1ba",
        "trainer.save_num_checkpoints_to_keep=2", *extra))]


def _load(tmp, name, rank=0):
    return torch.load(tmp / f"{name}-rank{rank}.pt", weights_only=False)


def _forwards(record, mode):
    """conv_in weights by batch index (0-based: the batch being trained, or the batches done at eval)."""
    out = {}
    for m, batch, weight in record["forwards"]:
        if m == mode:
            out.setdefault(batch, []).append(weight)
    return out


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_an_ema_eval_between_steps_leaves_training_unchanged(fsdp_runs, strategy):
    tmp, _ = fsdp_runs
    plain, evaluated = _load(tmp, f"{strategy}-plain"), _load(tmp, f"{strategy}-eval")
    train_plain, train_eval = _forwards(plain, "train"), _forwards(evaluated, "train")
    assert sorted(train_plain) == sorted(train_eval) == [0, 1, 2]
    for batch in train_plain:
        assert len(train_eval[batch]) == 2  # both microbatches
        for weight in train_eval[batch]:  # the forward after an eval computes with the training weights
            torch.testing.assert_close(weight, train_plain[batch][0], rtol=1e-5, atol=1e-6,
                                       msg=f"{strategy}: training forward of batch {batch} after an eval")
    for name, tensor in plain["final"].items():
        torch.testing.assert_close(evaluated["final"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    for name, tensor in plain["ema"].items():
        torch.testing.assert_close(evaluated["ema"][name], tensor, rtol=1e-5, atol=1e-6, msg=name)
    assert not _forwards(plain, "eval") and not _forwards(plain, "eval_ema")

    # The raw evaluator ran on the weights training computed with; the EMA evaluator on their EMA
    # (smoothing 0.9, started at fit start).
    weights = [train_plain[b][0] for b in (0, 1, 2)] + [plain["final"]["conv_in.weight"]]
    raw = _forwards(evaluated, "eval")
    assert sorted(raw) == [1, 2, 3]
    for batch, seen in raw.items():
        torch.testing.assert_close(seen[0], weights[batch], rtol=1e-5, atol=1e-6, msg=f"raw eval after batch {batch}")
    ema, expected = weights[0].clone(), {}
    for batch in (1, 2, 3):
        ema = 0.9 * ema + 0.1 * weights[batch]
        expected[batch] = ema
    evals = _forwards(evaluated, "eval_ema")
    assert sorted(evals) == [1, 2, 3]
    for batch, seen in evals.items():
        torch.testing.assert_close(seen[0], expected[batch], rtol=1e-5, atol=1e-6, msg=f"eval after batch {batch}")
        assert not torch.allclose(seen[0], weights[batch], atol=1e-4)  # really not the training weights
    torch.testing.assert_close(plain["ema"]["denoiser.conv_in.weight"], expected[3], rtol=1e-5, atol=1e-6)


@pytest.mark.slow
@pytest.mark.parametrize("strategy", STRATEGIES)
def test_the_logged_grad_norm_is_the_whole_gradients_on_every_rank(fsdp_runs, strategy):
    """callbacks.optimizer_monitor under FSDP: each rank holds a shard of the gradient; both log the
    norm of all of it (Composer's own OptimizerMonitor logs each rank's shard with torch's AdamW)."""
    tmp, _ = fsdp_runs
    rank0, rank1 = _load(tmp, f"{strategy}-plain", 0), _load(tmp, f"{strategy}-plain", 1)
    assert len(rank0["grad_norms"]) == 3 and rank0["grad_norms"] == rank1["grad_norms"]
    assert rank0["grad_keys"] == rank1["grad_keys"] and "l2_norm/grad/denoiser.conv_in.weight" in rank0["grad_keys"]
    assert rank0["grad_norms"] == pytest.approx(rank0["full_grad_norms"], rel=1e-4)
    assert all(n > 0 for n in rank0["grad_norms"])


@pytest.mark.slow
def test_fsdp2_an_ema_eval_between_steps_leaves_training_unchanged(fsdp_runs):
    tmp, _ = fsdp_runs
    for rank in (0, 1):
        runs = _load(tmp, "fsdp2", rank)
        plain, evaluated = runs["plain"], runs["eval"]  # forwards: t0 t1 t2 / t0 e1 t1 e2 t2 e3
        assert len(plain) == 3 and len(evaluated) == 6
        for step in range(3):
            torch.testing.assert_close(evaluated[2 * step], plain[step], rtol=1e-6, atol=1e-7)
        ema = plain[0]
        for step in (1, 2):
            ema = 0.9 * ema + 0.1 * plain[step]
            torch.testing.assert_close(evaluated[2 * step - 1], ema, rtol=1e-5, atol=1e-6)
            assert not torch.allclose(evaluated[2 * step - 1], plain[step], atol=1e-4)


@pytest.mark.slow
def test_a_nan_in_one_ranks_first_microbatch_stops_both_before_its_checkpoint(fsdp_runs):
    tmp, ckpt = fsdp_runs
    for rank in (0, 1):
        error = _load(tmp, "nan", rank)["error"]
        assert error is not None, f"rank {rank} did not stop"
        assert "loss is NaN" in error and "at batch index 2 (batch 3 of the run" in error, error
        assert "microbatch 1 of 2 on rank 1" in error, error
    names = sorted(os.listdir(ckpt))
    assert "ep0-ba2-rank0.pt" in names and not any("ba3" in n for n in names), names
    assert os.readlink(ckpt / "latest-rank0.pt") == "ep0-ba2-rank0.pt"
    # ...and what it holds is whole and finite: the full weights, and the EMA gathered from both ranks.
    state = torch.load(ckpt / "ep0-ba2-rank0.pt", weights_only=False)["state"]
    weights = {k: v for k, v in state["model"].items() if k.startswith("denoiser.")}
    ema = dict(state["algorithms"])["EMA"]["ema_params"]
    assert ema.keys() == weights.keys()
    for name, tensor in weights.items():
        assert ema[name].shape == tensor.shape, name
        assert torch.isfinite(tensor).all() and torch.isfinite(ema[name]).all(), name


@pytest.mark.slow
def test_kill_and_resume_under_fsdp_equals_a_straight_run(fsdp_runs):
    """4 batches straight == 2, killed, autoresumed from the batch-2 checkpoint, 2 more: the same
    training forwards, final weights, EMA and optimizer state (FULL_SHARD, full checkpoints), training
    from token ids (each rank's frozen text encoder, outside FSDP's wrapping, encodes its batches)."""
    tmp, _ = fsdp_runs
    for rank in (0, 1):
        straight, resumed = _load(tmp, "straight", rank), _load(tmp, "resumed", rank)
        assert straight["encodes_text"] and resumed["encodes_text"]
        assert not _load(tmp, "FULL_SHARD-plain", rank)["encodes_text"]
        assert sorted(_forwards(resumed, "train")) == [2, 3]  # it did not redo batches 1-2
        for batch, weights in _forwards(resumed, "train").items():
            torch.testing.assert_close(weights[0], _forwards(straight, "train")[batch][0], rtol=1e-5, atol=1e-6)
        for key in ("final", "ema"):
            for name, tensor in straight[key].items():
                torch.testing.assert_close(resumed[key][name], tensor, rtol=1e-5, atol=1e-6, msg=f"{key} {name}")
    states = [torch.load(tmp / run / "ep0-ba4-rank0.pt", weights_only=False)["state"] for run in ("straight", "resumed")]
    optimizers = [next(iter(state["optimizers"].values()))["state"] for state in states]
    assert optimizers[0].keys() == optimizers[1].keys() and optimizers[0]
    # Adam's two moments are saved as themselves, not one aliased to the other
    assert not any(torch.equal(m["exp_avg"], m["exp_avg_sq"]) for m in optimizers[0].values())
    for name, moments in optimizers[0].items():
        for key, value in moments.items():
            torch.testing.assert_close(optimizers[1][name][key], value, rtol=1e-5, atol=1e-7, msg=f"{name} {key}")


# ---- without FSDP: DDP's ranks, and run.py under FSDP2 (the same launch, last) -------------------------------

def _fit_one_process(args: list[str]):
    """Train in this process: the sample indices of each batch (sorted) and the final weights."""
    weights, batches = fit_in_process(load_config(args[0], args[1:]))
    return [sorted(b) for b in batches], weights


@pytest.mark.slow
def test_two_ranks_read_disjoint_samples_and_agree(fsdp_runs):
    """Two DDP ranks split each global batch; the result equals one process training the same global
    batches whole or in microbatches of 4 or 8: the noise is the sample's, not the split's. The data is
    a mix of two datasets (data.train.streams), so the mix's partitioning across ranks is covered too."""
    tmp, _ = fsdp_runs
    args = json.loads((tmp / "ddp-args.json").read_text())
    r0, r1 = (torch.load(tmp / f"ddp-rank{r}.pt", weights_only=False) for r in (0, 1))
    assert len(r0["seen"]) == len(r1["seen"]) == 4 * 8  # 4 batches of 16 global = 8 per rank
    assert not set(r0["seen"]) & set(r1["seen"])  # disjoint
    assert len(set(r0["seen"]) | set(r1["seen"])) == 64  # together: one epoch, each sample once
    for name, tensor in r0["weights"].items():
        if name != "_extra_state":
            torch.testing.assert_close(r1["weights"][name], tensor, rtol=0, atol=0, msg=name)
    assert os.path.exists(tmp / "ddp-ckpt" / "latest-rank0.pt")

    two_rank_batches = [sorted(r0["seen"][i:i + 8] + r1["seen"][i:i + 8]) for i in range(0, 32, 8)]
    one_process = [a for a in args if not a.startswith("trainer.save_folder")] + ["trainer.save_folder=null"]
    for microbatch in ("null", 4, 8):
        batches, weights = _fit_one_process(one_process + [f"trainer.device_train_microbatch_size={microbatch}"])
        assert batches == two_rank_batches, microbatch  # the same global batches ...
        # ... give the same weights, to float tolerance. (Summation order differs between the splits; with
        # Adam's usual eps, a near-zero gradient's sign decides a whole lr-sized first step, so this test
        # uses eps = 1, where the step is continuous in the gradient.)
        for name, tensor in r0["weights"].items():
            if name != "_extra_state":
                torch.testing.assert_close(weights[name], tensor, rtol=1e-5, atol=1e-7,
                                           msg=lambda m: f"microbatch {microbatch}: {name}: {m}")


@pytest.mark.slow
def test_fsdp2_trains_as_one_process_does_with_ema_and_a_full_checkpoint(fsdp_runs):
    """``composer -n 2 run.py ...``, the product's own entry point (run.py run as the launcher runs it) with
    ``trainer.fsdp.version=2`` (torch's fully_shard through Composer), as the SD2 YAMLs allow it: two
    CPU ranks, EMA, two microbatches per rank train the weights one process trains on the same global
    batches (gradients averaged over the ranks, not summed), and the checkpoint holds them whole with
    the EMA."""
    from diffusion.models.checkpoint import load_denoiser
    tmp, _ = fsdp_runs
    run_py = json.loads((tmp / "run-py-args.json").read_text())
    ema, _, ema_used = load_denoiser(str(tmp / "run-py-ckpt" / "latest-rank0.pt"))
    raw, _, _ = load_denoiser(str(tmp / "run-py-ckpt" / "latest-rank0.pt"), ema=False)
    assert ema_used and not torch.equal(ema.conv_in.weight, raw.conv_in.weight)

    common = run_py[:run_py.index("trainer.fsdp.version=2")]  # one process: the same run without FSDP
    _, one_process = _fit_one_process(common)
    for name, tensor in raw.state_dict().items():
        torch.testing.assert_close(tensor, one_process["denoiser." + name], rtol=1e-5, atol=1e-7, msg=name)


# ---- sharded checkpoints (``state_dict_type: sharded``): run.py's own command, the same launch, last --------------
# What autoresume does with them (it used to find none, remove ``latest`` and start over at batch 1): it resumes from
# the last complete checkpoint folder and trains the weights a straight run trains; a folder whose save never
# finished (no ``.metadata``) or whose shard was cut is set aside as ``<name>.incomplete``, never deleted; pruning
# counts the checkpoints earlier runs left; a folder holding only unreadable checkpoints is refused in one line
# instead of starting over, unless ``trainer.start_fresh=true``; the save folder's lock refuses a second run; a
# hostile ``.metadata`` is refused in one line and runs nothing (tests/train/test_sharded_checkpoints.py: the reader).

def _error_lines(result):
    return [line for line in (result.stderr + result.stdout).splitlines() if ": error: " in line]


def _weights(folder):
    """The model tensors of a sharded checkpoint folder, read in this (single) process."""
    import tempfile
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    with tempfile.TemporaryDirectory() as scratch:
        out = os.path.join(scratch, "whole.pt")
        dcp_to_torch_save(str(folder), out)
        state = torch.load(out, weights_only=False)["state"]["model"]
    return {k: v for k, v in state.items() if isinstance(v, torch.Tensor)}


class Step:
    """One step's record: ``returncodes`` (each rank's), ``stdout`` and ``stderr`` (rank 0's, as a launch prints
    them), ``err`` (each rank's stderr), ``listing`` (its save folder's names after it)."""

    def __init__(self, out, name):
        listing = out / f"{name}.listing"
        self.listing = json.loads(listing.read_text()) if listing.exists() else None
        self.returncodes = [int((out / f"{name}-rank{r}.rc").read_text()) for r in (0, 1)]
        self.stdout = (out / f"{name}-rank0.out").read_text()
        self.err = [(out / f"{name}-rank{r}.err").read_text() for r in (0, 1)]
        self.stderr = self.err[0]


@pytest.fixture(scope="module")
def runs(fsdp_runs):
    """The sharded steps' records (see _sharded_steps): {"tmp": their folder, "holder": the lock holder's pid,
    "hostile_index": the hostile checkpoint, and each step's Step by name}."""
    tmp = fsdp_runs[0] / "sharded"
    names = ("first", "resumed", "refused", "fresh", "second", "hostile")
    return {"tmp": tmp, "holder": int((tmp / "holder.pid").read_text()), "hostile_index": tmp / "hostile" / "ep0-ba5",
            **{name: Step(tmp, name) for name in names}}


@pytest.mark.slow
def test_autoresume_continues_a_sharded_run_from_its_last_complete_checkpoint(runs):
    first, resumed, folder = runs["first"], runs["resumed"], runs["tmp"] / "resumed"
    assert first.returncodes == [0, 0], first.stderr[-4000:]
    assert resumed.returncodes == [0, 0], resumed.stderr[-4000:]
    assert not any("Traceback" in err for err in resumed.err)
    assert first.listing == ["ep0-ba3", "ep0-ba4", "ep0-ba5", "latest-rank0.pt"]  # 1 and 2 pruned
    assert f"set aside {folder / 'ep0-ba4'} as ep0-ba4.incomplete: its shard __1_0.distcp is cut short" in resumed.stderr
    assert f"set aside {folder / 'ep0-ba5'} as ep0-ba5.incomplete: no .metadata" in resumed.stderr
    assert f"resuming from {folder / 'ep0-ba3'} at batch 3" in resumed.stdout
    assert f"done: trained to batch 5 of 5ba; checkpoint: {folder / 'ep0-ba5'}" in resumed.stdout
    # the newest two, the first run's batch 3 counted and pruned; the set-aside ones kept
    assert sorted(os.listdir(folder)) == ["ep0-ba4", "ep0-ba4.incomplete", "ep0-ba5", "ep0-ba5.incomplete",
                                          "latest-rank0.pt"]
    assert os.readlink(folder / "latest-rank0.pt") == "ep0-ba5"
    straight, ours = _weights(runs["tmp"] / "straight" / "ep0-ba5"), _weights(folder / "ep0-ba5")
    assert straight.keys() == ours.keys() and straight
    for name, tensor in straight.items():
        torch.testing.assert_close(ours[name], tensor, rtol=1e-5, atol=1e-6, msg=name)


@pytest.mark.slow
def test_a_folder_of_unreadable_checkpoints_is_refused_unless_asked_to_start_fresh(runs):
    folder, refused, fresh = runs["tmp"] / "cut", runs["refused"], runs["fresh"]
    assert refused.returncodes == [2, 2], refused.stderr[-4000:]  # every rank refuses (exit 2)
    assert not any("Traceback" in err for err in refused.err)
    [line] = _error_lines(refused)[:1]
    assert f"trainer.save_folder={folder} holds checkpoints autoresume cannot read" in line
    assert "set trainer.start_fresh=true" in line
    assert not any(n.startswith("ep0-ba") and not n.endswith(".incomplete") for n in refused.listing)
    assert fresh.returncodes == [0, 0], fresh.stderr[-4000:]
    assert "resuming from" not in fresh.stdout
    assert sorted(n for n in os.listdir(folder) if n.endswith(".incomplete")) == ["ep0-ba4.incomplete",
                                                                                 "ep0-ba5.incomplete"]
    assert os.readlink(folder / "latest-rank0.pt") == "ep0-ba1"


@pytest.mark.slow
def test_a_second_run_into_a_sharded_runs_folder_is_refused(runs):
    """The lock is the same for sharded runs: a live holder (here a process holding ``.run.lock``)
    refuses the second run at start, before any rank trains."""
    folder, second = runs["tmp"] / "straight", runs["second"]
    assert second.returncodes == [2, 2], second.stderr[-4000:]
    [line] = _error_lines(second)[:1]
    assert f"trainer.save_folder={folder} is in use by another run (pid {runs['holder']}" in line
    assert os.readlink(folder / "latest-rank0.pt") == "ep0-ba5"


@pytest.mark.slow
def test_a_sharded_load_path_that_would_run_code_is_refused_in_one_line_before_any_rank_reads_it(runs):
    """Through the command (the launch's last run): every rank refuses ``trainer.load_path`` in one line, and the
    index's payload never runs."""
    hostile = runs["hostile"]
    assert hostile.returncodes == [2, 2], hostile.stderr[-3000:]
    assert not any("Traceback" in err for err in hostile.err)
    [line] = _error_lines(hostile)
    assert line.startswith(f"run.py: error: {runs['hostile_index'] / '.metadata'}: refused"), line
    assert not (runs["tmp"] / "ran").exists()
