"""Long-caption text encoders (issue 27 item 4): a T5 text encoder, a configurable text length, and each
caption's attention mask (its stored token count) reaching both denoisers, from embeddings and from ids."""

import os

import numpy as np
import pytest
import torch

from diffusion import schema
from diffusion.errors import ConfigError, DatasetMismatchError
from diffusion.kit.sample import RECAP

LENGTH = 24  # tokens per caption: longer than most sample captions, shorter than every dense one
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "yamls", "tiny-cpu.yaml")


def _read_back(local):
    from streaming import StreamingDataset
    ds = StreamingDataset(local=str(local), shuffle=False, batch_size=1)
    return [ds[i] for i in range(len(ds))]


@pytest.fixture(scope="module")
def t5_data(convert_config, tiny_t5_kit, ray_local, tmp_path_factory):
    """40 sample rows converted with the tiny T5, both text storages, two captions, 24 tokens each."""
    from diffusion.convert.pipeline import run_conversion
    out = tmp_path_factory.mktemp("t5")
    run_conversion(convert_config(out, model=tiny_t5_kit, resolutions=(64,), text="both", text_length=LENGTH,
                                  captions=f"caption,{RECAP}", limit=40))
    return str(out), _read_back(out)


def test_t5_captions_are_stored_with_their_token_counts_and_encoded_under_their_mask(t5_data, tiny_t5_kit):
    from diffusion.models import loading
    out, rows = t5_data
    info = schema.DatasetInfo.load(out)
    assert (info.text_length, info.text_encoder_type, info.empty_text_tokens) == (LENGTH, "t5", 1)
    tokenizer, encoder = loading.load_tokenizer(tiny_t5_kit), loading.load_text_encoder(tiny_t5_kit)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id
    unmasked_differs = truncated = 0
    for row in rows:
        for name in (schema.CAPTION, RECAP):
            text, embeds, ids = schema.caption_columns(name)
            count = int(row[schema.tokens_column(name)])
            if row[text] == "":  # an empty dense caption: "" is </s> alone
                assert count == 1
                continue
            unpadded = tokenizer(row[text], truncation=True, max_length=LENGTH)["input_ids"]
            assert row[ids].shape == (LENGTH,) and count == len(unpadded) and row[ids][:count].tolist() == unpadded
            assert row[ids][count - 1] == eos and (row[ids][count:] == pad).all()
            truncated += count == LENGTH
            assert row[embeds].shape == (LENGTH, info.text_dim)
            mask = torch.arange(LENGTH)[None] < count
            with torch.no_grad():
                ids_ = torch.tensor(row[ids], dtype=torch.long)[None]
                masked = encoder(ids_, attention_mask=mask.long()).last_hidden_state[0].numpy()
                plain = encoder(ids_).last_hidden_state[0].numpy()
            np.testing.assert_allclose(row[embeds][:count], masked[:count], atol=2e-3, rtol=2e-3)
            unmasked_differs += count < LENGTH and np.abs(plain[:count] - row[embeds][:count]).max() > 1e-2
    assert unmasked_differs > 10  # the padding would have changed them: the mask was applied
    assert truncated > 10  # the dense captions are longer than LENGTH: cut, ending in </s>


def test_the_loader_gives_the_drawn_captions_token_count(t5_data):
    from diffusion.loader.captions import CaptionChoice
    from diffusion.loader.mds_source import build_dataset
    from diffusion.train.config import TrainLoaderConfig
    out, rows = t5_data
    stored = {r[schema.KEY]: r for r in rows}
    probabilities = {schema.CAPTION: 0.5, RECAP: 0.5}
    cfg = TrainLoaderConfig(path=out, batch_size=4, num_workers=0, shuffle=False, captions=probabilities)
    dataset = build_dataset(cfg, resolution=64, text_dim=64, device_batch_size=4, text_column=schema.INPUT_IDS,
                            seed=3, tokens=True)
    choice, recaps = CaptionChoice.from_mapping(probabilities, seed=3), 0
    for i in range(len(dataset)):
        sample = dataset[i]
        assert dataset._layout(dataset.spanner[i][0]) is not None  # read from the mapped shard, counts too
        row = stored[sample[schema.KEY]]
        name = choice.choose(sample[schema.KEY], 0)
        name = name if row[schema.caption_columns(name)[0]] != "" else schema.CAPTION
        recaps += name == RECAP
        assert int(sample[schema.TEXT_TOKENS]) == int(row[schema.tokens_column(name)])
        np.testing.assert_array_equal(sample[schema.INPUT_IDS], row[schema.caption_columns(name)[2]])
    assert 0 < recaps < len(dataset)


