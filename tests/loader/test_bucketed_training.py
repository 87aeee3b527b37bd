"""Training on a bucketed dataset (converted with --buckets): every global batch from one bucket, each
bucket's share of the batches its share of the samples, resume and rank count change nothing, the caption
each sample draws (data.train.captions) included."""

import json
import os
import socket
import subprocess
import sys

import pytest

from diffusion import schema
from diffusion.train.config import StreamConfig, TrainLoaderConfig
from diffusion.errors import DatasetMismatchError
from diffusion.kit.sample import RECAP
from diffusion.loader import dataset_info
from train_fixtures import kit_text_dim

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
BATCH = 4  # global


@pytest.fixture(scope="module")
def bucketed(sample_data, tiny_kit, ray_local, tmp_path_factory):
    from diffusion.convert.pipeline import ConvertConfig, run_conversion
    out = str(tmp_path_factory.mktemp("bucketed"))
    run_conversion(ConvertConfig(input=sample_data, output=out, model=tiny_kit, resolutions=(64,),
                                 buckets="48x80,64x64,80x48", captions=f"caption,{RECAP}", progress=False))
    return out


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(bucketed, tiny_kit, out, world=1, skip=None):
    """One rank: bucket_batches.main in this process; several: each rank a real process (streaming's World from the
    environment); returns each rank's batches."""
    if world == 1:
        import gc

        import bucket_batches
        args = [bucketed, str(kit_text_dim(tiny_kit)), str(BATCH), f"{out}.0.json"]
        bucket_batches.main(*args, *([str(skip)] if skip is not None else []))
        gc.collect()  # its loaders' datasets let go before the next one opens the folder
        with open(f"{out}.0.json") as f:
            return [json.load(f)]
    procs, port = [], _free_port()
    for rank in range(world):
        env = {**os.environ, "PYTHONPATH": os.pathsep.join([ROOT, HERE, os.environ.get("PYTHONPATH", "")]),
               "RANK": str(rank), "WORLD_SIZE": str(world), "LOCAL_RANK": str(rank),
               "LOCAL_WORLD_SIZE": str(world), "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port)}
        args = [sys.executable, os.path.join(HERE, "bucket_batches.py"), bucketed, str(kit_text_dim(tiny_kit)),
                str(BATCH), f"{out}.{rank}.json"] + ([str(skip)] if skip is not None else [])
        procs.append(subprocess.Popen(args, env=env, stderr=subprocess.PIPE, text=True))
    for p in procs:
        _, err = p.communicate(timeout=300)
        assert p.returncode == 0, err[-3000:]
    ranks = []
    for rank in range(world):
        with open(f"{out}.{rank}.json") as f:
            ranks.append(json.load(f))
    return ranks


def _bucket_of_index(bucketed):
    """Sample index in the loader's concatenation of buckets -> the bucket (streams in listed order)."""
    info = schema.DatasetInfo.load(bucketed)
    owner = []
    for b in info.buckets:
        if b["count"] >= BATCH:
            owner += [b["name"]] * b["count"]
    return owner, info


@pytest.fixture(scope="module")
def one_process(bucketed, tiny_kit, tmp_path_factory):
    return _run(bucketed, tiny_kit, str(tmp_path_factory.mktemp("one") / "batches"))[0]


def test_every_batch_is_one_bucket_and_buckets_share_by_size(bucketed, one_process):
    owner, info = _bucket_of_index(bucketed)
    per_bucket = {}
    for batch in one_process:
        buckets = {owner[i] for i in batch["index"]}
        assert len(buckets) == 1, batch
        (name,) = buckets
        w, h = schema.bucket_size(name)
        assert batch["shape"] == [8, h // 8, w // 8]
        per_bucket[name] = per_bucket.get(name, 0) + 1
    # each bucket's whole batches once per epoch (a different remainder left out each epoch)
    assert per_bucket == {b["name"]: b["count"] // BATCH for b in info.buckets if b["count"] >= BATCH}
    assert len(per_bucket) >= 2


def test_samples_draw_either_caption(bucketed, one_process):
    from diffusion.loader.mds_source import build_dataset
    dataset = build_dataset(TrainLoaderConfig(path=bucketed, batch_size=BATCH, num_workers=0), resolution=64,
                            text_dim=64, device_batch_size=BATCH)  # no captions: each sample's first caption's
    first = {}
    for batch in one_process:
        for index, text in zip(batch["index"], batch["text"]):
            first[index] = (round(float(dataset[index][schema.TEXT_EMBEDS].astype("float32").sum()), 2), text)
    drew_first = sum(a == b for a, b in first.values())
    assert 0 < drew_first < len(first)  # some drew the recap (an empty one gives the first caption)


def test_resume_mid_epoch_continues_with_the_same_batches(bucketed, tiny_kit, one_process, tmp_path):
    resumed = _run(bucketed, tiny_kit, str(tmp_path / "resumed"), skip=3)[0]
    assert resumed == one_process[3:]


def test_two_ranks_make_the_global_batches_one_process_makes(bucketed, tiny_kit, one_process, tmp_path):
    rank0, rank1 = _run(bucketed, tiny_kit, str(tmp_path / "two"), world=2)
    assert len(rank0) == len(rank1) == len(one_process)
    for a, b, whole in zip(rank0, rank1, one_process):
        assert sorted(a["index"] + b["index"]) == sorted(whole["index"])
        assert a["shape"] == b["shape"] == whole["shape"]
        # each sample conditioned on the caption it drew in one process
        assert dict(zip(a["index"] + b["index"], a["text"] + b["text"])) == dict(zip(whole["index"], whole["text"]))


def test_a_bucketed_dataset_in_a_mix_is_refused_naming_it(bucketed):
    cfg = TrainLoaderConfig(path=None, streams=[StreamConfig(path=bucketed)], batch_size=BATCH)
    with pytest.raises(DatasetMismatchError, match=r"streams\[0\].*bucketed dataset.*--buckets"):
        dataset_info.loader_streams(cfg)


def test_a_batch_no_bucket_can_fill_is_refused_with_the_counts(bucketed):
    cfg = TrainLoaderConfig(path=bucketed, batch_size=10_000)
    with pytest.raises(DatasetMismatchError, match=r"no bucket holds a global batch of 10000 samples \(bucket-48x80: \d+"):
        dataset_info.loader_streams(cfg)
