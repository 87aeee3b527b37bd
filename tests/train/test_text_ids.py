"""Training from stored token ids (datasets converted with --text ids): the frozen text encoder runs in the
step, training matches training from the stored embeddings of the same rows, caption dropout gives the
empty caption's embedding, a resumed run is exact, and a wrong setup fails at start naming its cause."""

import json
import os
import shutil

import numpy as np
import pytest
import torch
from composer.core import Callback

from diffusion import schema
from diffusion.train.callbacks.text_encoder_share import TextEncoderShare
from diffusion.train.config import load_config
from diffusion.errors import ConfigError, DatasetMismatchError, ModelReferenceError
from diffusion.train.trainer import build_trainer
from train_fixtures import close_trainer, fit_in_process, kit_text_dim, tiny_overrides, write_latent_mds

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(ROOT, "yamls", "tiny-cpu.yaml")
N = 48


class RecordLosses(Callback):
    """Each step's loss, and at fit end the text encoder's share of step time, if the run logged one."""

    def __init__(self):
        self.losses, self.share = [], None

    def after_loss(self, state, logger):
        self.losses.append(float(state.loss))

    def fit_end(self, state, logger):
        self.share = next((c.last for c in state.callbacks if isinstance(c, TextEncoderShare)), None)


@pytest.fixture(scope="module")
def datasets(train_kit, tiny_kit, tmp_path_factory):
    """The same 48 rows three ways: embeddings only, ids only, both; the text is the tiny kit's real
    tokenizer and text encoder (what the converter would store)."""
    root = tmp_path_factory.mktemp("text")
    return {text: write_latent_mds(str(root / text), kit=train_kit, n=N, text_encoder=tiny_kit, text=text)
            for text in schema.TEXT_STORAGE}


@pytest.fixture(scope="module")
def ids_run(train_kit, datasets, tmp_path_factory):
    """6 batches from the ids dataset without EMA, saving at batch 3 and 6: the run that training from the stored
    embeddings must match, and the straight run a resumed one must equal (one run for both tests)."""
    folder = tmp_path_factory.mktemp("ids-run") / "straight"
    weights, losses, share = _fit(_config(train_kit, datasets["ids"], "algorithms={}", "trainer.save_interval=3ba",
                                          save_folder=str(folder)))  # model.text=auto
    return {"weights": weights, "losses": losses, "share": share, "folder": folder}


def _config(kit, mds, *extra, batches=6, save_folder=None):
    return load_config(TINY, tiny_overrides(kit, mds, batches=batches, save_folder=save_folder, extra=extra))


def _fit(cfg):
    record = RecordLosses()
    weights, _ = fit_in_process(cfg, [record])
    return weights, record.losses, record.share


def _copy_with_dataset_json(source: str, out, **changes) -> str:
    """A copy of dataset ``source`` at ``out`` whose dataset.json has ``changes`` (a None value: the field
    dropped, as in a dataset.json written before it existed)."""
    shutil.copytree(source, out)
    path = out / schema.DATASET_JSON
    recorded = {**json.loads(path.read_text()), **changes}
    path.write_text(json.dumps({k: v for k, v in recorded.items() if v is not None}))
    return str(out)


@pytest.mark.slow
def test_training_from_ids_matches_training_from_the_stored_embeddings(train_kit, datasets, ids_run):
    # Tolerance: the text encoder runs on CPU in fp32 in both cases (the converter's embeddings here,
    # the step's there) and both are rounded to float16, so only the batch composition (4 captions
    # encoded together vs a batch of 8) can change a last bit: losses agree to 1e-4 relative per step.
    embeds, embeds_losses, no_share = _fit(_config(train_kit, datasets["embeds"], "algorithms={}"))
    ids, ids_losses, share = ids_run["weights"], ids_run["losses"], ids_run["share"]  # the same, from ids
    assert len(ids_losses) == len(embeds_losses) == 6
    np.testing.assert_allclose(ids_losses, embeds_losses, rtol=1e-4)
    assert ids_losses[-1] != ids_losses[0]  # it trained
    for name in embeds:
        torch.testing.assert_close(ids[name], embeds[name], rtol=1e-3, atol=1e-5, msg=name)
    assert all(name.startswith("denoiser.") for name in ids)  # the text encoder is no part of the trained model
    assert no_share is None and share is not None and 0 < share < 1  # its share of step time is logged


