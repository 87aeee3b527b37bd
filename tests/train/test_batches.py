"""One batch step for both sources: the same rows give the same batches offline (MDS) and online (stream)."""

import numpy as np
import torch

from diffusion import schema
from diffusion.config import TrainLoaderConfig
from diffusion.train import mds_source
from diffusion.train.batches import CaptionDropout, ToModelBatch, unit_hash
from diffusion.train.ray_workers import ShardBatches
from train_fixtures import kit_text_dim, write_latent_mds

N = 32


class RowsAsStream:
    """Stands in for a worker's Ray Data shard: the rows in order, as numpy column batches."""

    def __init__(self, columns: dict):
        self.columns = columns

    def iter_batches(self, batch_size, batch_format, drop_last, prefetch_batches):
        for start in range(0, N - batch_size + 1, batch_size):
            yield {name: values[start:start + batch_size] for name, values in self.columns.items()}


def test_the_same_rows_give_identical_batches_offline_and_online(train_kit, tmp_path):
    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=N)
    cfg = TrainLoaderConfig(path=mds, batch_size=8, num_workers=0, persistent_workers=False, shuffle=False,
                            caption_dropout=0.5)
    offline = list(mds_source.build_dataloader(cfg, resolution=64, text_dim=kit_text_dim(train_kit), seed=11))

    from streaming import LocalDataset
    rows = LocalDataset(mds)
    names = (schema.vae_moments_column(64), schema.TEXT_EMBEDS, schema.INPUT_IDS, schema.CAPTION, schema.KEY)
    stream = {name: np.stack([rows[i][name] for i in range(N)]) if name not in (schema.CAPTION, schema.KEY)
              else np.array([rows[i][name] for i in range(N)], dtype=object) for name in names}
    empty = np.load(f"{mds}/{schema.EMPTY_TEXT_EMBEDS}")
    # as online.py builds it: the same class, the training seed, the pass as the epoch
    to_batch = ToModelBatch(64, empty, CaptionDropout(0.5, seed=11))
    online = list(ShardBatches(RowsAsStream(stream), batch_size=8, to_batch=to_batch, max_passes=1))

    assert len(offline) == len(online) == N // 8
    dropped = 0
    for a, b in zip(offline, online):
        for key in (schema.BATCH_MOMENTS, schema.BATCH_TEXT_EMBEDS, schema.BATCH_INPUT_IDS):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        dropped += int((a[schema.BATCH_TEXT_EMBEDS] == torch.from_numpy(empty)).all(dim=(1, 2)).sum())
    assert 0 < dropped < N  # both sources dropped the same captions, and some were dropped


def test_dropout_is_a_pure_function_of_seed_epoch_and_key():
    dropout = CaptionDropout(0.3, seed=2)
    keys = [f"{i:09d}" for i in range(200)]
    first = dropout.mask(keys, epoch=0)
    assert np.array_equal(dropout.mask(list(reversed(keys)), epoch=0), first[::-1])  # position plays no part
    assert np.array_equal(CaptionDropout(0.3, seed=2).mask(keys, epoch=0), first)  # another process, same answer
    assert not np.array_equal(dropout.mask(keys, epoch=1), first)
    assert not np.array_equal(CaptionDropout(0.3, seed=3).mask(keys, epoch=0), first)
    assert not CaptionDropout(0.0, seed=2).mask(keys, epoch=0).any()


def test_dropout_rate_holds_over_many_draws():
    draws = [unit_hash(0, epoch, i) for epoch in range(3) for i in range(4000)]
    assert all(0 <= d < 1 for d in draws)
    assert 0.09 < np.mean(np.array(draws) < 0.1) < 0.11
