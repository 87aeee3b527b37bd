"""Remote checkpoints are pruned to the newest N, never the one autoresume loads: against a real S3 server
(moto's, on 127.0.0.1), the pruning rules directly and a tiny run saving every batch to s3://."""

import gc
import io
import os
import tempfile
import types

import pytest
import torch

from diffusion.train.callbacks.checkpoint_pruning import RemoteCheckpointPruner, remote_pruner
from diffusion.train.config import load_config
from diffusion.train.trainer import build_trainer
from train_fixtures import tiny_overrides, uploads_forked_from_one_server, write_latent_mds

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))), "yamls",
                    "tiny-cpu.yaml")


@pytest.fixture(scope="module")
def moto_endpoint():
    from moto.server import ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    yield f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    server.stop()


@pytest.fixture
def s3(moto_endpoint, monkeypatch, request):
    """A fresh bucket; the endpoint where boto3, pyarrow and Composer's uploader (S3_ENDPOINT_URL) look."""
    import boto3
    for name, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                        "AWS_ENDPOINT_URL": moto_endpoint, "S3_ENDPOINT_URL": moto_endpoint}.items():
        monkeypatch.setenv(name, value)
    client = boto3.client("s3", endpoint_url=moto_endpoint)
    bucket = request.node.name.lower().replace("_", "-")[:40].strip("-[]")
    client.create_bucket(Bucket=bucket)
    return client, bucket


def keys(client, bucket, prefix=""):
    listing = client.list_objects_v2(Bucket=bucket, Prefix=prefix).get("Contents", [])
    return sorted(o["Key"] for o in listing if not o["Key"].endswith("/"))  # pyarrow's directory markers


def test_keeps_the_newest_and_what_latest_points_to(s3):
    client, bucket = s3
    for batch in range(1, 7):
        client.put_object(Bucket=bucket, Key=f"run/ep0-ba{batch}-rank0.pt", Body=b"x")
    client.put_object(Bucket=bucket, Key="run/ep0-ba1/__0_0.distcp", Body=b"x")  # a sharded checkpoint's folder
    client.put_object(Bucket=bucket, Key="run/notes.txt", Body=b"not a checkpoint")
    client.put_object(Bucket=bucket, Key="other/ep0-ba1-rank0.pt", Body=b"another run")
    # the symlink lags (Composer moves it once the newer uploads are confirmed): it and all newer stay
    client.put_object(Bucket=bucket, Key="run/latest-rank0.pt.symlink", Body=b"run/ep0-ba3-rank0.pt")
    pruner = RemoteCheckpointPruner(f"s3://{bucket}/run", keep=2)
    deleted = pruner.prune()
    assert sorted(os.path.basename(os.path.dirname(p)) if p.endswith(".distcp") else os.path.basename(p)
                  for p in deleted) == ["ep0-ba1", "ep0-ba1-rank0.pt", "ep0-ba2-rank0.pt"]
    assert keys(client, bucket) == ["other/ep0-ba1-rank0.pt", "run/ep0-ba3-rank0.pt", "run/ep0-ba4-rank0.pt",
                                    "run/ep0-ba5-rank0.pt", "run/ep0-ba6-rank0.pt", "run/latest-rank0.pt.symlink",
                                    "run/notes.txt"]
    # once latest points to the newest, only the newest 2 stay
    client.put_object(Bucket=bucket, Key="run/latest-rank0.pt.symlink", Body=b"run/ep0-ba6-rank0.pt")
    pruner.prune()
    assert keys(client, bucket) == ["other/ep0-ba1-rank0.pt", "run/ep0-ba5-rank0.pt", "run/ep0-ba6-rank0.pt",
                                    "run/latest-rank0.pt.symlink", "run/notes.txt"]


def test_the_run_name_in_the_folder_is_filled_in_as_composer_does(s3):
    client, bucket = s3
    for batch in (1, 2):
        client.put_object(Bucket=bucket, Key=f"my-run/ckpt/ep0-ba{batch}-rank0.pt", Body=b"x")
    state = types.SimpleNamespace(run_name="my-run", callbacks=[])
    RemoteCheckpointPruner(f"s3://{bucket}/{{run_name}}/ckpt", keep=1).fit_end(state, None)
    assert keys(client, bucket) == ["my-run/ckpt/ep0-ba2-rank0.pt"]