def test_caption_dropout_with_ids_gives_the_empty_captions_embedding(train_kit, datasets):
    cfg = _config(train_kit, datasets["both"], "model.text=ids", "data.train.caption_dropout=0.5")
    trainer = build_trainer(cfg)
    model = trainer.state.model
    empty_ids = torch.tensor(schema.DatasetInfo.load(datasets["both"]).empty_input_ids)
    empty = torch.from_numpy(np.load(os.path.join(datasets["both"], schema.EMPTY_TEXT_EMBEDS)))
    dropped = kept = 0
    for batch in trainer.state.train_dataloader:
        assert schema.BATCH_TEXT_EMBEDS not in batch  # the step encodes the ids
        embeds, _ = model.conditioning(batch)
        for row, ids in enumerate(batch[schema.BATCH_INPUT_IDS]):
            if torch.equal(ids, empty_ids):
                dropped += 1
                torch.testing.assert_close(embeds[row].float(), empty.float(), rtol=0, atol=2e-3)
            else:
                kept += 1
                assert (embeds[row].float() - empty.float()).abs().max() > 0.1
    assert dropped > 5 and kept > 5
    close_trainer(trainer)


@pytest.mark.slow
def test_resume_from_ids_equals_a_straight_run(train_kit, datasets, ids_run, tmp_path):
    n = 3
    straight = ids_run["folder"]
    weights, losses = ids_run["weights"], ids_run["losses"]
    resumed = tmp_path / "resumed"
    resumed.mkdir()
    first = next(p for p in os.listdir(straight) if p.endswith(f"ba{n}-rank0.pt"))
    shutil.copy(straight / first, resumed / first)
    os.symlink(first, resumed / "latest-rank0.pt")
    weights2, losses2, _ = _fit(_config(train_kit, datasets["ids"], "algorithms={}", "trainer.save_interval=3ba",
                                        "trainer.autoresume=true", batches=2 * n, save_folder=str(resumed)))
    assert len(losses) == 2 * n and losses2 == losses[n:]  # the same batches, dropout and noise after the restart
    for name in weights:
        assert torch.equal(weights2[name], weights[name]), name
    checkpoint = torch.load(straight / first, map_location="cpu", weights_only=False)
    assert all(k.startswith("denoiser.") or k == "_extra_state" for k in checkpoint["state"]["model"])


def _other_text_encoder(tiny_kit, out) -> str:
    """A kit whose text encoder has the tiny kit's shape but other weights."""
    from transformers import CLIPTextModel
    source = CLIPTextModel.from_pretrained(os.path.join(tiny_kit, "text_encoder"))
    torch.manual_seed(1234)
    CLIPTextModel(source.config).save_pretrained(os.path.join(out, "text_encoder"))
    return str(out)


def test_a_missing_or_wrong_text_encoder_fails_at_start_naming_it(train_kit, tiny_kit, datasets, tmp_path):
    ids = datasets["ids"]
    with pytest.raises(ModelReferenceError, match=r"text encoder .*/nowhere.* cannot be loaded"):
        build_trainer(_config(train_kit, ids, f"model.text_encoder={tmp_path}/nowhere"))
    # the training kit has the text encoder's config but no weights
    with pytest.raises(ModelReferenceError, match=r"text encoder .*train_kit.*model.text_encoder.* no weights"):
        build_trainer(_config(train_kit, ids, f"model.text_encoder={train_kit}"))
    other = _other_text_encoder(tiny_kit, tmp_path / "other")
    with pytest.raises(DatasetMismatchError, match=r"does not give the dataset's empty_text_embeds.npy"):
        build_trainer(_config(train_kit, ids, f"model.text_encoder={other}"))
    # the dataset's own record of its text encoder points nowhere (moved, or another machine's path)
    moved = _copy_with_dataset_json(ids, tmp_path / "moved", text_encoder=str(tmp_path / "gone"))
    with pytest.raises(ModelReferenceError, match=r"text encoder .*gone.* \(the text encoder dataset.json records\)"):
        build_trainer(_config(train_kit, moved))


