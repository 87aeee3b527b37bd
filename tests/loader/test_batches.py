"""One batch step for both sources: the same rows give the same batches offline (MDS) and online (stream),
and each sample's random draws are its own (seed, epoch, key), read by a forward that compiles whole."""

import numpy as np
import pytest
import torch

from diffusion import schema
from diffusion.train.config import TrainLoaderConfig
from diffusion.loader import mds_source
from diffusion.loader.batches import CaptionDropout, NoiseDraws, ToModelBatch, unit_hash
from diffusion.stream.ray_workers import ShardBatches
from train_fixtures import kit_text_dim, write_latent_mds

N = 32


class RowsAsStream:
    """Stands in for a worker's Ray Data shard: the rows in order, as numpy column batches."""

    def __init__(self, columns: dict):
        self.columns = columns

    def iter_batches(self, batch_size, batch_format, drop_last, prefetch_batches):
        for start in range(0, N - batch_size + 1, batch_size):
            yield {name: values[start:start + batch_size] for name, values in self.columns.items()}


@pytest.mark.parametrize("text", [schema.TEXT_EMBEDS, schema.INPUT_IDS])
def test_the_same_rows_give_identical_batches_offline_and_online(train_kit, tmp_path, text):
    mds = write_latent_mds(str(tmp_path / "mds"), kit=train_kit, n=N)
    cfg = TrainLoaderConfig(path=mds, batch_size=8, num_workers=0, persistent_workers=False, shuffle=False,
                            caption_dropout=0.5)
    noise = NoiseDraws(seed=11, perturbation=True)
    offline = list(mds_source.build_dataloader(cfg, resolution=64, text_dim=kit_text_dim(train_kit), seed=11,
                                               noise=noise, text_column=text))

    from streaming import LocalDataset
    rows = LocalDataset(mds)
    names = (schema.vae_moments_column(64), schema.TEXT_EMBEDS, schema.INPUT_IDS, schema.CAPTION, schema.KEY)
    stream = {name: np.stack([rows[i][name] for i in range(N)]) if name not in (schema.CAPTION, schema.KEY)
              else np.array([rows[i][name] for i in range(N)], dtype=object) for name in names}
    if text == schema.TEXT_EMBEDS:
        empty = np.load(f"{mds}/{schema.EMPTY_TEXT_EMBEDS}")
    else:
        empty = np.asarray(schema.DatasetInfo.load(mds).empty_input_ids)
    text_key = schema.BATCH_TEXT_EMBEDS if text == schema.TEXT_EMBEDS else schema.BATCH_INPUT_IDS
    # as online.py builds it: the same class, the training seed, the pass as the epoch
    to_batch = ToModelBatch(64, empty, CaptionDropout(0.5, seed=11), noise, text_column=text)
    online = list(ShardBatches(RowsAsStream(stream), batch_size=8, to_batch=to_batch, max_passes=1))

    assert len(offline) == len(online) == N // 8
    dropped = 0
    for a, b in zip(offline, online):
        for key in (schema.BATCH_MOMENTS, text_key, schema.BATCH_NOISE,
                    schema.BATCH_POSTERIOR_NOISE, schema.BATCH_OFFSET_NOISE, schema.BATCH_TIMESTEP_DRAW,
                    schema.BATCH_PERTURBATION_NOISE):
            assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
        assert set(a) - {schema.BATCH_SAMPLE_INDEX} == set(b)  # only stored samples have an index
        empty_rows = (a[text_key] == torch.from_numpy(empty).to(a[text_key].dtype))
        dropped += int(empty_rows.flatten(1).all(dim=1).sum())
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


def test_each_sample_draws_its_own_noise_from_seed_epoch_and_key():
    keys = [f"{i:09d}" for i in range(64)]
    draws = NoiseDraws(seed=4)
    first = draws(keys, 0, (4, 8, 8))
    # alone, in another order, or in another process: the same numbers for the same sample
    alone = draws(keys[5:6], 0, (4, 8, 8))
    backwards = NoiseDraws(seed=4)(keys[::-1], 0, (4, 8, 8))
    for name, values in first.items():
        assert torch.equal(alone[name][0], values[5]), name
        assert torch.equal(backwards[name], values.flip(0)), name
    # switching input perturbation on adds a draw and changes none of the others
    with_perturbation = NoiseDraws(seed=4, perturbation=True)(keys, 0, (4, 8, 8))
    for name, values in first.items():
        assert torch.equal(with_perturbation[name], values), name
    # another epoch or seed: other numbers
    assert not torch.allclose(draws(keys, 1, (4, 8, 8))[schema.BATCH_NOISE], first[schema.BATCH_NOISE])
    assert not torch.allclose(NoiseDraws(seed=5)(keys, 0, (4, 8, 8))[schema.BATCH_NOISE], first[schema.BATCH_NOISE])
    # the distributions the model assumes: N(0, 1) noises, a U[0, 1) timestep draw
    noise = first[schema.BATCH_NOISE]
    assert abs(noise.mean()) < 0.05 and 0.95 < noise.std() < 1.05
    assert not torch.allclose(first[schema.BATCH_NOISE], first[schema.BATCH_POSTERIOR_NOISE])
    u = first[schema.BATCH_TIMESTEP_DRAW]
    assert u.min() >= 0 and u.max() < 1 and 0.35 < u.mean() < 0.65


@pytest.mark.parametrize("recipe", ["unet-v", "mmdit-flow"])
def test_the_training_forward_compiles_without_graph_breaks(recipe, request):
    """The noise path reads the batch's draws: no generator, no ``.item()``, nothing to break the graph,
    for the UNet with every DDPM option and the MMDiT with rectified flow (σ table, SD3 weighting)."""
    import torch._dynamo

    from diffusion.train.config import FlowConfig, ModelConfig
    from diffusion.models.latent_diffusion import build_model
    if recipe == "unet-v":
        kit = request.getfixturevalue("train_kit")
        model_cfg = ModelConfig(ref=kit, resolution=64, prediction_type="v_prediction", offset_noise=0.1,
                                input_perturbation=0.1, min_snr_gamma=5.0)
    else:
        kit = request.getfixturevalue("mmdit_train_kit")
        model_cfg = ModelConfig(ref=kit, resolution=64, objective="flow", flow=FlowConfig(shift=3.0, weighting="cosmap"))
    info = schema.DatasetInfo(model=kit, scaling_factor=0.18215, resolutions=[64], text_dim=kit_text_dim(kit))
    model = build_model(model_cfg, info)
    n, keys = 2, ["a", "b"]
    batch = {schema.BATCH_MOMENTS: torch.randn(n, 8, 8, 8), schema.BATCH_TEXT_EMBEDS: torch.randn(n, 77, model.text_dim),
             **NoiseDraws(seed=0, perturbation=True)(keys, 0, (4, 8, 8))}

    def step(batch):
        return model.loss(model(batch), batch)

    torch._dynamo.reset()
    explanation = torch._dynamo.explain(step)(batch)
    assert explanation.graph_break_count == 0, [str(b.reason) for b in explanation.break_reasons]
    assert explanation.graph_count == 1
