import hashlib
import io
import json
import pathlib

import pyarrow.parquet as pq
import pytest
from PIL import Image

from diffusion import schema
from diffusion.kit.sample import MAX_ASPECT, MAX_SIDE, MIN_SIDE, main, write_sample_data


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
                            schema.HEIGHT, schema.RAW_URL}
    assert len(rows) == manifest["rows"] == 100
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
