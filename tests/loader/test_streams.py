"""``data.train.streams``: a weighted mix of separately converted datasets, with streaming's ``Stream``
weights. What streaming guarantees, and these tests assert exactly: every epoch draws exactly
``floor(epoch size * proportion)`` samples from a stream (here the products are whole numbers, so no
remainder is spread at random), ``choose`` samples for ``choose``, ``repeat`` x its samples for ``repeat``;
a stream drawn below its size gives distinct samples, a different subset each epoch."""

import collections
import dataclasses
import functools
import gc
import json
import os
import re
import shutil
import subprocess
import sys

import numpy as np
import pytest
import streaming
import torch

from diffusion import schema
from diffusion.train.config import StreamConfig, TrainLoaderConfig, load_config
from diffusion.errors import ConfigError, DataIntegrityError, DatasetMismatchError, UserError
from diffusion.loader import dataset_info, mds_source
from train_fixtures import fit_in_process, kit_text_dim, tiny_overrides, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "yamls", "tiny-cpu.yaml")
N_A, N_B = 32, 24  # samples in the two datasets; in a mix, indices below N_A are A's


@pytest.fixture(scope="module")
def a(train_kit, tmp_path_factory):
    return write_latent_mds(str(tmp_path_factory.mktemp("a")), kit=train_kit, n=N_A, seed=0)


@pytest.fixture(scope="module")
def b(train_kit, tmp_path_factory):
    return write_latent_mds(str(tmp_path_factory.mktemp("b")), kit=train_kit, n=N_B, seed=1)


@pytest.fixture(scope="module")
def dim(train_kit):
    return kit_text_dim(train_kit)


def _cfg(*streams, **kw):
    kw = {"batch_size": 8, "num_workers": 0, "persistent_workers": False, **kw}
    return TrainLoaderConfig(path=None, streams=[StreamConfig(**s) for s in streams], **kw)


def _epochs(cfg, dim, epochs=2):
    """The sample indices of each of ``epochs`` epochs through the training loader."""
    loader = mds_source.build_dataloader(cfg, resolution=64, text_dim=dim, seed=3)
    out = []
    for _ in range(epochs):
        indices = []
        for batch in loader:
            indices.extend(batch[schema.BATCH_SAMPLE_INDEX].tolist())
        out.append(indices)
    del loader
    gc.collect()
    return out


def test_proportions_draw_exactly_their_share_of_every_epoch(a, b, dim):
    # 40 samples per epoch, 70/30: exactly 28 of A's 32 (distinct) and 12 of B's 24, every epoch.
    epochs = _epochs(_cfg({"path": a, "proportion": 0.7}, {"path": b, "proportion": 0.3}, num_samples=40), dim)
    for indices in epochs:
        from_a = [i for i in indices if i < N_A]
        from_b = [i for i in indices if i >= N_A]
        assert (len(from_a), len(from_b)) == (28, 12)
        assert len(set(from_a)) == 28 and len(set(from_b)) == 12  # drawn below their size: no repeats
        assert max(from_b) < N_A + N_B
    assert sorted(epochs[0]) != sorted(epochs[1])  # another subset the next epoch


def test_repeat_and_choose_draw_exact_counts(a, b, dim):
    (repeat, _) = _epochs(_cfg({"path": a}, {"path": b, "repeat": 2}), dim)
    counts = collections.Counter(repeat)
    assert sorted(counts) == list(range(N_A + N_B))
    assert {counts[i] for i in range(N_A)} == {1} and {counts[i] for i in range(N_A, N_A + N_B)} == {2}
    (choose, _) = _epochs(_cfg({"path": a, "choose": 16}, {"path": b}), dim)
    assert len({i for i in choose if i < N_A}) == len([i for i in choose if i < N_A]) == 16
    assert sorted(i for i in choose if i >= N_A) == list(range(N_A, N_A + N_B))


def test_samples_of_the_second_stream_are_its_own_and_keyed_apart(a, b, dim):
    # Both datasets were written with keys 000000, 000001, ...: the draws (noise, caption dropout) keyed
    # by sample key must not repeat across streams, so the second stream's keys carry its index.
    dataset = mds_source.build_dataset(_cfg({"path": a}, {"path": b}), resolution=64, text_dim=dim,
                                       device_batch_size=8)
    stored_b = streaming.LocalDataset(b)
    item = dataset[N_A + 5]
    np.testing.assert_array_equal(item[schema.vae_moments_column(64)], stored_b[5][schema.vae_moments_column(64)])
    assert item[schema.KEY] == "1/000005" and dataset[5][schema.KEY] == "000005"
    del dataset


