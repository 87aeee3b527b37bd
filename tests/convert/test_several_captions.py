"""Several captions per image (issue 27 item 2): the converter carries, cleans, counts and encodes each."""

import json
import os

import numpy as np
import pyarrow.parquet as pq
import pytest

from diffusion import schema
from diffusion.errors import ConfigError, OutputMismatchError
from diffusion.kit.sample import RECAP


def _read_back(local):
    from streaming import StreamingDataset
    ds = StreamingDataset(local=str(local), shuffle=False, batch_size=1)
    return [ds[i] for i in range(len(ds))]


def _input_recaps(sample_data) -> dict:
    rows = {}
    for name in sorted(os.listdir(sample_data)):
        if name.endswith(".parquet"):
            for row in pq.read_table(os.path.join(sample_data, name), columns=[schema.RAW_KEY, RECAP]).to_pylist():
                rows[row[schema.RAW_KEY]] = row[RECAP]
    return rows


@pytest.fixture(scope="module")
def two_captions(convert_config, ray_local, tmp_path_factory):
    """The sample data converted with --captions caption,recap --text both, at one resolution (the captions do
    not depend on it): (output, summary)."""
    from diffusion.convert.pipeline import run_conversion
    out = tmp_path_factory.mktemp("two-captions")
    return str(out), run_conversion(convert_config(out, captions=f"caption,{RECAP}", text="both", resolutions=(32,)))


def test_every_caption_is_stored_tokenized_and_encoded_and_empty_ones_counted(two_captions, converted, sample_data,
                                                                               tiny_kit):
    from diffusion.convert.encoders import TextEncoder
    out, summary = two_captions
    text, embeds, ids = schema.caption_columns(RECAP)
    assert (text, embeds, ids) == ("caption_recap", "text_embeds_recap", "input_ids_recap")
    samples = _read_back(out)
    # an empty second caption keeps the image: the same rows as the one-caption conversion
    assert len(samples) == summary.written == converted[1].written
    recaps = _input_recaps(sample_data)
    encoder = TextEncoder(tiny_kit, device="cpu")
    empty = 0
    for s in samples:
        assert s[text] == recaps[s[schema.KEY]].strip()
        empty += s[text] == ""
        want = encoder.tokenizer(s[text], padding="max_length", max_length=77, truncation=True)["input_ids"]
        assert s[ids].tolist() == want
        assert s[embeds].dtype == np.float16 and s[embeds].shape == s[schema.TEXT_EMBEDS].shape
    # the second caption's embeddings are the text encoder's, as the first caption's are
    for s in samples[:4]:
        np.testing.assert_allclose(s[embeds].astype(np.float32), encoder.encode_ids(s[ids][None])[0].astype(np.float32),
                                   atol=2e-3)
        assert s[schema.CAPTION] != s[text]
    assert 0 < empty < len(samples) // 3
    info = schema.DatasetInfo.load(out)
    assert info.captions == [schema.CAPTION, RECAP] and info.empty_captions == {RECAP: empty}
    assert summary.empty_captions == {RECAP: empty}
    assert f"empty caption {RECAP} (kept)" in summary.table()


def test_a_rerun_with_other_captions_is_refused_before_anything_is_touched(two_captions, convert_config):
    from diffusion.convert.pipeline import run_conversion
    out, _ = two_captions
    before = sorted(os.listdir(out))
    with pytest.raises(OutputMismatchError, match="captions"):
        run_conversion(convert_config(out, text="both"))
    assert sorted(os.listdir(out)) == before


def test_a_caption_column_the_input_lacks_is_one_line_naming_the_file_and_its_columns(convert_config, tmp_path):
    from diffusion.convert.pipeline import run_conversion
    from diffusion.errors import InputError
    with pytest.raises(InputError) as e:
        run_conversion(convert_config(tmp_path / "out", captions="caption,recap_llava"))
    message = str(e.value)
    assert "\n" not in message and "recap_llava" in message and ".parquet" in message and "--captions" in message
    assert not os.path.exists(tmp_path / "out")


@pytest.mark.parametrize("captions, problem", [("caption,recap,recap", "named twice"),
                                                ("caption,re-cap", "letters, digits and underscores"),
                                                (",,", "names no column"), ("", "names no column")])