def test_a_clip_text_encoder_refuses_a_longer_text(convert_config, tmp_path):
    from diffusion.convert.pipeline import run_conversion
    with pytest.raises(ConfigError, match="--text-length 100: .* is CLIP, which reads at most 77 tokens"):
        run_conversion(convert_config(tmp_path / "out", text_length=100))
    assert not (tmp_path / "out").exists()


# ---- training and sampling: the mask reaches both denoisers --------------------------------------------

class FirstBatch:
    def __new__(cls):
        from composer.core import Callback

        class Record(Callback):
            def __init__(self):
                self.batch = None

            def after_train_batch(self, state, logger):
                if self.batch is None:
                    self.batch = {k: v.clone() for k, v in state.batch.items() if isinstance(v, torch.Tensor)}
        return Record()


def _config(kit, data, denoiser, text, *extra):
    from diffusion.train.config import load_config
    from train_fixtures import tiny_overrides
    # the MMDiT masks a T5 on request (SD3 trains it unmasked, the default since issue 47 item 14)
    objective = (["model.objective=flow", "model.prediction_type=null", "model.text_mask=true"]
                 if denoiser == "SD3Transformer2DModel" else [])
    return load_config(TINY, tiny_overrides(kit, data, batches=2, batch_size=4, extra=(
        f"model.denoiser={denoiser}", f"model.text={text}", "algorithms={}", "data.train.caption_dropout=0.3",
        *objective, *extra)))


@pytest.mark.parametrize("denoiser", ["UNet2DConditionModel", "SD3Transformer2DModel"])
@pytest.mark.parametrize("text", ["embeds", "ids"])
def test_a_t5_conditions_both_denoisers_through_the_mask(t5_data, tiny_t5_kit, denoiser, text):
    from diffusion.models.sampling import Sampler
    from diffusion.train.trainer import build_trainer
    from train_fixtures import close_trainer
    out, rows = t5_data
    record = FirstBatch()
    trainer = build_trainer(_config(tiny_t5_kit, out, denoiser, text))
    trainer.state.callbacks.append(record)
    trainer.fit()
    model = trainer.state.model
    batch = record.batch
    # model.text_mask (the UNet's default for a T5: on; the MMDiT's asked for), and checkpoints say so
    assert model.text_mask and model.description.text_mask and model.description.text_length == LENGTH
    assert batch[schema.BATCH_TEXT_TOKENS].shape == (4,)
    embeds, mask = model.conditioning(batch)
    assert embeds.shape == (4, LENGTH, 64) and torch.equal(mask.sum(1), batch[schema.BATCH_TEXT_TOKENS])
    if text == "ids":  # the frozen T5 gives what the converter stored (both ran it under the mask)
        stored = torch.stack([torch.as_tensor(rows[i][schema.TEXT_EMBEDS]) for i in batch[schema.BATCH_SAMPLE_INDEX]])
        dropped = batch[schema.BATCH_TEXT_TOKENS] == 1
        keep = mask & ~dropped[:, None]
        torch.testing.assert_close(embeds.float()[keep], stored.float()[keep], atol=2e-3, rtol=2e-3)

    # padding changes nothing the denoiser predicts; a caption token does
    model.eval()
    noisy = torch.randn(4, 4, 8, 8, generator=torch.Generator().manual_seed(0))
    steps = torch.full((4,), 500.0)
    with torch.no_grad():
        base = model.adapter(model.denoiser, noisy, steps, embeds.float(), text_mask=mask)
        padding = embeds.float() + 5.0 * (~mask)[..., None]
        on_padding = model.adapter(model.denoiser, noisy, steps, padding, text_mask=mask)
        caption = embeds.float() + 5.0 * (torch.arange(LENGTH) == 0)[None, :, None]
        on_caption = model.adapter(model.denoiser, noisy, steps, caption, text_mask=mask)
        unmasked = model.adapter(model.denoiser, noisy, steps, padding)
    torch.testing.assert_close(on_padding, base, atol=1e-5, rtol=1e-5)
    assert (on_caption - base).abs().max() > 1e-3 and (unmasked - base).abs().max() > 1e-3

    # sampling pads prompts to the trained length and hands the denoiser their masks, CFG's doubled batch too
    seen = []
    hook = model.denoiser.register_forward_hook(  # a forward hook sees the kwargs the call ran with
        lambda _, args, kwargs, output: seen.append((kwargs["encoder_hidden_states"].shape,
                                             kwargs.get("encoder_attention_mask") if denoiser.startswith("UNet")
                                             else (kwargs.get("joint_attention_kwargs") or {}).get("attention_mask"))),
        with_kwargs=True)
    try:
        images = Sampler(model.description)(model.denoiser, ["a red circle above a blue square"], steps=2,
                                            guidance_scale=3.0, size=64)
    finally:
        hook.remove()
    close_trainer(trainer)
    assert len(images) == 1 and images[0].size == (64, 64)
    assert seen and all(shape == (2, LENGTH, 64) and m is not None and m.shape == (2, LENGTH) for shape, m in seen)
    negative, positive = seen[0][1].bool()
    assert int(negative.sum()) == 1 and int(positive.sum()) == 8  # "" is </s>; 7 words and </s>