def _edit_info(path, **fields):
    with open(os.path.join(path, schema.DATASET_JSON)) as f:
        info = json.load(f)
    info.update(fields)
    with open(os.path.join(path, schema.DATASET_JSON), "w") as f:
        json.dump(info, f)


@pytest.mark.parametrize("field", ["text_dim", "scaling_factor", "model", "resolution"])
def test_a_second_stream_converted_otherwise_is_refused_naming_both_and_the_field(a, b, dim, train_kit, tmp_path,
                                                                                   field):
    other = str(tmp_path / "other")
    if field == "text_dim":  # really written with another width
        write_latent_mds(other, kit=train_kit, n=N_B, text_dim=dim * 2)
        wanted = f"text_dim={dim * 2}.*text_dim={dim}"
    elif field == "resolution":  # no vae_moments_64 column
        write_latent_mds(other, kit=train_kit, n=N_B, resolution=128)
        wanted = "has no vae_moments_64 column where"
    else:
        shutil.copytree(b, other)
        _edit_info(other, **{field: {"scaling_factor": 0.13025, "model": "another/model"}[field]})
        wanted = field
    cfg = _cfg({"path": a, "proportion": 0.5}, {"path": other, "proportion": 0.5})
    with pytest.raises(DatasetMismatchError) as e:
        mds_source.build_dataset(cfg, resolution=64, text_dim=dim, device_batch_size=8)
    message = str(e.value)
    assert f"data.train.streams[1] ({other})" in message and f"data.train.streams[0] ({a})" in message
    assert "\n" not in message
    assert re.search(wanted, message), message
    # the trainer reads dataset.json before it builds the model: the same error, before any model is built
    with pytest.raises(DatasetMismatchError, match=re.escape(f"data.train.streams[1] ({other})")):
        dataset_info.read_loader_info(cfg, 64)


def test_a_different_empty_caption_embedding_is_refused_naming_both(a, b, dim, tmp_path):
    other = shutil.copytree(b, str(tmp_path / "other"))
    np.save(os.path.join(other, schema.EMPTY_TEXT_EMBEDS), np.zeros((schema.MAX_TOKENS, dim), np.float16))
    with pytest.raises(DatasetMismatchError) as e:
        mds_source.build_dataloader(_cfg({"path": a}, {"path": other}), resolution=64, text_dim=dim)
    message = str(e.value)
    assert f"data.train.streams[1] ({other})" in message and f"data.train.streams[0] ({a})" in message
    assert f"{schema.EMPTY_TEXT_EMBEDS} differs" in message and "other values" in message and "\n" not in message
    gc.collect()


def test_the_empty_caption_embedding_comes_from_the_first_stream(a, b, dim):
    loader = mds_source.build_dataloader(_cfg({"path": a}, {"path": b}, caption_dropout=0.5, shuffle=False),
                                         resolution=64, text_dim=dim)
    empty = np.load(os.path.join(a, schema.EMPTY_TEXT_EMBEDS))
    texts = [t for batch in loader for t in batch[schema.BATCH_TEXT_EMBEDS].numpy()]
    assert 0 < sum(np.array_equal(t, empty) for t in texts) < len(texts) == N_A + N_B
    del loader
    gc.collect()


