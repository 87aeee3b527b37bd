import hashlib
import io
import json
import pathlib

import pyarrow.parquet as pq
import pytest
from PIL import Image

from diffusion import schema
from diffusion.kit.sample import MAX_ASPECT, MAX_SIDE, METADATA, MIN_SIDE, RECAP, main, write_sample_data


def _digest(directory: pathlib.Path) -> str:
    h = hashlib.sha256()
    for p in sorted(directory.glob("*.parquet")):
        h.update(p.read_bytes())
    return h.hexdigest()


def _rows(directory: pathlib.Path) -> list[dict]:
    return [r for p in sorted(directory.glob("*.parquet")) for r in pq.read_table(p).to_pylist()]


def test_same_seed_same_bytes_other_seed_differs(tmp_path):
    write_sample_data(tmp_path / "a", n=24, seed=3, rows_per_shard=10)
    write_sample_data(tmp_path / "b", n=24, seed=3, rows_per_shard=10)
    write_sample_data(tmp_path / "c", n=24, seed=4, rows_per_shard=10)
    assert _digest(tmp_path / "a") == _digest(tmp_path / "b")
    assert _digest(tmp_path / "a") != _digest(tmp_path / "c")
    assert len(list((tmp_path / "a").glob("*.parquet"))) == 3


def test_rows_follow_the_manifest(tmp_path):
    manifest = write_sample_data(tmp_path, n=100, seed=0, rows_per_shard=50)
    rows = _rows(tmp_path)
    assert set(rows[0]) == {schema.RAW_KEY, schema.RAW_CAPTION, schema.RAW_IMAGE, schema.WIDTH,
                            schema.HEIGHT, schema.RAW_URL, *METADATA, RECAP}
    assert len(rows) == manifest["rows"] == 100
    # the second caption: longer than the first and saying what it says, empty on about one row in ten
    good = [r for r in rows if r[schema.RAW_KEY] not in manifest["bad_keys"]]
    empty = [r for r in good if r[RECAP] == ""]
    assert len(empty) == manifest["empty_recaps"] and 3 <= len(empty) <= 20
    assert all(r[schema.RAW_CAPTION] in r[RECAP] and len(r[RECAP]) > len(r[schema.RAW_CAPTION]) + 20
               for r in good if r[RECAP])
    assert manifest["bad"] == {"truncated": 2, "not_image": 2, "empty_caption": 2, "tiny": 2}
    assert json.loads((tmp_path / "manifest.json").read_text()) == manifest
    assert len({r[schema.RAW_KEY] for r in rows}) == 100

    modes, formats = set(), set()
    for row in rows:
        kind = manifest["bad_keys"].get(row[schema.RAW_KEY])
        if kind in ("truncated", "not_image"):
            with pytest.raises(OSError):  # PIL: truncated, or UnidentifiedImageError
                Image.open(io.BytesIO(row[schema.RAW_IMAGE])).load()
            continue
        image = Image.open(io.BytesIO(row[schema.RAW_IMAGE]))
        image.load()
        assert image.size == (row[schema.WIDTH], row[schema.HEIGHT])
        if kind == "tiny":
            assert image.size == (1, 1)
        elif kind == "empty_caption":
            assert row[schema.RAW_CAPTION] == ""
        else:
            w, h = image.size
            assert MIN_SIDE <= min(w, h) and max(w, h) <= MAX_SIDE and max(w, h) / min(w, h) <= MAX_ASPECT
            assert row[schema.RAW_CAPTION].startswith(("a ", "an "))
            modes.add(image.mode)
            formats.add(image.format)
    assert formats == {"JPEG", "PNG"}
    assert {"RGB", "L", "CMYK", "RGBA"} <= modes


def test_caption_names_the_colour_drawn(tmp_path):
    """Single-shape scenes: the shape's colour dominates the centre of the image."""
    import numpy as np
    from diffusion.kit.sample import COLORS, render_scene
    hits = total = 0
    for i in range(40):
        image, caption = render_scene(np.random.default_rng(i), 200, 160)
        words = caption.split()
        if len(words) != 3 and "background" not in caption:
            continue
        colour = words[1]
        centre = np.asarray(image)[70:90, 90:110].reshape(-1, 3).mean(0)
        nearest = min(COLORS, key=lambda c: np.abs(np.array(COLORS[c]) - centre).sum())
        hits += nearest == colour
        total += 1
    assert total >= 10 and hits == total


def test_cli(tmp_path, capsys):
    main(["--out", str(tmp_path), "--n", "8", "--seed", "1"])
    assert "wrote 8 rows" in capsys.readouterr().out
    assert len(_rows(tmp_path)) == 8
    with pytest.raises(SystemExit):  # numpy's "expected non-negative integer" traceback, after the folder was made
        main(["--out", str(tmp_path / "again"), "--n", "8", "--seed", "-1"])
    assert "argument --seed: -1 is not a whole number of at least 0" in capsys.readouterr().err
    assert not (tmp_path / "again").exists()


def test_laion_metadata_columns_are_realistic_and_fixed_by_the_seed(tmp_path):
    """aesthetic ~ N(5, 1) in [1, 10], punsafe mostly near 0, pwatermark in [0, 1], similarity 0.25-0.4,
    LANGUAGE mostly en; the rows written hold them, the same seed draws the same values."""
    import numpy as np
    from diffusion.kit.sample import laion_metadata
    write_sample_data(tmp_path, n=12, seed=5, rows_per_shard=12)
    assert [{m: r[m] for m in METADATA} for r in _rows(tmp_path)] == [laion_metadata(5, i) for i in range(12)]
    rows = [laion_metadata(5, i) for i in range(2000)]
    assert rows[:12] == [laion_metadata(5, i) for i in range(12)] and rows[0] != laion_metadata(6, 0)
    aesthetic = np.array([r["aesthetic"] for r in rows])
    assert 1.0 <= aesthetic.min() and aesthetic.max() <= 10.0
    assert abs(aesthetic.mean() - 5.0) < 0.1 and 0.9 < aesthetic.std() < 1.1
    punsafe = np.array([r["punsafe"] for r in rows])
    assert 0 <= punsafe.min() and punsafe.max() <= 1 and np.median(punsafe) < 0.05 and (punsafe > 0.1).any()
    pwatermark = np.array([r["pwatermark"] for r in rows])
    assert 0 <= pwatermark.min() and pwatermark.max() <= 1 and 0.15 < pwatermark.mean() < 0.3
    similarity = np.array([r["similarity"] for r in rows])
    assert 0.25 <= similarity.min() and similarity.max() <= 0.4
    languages = [r["LANGUAGE"] for r in rows]
    assert 0.8 < languages.count("en") / len(languages) < 0.9 and len(set(languages)) > 2
