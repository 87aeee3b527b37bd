"""Aspect-ratio buckets: geometry, and a real bucketed conversion of the sample data."""

import json
import math
import os

import numpy as np
import pytest
from PIL import Image

from diffusion import schema
from diffusion.convert.buckets import bucket_crop, nearest_bucket, parse_buckets, preset_buckets
from diffusion.errors import ConfigError

BUCKETS = "48x80,64x64,80x48"  # at the 64 px budget of the test conversions
RECAPTION_TOKENS = 5  # the tiny captioner never ends early: every caption is this many words


def _options(tiny_captioner, **overrides) -> dict:
    """The bucketed conversion's settings: two captions stored as ids and embeddings, and --recaption (its
    captions in column "blip", checked in every bucket by test_bucketed_rows_are_captioned_in_every_bucket)."""
    return dict(resolutions=(64,), buckets=BUCKETS, text="both", captions="caption,recap", recaption=tiny_captioner,
                recaption_column="blip", recaption_batch_size=8, recaption_max_tokens=RECAPTION_TOKENS, **overrides)


def test_preset_buckets_keep_the_pixel_budget_and_mirror():
    buckets = preset_buckets(512, 3.0)
    assert (512, 512) in buckets and len(buckets) % 2 == 1
    assert all(w % 64 == 0 and h % 64 == 0 and abs(w * h - 512 ** 2) <= 0.25 * 512 ** 2 for w, h in buckets)
    assert {(h, w) for w, h in buckets} == set(buckets)
    assert all(max(w, h) / min(w, h) <= 3.0 for w, h in buckets)


