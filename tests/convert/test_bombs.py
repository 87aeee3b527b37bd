"""Memory and time bombs in the converter's input (issue 24 item 6): tar members claiming gigabytes,
a progressive JPEG of thousands of scans, a 10 MB caption. Each is a counted reject, refused before the
work it would cost."""

import io
import json
import subprocess
import sys
import time

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from diffusion import schema
from diffusion.convert.readers import RawColumns, iter_rows
from diffusion.convert.transforms import ImageChecks, Rejected, decode_image
from diffusion.rejects import CAPTION_TOO_LONG, TOO_LARGE, TOO_MANY_SCANS
from hostile_files import gzip_tar_bomb, progressive_jpeg, scan_bomb, sparse_tar
from tfrecord_writer import example, write_tfrecord

_READ_UNDER_A_MEMORY_LIMIT = """
import json, resource, sys
resource.setrlimit(resource.RLIMIT_AS, (3 << 30, 3 << 30))  # the sparse member alone claims 8 GiB
from diffusion.convert.readers import iter_rows
rejects = {}
rows = [r["key"] for r in iter_rows(sys.argv[1], on_reject=rejects.update)]
print(json.dumps([rows, rejects]))
"""


def test_tar_members_over_the_byte_limit_are_rejects_skipped_unread(tmp_path):
    """A 10 KB sparse tar whose member claims 8 GiB and a 65 KB gzip tar of a 64 MiB member: each
    sample is a too_large reject, read under a 3 GiB address-space limit; the samples after them are read."""
    (tmp_path / "00000.tar").write_bytes(sparse_tar(8 << 30, "000000000"))
    gzip_tar_bomb(tmp_path / "00001.tar", 64 << 20, "000000001")
    result = subprocess.run([sys.executable, "-c", _READ_UNDER_A_MEMORY_LIMIT, str(tmp_path)],
                            capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-2000:]
    rows, rejects = json.loads(result.stdout)
    assert rows == [] and rejects == {"00000.tar/000000000": TOO_LARGE, "00001.tar/000000001": TOO_LARGE}


def _jpeg(size=(80, 60)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, (200, 30, 30)).save(buf, "JPEG")
    return buf.getvalue()


def test_tfrecord_records_and_image_files_over_the_byte_limit_are_rejects_not_read(tmp_path):
    big, small = _jpeg((1500, 1500)) + bytes(2 << 20), _jpeg()  # 2 MiB more than a record may hold
    write_tfrecord(tmp_path / "00000.tfrecord", [example({"key": "k0", "jpg": big, "txt": b"big"}),
                                                  example({"key": "k1", "jpg": small, "txt": b"small"})])
    (tmp_path / "imgs").mkdir()
    (tmp_path / "imgs" / "big.jpg").write_bytes(big)
    (tmp_path / "imgs" / "small.jpg").write_bytes(small)
    rejects = {}
    rows = [r[schema.RAW_KEY] for r in iter_rows(tmp_path, RawColumns(max_bytes=len(small) + 10),
                                                 on_reject=rejects.update)]
    assert rows == ["k1", "small.jpg"]
    assert rejects == {"00000.tfrecord:000000000": TOO_LARGE, "big.jpg": TOO_LARGE}