def test_bad_caption_names_are_refused_naming_them(convert_config, tmp_path, captions, problem):
    with pytest.raises(ConfigError, match=problem):
        convert_config(tmp_path, captions=captions)


def test_a_folder_of_images_reads_further_captions_from_name_txt_files(convert_config, ray_local, tmp_path):
    # images with .txt captions: IMAGE.recap.txt beside IMAGE.jpg holds the second caption
    from PIL import Image

    from diffusion.convert.pipeline import run_conversion
    folder = tmp_path / "images"
    folder.mkdir()
    for i, color in enumerate(("red", "blue", "green")):
        Image.new("RGB", (96, 80), color).save(folder / f"img{i}.jpg")
        (folder / f"img{i}.txt").write_text(f"a {color} picture")
        if i < 2:
            (folder / f"img{i}.{RECAP}.txt").write_text(f"a flat {color} rectangle, wider than tall")
    out = tmp_path / "out"
    summary = run_conversion(convert_config(out, input=str(folder), captions=f"caption,{RECAP}"))
    samples = {s[schema.KEY]: s for s in _read_back(out)}
    assert summary.written == 3
    assert samples["img0.jpg"]["caption_recap"] == "a flat red rectangle, wider than tall"
    assert samples["img2.jpg"]["caption_recap"] == ""
    assert json.loads((out / schema.DATASET_JSON).read_text())["empty_captions"] == {RECAP: 1}


# ---- training draws one caption per sample and epoch (data.train.captions) ---------------------------

def _loader_config(path, **overrides):
    from diffusion.train.config import TrainLoaderConfig
    return TrainLoaderConfig(path=path, batch_size=4, num_workers=0, shuffle=False, **overrides)


@pytest.mark.parametrize("text_column", [schema.INPUT_IDS, schema.TEXT_EMBEDS])
def test_training_samples_carry_the_caption_drawn_for_them(two_captions, text_column):
    from diffusion.loader.captions import CaptionChoice
    from diffusion.loader.mds_source import build_dataset
    out, _ = two_captions
    stored = {s[schema.KEY]: s for s in _read_back(out)}
    probabilities = {schema.CAPTION: 0.3, RECAP: 0.7}
    dataset = build_dataset(_loader_config(out, captions=probabilities), resolution=32, text_dim=64,
                            device_batch_size=4, text_column=text_column, seed=5)
    choice = CaptionChoice.from_mapping(probabilities, seed=5)
    recap_column = schema.caption_columns(RECAP)[1 if text_column == schema.TEXT_EMBEDS else 2]
    took_recap = eligible = 0
    for i in range(len(dataset)):
        sample = dataset[i]
        row = stored[sample[schema.KEY]]
        assert set(sample) >= {text_column, schema.KEY} and recap_column not in sample
        drew_recap = choice.choose(sample[schema.KEY], 0) == RECAP
        has_recap = row[schema.caption_columns(RECAP)[0]] != ""
        want = row[recap_column] if drew_recap and has_recap else row[text_column]  # empty recap: the caption
        np.testing.assert_array_equal(sample[text_column], want)
        eligible += has_recap
        took_recap += drew_recap and has_recap
    # the draw follows the probabilities: 0.7 of the samples with a recap, within 4 standard errors
    assert abs(took_recap / eligible - 0.7) < 4 * (0.7 * 0.3 / eligible) ** 0.5


def test_a_caption_the_dataset_lacks_is_refused_in_one_line(converted):
    from diffusion.errors import DatasetMismatchError
    from diffusion.loader.mds_source import build_dataset
    with pytest.raises(DatasetMismatchError) as e:
        build_dataset(_loader_config(converted[0], captions={"caption": 1, RECAP: 1}), resolution=32, text_dim=64,
                      device_batch_size=4)
    assert "\n" not in str(e.value) and f"--captions caption,{RECAP}" in str(e.value)


def test_caption_probabilities_are_checked_with_the_config(tmp_path):
    from diffusion.train.config import load_config
    with pytest.raises(ConfigError, match=r"data.train.captions.recap: a probability must be a number >= 0"):
        load_config("yamls/tiny-cpu.yaml", ["data.train.captions.caption=1", "data.train.captions.recap=-1"])
