"""Two "nodes" on one machine: ``composer --world_size 2 --node_rank 0|1 -n 1`` (gloo, the tiny flow MMDiT),
one launched with the README's command-line form, the other with its environment-variable form. A run
on a save folder both nodes see (as NFS), each node in its own working directory, is killed (SIGKILL to
every process of both nodes), relaunched, and ends with the weights one process trains straight
(streaming's ``num_canonical_nodes`` pinned, so the node count does not set the sample order); a run on
s3:// (moto's server) resumes from a checkpoint Composer never pointed ``latest`` at; a node-local save
folder is refused in one line. Each node has its own ``TMPDIR``; its own
``/dev/shm`` needs a mount namespace, which the suite does not have, so both nodes share the machine's.
"""

import json
import logging
import os
import re
import shutil
import signal
import subprocess
import sys
import tempfile

import pytest
import torch

from diffusion.train.config import load_config
from train_fixtures import fit_in_process, free_port, tiny_overrides, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
YAML = os.path.join(ROOT, "yamls", "tiny-mmdit-flow-cpu.yaml")

# One process per node runs several runs in turn (VARIANTS, a JSON list), as the product builds them: each
# trains with its overrides and records what it did (in RECORD_DIR, after each run: a launch's records add
# to an earlier launch's). "stop_at" stops it at the end of that batch on every rank, after the checkpoint
# before it: with "kill", by SIGKILL to the whole node (its launcher, rank and their children), as a lost node
# leaves the save folder (so it is the last run of its launch), else by an exception.
HARNESS = '''
import gc, json, os, signal, sys, time


def main():  # imports in here: Composer's S3 uploader spawns processes, which import this file's top
    import torch
    from composer.core import Callback
    from composer.utils import dist
    from diffusion.errors import UserError
    from diffusion.train.config import load_config
    from diffusion.train.trainer import build_trainer

    records = {}

    def save_records():
        path = os.path.join(os.environ["RECORD_DIR"], f"rank{dist.get_global_rank()}.pt")
        earlier = torch.load(path, weights_only=False) if os.path.exists(path) else {}
        torch.save({**earlier, **records}, path)

    class Stopped(Exception):
        pass

    class Stop(Callback):
        def __init__(self, variant, record):
            self.at, self.kill, self.record = variant.get("stop_at"), variant.get("kill"), record

        def batch_end(self, state, logger):  # before Composer's checkpoint saver's (the Trainer adds it last)
            if int(state.timestamp.batch) != self.at:
                return
            self.record["stopped"] = self.at
            if not self.kill:
                raise Stopped()
            save_records()
            dist.barrier()  # every rank has recorded before any node goes
            time.sleep(0.5)  # and has the barrier's last message (a peer gone mid-collective is an error)
            os.killpg(os.getpgid(0), signal.SIGKILL)

    base = sys.argv[1:]
    for variant in json.loads(os.environ["VARIANTS"]):
        cfg = load_config(base[0], base[1:] + variant["overrides"])
        record = records.setdefault(variant["name"], {})
        try:
            trainer = build_trainer(cfg, extra_callbacks=[Stop(variant, record)])
        except UserError as e:
            record["error"] = str(e)
            save_records()
            continue
        record["resumed_from"] = int(trainer.state.timestamp.batch)
        try:
            trainer.fit()
            record["finished"] = int(trainer.state.timestamp.batch)
            if hasattr(trainer.state.model, "module"):  # DDP's (an FSDP2 run's are shards: not recorded)
                record["weights"] = {k: v.clone() for k, v in trainer.state.model.module.state_dict().items()
                                    if k != "_extra_state"}
        except Stopped:
            pass
        trainer.close()
        del trainer
        gc.collect()
        save_records()


if __name__ == "__main__":
    main()
'''


