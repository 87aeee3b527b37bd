"""Shards damaged as a user's disk would damage them: the training loader stops on the first epoch with
one line naming the file, and never returns a wrong sample before it does."""

import functools
import json
import mmap
import multiprocessing
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading

import numpy as np
import pytest
import streaming
from filelock import FileLock

from diffusion import schema
from diffusion.train.config import TrainLoaderConfig
from diffusion.errors import ConfigError, DataIntegrityError, UserError
from diffusion.loader import mds_source, shard_checks, shared_memory
from train_fixtures import kit_text_dim, write_latent_mds

N, PER_SHARD = 40, 8  # five shards


def _write(out, kit, compression, hashes=("sha1", "xxh64")):
    """``write_latent_mds`` with the converter's hashes (diffusion.convert.sink records sha1 and xxh64)."""
    with pytest.MonkeyPatch.context() as mp:
        if hashes:
            mp.setattr(streaming, "MDSWriter", functools.partial(streaming.MDSWriter, hashes=list(hashes)))
        return write_latent_mds(out, kit=kit, n=N, samples_per_shard=PER_SHARD, compression=compression)


@pytest.fixture(scope="module")
def pristine(train_kit, tmp_path_factory):
    """Intact datasets to copy and damage: {None, "zstd", "nohash"}."""
    root = tmp_path_factory.mktemp("pristine")
    return {"none": _write(str(root / "none"), train_kit, None),
            "zstd": _write(str(root / "zstd"), train_kit, "zstd"),
            "nohash": _write(str(root / "nohash"), train_kit, None, hashes=())}


@pytest.fixture(scope="module")
def stored(pristine):
    """Every sample as written (the same for each compression: same seed, same shard boundaries)."""
    dataset = streaming.LocalDataset(pristine["none"])
    return [dataset[i] for i in range(N)]


@pytest.fixture(scope="module")
def dim(train_kit):
    return kit_text_dim(train_kit)


def _copy(pristine, kind, tmp_path):
    return shutil.copytree(pristine[kind], str(tmp_path / kind))


def _index(mds):
    with open(os.path.join(mds, "index.json")) as f:
        return json.load(f)


def _shard_file(mds, shard=1, raw=False):
    """Path of a shard's file as the index names it: the compressed one unless ``raw``."""
    info = _index(mds)["shards"][shard]
    return os.path.join(mds, (info["raw_data"] if raw or not info["zip_data"] else info["zip_data"])["basename"])


def _flip(path, n=16, at=None):
    data = bytearray(open(path, "rb").read())
    at = len(data) // 2 if at is None else at
    data[at:at + n] = bytes(b ^ 0xFF for b in data[at:at + n])
    with open(path, "wb") as f:
        f.write(data)


def _cfg(mds, **kw):
    kw = {"batch_size": 4, "num_workers": 0, "persistent_workers": False, "caption_dropout": 0.0, **kw}
    return TrainLoaderConfig(path=mds, **kw)


def _check_batch(batch, stored):
    for row, index in enumerate(batch[schema.BATCH_SAMPLE_INDEX].tolist()):
        want = stored[index]
        np.testing.assert_array_equal(batch[schema.BATCH_MOMENTS][row].numpy(), want[schema.vae_moments_column(64)])
        np.testing.assert_array_equal(batch[schema.BATCH_TEXT_EMBEDS][row].numpy(), want[schema.TEXT_EMBEDS])
    return batch[schema.BATCH_SAMPLE_INDEX].tolist()


def _epoch(mds, dim, stored, loader=None, **kw):
    """Every sample index one epoch returns through the training loader, each checked against ``stored``."""
    loader = loader or mds_source.build_dataloader(_cfg(mds, **kw), resolution=64, text_dim=dim)
    return [i for batch in loader for i in _check_batch(batch, stored)]


def _fails_naming(path, mds, dim, stored, loader=None, **kw):
    """Read one epoch (building the loader too, unless given): it must raise DataIntegrityError naming
    ``path`` in one line, and what it returned before must be right (``_check_batch``)."""
    returned = []
    with pytest.raises(DataIntegrityError) as e:
        returned.extend(_epoch(mds, dim, stored, loader, **kw))
    message = str(e.value)
    assert path in message and "\n" not in message, message
    assert isinstance(e.value, UserError)  # the CLI prints it as `run.py: error: ...`
    assert len(returned) < N
    return message