def test_autoresume_points_the_remote_latest_at_the_newest_checkpoint_uploaded(s3, monkeypatch):
    """A run killed before Composer moved ``latest-rank0.pt.symlink`` (it does so some 30 s after an upload
    completes) left it naming an older checkpoint, or none: at the next start it is moved to the newest
    ``ep*-ba*-rank0.pt`` listed (whole: an object shows only once uploaded), never back from a newer one."""
    from composer.utils.file_helpers import BACKEND_TO_OBJECT_STORE_FACTORY
    from composer.utils.object_store import S3ObjectStore

    from diffusion.train.save_folder import point_remote_latest
    client, bucket = s3
    store = S3ObjectStore(bucket=bucket)  # Composer's, built once here (a second a client on a busy machine)
    monkeypatch.setitem(BACKEND_TO_OBJECT_STORE_FACTORY, "s3", lambda name, path: store if name == bucket else None)
    folder, pointer = f"s3://{bucket}/{{run_name}}/ckpt", "my-run/ckpt/latest-rank0.pt.symlink"

    def named():
        return client.get_object(Bucket=bucket, Key=pointer)["Body"].read().decode()

    assert point_remote_latest(folder, "my-run") == [] and keys(client, bucket) == []  # a first run: nothing
    for name in ("ep0-ba2-rank0.pt", "ep0-ba4-rank0.pt", "ep0-ba10/__0_0.distcp", "ep0-ba6-rank0.pt.incomplete"):
        client.put_object(Bucket=bucket, Key=f"my-run/ckpt/{name}", Body=b"x")
    client.put_object(Bucket=bucket, Key="my-run/ep0-ba8-rank0.pt", Body=b"x")  # another folder's
    notices = point_remote_latest(folder, "my-run")
    assert named() == "my-run/ckpt/ep0-ba4-rank0.pt"
    assert notices == [f"s3://{bucket}/{pointer} now names my-run/ckpt/ep0-ba4-rank0.pt, the newest checkpoint "
                       f"uploaded whole (it was missing: the run stopped before Composer moved it)"]
    assert point_remote_latest(folder, "my-run") == []  # up to date: left as it is
    client.put_object(Bucket=bucket, Key=pointer, Body=b"my-run/ckpt/ep0-ba2-rank0.pt")  # an older one
    assert point_remote_latest(folder, "my-run") and named() == "my-run/ckpt/ep0-ba4-rank0.pt"
    client.put_object(Bucket=bucket, Key=pointer, Body=b"my-run/ckpt/ep0-ba10")  # a newer sharded one: Composer's
    assert point_remote_latest(folder, "my-run") == [] and named() == "my-run/ckpt/ep0-ba10"


def test_only_remote_folders_with_a_positive_count_are_pruned():
    assert remote_pruner("s3://bucket/run", 3)[0].keep == 3
    assert remote_pruner("s3://bucket/run", -1) == remote_pruner("s3://bucket/run", 0) == []
    assert remote_pruner("/tmp/run", 3) == remote_pruner(None, 3) == []
    with pytest.warns(UserWarning, match="remote checkpoints under oci://bucket/run are not pruned"):
        assert remote_pruner("oci://bucket/run", 3) == []  # Composer uploads there; pyarrow cannot list it


@pytest.fixture(scope="module")
def mds(train_kit, tmp_path_factory):
    return write_latent_mds(str(tmp_path_factory.mktemp("mds")), kit=train_kit, n=48)  # 6 batches an epoch: all saves in epoch 0


def _run(train_kit, mds, folder, batches):
    cfg = load_config(TINY, tiny_overrides(train_kit, mds, batches=batches, save_folder=folder, extra=(
        "trainer.save_interval=1ba", "trainer.save_num_checkpoints_to_keep=2", "trainer.autoresume=true")))
    trainer = build_trainer(cfg)
    trainer._checkpoint_saver._symlink_upload_wait_before_next_try_in_seconds = 0.2  # Composer's test knob
    resumed_at = int(trainer.state.timestamp.batch)
    trainer.fit()
    trainer.close()
    del trainer
    gc.collect()
    return resumed_at


@pytest.mark.slow
def test_a_run_saving_every_batch_to_s3_keeps_two_and_autoresumes(s3, train_kit, mds, tmp_path, monkeypatch, request):
    client, bucket = s3
    folder = f"s3://{bucket}/run"
    monkeypatch.chdir(tmp_path)  # Composer's autoresume writes its download under ./s3:/ (see below)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # and stages checkpoints in a mkdtemp() it keeps
    # the uploader's processes fork from one that imported Composer once, instead of each importing it (spawn)
    request.addfinalizer(uploads_forked_from_one_server(monkeypatch.setattr))
    assert _run(train_kit, mds, folder, batches=3) == 0
    assert keys(client, bucket, "run/") == ["run/ep0-ba2-rank0.pt", "run/ep0-ba3-rank0.pt",
                                           "run/latest-rank0.pt.symlink"]
    symlink = client.get_object(Bucket=bucket, Key="run/latest-rank0.pt.symlink")["Body"].read().decode()
    assert symlink == "run/ep0-ba3-rank0.pt"

    # autoresume from the bucket alone (a fresh local folder): it continues at batch 3, and prunes on
    assert _run(train_kit, mds, folder, batches=4) == 3
    assert keys(client, bucket, "run/") == ["run/ep0-ba3-rank0.pt", "run/ep0-ba4-rank0.pt",
                                           "run/latest-rank0.pt.symlink"]
    # Composer left its download of ba3 where its next autoresume would look first...
    assert (tmp_path / f"s3:/{bucket}/run/latest-rank0.pt").exists()
    # ...yet a second resume (another preemption) starts from the remote latest, batch 4
    assert _run(train_kit, mds, folder, batches=5) == 4
    assert keys(client, bucket, "run/") == ["run/ep0-ba4-rank0.pt", "run/ep0-ba5-rank0.pt",
                                           "run/latest-rank0.pt.symlink"]
    body = client.get_object(Bucket=bucket, Key="run/ep0-ba5-rank0.pt")["Body"].read()
    state = torch.load(io.BytesIO(body), weights_only=False)["state"]
    assert state["timestamp"]["Timestamp"]["batch"] == 5