def test_a_corrupt_shard_of_the_second_stream_is_named(a, train_kit, dim, tmp_path):
    with pytest.MonkeyPatch.context() as mp:  # the converter records hashes; write_latent_mds does not
        mp.setattr(streaming, "MDSWriter", functools.partial(streaming.MDSWriter, hashes=["xxh64"]))
        other = write_latent_mds(str(tmp_path / "other"), kit=train_kit, n=N_B, seed=1, samples_per_shard=8)
    with open(os.path.join(other, "index.json")) as f:
        shard = os.path.join(other, json.load(f)["shards"][1]["raw_data"]["basename"])
    data = bytearray(open(shard, "rb").read())
    data[len(data) // 2:len(data) // 2 + 16] = bytes(x ^ 0xFF for x in data[len(data) // 2:len(data) // 2 + 16])
    with open(shard, "wb") as f:
        f.write(data)
    loader = mds_source.build_dataloader(_cfg({"path": a}, {"path": other}, batch_size=4), resolution=64,
                                         text_dim=dim)
    read = []
    with pytest.raises(DataIntegrityError) as e:
        for batch in loader:
            read.extend(batch[schema.BATCH_SAMPLE_INDEX].tolist())
    message = str(e.value)
    assert f"shard {shard} of dataset {other}" in message and "xxh64" in message and "\n" not in message
    assert isinstance(e.value, UserError)
    assert not set(read) & set(range(N_A + 8, N_A + 16))  # no sample of the bad shard was returned
    del loader
    gc.collect()


def test_a_batch_larger_than_the_mix_names_its_streams(a, b, dim):
    with pytest.raises(ConfigError, match=rf"larger than the mix of data.train.streams \({a}, {b}\)"):
        mds_source.build_dataloader(_cfg({"path": a, "choose": 4}, {"path": b, "choose": 4}, batch_size=16),
                                    resolution=64, text_dim=dim)


# ---- through the trainer and run.py -----------------------------------------------------------------------

def _mix(a, b):
    return ("data.train.path=null", "data.train.num_samples=48",
            f"data.train.streams=[{{path: {a}, proportion: 0.75}}, {{path: {b}, proportion: 0.25}}]")


def _fit(kit, a, b, *overrides, batches, save_folder):
    cfg = load_config(TINY, tiny_overrides(kit, a, batches=batches, save_folder=save_folder,
                                           extra=(*_mix(a, b), "algorithms={}", *overrides)))
    return fit_in_process(cfg)


def test_resume_with_streams_continues_the_same_sample_order(train_kit, a, b, tmp_path):
    """8 batches straight == 4, kill, autoresume, 4 (an epoch is 48 samples, 6 batches: the resumed run
    starts mid-epoch and crosses into the next): the same samples in the same order, the same weights."""
    n = 4
    straight = tmp_path / "straight"
    weights, order = _fit(train_kit, a, b, "trainer.save_interval=4ba", batches=2 * n, save_folder=str(straight))
    epoch = [i for batch in order[:6] for i in batch]
    assert (sum(i < N_A for i in epoch), sum(i >= N_A for i in epoch)) == (36, 12)  # 75/25 of 48
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    first = next(p for p in os.listdir(straight) if p.endswith(f"ba{n}-rank0.pt"))
    shutil.copy(straight / first, resumed / first)
    os.symlink(first, resumed / "latest-rank0.pt")
    weights2, order2 = _fit(train_kit, a, b, "trainer.save_interval=4ba", "trainer.autoresume=true",
                            batches=2 * n, save_folder=str(resumed))
    assert order2 == order[n:] and len(order2) == n
    for name in weights:
        torch.testing.assert_close(weights2[name], weights[name], rtol=1e-5, atol=1e-6, msg=name)


def test_run_py_refuses_a_mismatched_stream_in_one_line(train_kit, a, b, dim, tmp_path, capfd):
    """run.py's refusal through its entry in this process (train_fixtures.run_py_here)."""
    from train_fixtures import run_py_here
    other = str(tmp_path / "other")
    write_latent_mds(other, kit=train_kit, n=N_B, text_dim=dim * 2)
    result = run_py_here(capfd, TINY, *tiny_overrides(train_kit, a, extra=_mix(a, other)))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    line = next(line for line in result.stderr.splitlines() if line.startswith("run.py: error:"))
    assert f"data.train.streams[1] ({other})" in line and f"data.train.streams[0] ({a})" in line
    assert f"text_dim={dim * 2}" in line


@pytest.fixture
def s3(monkeypatch):
    """A bucket on moto's S3 server (127.0.0.1), where streaming and boto3 look."""
    import boto3
    from moto.server import ThreadedMotoServer
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    endpoint = f"http://127.0.0.1:{server.get_host_and_port()[1]}"
    for name, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true",
                        "AWS_ENDPOINT_URL": endpoint, "S3_ENDPOINT_URL": endpoint}.items():
        monkeypatch.setenv(name, value)
    client = boto3.client("s3", endpoint_url=endpoint)
    client.create_bucket(Bucket="mix")
    yield client
    server.stop()


