"""The streaming loader: contract batches, unscaled moments, caption dropout, mismatch errors."""


import numpy as np
import pytest
import torch

from diffusion.train.config import EvalLoaderConfig, TrainLoaderConfig
from diffusion import schema
from diffusion.loader import dataset_info, mds_source
from diffusion.loader.batches import CaptionDropout
from train_fixtures import kit_text_dim, write_latent_mds


@pytest.fixture(scope="module")
def mds(train_kit, tmp_path_factory):
    return write_latent_mds(str(tmp_path_factory.mktemp("mds")), kit=train_kit, n=32)


@pytest.fixture(scope="module")
def dim(train_kit):
    return kit_text_dim(train_kit)


def _stored(mds, index):
    from streaming import LocalDataset
    return LocalDataset(mds)[index]


def _loader_cfg(mds, **kw):
    return TrainLoaderConfig(path=mds, batch_size=8, num_workers=0, persistent_workers=False, **kw)


def test_batches_carry_the_contract_keys_and_unscaled_moments(mds, dim):
    loader = mds_source.build_dataloader(EvalLoaderConfig(path=mds, batch_size=8, num_workers=0),
                                         resolution=64, text_dim=dim)
    batch = next(iter(loader))
    assert batch[schema.BATCH_MOMENTS].shape == (8, 8, 8, 8)
    assert batch[schema.BATCH_TEXT_EMBEDS].shape == (8, 77, dim)
    index = int(batch[schema.BATCH_SAMPLE_INDEX][3])
    stored = _stored(mds, index)
    # the loader hands the moments over untouched: the model alone scales them
    np.testing.assert_array_equal(batch[schema.BATCH_MOMENTS][3].numpy(),
                                  stored[schema.vae_moments_column(64)])
    np.testing.assert_array_equal(batch[schema.BATCH_TEXT_EMBEDS][3].numpy(), stored[schema.TEXT_EMBEDS])
    del loader


def _texts(mds, dim, loader_cfg):
    """(text embeddings, keys) of every sample, in order, through the training loader."""
    texts, keys = [], []
    for batch in mds_source.build_dataloader(loader_cfg, resolution=64, text_dim=dim, seed=5):
        for i in batch[schema.BATCH_SAMPLE_INDEX].tolist():
            keys.append(_stored(mds, i)[schema.KEY])
        texts.extend(batch[schema.BATCH_TEXT_EMBEDS].numpy())
    return texts, keys


def test_caption_dropout_substitutes_the_empty_embedding_by_sample_key(mds, dim):
    empty = np.load(f"{mds}/{schema.EMPTY_TEXT_EMBEDS}")
    texts, keys = _texts(mds, dim, _loader_cfg(mds, caption_dropout=0.5))
    dropout = CaptionDropout(0.5, seed=5)
    dropped = []
    for text, key in zip(texts, keys):
        is_empty = np.array_equal(text, empty)
        assert is_empty or np.array_equal(text, _stored(mds, int(key))[schema.TEXT_EMBEDS])
        assert is_empty == dropout.drops(key, 0)
        dropped.append(is_empty)
    assert len(dropped) == 32 and 6 <= sum(dropped) <= 26  # about half of 32
    assert [dropout.drops(k, 1) for k in keys] != dropped  # another subset in another epoch


def test_eval_loader_drops_no_caption_and_the_train_loader_does_by_default(mds, dim):
    empty = np.load(f"{mds}/{schema.EMPTY_TEXT_EMBEDS}")
    eval_texts, _ = _texts(mds, dim, EvalLoaderConfig(path=mds, batch_size=8, num_workers=0))
    train_texts, _ = _texts(mds, dim, _loader_cfg(mds, shuffle=False))
    assert not any(np.array_equal(t, empty) for t in eval_texts)
    assert any(np.array_equal(t, empty) for t in train_texts)


def test_resolution_mismatch_is_a_clear_error(mds, dim):
    with pytest.raises(mds_source.DatasetMismatchError, match=r"resolutions \[64\].*512"):
        mds_source.build_dataset(_loader_cfg(mds), resolution=512, text_dim=dim, device_batch_size=8)


