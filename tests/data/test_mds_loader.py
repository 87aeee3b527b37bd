"""The streaming loader: contract batches, unscaled moments, caption dropout, mismatch errors."""

import os

import numpy as np
import pytest
import torch

from diffusion.config import EvalLoaderConfig, TrainLoaderConfig
from diffusion.data import contract, mds_loader
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
    loader = mds_loader.build_dataloader(EvalLoaderConfig(path=mds, batch_size=8, num_workers=0),
                                         resolution=64, text_dim=dim)
    batch = next(iter(loader))
    assert batch[contract.BATCH_MOMENTS].shape == (8, 8, 8, 8)
    assert batch[contract.BATCH_TEXT_EMBEDS].shape == (8, 77, dim)
    index = int(batch[contract.BATCH_SAMPLE_INDEX][3])
    stored = _stored(mds, index)
    # the loader hands the moments over untouched: the model alone scales them
    np.testing.assert_array_equal(batch[contract.BATCH_MOMENTS][3].numpy(),
                                  stored[contract.vae_moments_column(64)])
    np.testing.assert_array_equal(batch[contract.BATCH_TEXT_EMBEDS][3].numpy(), stored[contract.TEXT_EMBEDS])
    del loader


def test_caption_dropout_substitutes_the_empty_embedding(mds, dim):
    dataset = mds_loader.build_dataset(_loader_cfg(mds, caption_dropout=0.5), resolution=64, text_dim=dim,
                                       device_batch_size=8)
    empty = np.load(f"{mds}/{contract.EMPTY_TEXT_EMBEDS}")
    dropped = []
    for i in range(32):
        text = dataset[i][contract.BATCH_TEXT_EMBEDS]
        is_empty = np.array_equal(text, empty)
        assert is_empty or np.array_equal(text, _stored(mds, i)[contract.TEXT_EMBEDS])
        assert is_empty == dataset.drops_caption(i, 0)
        dropped.append(is_empty)
    assert 6 <= sum(dropped) <= 26  # about half of 32
    # reproducible per (sample, epoch), and a different subset in another epoch
    assert [dataset.drops_caption(i, 0) for i in range(32)] == dropped
    assert [dataset.drops_caption(i, 1) for i in range(32)] != dropped
    del dataset


def test_no_dropout_by_default_in_eval(mds):
    assert EvalLoaderConfig(path=mds).caption_dropout == 0.0
    assert TrainLoaderConfig(path=mds).caption_dropout == 0.1


def test_resolution_mismatch_is_a_clear_error(mds, dim):
    with pytest.raises(mds_loader.DatasetMismatchError, match=r"resolutions \[64\].*512"):
        mds_loader.build_dataset(_loader_cfg(mds), resolution=512, text_dim=dim, device_batch_size=8)


def test_text_dim_mismatch_is_a_clear_error(mds, dim):
    with pytest.raises(mds_loader.DatasetMismatchError, match="dimension 64.*1024"):
        mds_loader.build_dataset(_loader_cfg(mds), resolution=64, text_dim=1024, device_batch_size=8)


def test_shards_without_the_resolution_name_the_sample_and_their_columns(mds):
    empty = np.load(f"{mds}/{contract.EMPTY_TEXT_EMBEDS}")  # dataset.json checked only by build_dataset
    dataset = mds_loader.LatentDataset(remote=None, local=mds, resolution=128, empty_text_embeds=empty,
                                       batch_size=8)
    with pytest.raises(mds_loader.DatasetMismatchError, match=f"sample 3 has no column {contract.vae_moments_column(128)}"):
        dataset[3]
    del dataset


def test_missing_dataset_json_names_the_path(tmp_path):
    with pytest.raises(FileNotFoundError, match="dataset.json"):
        mds_loader.read_dataset_info(str(tmp_path))


def test_batch_tensors_are_torch_with_the_contract_dtypes(mds, dim):
    batch = next(iter(mds_loader.build_dataloader(_loader_cfg(mds), resolution=64, text_dim=dim)))
    assert all(isinstance(v, torch.Tensor) for v in batch.values())
    assert batch[contract.BATCH_MOMENTS].dtype == torch.float16
    assert batch[contract.BATCH_INPUT_IDS].dtype == torch.int64
    assert batch[contract.BATCH_SAMPLE_INDEX].dtype == torch.int64
    batch[contract.BATCH_TEXT_EMBEDS] += 1  # writable: the model may work in place


@pytest.mark.parametrize("compression", [None, "zstd"])
@pytest.mark.parametrize("cache_limit", [None, "1gb"])
def test_every_sample_reads_exactly_what_streaming_decodes(train_kit, tmp_path, compression, cache_limit):
    # Zero-copy reads from memory-mapped shards where possible (uncompressed, or zstd once streaming
    # has decompressed the shard), streaming's own path under a cache limit: the same values either way.
    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=20, samples_per_shard=8,
                           compression=compression)
    empty = np.load(os.path.join(mds, contract.EMPTY_TEXT_EMBEDS))
    dataset = mds_loader.LatentDataset(remote=None, local=mds, resolution=64, empty_text_embeds=empty,
                                       batch_size=4, cache_limit=cache_limit)
    items = [dataset[i] for i in range(len(dataset))]
    for i, item in enumerate(items):
        stored = _stored(mds, i)
        np.testing.assert_array_equal(item[contract.BATCH_MOMENTS], stored[contract.vae_moments_column(64)])
        np.testing.assert_array_equal(item[contract.BATCH_TEXT_EMBEDS], stored[contract.TEXT_EMBEDS])
        np.testing.assert_array_equal(item[contract.BATCH_INPUT_IDS], stored[contract.INPUT_IDS])
        assert item[contract.BATCH_SAMPLE_INDEX] == i
    del dataset


def test_caption_dropout_rate_holds_over_many_draws():
    draws = [mds_loader.unit_hash(0, epoch, i) for epoch in range(3) for i in range(4000)]
    assert all(0 <= d < 1 for d in draws)
    assert 0.09 < np.mean(np.array(draws) < 0.1) < 0.11
