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
from diffusion.train.config import EvalLoaderConfig, StreamConfig, TrainLoaderConfig
from diffusion.errors import ConfigError, DatasetMismatchError
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


def _bucket_of_index(bucketed, smallest=BATCH):
    """Sample index in the loader's concatenation of buckets -> the bucket (streams in listed order; the
    training loader's leave out buckets under a batch, the eval loader's none)."""
    info = schema.DatasetInfo.load(bucketed)
    owner = []
    for b in info.buckets:
        if b["count"] >= smallest:
            owner += [b["name"]] * b["count"]
    return owner, info


@pytest.fixture(scope="module")
def one_process_out(bucketed, tiny_kit, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("one") / "batches")
    _run(bucketed, tiny_kit, out)
    return out


@pytest.fixture(scope="module")
def one_process(bucketed, tiny_kit, one_process_out):
    with open(f"{one_process_out}.0.json") as f:
        return json.load(f)


@pytest.fixture(scope="module")
def two_ranks_out(bucketed, tiny_kit, tmp_path_factory):
    out = str(tmp_path_factory.mktemp("two") / "batches")
    _run(bucketed, tiny_kit, out, world=2)
    return out


def _batches(out, rank, suffix=""):
    with open(f"{out}.{rank}.json{suffix}") as f:
        return json.load(f)


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


def test_two_ranks_make_the_global_batches_one_process_makes(one_process, two_ranks_out):
    rank0, rank1 = _batches(two_ranks_out, 0), _batches(two_ranks_out, 1)
    assert len(rank0) == len(rank1) == len(one_process)
    for a, b, whole in zip(rank0, rank1, one_process):
        assert sorted(a["index"] + b["index"]) == sorted(whole["index"])
        assert a["shape"] == b["shape"] == whole["shape"]
        # each sample conditioned on the caption it drew in one process
        assert dict(zip(a["index"] + b["index"], a["text"] + b["text"])) == dict(zip(whole["index"], whole["text"]))


def test_eval_reads_every_sample_of_every_bucket_once_on_one_and_two_ranks(bucketed, one_process_out, two_ranks_out):
    """The held-out set is the whole bucketed set: each bucket's batches of one shape, its last incomplete
    batch kept (a bucket smaller than the eval batch is one such batch), every sample once on one rank;
    two ranks read as many batches each, together every sample (the repeats evening out their shares
    are counted once by the held-out loss, keyed by these indices)."""
    from bucket_batches import eval_batch_size
    owner, info = _bucket_of_index(bucketed, smallest=1)
    size = eval_batch_size(bucketed)
    one = _batches(one_process_out, 0, ".eval")
    assert sorted(i for batch in one for i in batch["index"]) == list(range(info.count)) == list(range(len(owner)))
    for batch in one:
        (name,) = {owner[i] for i in batch["index"]}
        w, h = schema.bucket_size(name)
        assert batch["shape"] == [8, h // 8, w // 8]
    assert [len(batch["index"]) for batch in one].count(size) < len(one)  # incomplete batches kept
    assert len(one) == sum(-(-b["count"] // size) for b in info.buckets)
    rank0, rank1 = _batches(two_ranks_out, 0, ".eval"), _batches(two_ranks_out, 1, ".eval")
    assert len(rank0) == len(rank1) == len(one)
    for a, b, whole in zip(rank0, rank1, one):
        assert a["shape"] == b["shape"] == whole["shape"]
    assert {i for batch in rank0 + rank1 for i in batch["index"]} == set(range(info.count))
    from diffusion.models.held_out_loss import HeldOutLoss
    import torch
    metric = HeldOutLoss()
    for batch in rank0 + rank1:  # a sample's loss: its index; the mean over the whole set, each once
        metric.update(torch.tensor(batch["index"], dtype=torch.float), torch.tensor(batch["index"]))
    assert float(metric.compute()) == pytest.approx((info.count - 1) / 2)


def test_a_bucketed_dataset_in_a_mix_is_refused_naming_it(bucketed):
    cfg = TrainLoaderConfig(path=None, streams=[StreamConfig(path=bucketed)], batch_size=BATCH)
    with pytest.raises(DatasetMismatchError, match=r"streams\[0\].*bucketed dataset.*--buckets"):
        dataset_info.loader_streams(cfg)


def test_a_batch_no_bucket_can_fill_is_refused_with_the_counts(bucketed):
    cfg = TrainLoaderConfig(path=bucketed, batch_size=10_000)
    with pytest.raises(DatasetMismatchError, match=r"no bucket holds a global batch of 10000 samples \(bucket-48x80: \d+"):
        dataset_info.loader_streams(cfg)
    held_out = dataset_info.loader_streams(EvalLoaderConfig(path=bucketed, batch_size=10_000))  # each one batch
    assert len(held_out) == len(schema.DatasetInfo.load(bucketed).buckets)


def test_num_samples_on_a_bucketed_dataset_is_refused_naming_the_key(bucketed):
    """Streaming takes no epoch size beside the buckets' choose: its traceback was all a run said."""
    for cfg in (TrainLoaderConfig(path=bucketed, batch_size=BATCH, num_samples=32),
                EvalLoaderConfig(path=bucketed, batch_size=BATCH, num_samples=32)):
        section = dataset_info.section_name(cfg)
        with pytest.raises(ConfigError, match=rf"^{section}.num_samples=32: {bucketed} is a bucketed dataset .*"
                                              rf"set {section}.num_samples=null$"):
            dataset_info.loader_streams(cfg)


def test_a_run_scores_a_bucketed_held_out_set_sample_by_sample_through_composers_eval(bucketed, tiny_kit):
    """The trainer's eval loop (Composer's) over the bucket-by-bucket eval loader: each batch one bucket's shape
    through the model, and the held-out loss holds every sample of the set once."""
    from composer.core import Callback
    from torchmetrics.utilities import dim_zero_cat

    from bucket_batches import eval_batch_size
    from diffusion.train.config import load_config
    from train_fixtures import fit_in_process, tiny_overrides
    info = schema.DatasetInfo.load(bucketed)
    scored = {}

    class HeldOut(Callback):
        def eval_end(self, state, logger):
            metric = state.eval_metrics[state.dataloader_label]["loss"]
            scored[state.dataloader_label] = (dim_zero_cat(metric.index).tolist(), float(metric.compute()))

    cfg = load_config(os.path.join(ROOT, "yamls", "tiny-cpu.yaml"), tiny_overrides(tiny_kit, bucketed, batches=1,
                      batch_size=BATCH, extra=(f"data.eval.path={bucketed}", f"data.eval.batch_size={eval_batch_size(bucketed)}",
                                               "data.eval.num_workers=0", "trainer.eval_interval=1ba")))
    fit_in_process(cfg, callbacks=[HeldOut()])
    assert scored.keys() == {"eval", "eval_ema"}
    for indices, loss in scored.values():
        assert sorted(indices) == list(range(info.count)) and loss > 0  # every sample once, of every bucket
