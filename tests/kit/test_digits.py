"""diffusion.kit.digits: real digits as LAION-style rows the converter reads, and the judge fitted on them."""

import io
import json

import numpy as np
import pytest
from PIL import Image

from diffusion import schema
from diffusion.convert import readers
from diffusion.kit import digits


@pytest.fixture(scope="module")
def judge():
    return digits.DigitJudge()


def test_digits_are_written_as_raw_rows_the_converter_reads(tmp_path):
    digits.main(["--out", str(tmp_path), "--split", "test"])
    manifest = json.loads((tmp_path / "manifest.json").read_text())
    assert manifest["rows"] == 360 and sum(manifest["classes"].values()) == 360
    rows = [r for shard in manifest["shards"] for r in readers.iter_rows(str(tmp_path / shard), readers.RawColumns())]
    assert len(rows) == 360
    images, labels = digits.load("test")
    first = rows[0]
    assert first[schema.RAW_CAPTION] == f"a handwritten digit {labels[0]}"
    assert digits.label_of(first[schema.RAW_CAPTION]) == labels[0]
    picture = Image.open(io.BytesIO(first[schema.RAW_IMAGE]))
    assert picture.size == (64, 64)
    # dark ink on white, where the 8x8 scan has ink
    gray = np.asarray(picture.convert("L").resize((8, 8), Image.BOX), dtype=float)
    assert np.corrcoef(gray.ravel(), images[0].ravel())[0, 1] < -0.9


def test_the_splits_do_not_overlap_and_cover_the_set():
    train, test = digits.load("train"), digits.load("test")
    assert len(train[1]) + len(test[1]) == 1797 and len(test[1]) == 360


def test_the_judge_reads_real_held_out_digits_and_not_noise(judge):
    assert judge.real_accuracy() > 0.9  # digits it was not fitted on
    images, labels = digits.load("test")
    pictures = [digits.to_image(d) for d in images[:100]]
    assert judge.accuracy(pictures, np.roll(labels[:100], 1)) < 0.3  # the wrong prompts are read as wrong
    rng = np.random.default_rng(0)
    noise = [Image.fromarray(rng.integers(0, 256, (64, 64, 3), dtype=np.uint8)) for _ in range(40)]
    assert judge.accuracy(noise, [k % 10 for k in range(40)]) <= 0.2  # chance is 0.1