def test_a_remote_stream_is_read_beside_a_local_one(a, b, dim, s3, tmp_path, monkeypatch):
    """Its shards come from the bucket into its cache; its side files (dataset.json, the empty caption's
    embedding) are downloaded for the checks and their temporary folders removed; one that is no array is
    named by its place in the bucket."""
    import tempfile
    made, mkdtemp = [], tempfile.mkdtemp
    monkeypatch.setattr(tempfile, "mkdtemp", lambda *args, **kwargs: made.append(mkdtemp(*args, **kwargs)) or made[-1])
    for name in os.listdir(b):
        s3.upload_file(os.path.join(b, name), "mix", f"b/{name}")
    cfg = _cfg({"path": a, "proportion": 0.5}, {"path": "s3://mix/b", "local": str(tmp_path / "cache"),
                                                "proportion": 0.5}, num_samples=48, shuffle=False)
    (indices, _) = _epochs(cfg, dim)
    assert (sum(i < N_A for i in indices), sum(i >= N_A for i in indices)) == (24, 24)  # all of B's 24
    shards = sorted(n for n in os.listdir(b) if n.endswith(".mds"))
    assert sorted(os.listdir(tmp_path / "cache")) == sorted(shards + ["index.json"])  # B's, from the bucket
    s3.put_object(Bucket="mix", Key="b/empty_text_embeds.npy", Body=b"not an array")
    with pytest.raises(DataIntegrityError, match="^s3://mix/b/empty_text_embeds.npy is not an array"):
        mds_source.build_dataloader(_cfg({"path": a}, {"path": "s3://mix/b", "local": str(tmp_path / "cache2")}),
                                    resolution=64, text_dim=dim)
    downloads = [folder for folder in made if os.path.basename(folder).startswith("mds-meta-")]
    assert len(downloads) >= 4 and not any(os.path.exists(folder) for folder in downloads)  # 2 reads a build
    gc.collect()


def _indices(loader):
    return sorted(i for batch in loader for i in batch[schema.BATCH_SAMPLE_INDEX].tolist())


def test_a_remote_dataset_without_local_is_cached_in_a_folder_every_run_reuses(a, dim, s3, tmp_path, monkeypatch):
    """Streaming's own default (a folder per remote that must not exist yet) refused every run after the first,
    a resumed one included. The default is a folder per remote and section: a re-run reads through it again,
    the train and eval loaders of one remote at once each have their own, and a second job reading through
    the same folder at the same time is one line naming the key to set."""
    import tempfile
    from diffusion.loader import shard_checks
    from diffusion.train.config import EvalLoaderConfig
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))
    os.makedirs(tempfile.tempdir)
    for name in os.listdir(a):
        s3.upload_file(os.path.join(a, name), "mix", f"a/{name}")
    cfg = TrainLoaderConfig(path="s3://mix/a", batch_size=8, num_workers=0, persistent_workers=False, shuffle=False)
    for _ in range(2):  # a run, then the same command again
        loader = mds_source.build_dataloader(cfg, resolution=64, text_dim=dim)
        assert _indices(loader) == list(range(N_A))
        del loader
        gc.collect()
    cache = shard_checks.default_cache("s3://mix/a/")
    assert cache.startswith(tempfile.tempdir) and "index.json" in os.listdir(cache)
    train = mds_source.build_dataloader(cfg, resolution=64, text_dim=dim)
    held_out = mds_source.build_dataloader(EvalLoaderConfig(path="s3://mix/a", batch_size=8, num_workers=0),
                                           resolution=64, text_dim=dim, drop_last=False)
    assert _indices(held_out) == _indices(train) == list(range(N_A))
    # another job (its own TMPDIR, as another container or user has) given the same folder as data.train.local
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp2"))
    os.makedirs(tempfile.tempdir)
    with pytest.raises(ConfigError, match=r"^data.train: another job on this machine is reading through the same "
                                          rf"cache folder \['{re.escape(cache)}'\].*data.train.local of its own$"):
        mds_source.build_dataloader(dataclasses.replace(cfg, local=cache), resolution=64, text_dim=dim)
    del train, held_out
    gc.collect()


def test_a_cache_limit_below_streamings_minimum_names_the_key_and_the_minimum(a, dim):
    with open(os.path.join(a, "index.json")) as f:
        largest = max(shard["raw_data"]["bytes"] + (shard.get("zip_data") or {}).get("bytes", 0)
                      for shard in json.load(f)["shards"])
    with pytest.raises(ConfigError, match=rf"^data.train.cache_limit=100kb is below streaming's minimum .* at least "
                                          rf"{4 * largest:,} bytes"):
        mds_source.build_dataloader(_cfg({"path": a}, cache_limit="100kb"), resolution=64, text_dim=dim)


# ---- repeated samples: each copy its own example (issue 25 item 1) ----------------------------------------

