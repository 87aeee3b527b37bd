"""--recaption: an image-to-text model writes a new caption column (issue 27 item 3), on the tiny kit's
random BLIP captioner over a small sample. (Over buckets: test_buckets.py's bucketed conversion captions too.)"""

import functools
import json
import os
import re
import shutil
import signal

import numpy as np
import pytest

from diffusion import schema
from diffusion.convert import pipeline
from diffusion.convert.pipeline import ConvertConfig, plan_pools, run_conversion
from diffusion.convert.recaption import Recaptioner
from diffusion.convert.sink import KEYS_RECORD
from diffusion.errors import ConfigError, OutputMismatchError

RES = 64
MAX_TOKENS = 5  # the tiny captioner never ends early: every caption is this many words


@pytest.fixture(scope="module")
def small_sample(tmp_path_factory):
    """(input dir, manifest): 40 rows in 3 parquet files, bad rows among them."""
    from diffusion.kit.sample import write_sample_data
    out = tmp_path_factory.mktemp("recaption_sample")
    return str(out), write_sample_data(out, n=40, seed=3, rows_per_shard=16)


@pytest.fixture(scope="module")
def recaption_config(small_sample, tiny_kit, tiny_captioner):
    def make(output, **overrides):
        options = dict(input=small_sample[0], output=str(output), model=tiny_kit, resolutions=(RES,), progress=False,
                       recaption=tiny_captioner, recaption_batch_size=8, recaption_max_tokens=MAX_TOKENS)
        return ConvertConfig(**{**options, **overrides})
    return make


@pytest.fixture(scope="module")
def recaptioned(recaption_config, ray_local, tmp_path_factory):
    """(output dir, summary) of a clean conversion with --recaption."""
    out = tmp_path_factory.mktemp("recaptioned")
    return str(out), run_conversion(recaption_config(out))


@functools.lru_cache(maxsize=None)  # an output is read once: each StreamingDataset holds descriptors till exit
def _read_back(local):
    from streaming import StreamingDataset
    ds = StreamingDataset(local=str(local), shuffle=False, batch_size=1)
    return [ds[i] for i in range(len(ds))]


def _captions(out, name=schema.RECAPTION) -> dict[str, str]:
    column = schema.caption_columns(name)[0]
    samples = _read_back(str(out))
    keys = [s[schema.KEY] for s in samples]
    assert len(keys) == len(set(keys)), "a row was written twice"
    return {s[schema.KEY]: s[column] for s in samples}


def test_every_image_gets_a_caption_stored_and_encoded_as_one_more_caption(recaptioned, small_sample, tiny_kit,
                                                                             tiny_captioner):
    from diffusion.convert.encoders import TextEncoder
    out, summary = recaptioned
    manifest = small_sample[1]
    captions = _captions(out)
    assert summary.written == len(captions) == manifest["good"]
    assert all(isinstance(c, str) and len(c.split()) == MAX_TOKENS for c in captions.values())
    assert len(set(captions.values())) > len(captions) // 2  # the model looks at each row's own image
    with open(os.path.join(out, "index.json")) as f:
        shard = json.load(f)["shards"][0]
    text, embeds, ids = schema.caption_columns(schema.RECAPTION)
    assert dict(zip(shard["column_names"], shard["column_encodings"]))[text] == "str"
    info = schema.DatasetInfo.load(out)
    # one more caption: encoded as the first (training draws it with data.train.captions), none empty
    assert info.captions == [schema.CAPTION, schema.RECAPTION] and info.empty_captions == {schema.RECAPTION: 0}
    encoder = TextEncoder(tiny_kit, device="cpu")
    for s in _read_back(str(out))[:3]:
        assert ids not in s  # --text embeds: the embeddings only, as for the first caption
        np.testing.assert_allclose(s[embeds].astype(np.float32),
                                   encoder.encode_captions([s[text]])[0].astype(np.float32), atol=2e-3)
    assert info.extra["recaption"]["model"] == os.path.abspath(tiny_captioner)
    assert info.extra["recaption"]["column"] == schema.RECAPTION
    # the original captions are kept and encoded as before
    originals = {s[schema.KEY]: s[schema.CAPTION] for s in _read_back(str(out))}
    assert originals.keys() == captions.keys() and all(originals[k] != captions[k] for k in captions)
    assert "recaption_seconds" in summary.stage_seconds