@pytest.mark.parametrize("kind", ["none", "zstd"])
def test_an_intact_dataset_reads_every_sample_every_epoch(pristine, stored, dim, tmp_path, kind):
    mds = _copy(pristine, kind, tmp_path)
    loader = mds_source.build_dataloader(_cfg(mds), resolution=64, text_dim=dim)
    for _ in range(2):
        assert sorted(_epoch(mds, dim, stored, loader)) == list(range(N))


@pytest.mark.parametrize("kind", ["none", "zstd"])
def test_flipped_bytes_in_a_shard(pristine, stored, dim, tmp_path, kind):
    mds = _copy(pristine, kind, tmp_path)
    path = _shard_file(mds)  # shard.00001.mds, or .mds.zstd
    _flip(path)
    message = _fails_naming(path, mds, dim, stored)
    assert f"dataset {mds}" in message and "xxh64" in message


def test_flipped_bytes_in_a_decompressed_shard(pristine, stored, dim, tmp_path):
    # The raw .mds streaming decompressed beside the .zstd on an earlier run is what is read from then on.
    mds = _copy(pristine, "zstd", tmp_path)
    assert sorted(_epoch(mds, dim, stored)) == list(range(N))
    raw = _shard_file(mds, raw=True)
    assert os.path.isfile(raw)
    _flip(raw)
    message = _fails_naming(raw, mds, dim, stored)
    assert "decompressed again from shard.00001.mds.zstd" in message