def test_text_mask_on_a_dataset_without_token_counts_is_one_line(train_kit, tmp_path):
    from diffusion.train.config import load_config
    from diffusion.train.trainer import build_trainer
    from train_fixtures import tiny_overrides, write_latent_mds
    data = write_latent_mds(str(tmp_path / "old"), kit=train_kit, n=16)  # as written before token counts
    cfg = load_config(TINY, tiny_overrides(train_kit, data, batches=1, batch_size=4, extra=("model.text_mask=true",)))
    with pytest.raises(DatasetMismatchError, match="stores no token counts .*convert it again, or set "
                                                   "model.text_mask=false"):
        build_trainer(cfg)


def test_a_t5_text_length_past_what_it_reads_is_refused_before_ray_starts(convert_config, tiny_t5_kit, tmp_path,
                                                                           monkeypatch):
    """100000 tokens once started Ray, then failed allocating 1.28 TB: the tokenizer's model_max_length
    (the tiny T5's: 64) bounds it, and where the tokenizer states none, 4096 does."""
    import json
    import shutil

    from diffusion.convert import pipeline
    monkeypatch.setattr(pipeline, "init_ray", lambda *a, **k: pytest.fail("Ray started"))
    with pytest.raises(ConfigError, match=r"^--text-length 100000: the text encoder of .*tiny-t5 \(t5\) reads at most "
                                          r"64 tokens \(its tokenizer's model_max_length\); give --text-length 64 or less$"):
        pipeline.run_conversion(convert_config(tmp_path / "out", model=tiny_t5_kit, text_length=100000))
    assert not (tmp_path / "out").exists()
    unstated = tmp_path / "kit"
    shutil.copytree(tiny_t5_kit, unstated)
    config = unstated / "tokenizer" / "tokenizer_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()), "model_max_length": int(1e30)}))
    with pytest.raises(ConfigError, match=r"reads at most 4096 tokens \(the limit for a T5 whose tokenizer states none"):
        pipeline.run_conversion(convert_config(tmp_path / "out", model=str(unstated), text_length=5000))
    pipeline.check_text_length(str(unstated), 4096)  # up to it: accepted


def test_an_export_of_a_masked_model_samples_as_its_checkpoint(t5_data, tiny_t5_kit, tmp_path, capsys):
    """The export keeps text_mask and text_length where our sampler reads them: generate on the export
    draws what generate on the checkpoint draws (the review found 19.5/255 apart without them)."""
    from diffusion.models import sampling
    from diffusion.sample import export, generate
    from diffusion.train.trainer import build_trainer
    from train_fixtures import close_trainer
    out, _ = t5_data
    folder = tmp_path / "checkpoints"
    trainer = build_trainer(_config(tiny_t5_kit, out, "SD3Transformer2DModel", "embeds",
                                    f"trainer.save_folder={folder}", "trainer.save_interval=2ba"))
    trainer.fit()
    close_trainer(trainer)
    checkpoint = str(folder / "latest-rank0.pt")
    exported = export.export_pipeline(checkpoint, str(tmp_path / "pipe"))
    printed = capsys.readouterr().out
    assert f"generate --checkpoint {exported} (it reads {sampling.TEXT_CONDITIONING})" in printed
    described = sampling.load_trained(exported).description
    assert described.text_mask and described.text_length == LENGTH
    kwargs = dict(steps=3, guidance_scale=4.0, seed=3)
    prompts = ["a red circle above a blue square", "a green triangle"]
    ours = generate.generate_images(checkpoint, prompts, **kwargs)
    theirs = generate.generate_images(exported, prompts, **kwargs)
    for a, b in zip(ours, theirs):
        assert np.abs(np.asarray(a, np.int16) - np.asarray(b, np.int16)).max() <= 2