def test_each_caption_is_the_models_caption_of_that_rows_image(recaptioned, small_sample, tiny_kit, tiny_captioner):
    """Not shuffled between rows: a sample's stored caption is what the captioner says of its own crop."""
    from diffusion.convert.readers import iter_rows
    from diffusion.convert.transforms import ImageCaptionTransform
    rows = list(iter_rows(small_sample[0], on_reject=lambda rejects: None))
    crops = ImageCaptionTransform(tiny_kit, (RES,))({c: np.array([r[c] for r in rows], dtype=object)
                                                     for c in (schema.RAW_KEY, schema.RAW_CAPTION, schema.RAW_IMAGE)})
    direct = Recaptioner(tiny_captioner, RES, max_new_tokens=MAX_TOKENS).caption(list(crops[schema.image_column(RES)]))
    assert dict(zip(crops[schema.KEY], direct)) == _captions(recaptioned[0])


@pytest.fixture(scope="module")
def resumed(recaption_config, recaptioned, tmp_path_factory):
    """(output dir, summary, the refusals' errors, the kill's marker) of a copy of the clean output less a part
    the "killed" run never committed: re-run with other --recaption settings (each refused, the error kept or
    None), then resumed with a captioning actor whose process is killed (SIGKILL) on its second batch, once.
    One conversion for the resume and the killed actor (fresh Ray actors and their imports are most of one); the
    part with the most rows is lost, and in batches of 2 (not a setting) its rows are several batches, so the
    kill comes after one is done."""
    tmp = tmp_path_factory.mktemp("resumed")
    out = tmp / "resumed"
    shutil.copytree(recaptioned[0], out)
    parts = sorted(p for p in os.listdir(out) if p.startswith("part-"))
    lost = max(parts, key=lambda p: len(json.loads((out / p / KEYS_RECORD).read_text())))  # the most rows
    shutil.rmtree(out / lost)  # a part the "killed" run never committed
    (out / "index.json").unlink()
    refusals = []
    for other in (dict(recaption_column="blip_caption"), dict(recaption=None)):
        try:
            run_conversion(recaption_config(out, **other))
            refusals.append(None)
        except OutputMismatchError as e:
            refusals.append(e)
    marker = tmp / "killed"
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(pipeline, "Recaptioner", _dies_once(str(marker)))
        summary = run_conversion(recaption_config(out, recaption_batch_size=2))
    return out, summary, refusals, marker


def test_a_killed_captioning_actor_is_restarted_and_every_image_still_gets_its_caption(recaptioned, resumed):
    """The captioning actor's process is killed (SIGKILL) on its second batch, once: Ray restarts the
    actor and retries the batch, and the output is the clean run's, row for row."""
    out, summary, _, marker = resumed
    assert marker.exists(), "the actor was never killed"
    assert summary.written == recaptioned[1].written
    assert _captions(out) == _captions(recaptioned[0])


def _dies_once(marker: str):
    """A Recaptioner whose process kills itself on its second batch unless ``marker`` exists (a class
    made here is pickled by value, so the Ray workers need not import this test module)."""
    class DiesOnce(Recaptioner):
        batches = 0

        def __call__(self, batch):
            self.batches += 1
            if self.batches == 2 and not os.path.exists(marker):
                with open(marker, "w") as f:
                    f.write(str(os.getpid()))
                os.kill(os.getpid(), signal.SIGKILL)
            return super().__call__(batch)
    return DiesOnce


def test_resume_keeps_the_captions_and_other_recaption_settings_are_refused(recaptioned, resumed):
    out, summary, refusals, _ = resumed
    for refusal in refusals:  # another --recaption-column, no --recaption: refused before anything is touched
        assert isinstance(refusal, OutputMismatchError) and re.search("recaption", str(refusal)), refusal
    assert 0 < summary.written_this_run < summary.written == recaptioned[1].written
    assert _captions(out) == _captions(recaptioned[0])


def test_crops_of_bucketed_rows_caption_as_the_same_arrays(tiny_captioner):
    from diffusion.convert.recaption import crops_of
    rng = np.random.default_rng(0)
    crops = [rng.integers(0, 256, (h, w, 3), dtype=np.uint8) for w, h in ((96, 64), (64, 96), (96, 64))]
    names = [schema.bucket_name(c.shape[1], c.shape[0]) for c in crops]
    batch = {schema.BUCKET: np.array(names, dtype=object),
             schema.image_column(RES): np.array([c.tobytes() for c in crops], dtype=object)}
    assert all(np.array_equal(a, b) for a, b in zip(crops_of(batch, RES), crops))
    captioner = Recaptioner(tiny_captioner, RES, column="blip", max_new_tokens=3)
    out = captioner(batch)
    text = schema.caption_columns("blip")[0]
    assert list(out[text]) == captioner.caption(crops) and all(out[text])
    assert set(out) >= set(batch)


@pytest.mark.parametrize("column", [schema.CAPTION, "recap", "re-cap", ""])
def test_a_recaption_column_that_would_replace_another_is_refused(column):
    with pytest.raises(ConfigError, match="--recaption-column"):
        ConvertConfig(input="x", output="y", model="m", resolutions=(RES,), recaption="m2", recaption_column=column,
                      captions="caption,recap")