def test_a_text_encoder_that_differs_only_past_the_empty_caption_is_refused_at_start(train_kit, tiny_kit, datasets,
                                                                                      tmp_path):
    """The empty caption's check alone passes an encoder whose word embeddings differ: dataset.json's
    text_probe (the converter's fingerprint of its encoder) catches it, naming it."""
    from transformers import CLIPTextModel
    ids = datasets["ids"]
    info = json.loads(open(os.path.join(ids, schema.DATASET_JSON)).read())
    encoder = CLIPTextModel.from_pretrained(os.path.join(tiny_kit, "text_encoder"))
    with torch.no_grad():  # every token the empty caption does not hold: "" still encodes the same
        table = encoder.get_input_embeddings().weight  # transformers 4 and 5 alike
        words = torch.ones(table.shape[0], dtype=torch.bool)
        words[torch.as_tensor(sorted(set(info["empty_input_ids"])))] = False
        table[words] += 0.5 * torch.randn_like(table[words])
    encoder.save_pretrained(str(tmp_path / "words" / "text_encoder"))
    words = str(tmp_path / "words")
    assert info["text_probe"]["captions"] and len(info["text_probe"]["mean_embedding"][0]) == kit_text_dim(train_kit)
    without_probe = _copy_with_dataset_json(ids, tmp_path / "old", text_probe=None)  # written before the probe
    close_trainer(build_trainer(_config(train_kit, without_probe, f"model.text_encoder={words}")))  # not caught
    with pytest.raises(DatasetMismatchError, match=r"^text encoder '.*words' \(model.text_encoder\) does not give "
                                                   r"the embeddings dataset.json's text_probe recorded"):
        build_trainer(_config(train_kit, ids, f"model.text_encoder={words}"))
    close_trainer(build_trainer(_config(train_kit, ids, f"model.text_encoder={tiny_kit}")))  # its own encoder


def test_which_text_a_run_reads_is_refused_at_start_where_a_dataset_lacks_it(train_kit, datasets):
    with pytest.raises(DatasetMismatchError, match=r"holds token ids but no text embeddings .* model.text=embeds"):
        build_trainer(_config(train_kit, datasets["ids"], "model.text=embeds"))
    with pytest.raises(DatasetMismatchError, match=r"holds no token ids .* model.text=ids"):
        build_trainer(_config(train_kit, datasets["embeds"], "model.text=ids"))
    # a text encoder named for a run that reads stored embeddings was ignored (issue 47 item 7): refused
    with pytest.raises(ConfigError, match=r"^model.text_encoder=.* is read only when the run trains from token ids"):
        build_trainer(_config(train_kit, datasets["both"], f"model.text_encoder={train_kit}"))
    mix = ["data.train.path=null", f"data.train.streams=[{{path: {datasets['embeds']}}}, {{path: {datasets['ids']}}}]"]
    with pytest.raises(DatasetMismatchError, match=r"holds text embeddings only where .* holds token ids only"):
        build_trainer(_config(train_kit, datasets["embeds"], *mix))
    # a dataset holding both mixes with either kind: here with one of ids, every sample is encoded
    mix = ["data.train.path=null", f"data.train.streams=[{{path: {datasets['both']}}}, {{path: {datasets['ids']}}}]"]
    trainer = build_trainer(_config(train_kit, datasets["both"], *mix))
    batch = next(iter(trainer.state.train_dataloader))
    assert trainer.state.model.text_encoder is not None and schema.BATCH_TEXT_EMBEDS not in batch
    close_trainer(trainer)


def test_a_dataset_written_before_text_storage_was_recorded_trains_from_its_ids(train_kit, datasets, tmp_path):
    # Its dataset.json has no text, text_encoder or empty_input_ids: it holds both columns (as every
    # dataset did), its text encoder is its model, and the empty caption's ids are its tokenizer's.
    want = schema.DatasetInfo.load(datasets["both"]).empty_input_ids
    old = _copy_with_dataset_json(datasets["both"], tmp_path / "old", text=None, text_encoder=None,
                                  empty_input_ids=None)
    info = schema.DatasetInfo.load(old)
    assert info.text == schema.TEXT_BOTH and info.empty_input_ids is None
    trainer = build_trainer(_config(train_kit, old, "model.text=ids", "data.train.caption_dropout=0.5"))
    dropped = 0
    for batch in trainer.state.train_dataloader:
        dropped += int((batch[schema.BATCH_INPUT_IDS] == torch.tensor(want)).all(dim=1).sum())
    assert dropped > 5 and trainer.state.model.text_encoder is not None
    close_trainer(trainer)


def test_a_dataset_json_naming_an_unknown_text_storage_is_named_as_damaged(train_kit, datasets, tmp_path):
    from diffusion.errors import DataIntegrityError
    damaged = _copy_with_dataset_json(datasets["ids"], tmp_path / "damaged", text="idz")
    with pytest.raises(DataIntegrityError, match=r"damaged/dataset.json is not a dataset.json .*text='idz'"):
        build_trainer(_config(train_kit, damaged))