def test_nearest_bucket_and_minimal_crop():
    buckets = parse_buckets(BUCKETS, [64], 3.0)
    assert nearest_bucket(300, 500, buckets) == (48, 80)
    assert nearest_bucket(500, 300, buckets) == (80, 48)
    assert nearest_bucket(510, 500, buckets) == (64, 64)
    image = Image.new("RGB", (200, 100))
    crop, top, left = bucket_crop(image, (80, 48))
    assert crop.shape == (48, 80, 3)
    assert (top, left) == (0, (96 - 80) // 2)  # scaled to 96x48: 16 columns cropped, centred


def test_bad_bucket_lists_are_one_line():
    with pytest.raises(ConfigError, match="'64by64' is not WIDTHxHEIGHT"):
        parse_buckets("64by64", [64], 3.0)
    with pytest.raises(ConfigError, match="one --resolutions value"):
        parse_buckets("preset", [32, 64], 3.0)


@pytest.fixture(scope="session")
def bucketed(convert_config, tiny_captioner, ray_local, tmp_path_factory):
    """(output dir, summary) of the sample data converted into BUCKETS (one conversion for this file's tests)."""
    from diffusion.convert.pipeline import run_conversion
    out = tmp_path_factory.mktemp("bucketed")
    summary = run_conversion(convert_config(out, **_options(tiny_captioner)))
    return str(out), summary


def test_images_land_in_the_bucket_nearest_their_aspect(bucketed, manifest):
    from streaming import StreamingDataset
    out, summary = bucketed
    info = schema.DatasetInfo.load(out)
    assert [b["name"] for b in info.buckets] == ["bucket-48x80", "bucket-64x64", "bucket-80x48"]
    assert sum(b["count"] for b in info.buckets) == info.count == summary.written > 0
    assert all(b["count"] > 0 for b in info.buckets)  # the sample holds portraits, landscapes and squares
    assert not os.path.exists(os.path.join(out, "index.json"))  # the root is a list of datasets, not one
    buckets = parse_buckets(BUCKETS, [64], 3.0)
    for b in info.buckets:
        ds = StreamingDataset(local=os.path.join(out, b["name"]), shuffle=False, batch_size=1)
        assert ds.num_samples == b["count"] == schema.DatasetInfo.load(os.path.join(out, b["name"])).count
        for i in range(ds.num_samples):
            row = ds[i]
            assert row[schema.vae_moments_column(64)].shape == (8, b["height"] // 8, b["width"] // 8)
            assert nearest_bucket(row[schema.WIDTH], row[schema.HEIGHT], buckets) == (b["width"], b["height"])
            scale = max(b["width"] / row[schema.WIDTH], b["height"] / row[schema.HEIGHT])
            # minimal crop: one side is cropped only by rounding, the other centred
            assert min(row[schema.CROP_TOP], row[schema.CROP_LEFT]) == 0
            for corner, side, size in ((schema.CROP_LEFT, schema.WIDTH, "width"), (schema.CROP_TOP, schema.HEIGHT, "height")):
                centred = (max(b[size], round(row[side] * scale)) - b[size]) / 2  # ±1: JPEGs decode at a draft scale
                assert abs(row[corner] - centred) <= 1
            assert row[schema.INPUT_IDS].shape == (schema.MAX_TOKENS,)
            assert row["input_ids_recap"].shape == (schema.MAX_TOKENS,)
        # --captions: each bucket counts its own empty second captions, and they add up to the root's
        empty = sum(ds[i]["caption_recap"] == "" for i in range(ds.num_samples))
        assert schema.DatasetInfo.load(os.path.join(out, b["name"])).empty_captions == {"recap": empty, "blip": 0}
    assert sum(schema.DatasetInfo.load(os.path.join(out, b["name"])).empty_captions["recap"] for b in info.buckets) \
        == info.empty_captions["recap"] == summary.empty_captions["recap"] > 0


def _bucket_keys(out):
    from streaming import StreamingDataset
    keys = {}
    for b in schema.DatasetInfo.load(out).buckets:
        ds = StreamingDataset(local=os.path.join(out, b["name"]), shuffle=False, batch_size=1)
        keys[b["name"]] = sorted(ds[i][schema.KEY] for i in range(ds.num_samples))
    return keys


@pytest.mark.slow
def test_kill_and_resume_over_buckets_equals_a_clean_run(bucketed, convert_config, tiny_captioner, tmp_path):
    """The "crash" is a copy of the clean output less the largest part of the largest bucket, its indexes and
    dataset.json files (a write task killed before it committed that part; one conversion fewer than a run
    stopped part-way)."""
    import shutil
    from diffusion.convert.pipeline import run_conversion
    from diffusion.convert.sink import KEYS_RECORD, TMP_PREFIX
    from diffusion.convert.summary import summarize
    out = tmp_path / "resumed"
    shutil.copytree(bucketed[0], out)
    largest = max(schema.DatasetInfo.load(str(out)).buckets, key=lambda b: b["count"])["name"]
    lost = max((p for p in (out / largest).iterdir() if p.name.startswith("part-")),
               key=lambda p: len(json.loads((p / KEYS_RECORD).read_text())))
    shutil.rmtree(lost)  # a part the "killed" run never committed
    for made_at_the_end in (*out.glob("*/index.json"), *out.glob("**/dataset.json")):  # never made by the killed run
        made_at_the_end.unlink()
    first = summarize(str(out))
    assert 0 < first.written < bucketed[1].written
    stale = out / "bucket-64x64" / f"{TMP_PREFIX}part-deadbeef"  # a part a killed write task left half-written
    stale.mkdir(parents=True, exist_ok=True)
    (stale / "shard.00000.mds.zstd").write_bytes(b"half a shard")
    second = run_conversion(convert_config(out, **_options(tiny_captioner)))
    assert _bucket_keys(str(out)) == _bucket_keys(bucketed[0])
    assert second.written_this_run == bucketed[1].written - first.written and not stale.exists()
    assert schema.DatasetInfo.load(str(out)).buckets == schema.DatasetInfo.load(bucketed[0]).buckets


def test_rerun_with_other_buckets_is_refused(bucketed, convert_config, tiny_captioner):
    from diffusion.convert.pipeline import run_conversion
    from diffusion.errors import OutputMismatchError
    with pytest.raises(OutputMismatchError, match="buckets"):
        run_conversion(convert_config(bucketed[0], **{**_options(tiny_captioner), "buckets": "64x64"}))


def test_bucketed_rows_are_captioned_in_every_bucket(bucketed, manifest):
    """--recaption over buckets: every written row of every bucket gets the captioner's caption of its own
    bucket-shaped crop, in its bucket's shards."""
    from streaming import StreamingDataset
    out, summary = bucketed
    info = schema.DatasetInfo.load(out)
    captions = {}
    for b in info.buckets:
        if b["count"]:
            ds = StreamingDataset(local=os.path.join(out, b["name"]), shuffle=False, batch_size=1)
            rows = [ds[i] for i in range(ds.num_samples)]
            captions.update((row[schema.KEY], row[schema.caption_columns("blip")[0]]) for row in rows)
            assert len(rows) == len({row[schema.KEY] for row in rows}), "a row was written twice"
    assert summary.written == len(captions) == manifest["good"]
    assert sum(1 for b in info.buckets if b["count"]) > 1
    assert all(isinstance(c, str) and len(c.split()) == RECAPTION_TOKENS for c in captions.values())
    assert info.captions == [schema.CAPTION, "recap", "blip"] and info.empty_captions["blip"] == 0


@pytest.mark.parametrize("buckets, off", [("preset", "48x80, 80x48"), ("64x64,96x48", "96x48")])
def test_buckets_off_the_autoencoders_grid_are_one_line_before_any_work(convert_config, tiny_dcae_kit, tmp_path,
                                                                       buckets, off):
    """A /32 autoencoder (DC-AE) cannot encode a 48x80 crop: refused at the start naming --buckets, where the encode
    actors died a minute in (pixel_unshuffle) and the partial output blocked the corrected re-run."""
    from diffusion.convert.pipeline import run_conversion
    from diffusion.errors import ConfigError
    out = tmp_path / "out"
    with pytest.raises(ConfigError, match=f"^--buckets {buckets}: {off} not multiples of 32, the downsampling of "):
        run_conversion(convert_config(out, model=tiny_dcae_kit, resolutions=(64,), buckets=buckets))
    assert not out.exists()