def launch_two_nodes(tmp_path, args: list[str], *, env: dict, timeout: float = 600):
    """Node 0 as ``composer --world_size 2 --node_rank 0 -n 1 --master_addr ... --master_port ...``, node 1 as
    ``WORLD_SIZE=2 NODE_RANK=1 MASTER_ADDR=... MASTER_PORT=... composer -n 1``, each in its own working
    directory with its own TMPDIR, on a master port from the OS, each node in a process group of its own that is
    killed whole (the launcher and its rank) if the test times out or fails; returns [(returncode, output)] of both."""
    harness = tmp_path / "harness.py"
    harness.write_text(HARNESS)
    composer = os.path.join(os.path.dirname(sys.executable), "composer")
    base = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", "NODE_RANK", "LOCAL_WORLD_SIZE",
                                                             "MASTER_ADDR", "MASTER_PORT", "RANK", "BASE_RANK")}
    base.update(PYTHONPATH=ROOT, OMP_NUM_THREADS="1", RECORD_DIR=str(tmp_path), **env)
    processes, temporaries, port = [], [], free_port()
    for node in (0, 1):
        # a short TMPDIR: multiprocessing's sockets in it (Composer's uploader) must fit AF_UNIX's 108 bytes
        work, tmp = tmp_path / f"node{node}", tempfile.mkdtemp(prefix=f"node{node}-")
        work.mkdir(exist_ok=True)  # a second launch: the same node's directory
        temporaries.append(tmp)
        node_env = dict(base, TMPDIR=tmp)
        if node == 0:
            command = [composer, "--world_size", "2", "--node_rank", "0", "-n", "1", "--master_addr", "127.0.0.1",
                       "--master_port", str(port)]
        else:
            node_env.update(WORLD_SIZE="2", NODE_RANK="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
            command = [composer, "-n", "1"]
        processes.append(subprocess.Popen([*command, str(harness), *args], cwd=work, env=node_env,
                                          stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                          start_new_session=True))
    results = []
    try:
        for process in processes:
            out, _ = process.communicate(timeout=timeout)
            results.append((process.returncode, out))
    finally:
        for process in processes:
            if process.poll() is None:
                try:
                    os.killpg(process.pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
                process.wait()
        for tmp in temporaries:
            shutil.rmtree(tmp, ignore_errors=True)
    return results


def _fail(results) -> str:
    return "\n".join(f"--- node {n} rc {rc}\n{out[-3000:]}" for n, (rc, out) in enumerate(results))


@pytest.fixture
def s3_bucket():
    """A bucket on moto's S3 server (127.0.0.1, a port from the OS): a client, its name, the environment that
    reaches it."""
    import boto3
    from moto.server import ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    werkzeug, level = logging.getLogger("werkzeug"), logging.getLogger("werkzeug").level
    werkzeug.setLevel(logging.WARNING)  # its line a request: hundreds in a failure's report
    endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    env = {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_EC2_METADATA_DISABLED": "true", "AWS_ENDPOINT_URL": endpoint, "S3_ENDPOINT_URL": endpoint}
    client = boto3.client("s3", endpoint_url=endpoint, region_name="us-east-1", aws_access_key_id="test",
                          aws_secret_access_key="test")
    client.create_bucket(Bucket="two-nodes")
    yield client, "two-nodes", env
    server.stop()
    werkzeug.setLevel(level)


@pytest.mark.slow
def test_two_nodes_resume_on_shared_storage_and_train_what_one_process_trains(mmdit_train_kit, s3_bucket, tmp_path):
    """Two nodes (one launched with the command-line form, one with the environment form) killed at batch 3
    (SIGKILL to every process of both nodes: the save folder's lock is left behind, and taken over) resume
    from batch 2's checkpoint and end with the weights one process trains straight through 4 batches, on a
    save folder both see (Composer 0.32 gave both nodes one signal file, which each removed: "No such file
    or directory"). On s3:// (moto's server) they resume from a checkpoint whose ``latest`` pointer Composer
    never uploaded: it does so only some 30 s after an upload completes (a 30 s poll, then the next batch
    end) or at the run's end, so a run killed in between left none (this run's checkpoint object, uploaded
    as such a run leaves it) and the next launch started over, its first upload failing on the object
    already there ("overwrite was set to False"); autoresume now points it at the newest checkpoint
    uploaded; a run on other data in that folder is refused (the own-run check, on the downloaded checkpoint). A
    save folder each node has its own of is refused in one line before anything trains."""
    client, bucket, s3_env = s3_bucket
    mds = write_latent_mds(str(tmp_path / "mds"), kit=mmdit_train_kit, n=64)
    other = shutil.copytree(mds, tmp_path / "mds-copy")  # the refused run's dataset (never closed)
    shared = str(tmp_path / "shared")
    resume = ["trainer.autoresume=true", "trainer.save_interval=2ba", "trainer.run_name=two-nodes"]
    sharded = "trainer.fsdp={version: 2, sharding_strategy: FULL_SHARD, state_dict_type: sharded}"
    killed = [  # launch 1: the killed run comes last
        # relative: in each node's own working directory, as on a node-local disk
        {"name": "local", "overrides": [*resume, "trainer.save_folder=ckpt", f"data.train.path={other}"]},
        {"name": "shared-killed", "overrides": [*resume, f"trainer.save_folder={shared}"], "stop_at": 3,
         "kill": True}]
    resumed = [{"name": "shared", "overrides": [*resume, f"trainer.save_folder={shared}"]},  # launch 2
               # stopped after its first batch: the resume is what is new here (the next save at batch 4)
               {"name": "s3", "overrides": [*resume, f"trainer.save_folder=s3://{bucket}/run"], "stop_at": 3},
               # the same s3:// folder, another dataset: refused once Composer has downloaded the checkpoint
               # (before, the own-run check read local folders only, and this run resumed the other's)
               {"name": "s3-other", "overrides": [*resume, f"trainer.save_folder=s3://{bucket}/run",
                                                  f"data.train.path={other}"]},
               # sharded checkpoints (FSDP2), which Composer reads from the store in place: a run, then one on
               # other data in its folder, refused once the extra state is loaded, before it trains
               *({"name": name, "overrides": [*resume, f"trainer.save_folder=s3://{bucket}/sharded", sharded,
                                              "trainer.max_duration=2ba", *more]}
                 for name, more in (("s3-sharded", []), ("s3-sharded-other", [f"data.train.path={other}"])))]
    # Adam with eps = 1 (smooth in the gradient: see tests/train/test_fsdp.py), no clipping, no EMA
    args = [YAML, *tiny_overrides(mmdit_train_kit, mds, batches=4, batch_size=8, extra=(
        "model.prediction_type=null", "model.objective=flow", "optimizer.eps=1.0", "optimizer.lr=0.05",
        "trainer.grad_clip_norm=null", "algorithms={}"))]
    results = launch_two_nodes(tmp_path, args, env={"VARIANTS": json.dumps(killed), **s3_env})
    assert all(rc == -signal.SIGKILL for rc, _ in results), _fail(results)  # each launcher killed with its rank
    # an s3:// run of these settings uploads this very checkpoint (the model's, Adam's and the data's state)
    client.upload_file(os.path.join(shared, "ep0-ba2-rank0.pt"), bucket, "run/ep0-ba2-rank0.pt")
    results = launch_two_nodes(tmp_path, args, env={"VARIANTS": json.dumps(resumed), **s3_env})
    assert all(rc == 0 for rc, _ in results), _fail(results)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in (0, 1)]

    line = ("trainer.save_folder=ckpt is not one folder for all 2 nodes: node 1 does not see what node 0 writes "
            "there, so it could never resume; on several nodes save to s3://... or to shared storage")
    assert all(line in r["local"].get("error", "") for r in ranks), ranks[0]["local"]
    assert not (tmp_path / "node1" / "ckpt").exists()  # node 1 wrote nothing, node 0 no checkpoint
    assert not [n for n in os.listdir(tmp_path / "node0" / "ckpt") if n.endswith(".pt")]
    assert re.search(r"taking over the lock of pid \d+ on \S+, which exited without removing it", results[0][1])
    assert all(r["s3"]["resumed_from"] == 2 and r["s3"]["stopped"] == 3 for r in ranks), [r["s3"] for r in ranks]
    refused = f"trainer.save_folder=s3://{bucket}/run holds another run's checkpoint"
    assert all(refused in r["s3-other"].get("error", "") and "training data" in r["s3-other"]["error"]
               for r in ranks), [r["s3-other"] for r in ranks]
    refused = f"trainer.save_folder=s3://{bucket}/sharded holds another run's checkpoint (ep0-ba2)"
    assert all(r["s3-sharded"]["resumed_from"] == 0 and r["s3-sharded"]["finished"] == 2 for r in ranks)
    assert all(refused in r["s3-sharded-other"].get("error", "") and "nothing was trained" in
               r["s3-sharded-other"]["error"] for r in ranks), [r["s3-sharded-other"] for r in ranks]
    assert (f"s3://{bucket}/run/latest-rank0.pt.symlink now names run/ep0-ba2-rank0.pt, the newest checkpoint "
            f"uploaded whole (it was missing: the run stopped before Composer moved it)") in results[0][1]

    straight, _ = fit_in_process(load_config(args[0], args[1:]))  # one process, 4 batches, no stop
    for rank in ranks:
        assert rank["shared-killed"]["stopped"] == 3 and rank["shared"]["resumed_from"] == 2
        for key, tensor in rank["shared"]["weights"].items():
            torch.testing.assert_close(tensor, straight[key], rtol=1e-5, atol=1e-6, msg=lambda m: f"{key}: {m}")
    assert not [n for n in os.listdir(shared) if n.startswith("._signal_file")]  # each node removed its own


def test_readme_launch_commands_are_accepted_by_composers_launcher(monkeypatch):
    """Every ``composer ... run.py`` command README gives, in both forms (command-line arguments and the
    WORLD_SIZE/NODE_RANK/MASTER_ADDR/MASTER_PORT environment variables), passes Composer's own argument
    checks (before, --master_port was missing: "In a multi-node environment, master_port is required")."""
    from composer.cli import launcher
    from diffusion.launch import TRAIN_EXAMPLES
    with open(os.path.join(ROOT, "README.md")) as f:
        text = f.read() + "\n" + TRAIN_EXAMPLES
    commands = set(re.findall(r"((?:[A-Z_]+=\S+ )*composer [^`\n]*?run\.py)", text))
    assert any("--world_size" in c for c in commands) and any(c.startswith("WORLD_SIZE=") for c in commands)
    for command in sorted(c for c in commands if "$" not in c):  # Slurm's line: its shell fills them in
        words = command.split()
        env = dict(w.split("=", 1) for w in words if re.match(r"^[A-Z_]+=", w))
        argv = [w for w in words if not re.match(r"^[A-Z_]+=", w)]
        for name in ("WORLD_SIZE", "NODE_RANK", "MASTER_ADDR", "MASTER_PORT", "LOCAL_WORLD_SIZE", "BASE_RANK"):
            monkeypatch.delenv(name, raising=False)
        for name, value in env.items():
            monkeypatch.setenv(name, value)
        monkeypatch.setattr(sys, "argv", argv[:argv.index("run.py") + 1])
        args = launcher._parse_args()
        assert args.training_script == "run.py", command
        if "--world_size" in command or "WORLD_SIZE=" in command:
            assert args.world_size > args.nproc and args.master_port, command