@pytest.mark.parametrize("kind", ["none", "zstd"])
def test_a_truncated_shard_fails_when_the_dataset_opens(pristine, stored, dim, tmp_path, kind):
    mds = _copy(pristine, kind, tmp_path)
    path = _shard_file(mds)
    os.truncate(path, os.path.getsize(path) // 2)
    assert "truncated" in _fails_naming(path, mds, dim, stored)


@pytest.mark.parametrize("kind", ["none", "zstd"])
def test_a_shard_truncated_after_the_loader_started_fails_when_opened(pristine, stored, dim, tmp_path, kind):
    mds = _copy(pristine, kind, tmp_path)
    loader = mds_source.build_dataloader(_cfg(mds), resolution=64, text_dim=dim)
    path = _shard_file(mds)
    os.truncate(path, os.path.getsize(path) // 2)
    _fails_naming(path, mds, dim, stored, loader)


def test_a_prefetch_thread_that_fails_counts_its_exit_so_the_epoch_can_end_with_its_error(pristine, stored, dim,
                                                                                           tmp_path):
    """Streaming's epoch end waits until both prefetch threads have counted their exit, and a thread that raised
    never counted it: when the prefetch thread met the truncated shard before the reading thread did, the epoch
    hung there for good instead of raising the error (the suite hung so on a fresh clone, 2026-11-29). The
    prefetch loop run here as streaming's thread runs it."""
    import threading
    from streaming.base.dataset import _Iterator
    mds = _copy(pristine, "none", tmp_path)
    dataset = mds_source.build_dataloader(_cfg(mds), resolution=64, text_dim=dim).dataset
    path = _shard_file(mds)
    os.truncate(path, os.path.getsize(path) // 2)
    dataset._event = threading.Event()  # what streaming's __iter__ sets at an epoch's start
    it = _Iterator(np.arange(N, dtype=np.int64))
    with pytest.raises(DataIntegrityError, match=path):
        dataset._prepare_thread(it)
    assert it._num_exited == 1  # the epoch's end (it.exit()) now waits for the ready thread only


@pytest.mark.parametrize("kind", ["none", "zstd"])
@pytest.mark.parametrize("when", ["before", "after"])
def test_a_deleted_shard(pristine, stored, dim, tmp_path, kind, when):
    mds = _copy(pristine, kind, tmp_path)
    path = _shard_file(mds)
    loader = None
    if when == "after":  # deleted once the loader was built: found when first opened
        loader = mds_source.build_dataloader(_cfg(mds), resolution=64, text_dim=dim)
    os.remove(path)
    assert "is missing" in _fails_naming(path, mds, dim, stored, loader)


@pytest.mark.parametrize("kind", ["none", "zstd"])
@pytest.mark.parametrize("delta", [1, -1])
def test_a_wrong_sample_count_in_index_json(pristine, stored, dim, tmp_path, kind, delta):
    mds = _copy(pristine, kind, tmp_path)
    index = _index(mds)
    index["shards"][1]["samples"] += delta
    with open(os.path.join(mds, "index.json"), "w") as f:
        json.dump(index, f)
    message = _fails_naming(_shard_file(mds, raw=True), mds, dim, stored)
    assert f"holds {PER_SHARD} samples where index.json records {PER_SHARD + delta}" in message


@pytest.mark.parametrize("kind", ["none", "nohash"])
def test_a_corrupted_offset(pristine, stored, dim, tmp_path, kind):
    # The MDS header check finds it before the hash does, and alone where no hash is recorded.
    mds = _copy(pristine, kind, tmp_path)
    path = _shard_file(mds)
    _flip(path, n=2, at=4 * 3)  # the third sample's offset
    assert "corrupt MDS offset table" in _fails_naming(path, mds, dim, stored)


def test_a_corrupted_sample_header_without_hashes(pristine, stored, dim, tmp_path):
    # A variable-size column's length inside a sample, in a dataset that records no hashes.
    mds = _copy(pristine, "nohash", tmp_path)
    path = _shard_file(mds)
    with open(path, "rb") as f:
        begin = int(np.frombuffer(f.read(12), "<u4")[2])  # sample 1's offset
    _flip(path, n=1, at=begin + 1)
    assert "corrupt sample 1" in _fails_naming(path, mds, dim, stored)


@pytest.mark.parametrize("name", ["dataset.json", "index.json"])
def test_garbage_metadata_names_the_file(pristine, stored, dim, tmp_path, name):
    mds = _copy(pristine, "none", tmp_path)
    with open(os.path.join(mds, name), "w") as f:
        f.write('{"shards": [{"samples": ')
    _fails_naming(os.path.join(mds, name), mds, dim, stored)


def test_an_index_whose_shard_entry_is_garbage_names_the_index(pristine, stored, dim, tmp_path):
    mds = _copy(pristine, "none", tmp_path)
    index = _index(mds)
    index["shards"][1]["samples"] = "eight"
    with open(os.path.join(mds, "index.json"), "w") as f:
        json.dump(index, f)
    _fails_naming(os.path.join(mds, "index.json"), mds, dim, stored)


def test_a_worker_process_error_is_one_line_naming_the_file(pristine, stored, dim, tmp_path):
    mds = _copy(pristine, "none", tmp_path)
    path = _shard_file(mds)
    _flip(path)
    _fails_naming(path, mds, dim, stored, num_workers=1)


@pytest.mark.parametrize("kind", ["none", "zstd"])
def test_streamings_path_is_checked_too(pristine, stored, dim, tmp_path, kind, monkeypatch):
    # Every read through streaming's own path, as for shards it does not hold as fixed-shape arrays.
    monkeypatch.setattr(mds_source.LatentDataset, "_layout", lambda self, shard_id: None)
    mds = _copy(pristine, kind, tmp_path)
    path = _shard_file(mds, raw=True)
    if kind == "zstd":  # decompress first, so the raw file exists to damage
        _epoch(mds, dim, stored)
    _flip(path)
    _fails_naming(path, mds, dim, stored, cache_limit="10mb")


def test_hash_checks_can_be_off_and_sizes_are_still_checked(pristine, tmp_path):
    mds = _copy(pristine, "none", tmp_path)
    _flip(_shard_file(mds, shard=0))
    dataset = mds_source.LatentDataset(remote=None, local=mds, resolution=64, batch_size=4, verify_hashes=False)
    dataset[0]  # read, unchecked
    os.truncate(_shard_file(mds, shard=2), 100)
    with pytest.raises(DataIntegrityError, match="shard.00002.mds .*truncated"):
        dataset[2 * PER_SHARD]
    del dataset


def test_each_shard_is_hashed_once_per_node(pristine, tmp_path, monkeypatch):
    mds = _copy(pristine, "none", tmp_path)
    hashed = []
    real = mds_source.check_file

    def check_file(path, info, algo, **kw):  # this dataset's files only: not a thread an earlier test left running
        if algo is not None and path.startswith(mds + os.sep):
            hashed.append(os.path.basename(path))
        return real(path, info, algo, **kw)

    monkeypatch.setattr(mds_source, "check_file", check_file)
    dataset = mds_source.LatentDataset(remote=None, local=mds, resolution=64, batch_size=4, shuffle=True)
    for _ in range(2):
        assert len(list(dataset)) == N
    assert sorted(hashed) == [_shard_name(s) for s in range(N // PER_SHARD)]
    dataset.forget_checks()  # as a new run would
    assert len(list(dataset)) == N and len(hashed) == 2 * N // PER_SHARD
    del dataset


def test_a_shard_damaged_at_the_remote_fails_when_downloaded(pristine, stored, dim, tmp_path):
    # A local directory as the "remote": streaming copies each shard into the cache as it would download it.
    remote = _copy(pristine, "zstd", tmp_path)
    _flip(_shard_file(remote))
    cache = str(tmp_path / "cache")
    dataset = mds_source.LatentDataset(remote=remote, local=cache, resolution=64, batch_size=4)
    with pytest.raises(DataIntegrityError) as e:
        for i in range(N):
            sample = dataset[i]
            np.testing.assert_array_equal(sample[schema.TEXT_EMBEDS], stored[i][schema.TEXT_EMBEDS])
    assert i == PER_SHARD  # the first sample of shard 1
    message = str(e.value)
    assert f"{cache}/shard.00001.mds.zstd of dataset {remote} " in message and "downloaded again" in message
    del dataset


def _cache_bytes(cache, sizes):
    """Bytes the cache directory holds on disk: its files, and those deleted from it that this process
    still maps (a mapped file keeps its blocks until it is unmapped), by ``sizes`` (basename: bytes)."""
    held = 0
    for d, _, files in os.walk(cache):
        for name in files:
            try:
                held += os.path.getsize(os.path.join(d, name))
            except FileNotFoundError:  # evicted meanwhile
                pass
    deleted = {}  # inode: basename
    with open("/proc/self/maps") as maps:
        for line in maps:
            fields = line.split(maxsplit=5)
            if len(fields) == 6 and fields[5].startswith(cache + "/") and fields[5].rstrip().endswith(" (deleted)"):
                deleted[fields[4]] = os.path.basename(fields[5].rstrip()[:-len(" (deleted)")])
    return held + sum(sizes[name] for name in deleted.values()), len(deleted)


def _deleted_maps(cache):
    with open("/proc/self/maps") as maps:
        return sorted({line.split(maxsplit=5)[5].strip() for line in maps
                       if line.count(" ") >= 5 and cache + "/" in line and "(deleted)" in line})


def _shard_name(shard):
    return f"shard.{shard:05d}.mds"


def _mapped(array):
    while isinstance(array, (np.ndarray, memoryview)):
        array = array.base if isinstance(array, np.ndarray) else array.obj
    return isinstance(array, mmap.mmap)


def test_a_cache_limit_keeps_the_mapped_read_and_the_disk_under_it(pristine, stored, tmp_path):
    # A local directory as the "remote", read through a cache that holds four of its five shards: every
    # epoch evicts shards and downloads them again. Reads stay zero-copy views of the mapped shard, return
    # what streaming decodes, and the cache (files mapped after their deletion included) stays under the limit.
    remote, cache = pristine["none"], str(tmp_path / "cache")
    sizes = {s["raw_data"]["basename"]: s["raw_data"]["bytes"] for s in _index(remote)["shards"]}
    limit = 4 * max(sizes.values()) + os.path.getsize(os.path.join(remote, "index.json"))
    dataset = mds_source.LatentDataset(remote=remote, local=cache, resolution=64, batch_size=4, cache_limit=limit,
                                       predownload=4)
    moments = schema.vae_moments_column(64)
    # Least recently read goes first: shard 0, read again after 1-3 were downloaded, outlives shard 1.
    for index in (0, PER_SHARD, 2 * PER_SHARD, 3 * PER_SHARD, 1, 4 * PER_SHARD):
        np.testing.assert_array_equal(dataset[index][moments], stored[index][moments])
    assert sorted(f for f in os.listdir(cache) if f in sizes) == [_shard_name(s) for s in (0, 2, 3, 4)]
    for epoch in range(2):
        read = []
        for sample in dataset:
            index = sample[schema.BATCH_SAMPLE_INDEX]
            np.testing.assert_array_equal(sample[moments], stored[index][moments])
            np.testing.assert_array_equal(sample[schema.TEXT_EMBEDS], stored[index][schema.TEXT_EMBEDS])
            assert sample[schema.KEY] == stored[index][schema.KEY]
            assert _mapped(sample[moments]) and _mapped(sample[schema.TEXT_EMBEDS]), "not the zero-copy read"
            # measured under streaming's cache lock, as its prefetch thread evicts: a shard deleted between
            # listing the folder and reading the maps would count twice (once listed, once as mapped and deleted)
            with FileLock(dataset._cache_filelock_path):
                held, _ = _cache_bytes(cache, sizes)
                listed = sorted(os.listdir(cache))
                # streaming's own accounting, for a failure's message (seen once in a loaded fresh clone's run)
                counted = int(dataset.cache_usage)
                states = [int(dataset._shard_states[i]) for i in range(dataset.num_shards)]
            assert held <= limit, (f"epoch {epoch}, sample {index}: the cache holds {held} bytes, limit {limit}: "
                                   f"{listed}, {_deleted_maps(cache)}; streaming counts {counted} bytes, shard "
                                   f"states {states} (1 remote, 2 preparing, 3 local)")
            read.append(index)
        assert sorted(read) == list(range(N))
        assert len([f for f in os.listdir(cache) if f in sizes]) <= 4  # some were evicted
    del sample
    # Another process of the node evicts a shard this one maps: its map is dropped at this one's next
    # shard preparation (streaming's prefetch thread) or read.
    for drop in (lambda: dataset.prepare_shard(4), lambda: dataset[N - 1]):
        np.testing.assert_array_equal(dataset[0][moments], stored[0][moments])  # downloaded again
        assert _cache_bytes(cache, sizes)[1] == 0
        child = multiprocessing.get_context("fork").Process(target=dataset.evict_shard, args=(0,))
        child.start()
        child.join()
        assert child.exitcode == 0
        assert _cache_bytes(cache, sizes)[1] == 1  # shard 0 is gone from the cache but still mapped here
        drop()
        assert _cache_bytes(cache, sizes)[1] == 0
    del dataset


def test_two_shards_downloading_at_once_under_a_cache_limit_each_reserve_their_room(pristine, stored, tmp_path):
    """Streaming checks a download's room under its cache lock but counts the download only once it has
    landed, so two shards prepared at once (the prefetch and the reading thread, or two workers of a node)
    each found room for one and together passed the limit by a shard: the test above once saw all 5 shards
    under its 4-shard limit. The room is reserved before the lock is let go, and the coldest shard makes it."""
    remote, cache = pristine["none"], str(tmp_path / "cache")
    sizes = {s["raw_data"]["basename"]: s["raw_data"]["bytes"] for s in _index(remote)["shards"]}
    index = os.path.getsize(os.path.join(remote, "index.json"))
    limit = 4 * max(sizes.values()) + index
    dataset = mds_source.LatentDataset(remote=remote, local=cache, resolution=64, batch_size=4, cache_limit=limit)
    for shard in (0, 1, 2):  # read in this order: shard 0 is the coldest
        dataset.prepare_shard(shard)
    stream, both = dataset.streams[0], threading.Barrier(2, timeout=60)
    download = stream.prepare_shard

    def gated(shard):
        both.wait()  # neither download lands before the other has looked for room
        return download(shard)

    stream.prepare_shard = gated
    errors = []

    def prepare(shard):
        try:
            dataset.prepare_shard(shard)
        except BaseException as e:  # noqa: BLE001 - the main thread asserts on it
            errors.append(e)

    threads = [threading.Thread(target=prepare, args=(shard,)) for shard in (3, 4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert errors == []
    on_disk = sorted(f for f in os.listdir(cache) if f in sizes)
    assert on_disk == [_shard_name(s) for s in (1, 2, 3, 4)], f"limit {limit}: {on_disk}"
    assert _cache_bytes(cache, sizes)[0] <= limit
    assert dataset.cache_usage == index + sum(sizes[f] for f in on_disk)  # the reservations settled
    stream.prepare_shard = download
    moments = schema.vae_moments_column(64)
    np.testing.assert_array_equal(dataset[0][moments], stored[0][moments])  # shard 0 again: shard 1 makes room
    assert sorted(f for f in os.listdir(cache) if f in sizes) == [_shard_name(s) for s in (0, 2, 3, 4)]
    del dataset


def test_without_a_cache_limit_streamings_cache_lock_is_taken_once_a_shard_not_once_a_sample(pristine, stored,
                                                                                               tmp_path, monkeypatch):
    """Streaming's prefetch thread prepares each sample's shard, and its step makes and takes the node's
    cache file lock every time (to touch the shard's access time, which only its evictions read; it means
    to keep the lock, but looks for it under another name). Without a cache limit a shard prepared and
    checked stays so: the lock was taken 76 times in 2 epochs of 40 samples (BENCHMARKS.md, "The loader's
    cache lock per sample"); now at most once a shard once the first epoch has checked them (in the first, a
    shard still being checked by the reading thread may be locked again), and every sample still reads what was
    written."""
    mds = _copy(pristine, "none", tmp_path)
    dataset = mds_source.LatentDataset(local=mds, resolution=64, batch_size=4, predownload=4)
    taken = []

    class Counting(FileLock):
        def acquire(self, *args, **kwargs):
            if self.lock_file == dataset._cache_filelock_path:
                taken.append(1)
            return super().acquire(*args, **kwargs)

    monkeypatch.setattr(streaming.base.dataset, "FileLock", Counting)
    moments = schema.vae_moments_column(64)
    per_epoch = []
    for epoch in range(2):
        read, before = [], len(taken)
        for sample in dataset:
            index = sample[schema.BATCH_SAMPLE_INDEX]
            np.testing.assert_array_equal(sample[moments], stored[index][moments])
            read.append(index)
        assert sorted(read) == list(range(N))
        per_epoch.append(len(taken) - before)
    # the first epoch prepares every shard (a fresh cache: at least once a shard); the second finds them checked
    assert per_epoch[0] >= N // PER_SHARD and per_epoch[1] <= N // PER_SHARD, per_epoch
    del dataset


def _prefetch_threads_end(it, within: float = 5.0) -> bool:
    """Whether both of an epoch's prefetch threads (streaming's prepare and ready threads) end within ``within`` s."""
    import time
    deadline = time.monotonic() + within
    while time.monotonic() < deadline:
        if it._num_exited >= 2:
            return True
        time.sleep(0.01)
    return False


def test_an_epoch_left_early_stops_its_prefetch_threads(pristine, stored, tmp_path):
    """Streaming ends an epoch's prepare and ready threads only when the epoch is read to its end, another
    starts, or a thread fails. An epoch left early without an error (a loop's break,
    ``eval_subset_num_batches``, a run's last batch mid-epoch) kept both for the life of the process: preparing
    shards ahead (downloading and hashing them) until the read-ahead window filled, then waking every 7 ms.
    Now they end as soon as the epoch's reading does, and the next epoch reads every sample as before."""
    remote = _copy(pristine, "none", tmp_path)
    dataset = mds_source.LatentDataset(remote=remote, local=str(tmp_path / "cache"), resolution=64, batch_size=4,
                                       predownload=PER_SHARD)
    epoch = iter(dataset)
    moments = schema.vae_moments_column(64)
    for _ in range(3):
        sample = next(epoch)
        np.testing.assert_array_equal(sample[moments], stored[sample[schema.BATCH_SAMPLE_INDEX]][moments])
    it = dataset._iterator
    del epoch  # the loop let go of it
    assert _prefetch_threads_end(it), (it._num_exited, it.prepare_index, it.ready_index, it.yield_index)
    assert sorted(s[schema.BATCH_SAMPLE_INDEX] for s in dataset) == list(range(N))
    del dataset


def test_a_missing_index_names_it(pristine, stored, dim, tmp_path):
    mds = _copy(pristine, "none", tmp_path)
    os.remove(os.path.join(mds, "index.json"))
    assert "is missing" in _fails_naming(os.path.join(mds, "index.json"), mds, dim, stored)


# ---- a read-only compressed dataset, the batch size, the switch for hash checks -------------------------

@pytest.fixture
def unwritable():
    """Make a directory unwritable in a way its owner and root respect: the immutable attribute as
    root (root ignores a mode of 555), a mode of 555 otherwise. Undone at teardown."""
    made = []

    def make(path):
        if os.geteuid() == 0:
            subprocess.run(["chattr", "+i", path], check=True)
        else:
            os.chmod(path, 0o555)
        made.append(path)
        with pytest.raises(PermissionError):  # the setup holds: nothing can be written in it
            open(os.path.join(path, "probe"), "w")
        return path

    yield make
    for path in made:
        if os.geteuid() == 0:
            subprocess.run(["chattr", "-i", path], check=True)
        else:
            os.chmod(path, 0o755)


def _listing(root):
    return sorted((os.path.relpath(os.path.join(d, f), root), os.stat(os.path.join(d, f)).st_mtime_ns)
                  for d, _, files in os.walk(root) for f in files)


def test_a_read_only_compressed_dataset_is_read_through_a_cache(pristine, stored, dim, tmp_path, unwritable,
                                                                monkeypatch):
    # Streaming decompresses a shard beside its .zstd; in a read-only directory it cannot, and the loader
    # then returned no sample. What this proves: with the directory truly unwritable (even to root), every
    # sample is read, twice, and again by a restarted loader, and nothing in the directory changes.
    mds = _copy(pristine, "zstd", tmp_path)
    assert not os.path.exists(_shard_file(mds, raw=True))  # compressed only
    before = _listing(unwritable(mds))
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "tmp"))  # where the default cache goes
    os.makedirs(tempfile.tempdir)
    loader = mds_source.build_dataloader(_cfg(mds), resolution=64, text_dim=dim)
    for _ in range(2):
        assert sorted(_epoch(mds, dim, stored, loader)) == list(range(N))
    del loader
    cache = shard_checks.default_cache(mds)
    assert cache.startswith(tempfile.tempdir)
    assert sorted(f for f in os.listdir(cache) if f.endswith(".mds")) == [f"shard.{i:05d}.mds" for i in range(5)]
    assert sorted(_epoch(mds, dim, stored)) == list(range(N))  # a restart reuses the cache
    assert _listing(mds) == before


def test_a_read_only_compressed_dataset_uses_the_configured_cache(pristine, stored, dim, tmp_path, unwritable):
    mds = unwritable(_copy(pristine, "zstd", tmp_path))
    cache = str(tmp_path / "cache")
    assert sorted(_epoch(mds, dim, stored, local=cache)) == list(range(N))
    assert os.path.isfile(os.path.join(cache, "shard.00004.mds"))


def test_a_shard_missing_from_a_read_only_dataset_names_it(pristine, stored, dim, tmp_path, unwritable):
    mds = _copy(pristine, "zstd", tmp_path)
    path = _shard_file(mds)
    os.remove(path)
    unwritable(mds)
    message = _fails_naming(path, mds, dim, stored, local=str(tmp_path / "cache"))
    assert f"shard {path} of dataset {mds} is missing" in message


def test_a_read_only_uncompressed_dataset_is_read_in_place(pristine, stored, dim, tmp_path, unwritable):
    mds = _copy(pristine, "none", tmp_path)
    before = _listing(unwritable(mds))
    assert not shard_checks.needs_decompression_cache(mds)
    assert sorted(_epoch(mds, dim, stored)) == list(range(N))
    assert _listing(mds) == before


def test_a_writable_compressed_dataset_decompresses_in_place(pristine, stored, dim, tmp_path):
    mds = _copy(pristine, "zstd", tmp_path)
    assert not shard_checks.needs_decompression_cache(mds)
    assert sorted(_epoch(mds, dim, stored)) == list(range(N))
    assert os.path.isfile(_shard_file(mds, raw=True))


def test_a_batch_larger_than_the_dataset_is_refused_at_start(pristine, dim, tmp_path):
    mds = _copy(pristine, "none", tmp_path)
    with pytest.raises(ConfigError) as e:
        mds_source.build_dataloader(_cfg(mds, batch_size=N + 8), resolution=64, text_dim=dim)
    message = str(e.value)
    assert message == (f"data.train.batch_size 48 is larger than dataset {mds}, which holds 40 samples: no full "
                       f"batch can be made; set data.train.batch_size to at most 40")
    assert mds_source.build_dataloader(_cfg(mds, batch_size=N), resolution=64, text_dim=dim)  # one batch: fine


def test_hash_checks_can_be_switched_off_in_the_config(pristine, stored, dim, tmp_path):
    mds = _copy(pristine, "none", tmp_path)
    path = _shard_file(mds, shard=1)
    _flip(path)  # inside a sample's arrays: only the hash sees it
    assert "xxh64" in _fails_naming(path, mds, dim, stored)
    loader = mds_source.build_dataloader(_cfg(mds, verify_shards=False), resolution=64, text_dim=dim)
    assert loader.dataset.verify_hashes is False
    assert len([i for batch in loader for i in batch[schema.BATCH_SAMPLE_INDEX].tolist()]) == N
    os.truncate(path, 100)  # sizes are checked regardless
    with pytest.raises(DataIntegrityError, match="truncated"):
        mds_source.build_dataloader(_cfg(mds, verify_shards=False), resolution=64, text_dim=dim)


def test_the_fastest_recorded_hash_is_checked():
    assert shard_checks.pick_hash({"sha1": "", "xxh64": "", "xxh3_64": ""}) == "xxh3_64"
    assert shard_checks.pick_hash({"sha1": "", "xxh64": ""}) == "xxh64"
    assert shard_checks.pick_hash({"sha1": "", "md5": ""}) == "md5"
    assert shard_checks.pick_hash({}) is None


# ---- shared memory at a training start: another job's survives, a killed run's goes (issue 13) ---------

_JOB = """
import sys
from diffusion.loader.mds_source import LatentDataset
dataset = LatentDataset(remote=None, local=sys.argv[1], resolution=64, batch_size=4)
dataset[0]
print(dataset._shm_prefix_int, flush=True)
for line in sys.stdin:  # "read": read every sample again and say how many
    print(sum(1 for _ in dataset), flush=True)
"""


def _start_job(mds):
    """Another process on this node with a dataset open (its own session: killing it kills its
    resource tracker too, as killing a job's process group does); returns (process, shm prefix)."""
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    job = subprocess.Popen([sys.executable, "-c", _JOB, mds], cwd=root, stdin=subprocess.PIPE,
                           stdout=subprocess.PIPE, text=True, start_new_session=True,
                           env=dict(os.environ, PYTHONPATH=root, OMP_NUM_THREADS="1"))
    return job, int(job.stdout.readline())


def _segments(prefix_int):
    return sorted(name for name in os.listdir("/dev/shm") if name.startswith(f"{prefix_int:06d}_"))


def test_cleanup_at_start_keeps_another_jobs_shared_memory_and_removes_a_killed_ones(pristine, tmp_path):
    live, live_prefix = _start_job(_copy(pristine, "none", tmp_path / "live"))
    killed, killed_prefix = _start_job(_copy(pristine, "none", tmp_path / "killed"))
    try:
        live_segments = _segments(live_prefix)
        assert live_segments and _segments(killed_prefix)
        os.killpg(killed.pid, signal.SIGKILL)
        killed.wait()
        assert _segments(killed_prefix)  # left behind

        shared_memory.clean_shared_memory()  # what a new training run does at start

        assert _segments(killed_prefix) == []
        assert _segments(live_prefix) == live_segments
        live.stdin.write("read\n")
        live.stdin.flush()
        assert live.stdout.readline().strip() == str(N)  # the other job reads on
    finally:
        for job in (live, killed):
            if job.poll() is None:
                job.stdin.close()  # the job ends, and removes its shared memory as it exits
                job.wait(timeout=60)


def test_a_name_this_process_mapped_before_it_was_removed_does_not_keep_a_killed_jobs_segments():
    """A prefix is reused once its segments are removed, while a process may still map the removed
    ones (the kernel lists them as "(deleted)"): that mapping is another file, not a use of the new one."""
    taken = {shared_memory._prefix_of(name) for name in os.listdir("/dev/shm") + os.listdir(tempfile.gettempdir())}
    prefix = next(p for p in range(900_000, 999_999) if p not in taken)
    path = f"/dev/shm/{prefix:06d}_locals"
    fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_RDWR, 0o600)
    os.ftruncate(fd, 4096)
    earlier = mmap.mmap(fd, 4096)  # this process's earlier dataset at that prefix, its segment since removed
    os.close(fd)
    os.unlink(path)
    killed = [f"/dev/shm/{prefix:06d}_{name}" for name in ("locals", "barrier")]
    try:
        for name in killed:  # the prefix taken again by a job that was killed: nothing maps its segments
            with open(name, "wb") as f:
                f.write(np.int32(64).tobytes() + bytes(60))
        shared_memory.clean_shared_memory()
        assert [name for name in killed if os.path.exists(name)] == []
    finally:
        earlier.close()
        for name in killed:
            if os.path.exists(name):
                os.unlink(name)


def test_run_py_refuses_a_batch_larger_than_the_dataset_in_one_line(pristine, train_kit, tmp_path, capfd):
    """run.py's refusal through its entry in this process (train_fixtures.run_py_here)."""
    from train_fixtures import run_py_here, tiny_overrides
    mds = _copy(pristine, "none", tmp_path)
    result = run_py_here(capfd, "yamls/tiny-cpu.yaml", *tiny_overrides(train_kit, mds, batch_size=48))
    assert result.returncode == 2, result.stderr[-2000:]
    assert "Traceback" not in result.stderr
    assert (f"run.py: error: data.train.batch_size 48 is larger than dataset {mds}, which holds 40 samples"
            in result.stderr)