def test_a_dataset_larger_than_dev_shm_is_refused_at_start_naming_the_size_it_needs(mds, dim, monkeypatch):
    """Docker's default /dev/shm is 64 MB; past it streaming dies with a bus error at the first batch."""
    import types
    needed = 8 * 32 + 9 * mds_source.build_dataset(_loader_cfg(mds), resolution=64, text_dim=dim,
                                                   device_batch_size=8).num_shards
    monkeypatch.setattr(mds_source.os, "statvfs", lambda path: types.SimpleNamespace(f_bavail=needed - 1, f_frsize=1))
    with pytest.raises(mds_source.ConfigError, match=rf"^data.train: streaming needs about {needed} bytes of shared "
                       rf"memory .*\(32 samples an epoch, \d+ shards\) but /dev/shm has {needed - 1} bytes free: "
                       rf".*--shm-size"):
        mds_source.build_dataloader(_loader_cfg(mds), resolution=64, text_dim=dim)
    monkeypatch.setattr(mds_source.os, "statvfs", lambda path: types.SimpleNamespace(f_bavail=needed, f_frsize=1))
    loader = mds_source.build_dataloader(_loader_cfg(mds), resolution=64, text_dim=dim)  # just fits
    del loader


def test_a_dataset_of_no_samples_is_refused_in_one_line_naming_it(train_kit, dim, tmp_path):
    """A conversion whose every row was rejected writes a dataset of no samples (its summary says so); training
    on it was streaming's RuntimeError with a traceback."""
    empty = write_latent_mds(str(tmp_path / "empty"), kit=train_kit, n=0)
    with pytest.raises(mds_source.DatasetMismatchError, match=rf"^data.train: {empty} holds no samples .*convert rows"):
        mds_source.build_dataloader(_loader_cfg(empty), resolution=64, text_dim=dim)


def test_text_dim_mismatch_is_a_clear_error(mds, dim):
    with pytest.raises(mds_source.DatasetMismatchError, match="dimension 64.*1024"):
        mds_source.build_dataset(_loader_cfg(mds), resolution=64, text_dim=1024, device_batch_size=8)


def test_shards_without_the_resolution_name_the_sample_and_their_columns(mds):
    # dataset.json is checked only by build_dataset
    dataset = mds_source.LatentDataset(remote=None, local=mds, resolution=128, batch_size=8)
    with pytest.raises(mds_source.DatasetMismatchError, match=f"sample 3 has no column {schema.vae_moments_column(128)}"):
        dataset[3]
    del dataset


def test_missing_dataset_json_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset.json"):
        dataset_info.read_dataset_info(str(tmp_path))


def test_batch_tensors_are_torch_with_the_contract_dtypes(mds, dim):
    batch = next(iter(mds_source.build_dataloader(_loader_cfg(mds), resolution=64, text_dim=dim)))
    assert all(isinstance(v, torch.Tensor) for v in batch.values())
    assert batch[schema.BATCH_MOMENTS].dtype == torch.float16
    assert batch[schema.BATCH_SAMPLE_INDEX].dtype == torch.int64
    assert schema.BATCH_INPUT_IDS not in batch  # embeddings or ids, never both
    batch[schema.BATCH_TEXT_EMBEDS] += 1  # writable: the model may work in place
    ids = next(iter(mds_source.build_dataloader(_loader_cfg(mds), resolution=64, text_dim=dim,
                                                text_column=schema.INPUT_IDS)))
    assert ids[schema.BATCH_INPUT_IDS].dtype == torch.int64 and schema.BATCH_TEXT_EMBEDS not in ids


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("path", ["mapped", "streaming's"])
def test_every_sample_reads_exactly_what_streaming_decodes(train_kit, tmp_path, compression, path, monkeypatch):
    # Zero-copy reads from memory-mapped shards where possible (uncompressed, or zstd once streaming
    # has decompressed the shard), else streaming's own path: the same values either way.
    if path != "mapped":  # as for shards streaming does not hold as fixed-shape arrays
        monkeypatch.setattr(mds_source.LatentDataset, "_layout", lambda self, shard_id: None)
    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=20, samples_per_shard=8,
                           compression=compression)
    for text in (schema.TEXT_EMBEDS, schema.INPUT_IDS):
        dataset = mds_source.LatentDataset(remote=None, local=mds, resolution=64, batch_size=4,
                                           cache_limit="1gb" if path == "mapped" else None, text_column=text)
        items = [dataset[i] for i in range(len(dataset))]
        for i, item in enumerate(items):
            stored = _stored(mds, i)
            for column in (schema.vae_moments_column(64), text):
                np.testing.assert_array_equal(item[column], stored[column])
            assert item[schema.KEY] == stored[schema.KEY] and item[schema.BATCH_SAMPLE_INDEX] == i
        del dataset