COPIES_SCRIPT = '''
import json, os, sys, torch
from diffusion import schema
from diffusion.train.config import StreamConfig, TrainLoaderConfig
from diffusion.loader import mds_source
from diffusion.loader.batches import NoiseDraws, CaptionDropout
a, b, dim, out, world = sys.argv[1], sys.argv[2], int(sys.argv[3]), sys.argv[4], int(sys.argv[5])
cfg = TrainLoaderConfig(path=None, streams=[StreamConfig(path=a), StreamConfig(path=b, repeat=2)], batch_size=8,
                        num_workers=int(sys.argv[6]), persistent_workers=False, caption_dropout=0.5)
loader = mds_source.build_dataloader(cfg, resolution=64, text_dim=dim, world_size=world, seed=3,
                                     noise=NoiseDraws(seed=3))
draws = []
for epoch in range(2):
    for batch in loader:
        for i in range(len(batch[schema.BATCH_SAMPLE_INDEX])):
            draws.append([epoch, int(batch[schema.BATCH_SAMPLE_INDEX][i]), batch[schema.BATCH_NOISE][i].sum().item(),
                          batch[schema.BATCH_TIMESTEP_DRAW][i].item(), bool((batch[schema.BATCH_TEXT_EMBEDS][i] == -1).all())])
with open(os.path.join(out, f"draws-{os.environ.get('RANK', '0')}.json"), "w") as f:
    json.dump(draws, f)
'''


def _copies(a, b, dim, tmp_path, monkeypatch, *, world=1, workers=0):
    """(epoch, sample index, noise sum, timestep draw, caption dropped) of every sample read, over all ranks: one
    rank in this process (its DataLoader workers forked from it), several each a process of its own with the
    environment a launcher gives its ranks (streaming's World reads it; tests/loader/test_bucketed_training.py
    does the same)."""
    from train_fixtures import free_port
    out = tmp_path / f"w{world}-{workers}"
    out.mkdir()
    args = [a, b, str(dim), str(out), str(world), str(workers)]
    if world == 1:
        with monkeypatch.context() as m:
            m.delenv("RANK", raising=False)
            m.setattr(sys, "argv", ["copies.py", *args])
            exec(compile(COPIES_SCRIPT, "copies.py", "exec"), {"__name__": "__main__"})
        gc.collect()  # the loader's datasets let go before the next one opens the same folders
    else:
        script, port, ranks = tmp_path / "copies.py", free_port(), []
        script.write_text(COPIES_SCRIPT)
        for rank in range(world):
            env = dict(os.environ, PYTHONPATH=ROOT, OMP_NUM_THREADS="1", RANK=str(rank), WORLD_SIZE=str(world),
                       LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(port))
            ranks.append(subprocess.Popen([sys.executable, str(script), *args], cwd=ROOT, env=env,
                                          stderr=subprocess.PIPE, text=True))
        try:
            for rank in ranks:
                _, err = rank.communicate(timeout=300)
                assert rank.returncode == 0, err[-3000:]
        finally:
            for rank in ranks:
                if rank.poll() is None:
                    rank.kill()
                    rank.wait()
    return sorted(tuple(d) for name in os.listdir(out) for d in json.loads((out / name).read_text()))


def test_each_copy_of_a_repeated_sample_gets_its_own_draws_on_any_number_of_ranks(a, b, dim, tmp_path, monkeypatch):
    from diffusion.loader.batches import NoiseDraws
    draws = _copies(a, b, dim, tmp_path, monkeypatch)
    for epoch in (0, 1):
        seen = collections.defaultdict(list)
        for e, index, noise, level, dropped in draws:
            if e == epoch:
                seen[index].append((noise, level, dropped))
        assert {len(v) for i, v in seen.items() if i < N_A} == {1}
        assert {len(v) for i, v in seen.items() if i >= N_A} == {2}  # B repeated twice
        # the two copies of a sample are two examples: other noise, another level
        for index in range(N_A, N_A + N_B):
            (n1, l1, _), (n2, l2, _) = seen[index]
            assert n1 != n2 and l1 != l2, index
        # copies drop their captions independently: some of B's pairs differ (half dropped at random)
        assert any(seen[i][0][2] != seen[i][1][2] for i in range(N_A, N_A + N_B))
        # a sample the epoch holds once keeps the draws its key always had
        noise = NoiseDraws(seed=3)([f"{5:06d}"], epoch, (4, 8, 8))
        assert seen[5][0][0] == pytest.approx(noise[schema.BATCH_NOISE][0].sum().item(), rel=1e-6)
    # the same examples with the same draws however the epoch is split: DataLoader workers, two ranks
    assert _copies(a, b, dim, tmp_path, monkeypatch, workers=2) == draws
    assert _copies(a, b, dim, tmp_path, monkeypatch, world=2) == draws