def test_a_text_encoder_that_differs_only_on_words_the_probe_lacks_is_refused_by_its_weights(train_kit, tiny_kit,
                                                                                            datasets, tmp_path):
    """The probe captions' embeddings pass an encoder whose other token rows differ, though it encodes the
    dataset's own captions quite differently: the sha256 of the weights text_probe records catches it,
    naming the encoder. A dataset.json written before that field keeps the probe check alone."""
    from transformers import CLIPTextModel

    from diffusion.models.loading import load_tokenizer
    from diffusion.models.text_encoder import tokenize
    ids = datasets["ids"]
    info = json.loads(open(os.path.join(ids, schema.DATASET_JSON)).read())
    assert len(info["text_probe"]["weights_sha256"]) == 64
    encoder = CLIPTextModel.from_pretrained(os.path.join(tiny_kit, "text_encoder"))
    captions = torch.as_tensor(tokenize(load_tokenizer(tiny_kit), ["class 3", "class 7"])[0]).long()
    with torch.no_grad():
        own = encoder(captions).last_hidden_state
    kept = {int(i) for row in info["text_probe"]["input_ids"] for i in row} | set(info["empty_input_ids"])
    with torch.no_grad():
        table = encoder.get_input_embeddings().weight
        others = torch.ones(table.shape[0], dtype=torch.bool)
        others[torch.as_tensor(sorted(kept))] = False
        table[others] += 0.5 * torch.randn_like(table[others])
        changed = encoder(captions).last_hidden_state
    encoder.save_pretrained(str(tmp_path / "others" / "text_encoder"))
    assert (changed - own).abs().max() > 0.3 * own.abs().max()  # the dataset's own captions: far off
    others = str(tmp_path / "others")
    with pytest.raises(DatasetMismatchError, match=r"^text encoder '.*others' \(model.text_encoder\) is not the one "
                                                   r"dataset .*ids was converted with: its weights' sha256 [0-9a-f]{16} "
                                                   r"differs from the [0-9a-f]{16} that dataset.json's text_probe"):
        build_trainer(_config(train_kit, ids, f"model.text_encoder={others}"))
    old = {k: v for k, v in info["text_probe"].items() if k != "weights_sha256"}
    before_the_field = _copy_with_dataset_json(ids, tmp_path / "old", text_probe=old)
    close_trainer(build_trainer(_config(train_kit, before_the_field, f"model.text_encoder={others}")))  # probe only
    close_trainer(build_trainer(_config(train_kit, ids, f"model.text_encoder={tiny_kit}")))  # its own encoder


def test_on_a_gpu_only_local_rank_0_loads_the_text_encoder_in_float32_and_every_rank_trains_it_in_bf16(
        train_kit, datasets, monkeypatch):
    """A T5-XXL in float32 is ~19 GB: one copy a node for the start-up checks, not one a rank (issue 49 item 5)."""
    import gc
    import diffusion.train.trainer as trainer_module
    from diffusion.models import loading

    class Captured(Exception):
        pass

    def no_trainer(**kwargs):
        raise Captured

    loaded, real_load = [], loading.load_text_encoder
    monkeypatch.setattr(loading, "load_text_encoder", lambda ref, dtype=None: (loaded.append(dtype), real_load(ref, dtype))[1])
    monkeypatch.setattr(trainer_module, "Trainer", no_trainer)
    monkeypatch.setattr(trainer_module, "_on_gpu", lambda cfg: True)
    monkeypatch.setattr(trainer_module, "encoding_dtype", lambda kind: torch.bfloat16 if kind == "cuda" else torch.float32)
    attached = []
    real_attach = trainer_module.attach_text_encoder
    monkeypatch.setattr(trainer_module, "attach_text_encoder",
                        lambda cfg, model, *a: (real_attach(cfg, model, *a), attached.append(model.text_encoder))[0])
    for rank in (0, 1):
        monkeypatch.setattr(trainer_module.dist, "get_local_rank", lambda rank=rank: rank)
        with pytest.raises(Captured):
            build_trainer(_config(train_kit, datasets["ids"]))
        gc.collect()
    assert loaded == [None, torch.bfloat16]  # rank 0: float32 for the checks; rank 1: bf16 from the start
    assert [next(e.model.parameters()).dtype for e in attached] == [torch.bfloat16, torch.bfloat16]
