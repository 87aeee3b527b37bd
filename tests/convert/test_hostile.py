"""Hostile input in a real (small) conversion: bad rows, broken files and damaged resume records are
counted by reason and never stop the job (issue 17)."""

import io
import json
import tarfile

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diffusion import schema
from diffusion.convert.pipeline import run_conversion
from diffusion.convert.sink import KEYS_RECORD, REJECTS_DIR, committed_parts
from diffusion.rejects import CAPTION_TOO_LONG, TOO_MANY_SCANS


def _scene(rng) -> bytes:
    from diffusion.kit.sample import render_scene
    image, _ = render_scene(rng, 96, 96)
    buf = io.BytesIO()
    image.save(buf, "JPEG")
    return buf.getvalue()


def _float_tiff() -> bytes:
    from PIL import Image
    buf = io.BytesIO()
    Image.fromarray(np.tile(np.linspace(0, 1, 96, dtype=np.float32), (96, 1))).save(buf, "TIFF")
    return buf.getvalue()


def _tar(path, samples, cut_in=None):
    """A tar of (stem, {ext: bytes}); ``cut_in``: a member whose data the file is cut short in."""
    with tarfile.open(path, "w") as tar:
        for stem, parts in samples:
            for ext, data in parts.items():
                info = tarfile.TarInfo(stem + ext)
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
    if cut_in:
        with tarfile.open(path) as tar:
            offset = tar.getmember(cut_in).offset_data
        with open(path, "r+b") as f:
            f.truncate(offset + 50)


def _hostile_input(raw, rng) -> None:
    raw.mkdir()
    img = [_scene(rng) for _ in range(12)]
    pq.write_table(pa.table({  # sorts first and is readable: the start-up column check passes on it
        "key": [f"k{i}" for i in range(7)],
        "caption": pa.array([b"a red circle", b"\xff\xfe", "\ufeff".encode(), "\u200b".encode(), b"\x00",
                             b"a blue square", b"a grey ramp"], pa.binary()),
        "jpg": img[:6] + [_float_tiff()],
        "width": ["96", "96", "96", "96", "96", "abc", None]}), raw / "a.parquet")
    pq.write_table(pa.table({"key": [100, 101], "caption": [7, 8], "jpg": img[6:8]}), raw / "b.parquet")
    pq.write_table(pa.table({"caption": [["a", "list"]], "jpg": img[8:9]}), raw / "c.parquet")
    pq.write_table(pa.table({"caption": ["a green dot", "a purple dot"], "jpg": img[9:11],
                             "width": [float("nan"), 96.0]}), raw / "d.parquet")
    good = json.dumps({"width": 96, "height": 96, "status": "success"}).encode()
    _tar(raw / "w.tar", [("s0", {".jpg": img[11], ".txt": b"a red dot", ".json": good}),
                         ("s1", {".jpg": img[0], ".txt": b"a blue dot", ".json": b"{broken"}),
                         ("s2", {".jpg": img[1], ".txt": b"a grey dot"})])
    _tar(raw / "x.tar", [(f"t{i}", {".jpg": img[i], ".txt": b"a dot"}) for i in range(3)], cut_in="t2.jpg")
    (raw / "y.parquet").write_bytes(b"")
    (raw / "z.parquet").write_text("not parquet")
    # Memory and time bombs (issue 24 item 6; their readers' tests are in test_bombs.py), in this conversion
    # rather than one of their own: a scene, a JPEG of 300 scans (over --max-scans 200) and a 250-character
    # caption (over --max-caption-chars 200).
    from hostile_files import scan_bomb
    pq.write_table(pa.table({"jpg": [img[2], scan_bomb(300, (256, 256)), img[3]],
                             "caption": ["a scene", "a scan bomb", "long " * 50]}), raw / "e.parquet")


@pytest.mark.slow
def test_hostile_rows_broken_files_and_damaged_records(convert_config, tmp_path, ray_local):
    raw, out = tmp_path / "raw", tmp_path / "mds"
    _hostile_input(raw, np.random.default_rng(0))
    rejects = {"bad_caption": 4, "empty_caption": 3, "bad_size": 1, "bad_metadata": 1,
               TOO_MANY_SCANS: 1, CAPTION_TOO_LONG: 1}  # the last two: e.parquet's bombs
    failed = {"x.tar", "y.parquet", "z.parquet"}
    options = dict(input=str(raw), resolutions=(32,), max_scans=200, max_caption_chars=200)

    summary = run_conversion(convert_config(out, **options))
    # a.parquet k0 k6 (the float TIFF), d.parquet 2, e.parquet 1 (its bombs are rejects), w.tar s0 s2,
    # x.tar t0 t1 (before the damage)
    assert summary.written == 9 and summary.rejects == rejects
    assert set(summary.failed_inputs) == failed and "y.parquet" in summary.table()
    info = schema.DatasetInfo.load(str(out))
    assert (info.count, info.rejects) == (9, rejects)

    # Damage the resume records as a disk or a kill would; fix one broken input. The re-run must
    # repair what it finds (damaged parts and reject files are redone) and count the same.
    parts = committed_parts(str(out))
    (out / parts[0] / KEYS_RECORD).write_text('["k0", "k')
    if len(parts) > 1:
        (out / parts[-1] / KEYS_RECORD).unlink()
    reject_file = sorted((out / REJECTS_DIR).glob("*.jsonl"))[0]
    reject_file.write_text(reject_file.read_text()[:5])
    pq.write_table(pa.table({"caption": ["a fixed file"], "jpg": [_scene(np.random.default_rng(1))]}),
                   raw / "z.parquet")

    again = run_conversion(convert_config(out, **options))
    assert again.written == 10 and again.rejects == rejects
    assert set(again.failed_inputs) == failed - {"z.parquet"}  # read to its end: no longer failed
    from streaming import StreamingDataset
    keys = [s[schema.KEY] for s in StreamingDataset(local=str(out), shuffle=False, batch_size=1)]
    assert len(keys) == len(set(keys)) == 10
    assert {"k0", "k6", "w.tar/s0", "w.tar/s2", "x.tar/t0", "x.tar/t1", "z.parquet:000000000"} <= set(keys)
    assert {k for k in keys if k.startswith("e.parquet")} == {"e.parquet:000000000"}  # the scene, not a bomb