def test_pools_with_recaption_leave_room_for_read_tasks_and_share_one_gpu():
    two_cpus = plan_pools({"CPU": 2.0}, ConvertConfig(input="x", output="y", model="m", recaption="c"))
    assert (two_cpus.num_recaptioners, two_cpus.gpus_per_recaptioner) == (1, 0.0)
    assert (two_cpus.num_transformers * two_cpus.cpus_per_transformer + two_cpus.cpus_per_encoder
            + two_cpus.cpus_per_recaptioner) <= 1.0
    one_gpu = plan_pools({"CPU": 8.0, "GPU": 1.0}, ConvertConfig(input="x", output="y", model="m", recaption="c"))
    assert one_gpu.gpus_per_recaptioner + one_gpu.num_encoders * one_gpu.gpus_per_encoder <= 1.0
    eight = plan_pools({"CPU": 64.0, "GPU": 8.0}, ConvertConfig(input="x", output="y", model="m", recaption="c"))
    assert (eight.num_recaptioners, eight.num_encoders) == (4, 4)
    assert eight.num_recaptioners * eight.gpus_per_recaptioner + eight.num_encoders * eight.gpus_per_encoder == 8
    off = plan_pools({"CPU": 2.0}, ConvertConfig(input="x", output="y", model="m"))
    assert off.num_recaptioners == 0


class _WritesMarker:
    """Unpickling it writes ``marker``: what an attacker puts in a pickled weight file."""

    def __init__(self, marker):
        self.marker = str(marker)

    def __reduce__(self):
        return exec, (f"open({self.marker!r}, 'w').write('code ran')",)


def _pickled_captioner(tiny_captioner, out, marker):
    """The tiny captioner with its weights in a pickled pytorch_model.bin that also carries a payload."""
    import torch
    from safetensors.torch import load_file
    shutil.copytree(tiny_captioner, out)
    weights = load_file(str(out / "model.safetensors"))
    (out / "model.safetensors").unlink()
    torch.save({**weights, "payload": _WritesMarker(marker)}, str(out / "pytorch_model.bin"))
    return out


def _remote_code_captioner(tiny_captioner, out, marker):
    """The tiny captioner whose processor config asks for its own code, a module that writes ``marker``."""
    shutil.copytree(tiny_captioner, out)
    (out / "processing_evil.py").write_text(f"open({str(marker)!r}, 'w').write('code ran')\n")
    config = out / "preprocessor_config.json"
    config.write_text(json.dumps({**json.loads(config.read_text()),
                                  "auto_map": {"AutoProcessor": "processing_evil.EvilProcessor"}}))
    return out


@pytest.mark.parametrize("make, message", [
    (_pickled_captioner, r" holds its weights only as pickled files \(pytorch_model.bin\), which can run code when "
                         r"loaded: give a copy with .safetensors weights$"),
    (_remote_code_captioner, r": preprocessor_config.json asks for the model's own code \(auto_map\), which the "
                             r"converter never runs"),
])
def test_a_pickled_or_remote_code_captioner_is_refused_in_one_line_before_ray_starts(
        make, message, recaption_config, tiny_captioner, tmp_path, monkeypatch):
    from diffusion.errors import ModelReferenceError
    marker = tmp_path / "marker"
    hostile = make(tiny_captioner, tmp_path / "hostile", marker)
    monkeypatch.setattr(pipeline, "init_ray", lambda *a, **k: pytest.fail("Ray started"))
    with pytest.raises(ModelReferenceError, match=r"^--recaption .*hostile" + message):
        run_conversion(recaption_config(tmp_path / "out", recaption=str(hostile)))
    assert not marker.exists() and not (tmp_path / "out").exists()


def test_the_command_refuses_a_pickled_captioner_in_one_line(small_sample, tiny_kit, tiny_captioner, tmp_path):
    import subprocess
    import sys
    marker = tmp_path / "marker"
    hostile = _pickled_captioner(tiny_captioner, tmp_path / "hostile", marker)
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "convert/laion_to_mds.py", "--input", small_sample[0], "--output",
                           str(tmp_path / "out"), "--model", tiny_kit, "--resolutions", str(RES), "--recaption",
                           str(hostile)], cwd=root, capture_output=True, text=True, timeout=300)
    assert done.returncode == 2, done.stderr
    assert done.stderr.strip().splitlines() == [f"laion_to_mds: error: --recaption {hostile} holds its weights only "
                                                f"as pickled files (pytorch_model.bin), which can run code when loaded: "
                                                f"give a copy with .safetensors weights"]
    assert not marker.exists()