def test_a_ten_megabyte_caption_is_a_reject_before_it_is_tokenized(tmp_path):
    huge = "a cat " * (10 * 2**20 // 6)
    pq.write_table(pa.table({"jpg": [_jpeg()] * 3, "caption": [huge, "x" * 100, "é" * 100],
                             "key": ["huge", "ok", "accents"]}), tmp_path / "a.parquet")
    import tarfile
    with tarfile.open(tmp_path / "00000.tar", "w") as tar:
        for name, data in (("t0.jpg", _jpeg()), ("t0.txt", huge.encode()), ("t1.jpg", _jpeg()), ("t1.txt", b"fine")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    rejects = {}
    start = time.process_time()  # CPU time: what the work costs, whatever the load
    rows = [r[schema.RAW_KEY] for r in iter_rows(tmp_path, RawColumns(max_caption_chars=100),
                                                 on_reject=rejects.update)]
    assert time.process_time() - start < 5
    assert rows == ["00000.tar/t1", "ok", "accents"]  # 100 characters are kept, however many bytes they take
    assert rejects == {"00000.tar/t0": CAPTION_TOO_LONG, "huge": CAPTION_TOO_LONG}
    assert len([r for r in iter_rows(tmp_path, on_reject=rejects.update)]) == 3  # the default: 8192 characters


def test_a_jpeg_of_thousands_of_scans_is_refused_before_decoding():
    bomb = scan_bomb(2000)
    start = time.process_time()  # CPU time: what the work costs, whatever the load
    with pytest.raises(Rejected) as e:
        decode_image(bomb, 64)
    assert e.value.reason == TOO_MANY_SCANS and "2010 scans" in str(e.value)
    assert time.process_time() - start < 0.5  # CPU-s; decoding it takes about a second here, 500 s at 4096 x 4096
    image, width, height = decode_image(progressive_jpeg(), 64)  # a progressive JPEG of 10 scans is fine
    assert (width, height) == (1024, 1024)
    with pytest.raises(Rejected):
        decode_image(progressive_jpeg(), 64, ImageChecks(max_scans=5))  # the bound is a setting


# Bombs in a real conversion (each a counted reject, the rest written): e.parquet of test_hostile.py's
# conversion, which carries --max-scans 200 --max-caption-chars 200 (one conversion fewer for the suite).


@pytest.mark.parametrize("setting, value, said", [
    # each was a Ray ValueError traceback once Ray had started, or 0 silently taken as the default
    ("transform_batch_size", 0, "--transform-batch-size must be positive, got 0"),
    ("encoder_batch_size", -1, "--batch-size must be positive, got -1"),
    ("encoder_batch_size", 0, "--batch-size must be positive, got 0"),
    ("num_encoders", -1, "--num-encoders must be positive, got -1"),
    ("num_transformers", 0, "--num-transformers must be positive, got 0"),
    ("cpus_per_transformer", -0.5, "--cpus-per-transformer must be positive, got -0.5"),
    ("encoder_gpus", -1.0, r"--encoder-gpus must be >= 0 \(0: encode on CPUs\), got -1.0"),
])
def test_a_pool_size_that_is_not_positive_is_refused_naming_its_flag(setting, value, said, tmp_path):
    from diffusion.convert.pipeline import ConvertConfig
    from diffusion.errors import ConfigError
    with pytest.raises(ConfigError, match=f"^{said}$"):
        ConvertConfig(input=str(tmp_path), output=str(tmp_path / "out"), model="m", **{setting: value})
    ConvertConfig(input=str(tmp_path), output=str(tmp_path / "out"), model="m", encoder_gpus=0.0)  # CPU encoding


@pytest.mark.parametrize("setting", ["max_bytes", "max_scans", "max_caption_chars"])
def test_a_limit_that_is_not_positive_is_refused_naming_its_flag(setting, tmp_path):
    from diffusion.convert.pipeline import ConvertConfig
    from diffusion.download.image import ImageRules
    from diffusion.errors import ConfigError
    with pytest.raises(ConfigError, match=f"--{setting.replace('_', '-')} must be positive, got 0"):
        ConvertConfig(input=str(tmp_path), output=str(tmp_path / "out"), model="m", **{setting: 0})
    with pytest.raises(ConfigError, match="max_scans"):
        ImageRules(max_scans=0)
    with pytest.raises(ConfigError, match=r"--resolutions 100000: a 100000x100000 crop is 10,000,000,000 pixels, "
                                          r"more than --max-pixels 67,108,864"):  # hung the transform actors
        ConvertConfig(input=str(tmp_path), output=str(tmp_path / "out"), model="m", resolutions=[64, 100000])
    with pytest.raises(ConfigError, match="--max-aspect must be >= 1, got nan"):
        ConvertConfig(input=str(tmp_path), output=str(tmp_path / "out"), model="m", max_aspect=float("nan"))


def test_max_pixels_above_pillows_own_limit_is_the_one_that_applies(monkeypatch):
    """--max-pixels 100000000 read images of 89.5 to 100 MP as too_many_pixels, with Pillow's message: its own
    guard (MAX_IMAGE_PIXELS) applied first. Pillow's limit is lowered here to keep the images small."""
    from diffusion.rejects import TOO_MANY_PIXELS
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 5000)

    def png(side):
        buf = io.BytesIO()
        Image.new("RGB", (side, side), (90, 120, 30)).save(buf, format="PNG")
        return buf.getvalue()
    checks = ImageChecks(max_pixels=200 * 200)
    image, width, height = decode_image(png(200), 64, checks)  # 4x Pillow's limit (its error, not its warning)
    assert (width, height) == image.size == (200, 200)
    with pytest.raises(Rejected) as over:
        decode_image(png(201), 64, checks)
    assert over.value.reason == TOO_MANY_PIXELS
    with pytest.raises(Rejected) as small_limit:  # a limit below Pillow's applies as before
        decode_image(png(60), 32, ImageChecks(max_pixels=59 * 59))
    assert small_limit.value.reason == TOO_MANY_PIXELS
    assert Image.MAX_IMAGE_PIXELS == 5000  # Pillow's own setting is left as it was
