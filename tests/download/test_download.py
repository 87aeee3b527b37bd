"""The downloader against a local HTTP server on 127.0.0.1 that serves every kind of answer the web gives."""

import collections
import glob
import hashlib
import http.server
import io
import json
import os
import subprocess
import sys
import tarfile
import threading
import time

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from diffusion import schema
from diffusion.download.job import DownloadConfig, download
from diffusion.download.http import USER_AGENT, FetchConfig, Fetcher, FetchError
from diffusion.download.image import ImageRules, check_image
from diffusion.download.plan import InputColumns, ShardSpec, plan_shards
from diffusion.errors import InputError
from diffusion.download.shard import ShardJob, ShardNaming, download_shard
from hostile_files import progressive_jpeg, scan_bomb

FETCH = FetchConfig(timeout=0.5, retries=2, backoff=0.01, max_bytes=200_000, max_redirects=3)
RULES = ImageRules(min_size=16)
SLOW_S = 1.0  # > FETCH.timeout


def _image_bytes(fmt: str, size=(64, 48), seed=0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (size[1], size[0], 3), dtype=np.uint8)
    buf = io.BytesIO()
    Image.fromarray(pixels).save(buf, fmt, **({"quality": 90} if fmt == "JPEG" else {}))
    return buf.getvalue()


JPEG, PNG, TINY = _image_bytes("JPEG"), _image_bytes("PNG", (40, 40)), _image_bytes("PNG", (8, 8))
STALL_S = 2.0  # how long /stall takes to answer (it answers: a slow server, not a dead one)
PACED_S = 0.1  # how long /paced takes to answer


def _jpeg_with_exif() -> bytes:
    from PIL import ExifTags, TiffImagePlugin
    exif = Image.Exif()
    exif[0x010F] = "Canon"  # Make
    exif.get_ifd(ExifTags.IFD.Exif)[0x829A] = TiffImagePlugin.IFDRational(1, 100)  # ExposureTime
    buf = io.BytesIO()
    Image.open(io.BytesIO(JPEG)).save(buf, "JPEG", exif=exif)
    return buf.getvalue()


EXIF_JPEG = _jpeg_with_exif()
SCAN_BOMB = scan_bomb(2000)  # 34 KB; about a second to decode at 1024 x 1024 (500 s at 4096 x 4096)

# path -> expected status of the row ("success" or the failure reason), in the order the input lists them
CASES = {
    "/ok.jpg": "success",
    "/ok.png": "success",
    "/moved": "success",  # 301 to /ok.jpg
    "/flaky": "success",  # 500, then 200 on the retry
    "/missing": "http_404",
    "/down": "http_503",  # 503 every time
    "/slow": "timeout",
    "/big": "too_large",  # Content-Length over the limit
    "/big-stream": "too_large",  # no Content-Length: stopped while streaming
    "/truncated.jpg": "decode_error",
    "/page.html": "not_image",
    "/tiny.png": "too_small",
    "/loop": "too_many_redirects",
    "/to-file": "redirect_scheme",
}


class _Handler(http.server.BaseHTTPRequestHandler):
    hits: collections.Counter  # set per server
    agents: list

    def log_message(self, *args):  # keep test output quiet
        pass

    def _send(self, status, body=b"", content_type="image/jpeg", headers=(), length=True):
        self.send_response(status)
        self.send_header("Content-Type", content_type)
        if length:
            self.send_header("Content-Length", str(len(body)))
        for name, value in headers:
            self.send_header(name, value)
        self.end_headers()
        try:
            self.wfile.write(body)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up, as it should
            pass

    def do_GET(self):
        path = self.path.split("?")[0]
        self.hits[path] += 1
        self.agents.append(self.headers.get("User-Agent"))
        if path == "/ok.jpg":
            self._send(200, JPEG)
        elif path == "/ok.png":
            self._send(200, PNG, "image/png")
        elif path == "/tiny.png":
            self._send(200, TINY, "image/png")
        elif path == "/moved":
            self._send(301, headers=[("Location", "/ok.jpg")])
        elif path.startswith("/flaky"):
            self._send(500 if self.hits[path] == 1 else 200, JPEG)
        elif path == "/missing":
            self._send(404, b"not here", "text/plain")
        elif path == "/down":
            self._send(503, b"busy", "text/plain")
        elif path == "/slow":
            time.sleep(SLOW_S)
            self._send(200, JPEG)
        elif path.startswith("/stall"):
            self.stalls.append((time.monotonic(), path))  # when each stalled request arrived
            time.sleep(STALL_S)
            self._send(200, JPEG)
        elif path.startswith("/paced"):
            time.sleep(PACED_S)
            self._send(200, JPEG)
        elif path == "/exif.jpg":
            self._send(200, EXIF_JPEG)
        elif path == "/scans.jpg":
            self._send(200, SCAN_BOMB)
        elif path == "/big":
            self._send(200, b"\xff" * 300_000)
        elif path == "/big-stream":
            self._send(200, b"\xff" * 300_000, length=False)
        elif path == "/truncated.jpg":
            self._send(200, JPEG[: len(JPEG) // 2])
        elif path == "/page.html":
            self._send(200, b"<!doctype html><html><body>an image was here</body></html>", "text/html")
        elif path == "/loop":
            self._send(302, headers=[("Location", "/loop")])
        elif path == "/to-file":
            self._send(302, headers=[("Location", "file:///etc/passwd")])
        else:
            self._send(404, b"unknown test path", "text/plain")


class LocalServer:
    def __init__(self):
        handler = type("Handler", (_Handler,), {"hits": collections.Counter(), "agents": [], "stalls": []})
        self.handler = handler
        self.httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
        self.httpd.daemon_threads = True
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def url(self, path: str) -> str:
        return f"http://127.0.0.1:{self.httpd.server_port}{path}"

    @property
    def hits(self) -> collections.Counter:
        return self.handler.hits

    def reset(self):
        self.handler.hits.clear()
        self.handler.agents.clear()
        self.handler.stalls.clear()


@pytest.fixture(scope="module")
def server():
    s = LocalServer()
    yield s
    s.httpd.shutdown()


def _write_input(path, urls, fmt="parquet", extra=None):
    rows = {"URL": urls, "TEXT": [f"caption {i}" for i in range(len(urls))], **(extra or {})}
    if fmt == "parquet":
        pq.write_table(pa.table(rows), path, row_group_size=3)  # shards cross row-group boundaries
    elif fmt == "csv":
        import pyarrow.csv as pa_csv
        pa_csv.write_csv(pa.table(rows), path)
    else:
        with open(path, "w") as f:
            for i in range(len(urls)):
                f.write(json.dumps({k: v[i] for k, v in rows.items()}) + "\n")
    return str(path)


def _read_output(out) -> pa.Table:
    """Every row of the output's parquet shards, by key (a shard holds its rows in the order they finished)."""
    files = sorted(glob.glob(os.path.join(out, "*.parquet")))
    table = pa.concat_tables([pq.read_table(f) for f in files])
    return table.sort_by(schema.RAW_KEY)


def _reason(row) -> str:
    return row[schema.RAW_STATUS] if row[schema.RAW_STATUS] == "success" else row[schema.RAW_ERROR].split(":")[0]


# ---- the fetcher and the image check, without Ray -------------------------------------------------

def test_fetcher_retries_only_timeouts_and_5xx_and_names_itself(server):
    server.reset()
    fetcher = Fetcher(FETCH, pool_size=4)
    assert fetcher.fetch(server.url("/flaky-a")) == JPEG
    for path, reason in [("/missing", "http_404"), ("/down", "http_503"), ("/slow", "timeout")]:
        with pytest.raises(FetchError) as err:
            fetcher.fetch(server.url(path))
        assert err.value.reason == reason
    assert server.hits["/flaky-a"] == 2
    assert server.hits["/missing"] == 1  # a 404 is final
    assert server.hits["/down"] == FETCH.retries + 1
    assert server.hits["/slow"] == FETCH.retries + 1
    assert set(server.handler.agents) == {USER_AGENT} and "sd-pretrain-downloader" in USER_AGENT


def test_fetcher_refuses_other_schemes_and_endless_redirects(server):
    server.reset()
    fetcher = Fetcher(FETCH)
    with pytest.raises(FetchError, match=r"redirect_scheme: redirected to 'file:///etc/passwd': only http and https"):
        fetcher.fetch(server.url("/to-file"))
    with pytest.raises(FetchError, match="unsupported_scheme"):
        fetcher.fetch("ftp://127.0.0.1/x.jpg")
    with pytest.raises(FetchError, match="too_many_redirects"):
        fetcher.fetch(server.url("/loop"))
    assert server.hits["/loop"] == FETCH.max_redirects + 1


def test_a_refused_connection_is_counted_as_refused_not_as_a_timeout():
    import socket
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    fetcher = Fetcher(FetchConfig(timeout=0.5, retries=2, backoff=5.0))
    start = time.monotonic()
    with pytest.raises(FetchError) as err:
        fetcher.fetch(f"http://127.0.0.1:{port}/x.jpg")
    assert err.value.reason == "connection_refused"
    assert time.monotonic() - start < 4.0  # final, like a 404: not retried (5 s backoff) as a timeout is


def test_hostile_input_values_do_not_fail_the_file(tmp_path):
    from diffusion.download.plan import read_shard
    src = tmp_path / "in.jsonl"  # rows that disagree on types, a line that is not JSON, a list URL
    src.write_text('{"URL": "http://a/1.jpg", "TEXT": "a cat"}\n{"URL": "http://a/2.jpg", "TEXT": 1984}\n'
                   'not json\n{"URL": ["x"], "TEXT": "y"}\n')
    shards, _ = plan_shards(str(src), InputColumns(), rows_per_shard=10)
    rows = read_shard(str(src), shards[0], "jsonl", InputColumns()).to_pylist()
    assert rows == [{"URL": "http://a/1.jpg", "TEXT": "a cat"}, {"URL": "http://a/2.jpg", "TEXT": "1984"},
                    {"URL": None, "TEXT": None}, {"URL": None, "TEXT": "y"}]
    pq.write_table(pa.table({"URL": ["http://a/1.jpg", "http://a/2.jpg"], "TEXT": [b"\xff\xfe", b"ok"]}),
                   tmp_path / "bin.parquet")
    shards, _ = plan_shards(str(tmp_path / "bin.parquet"), InputColumns(), rows_per_shard=10)
    rows = read_shard(str(tmp_path / "bin.parquet"), shards[0], "parquet", InputColumns()).to_pylist()
    assert [r["TEXT"] for r in rows] == [None, "ok"]  # not UTF-8: no caption, the row goes on


def _refused(config):
    """Run the download of ``config``: it must stop at start with one line, and write nothing."""
    with pytest.raises(InputError) as err:
        download(config)
    message = str(err.value)
    assert "\n" not in message and not os.path.exists(config.output)
    return message


def test_a_parquet_file_with_an_intact_footer_over_damaged_data_stops_at_start_naming_it(tmp_path):
    src = tmp_path / "in"
    src.mkdir()
    _write_input(src / "a.parquet", [f"http://127.0.0.1:1/{i}.jpg" for i in range(6)])
    urls = [f"http://127.0.0.1:1/{i}.jpg" for i in range(500)]
    pq.write_table(pa.table({"URL": urls, "TEXT": [f"a longer caption, number {i}" for i in range(500)]}),
                   src / "b.parquet", compression="none")
    data = bytearray((src / "b.parquet").read_bytes())
    data[100:len(data) // 2] = b"\xab" * (len(data) // 2 - 100)  # the data pages, not the footer
    (src / "b.parquet").write_bytes(bytes(data))
    assert pq.ParquetFile(src / "b.parquet").metadata.num_rows == 500  # the footer reads
    message = _refused(DownloadConfig(input=str(src), output=str(tmp_path / "out")))
    assert message.startswith(f"{src / 'b.parquet'}: not a readable parquet file (") and "re-run" in message


@pytest.mark.parametrize("line,problem", [("http://a/2.jpg,a caption,extra", "Expected 2 columns, got 3"),
                                          ("http://a/2.jpg", "Expected 2 columns, got 1")])
def test_a_csv_row_with_too_many_or_too_few_fields_stops_at_start_naming_the_file(tmp_path, line, problem):
    src = tmp_path / "in.csv"
    src.write_text(f"URL,TEXT\nhttp://a/1.jpg,a cat\n{line}\nhttp://a/3.jpg,a dog\n")
    message = _refused(DownloadConfig(input=str(src), output=str(tmp_path / "out")))
    assert message.startswith(f"{src}: not a readable csv file (") and problem in message


def test_a_shard_of_a_file_damaged_after_planning_names_the_file_and_rows(tmp_path):
    from diffusion.download.plan import read_shard
    src = _write_input(tmp_path / "in.parquet", [f"http://127.0.0.1:1/{i}.jpg" for i in range(6)])
    shards, _ = plan_shards(src, InputColumns(), rows_per_shard=4)
    with open(src, "r+b") as f:  # damaged while the job runs: the footer stays, the data goes
        f.seek(4)
        f.write(b"\xab" * 64)
    with pytest.raises(InputError) as err:
        read_shard(src, shards[0], "parquet", InputColumns())
    assert str(err.value).startswith(f"{src}: rows 0-3 cannot be read as parquet (")


@pytest.mark.parametrize("mode,size,expected", [("no", 32, (64, 48)), ("center_crop", 32, (32, 32)),
                                                  ("keep_ratio", 24, (32, 24)), ("keep_ratio", 100, (64, 48))])
def test_check_image_resize_modes(mode, size, expected):
    checked = check_image(JPEG, ImageRules(min_size=16, resize_mode=mode, image_size=size))
    assert (checked.width, checked.height) == expected
    assert (checked.original_width, checked.original_height) == (64, 48)
    assert Image.open(io.BytesIO(checked.data)).size == expected
    if mode == "no":
        assert checked.data == JPEG  # the original bytes, untouched


def test_check_image_refuses_giants_before_decoding():
    with pytest.raises(FetchError, match="too_many_pixels"):
        check_image(JPEG, ImageRules(min_size=16, max_pixels=64 * 48 - 1))


def test_max_pixels_above_pillows_own_limit_is_the_one_that_applies(monkeypatch):
    """--max-pixels above Pillow's own guard (89.5 MP) fetched images under it as too_many_pixels: Pillow's
    applied first. Its limit is lowered here to keep the image small (64x48 = 3,072 pixels)."""
    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    assert check_image(JPEG, ImageRules(min_size=16, max_pixels=64 * 48)).original_width == 64  # 3x Pillow's
    with pytest.raises(FetchError, match="too_many_pixels"):
        check_image(JPEG, ImageRules(min_size=16, max_pixels=64 * 48 - 1))
    assert Image.MAX_IMAGE_PIXELS == 1000  # Pillow's own setting is left as it was


def test_a_jpeg_of_thousands_of_scans_is_refused_before_decoding_and_counted(server, tmp_path):
    start = time.process_time()
    with pytest.raises(FetchError, match="too_many_scans: a JPEG of 2010 scans"):
        check_image(SCAN_BOMB, RULES)
    assert time.process_time() - start < 0.5  # CPU-s: decoding it would take about 1, whatever the load
    assert check_image(progressive_jpeg(), RULES).width == 1024  # 10 scans: an ordinary progressive JPEG
    server.reset()
    src = _write_input(tmp_path / "in.parquet", [server.url("/scans.jpg"), server.url("/ok.jpg")])
    job = ShardJob(src, str(tmp_path / "out"), {src: "parquet"}, InputColumns(), ShardNaming.for_plan(1, 2),
                   FETCH, RULES, threads=2)
    os.makedirs(tmp_path / "out")
    download_shard(job, ShardSpec(0, src, 0, 2))
    assert [_reason(r) for r in _read_output(tmp_path / "out").to_pylist()] == ["too_many_scans", "success"]
    assert json.loads((tmp_path / "out" / "00000_stats.json").read_text())["failures"] == {"too_many_scans": 1}


# ---- one shard, without Ray ----------------------------------------------------------------------

def test_shard_rows_statuses_and_stats(server, tmp_path):
    server.reset()
    paths = list(CASES) + ["ftp://127.0.0.1/x.jpg", None]
    expected = list(CASES.values()) + ["unsupported_scheme", "invalid_url"]
    src = _write_input(tmp_path / "in.parquet", [p if p is None or "://" in p else server.url(p) for p in paths],
                       extra={"similarity": [0.5] * len(paths)})
    columns = InputColumns(keep=("similarity",))
    naming = ShardNaming.for_plan(1, 100)
    job = ShardJob(src, str(tmp_path / "out"), {src: "parquet"}, columns, naming, FETCH, RULES, threads=8)
    os.makedirs(tmp_path / "out")
    stats = download_shard(job, ShardSpec(7, src, 0, len(paths)))

    table = _read_output(tmp_path / "out").to_pylist()
    assert [_reason(r) for r in table] == expected  # one row per input row, keyed by its input position
    assert [r[schema.RAW_KEY] for r in table] == [f"00007{i:02d}" for i in range(len(paths))]
    assert [r[schema.RAW_CAPTION] for r in table] == [f"caption {i}" for i in range(len(paths))]
    assert all(r["similarity"] == 0.5 for r in table)
    ok = [r for r in table if r[schema.RAW_STATUS] == schema.RAW_STATUS_SUCCESS]
    assert [(r[schema.WIDTH], r[schema.HEIGHT]) for r in ok] == [(64, 48), (40, 40), (64, 48), (64, 48)]
    assert ok[0][schema.RAW_IMAGE] == JPEG and ok[1][schema.RAW_IMAGE] == PNG
    failed = [r for r in table if r[schema.RAW_STATUS] != schema.RAW_STATUS_SUCCESS]
    assert all(r[schema.RAW_IMAGE] is None and r[schema.WIDTH] is None for r in failed)

    on_disk = json.loads((tmp_path / "out" / "00007_stats.json").read_text())
    assert on_disk["count"] == len(paths) and on_disk["successes"] == 4
    assert on_disk["failures"] == dict(sorted(collections.Counter(e for e in expected if e != "success").items()))
    assert on_disk["failed_to_resize"] == 3  # decode_error, not_image, too_small
    assert on_disk["failed_to_download"] == len(paths) - 4 - 3
    assert on_disk["status_dict"]["success"] == 4 and on_disk["duration"] > 0
    assert stats["skipped"] is False
    assert download_shard(job, ShardSpec(7, src, 0, len(paths)))["skipped"] is True  # finished: not redone
    assert not glob.glob(str(tmp_path / "out" / "*.tmp"))


# ---- the Ray job ---------------------------------------------------------------------------------

def _config(src, out, **kw):
    return DownloadConfig(input=str(src), output=str(out), rows_per_shard=4, threads=4, fetch=FETCH,
                          image=RULES, **kw)


@pytest.mark.parametrize("fmt", ["csv", "jsonl"])
def test_plan_reads_csv_and_jsonl(tmp_path, fmt):
    src = _write_input(tmp_path / f"in.{fmt}", [f"http://127.0.0.1:1/{i}.jpg" for i in range(10)], fmt)
    shards, formats = plan_shards(src, InputColumns(), rows_per_shard=4)
    assert [(s.start, s.stop) for s in shards] == [(0, 4), (4, 8), (8, 10)]
    assert formats == {src: fmt}
    with pytest.raises(ValueError, match=r"in\.%s: no column \['url'\]" % fmt):
        plan_shards(src, InputColumns(url="url"), rows_per_shard=4)


def test_download_job_counts_and_resumes_after_a_kill(server, tmp_path, ray_local):
    server.reset()
    urls = [server.url(p if p != "/flaky" else f"/flaky-{i}") for i, p in enumerate(CASES)]  # 14 rows
    os.makedirs(tmp_path / "in")
    _write_input(tmp_path / "in" / "a.parquet", urls[:10])
    _write_input(tmp_path / "in" / "b.parquet", urls[10:])
    out = tmp_path / "out"
    summary = download(_config(tmp_path / "in", out))

    failures = collections.Counter(v for v in CASES.values() if v != "success")
    assert (summary.shards, summary.count, summary.successes) == (4, 14, 4)  # a: 4+4+2 rows, b: 4
    assert summary.failures == dict(sorted(failures.items()))
    assert summary.downloaded == 14 and summary.images_per_s > 0
    table = _read_output(out)
    assert sorted(table[schema.RAW_KEY].to_pylist()) == [f"00000{i}" for i in range(4)] + [
        f"00001{i}" for i in range(4)] + [f"00002{i}" for i in range(2)] + [f"00003{i}" for i in range(4)]
    assert sorted(_reason(r) for r in table.to_pylist()) == sorted(CASES.values())
    assert json.loads((out / "summary.json").read_text())["successes"] == 4

    # What a kill leaves: shard 1's parquet renamed but no stats yet, shard 2 half-written under .tmp.
    (out / "00001_stats.json").unlink()
    (out / "00002.parquet").rename(out / "00002.parquet.tmp")
    (out / "00002_stats.json").unlink()
    server.reset()
    again = download(_config(tmp_path / "in", out))
    assert (again.skipped_shards, again.downloaded) == (2, 6)
    assert sum(server.hits.values()) > 0 and not any(k.startswith("/ok") for k in server.hits)  # shard 0 not refetched
    resumed = _read_output(out)
    assert resumed.num_rows == 14 and len(set(resumed[schema.RAW_KEY].to_pylist())) == 14  # nothing lost or doubled
    assert (again.count, again.successes, again.failures) == (14, 4, summary.failures)

    with pytest.raises(ValueError, match="different plan.*rows_per_shard"):
        download(DownloadConfig(input=str(tmp_path / "in"), output=str(out), rows_per_shard=5, fetch=FETCH))
    # a plan written before --max-scans existed resumes with its default, and only with it
    plan = json.loads((out / "download_plan.json").read_text())
    del plan["image"]["max_scans"]
    (out / "download_plan.json").write_text(json.dumps(plan))
    assert download(_config(tmp_path / "in", out)).skipped_shards == 4
    with pytest.raises(ValueError, match="different plan.*image"):
        download(DownloadConfig(input=str(tmp_path / "in"), output=str(out), rows_per_shard=4, fetch=FETCH,
                                image=ImageRules(min_size=16, max_scans=50)))
    with pytest.raises(ValueError, match=r"different plan \(output_format changed\)"):  # no mixed formats
        download(_config(tmp_path / "in", out, output_format="webdataset"))
    plan = json.loads((out / "download_plan.json").read_text())
    del plan["output_format"]  # as a download started before the flag wrote it: parquet
    (out / "download_plan.json").write_text(json.dumps(plan))
    assert download(_config(tmp_path / "in", out)).skipped_shards == 4


def test_an_output_folder_inside_the_input_folder_resumes_with_the_first_runs_plan(server, tmp_path, ray_local):
    """``--input urls --output urls/raw``: the documented resume (the same command again) listed the input
    recursively and read the first run's shards and records as url lists ("raw/00000.parquet: no column
    ['URL', 'TEXT']"); the output folder is no input, so the re-run plans what the first run planned."""
    server.reset()
    urls = [server.url(p if p != "/flaky" else f"/flaky-{i}") for i, p in enumerate(CASES)][:6]
    os.makedirs(tmp_path / "urls")
    _write_input(tmp_path / "urls" / "a.parquet", urls)
    out = tmp_path / "urls" / "raw"
    first = download(_config(tmp_path / "urls", out))
    assert (first.shards, first.count) == (2, 6)
    (out / "00001_stats.json").unlink()  # as a kill leaves it
    again = download(_config(tmp_path / "urls", out))
    assert (again.shards, again.count, again.skipped_shards, again.downloaded) == (2, 6, 1, 2)
    assert _read_output(out).num_rows == 6


@pytest.mark.parametrize("endpoint_from", ["uri", "environment"])
def test_s3_input_and_output(server, tmp_path, monkeypatch, endpoint_from):
    """Input listed and read from s3://, shard and stats written to s3:// (a local moto server), the
    endpoint given in the URI or, as for every other stage, in AWS_ENDPOINT_URL."""
    boto3 = pytest.importorskip("boto3")
    from moto.server import ThreadedMotoServer
    for name, value in {"AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test",
                        "AWS_DEFAULT_REGION": "us-east-1", "AWS_EC2_METADATA_DISABLED": "true"}.items():
        monkeypatch.setenv(name, value)
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    moto.start()
    try:
        port = moto.get_host_and_port()[1]
        s3 = boto3.client("s3", endpoint_url=f"http://127.0.0.1:{port}")
        s3.create_bucket(Bucket="laion")
        src = _write_input(tmp_path / "in.parquet", [server.url("/ok.jpg"), server.url("/missing")])
        s3.upload_file(src, "laion", "urls/part-0.parquet")
        query = f"?endpoint_override=127.0.0.1:{port}&scheme=http&region=us-east-1"
        if endpoint_from == "environment":
            monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://127.0.0.1:{port}")
            query = ""
        columns, uri, out = InputColumns(), f"s3://laion/urls{query}", f"s3://laion/raw{query}"

        shards, formats = plan_shards(uri, columns, rows_per_shard=4)
        assert [(s.path, s.start, s.stop) for s in shards] == [("laion/urls/part-0.parquet", 0, 2)]
        job = ShardJob(uri, out, formats, columns, ShardNaming(), FETCH, RULES, threads=2)
        assert download_shard(job, shards[0])["successes"] == 1

        listing = s3.list_objects_v2(Bucket="laion", Prefix="raw/")["Contents"]
        keys = sorted(o["Key"] for o in listing if not o["Key"].endswith("/"))  # pyarrow's directory marker
        assert keys == ["raw/00000.parquet", "raw/00000_stats.json"]
        body = s3.get_object(Bucket="laion", Key="raw/00000.parquet")["Body"].read()
        rows = pq.read_table(io.BytesIO(body)).sort_by(schema.RAW_KEY).to_pylist()
        assert [_reason(r) for r in rows] == ["success", "http_404"] and rows[0][schema.RAW_IMAGE] == JPEG
    finally:
        moto.stop()


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_cli_downloads_csv_with_renamed_columns_and_resize(server, tmp_path, ray_local, capsys, fmt):
    import runpy
    cli = runpy.run_path(os.path.join(os.path.dirname(__file__), "..", "..", "convert", "download_laion.py"))
    src = tmp_path / "in.csv"
    src.write_text(f"link,alt,lang\n{server.url('/ok.jpg')},a noisy photo,en\n{server.url('/missing')},gone,de\n")
    out = tmp_path / "out"
    cli["main"](["--input", str(src), "--output", str(out), "--url-col", "link", "--caption-col", "alt",
                 "--keep-columns", "lang", "--resize-mode", "center_crop", "--image-size", "32",
                 "--min-size", "16", "--timeout", "2", "--output-format", fmt])
    printed = capsys.readouterr().out
    assert "1/2 images downloaded" in printed and "http_404 1" in printed
    rows = _read_output(out).to_pylist()
    assert [(r[schema.RAW_CAPTION], r["lang"], _reason(r)) for r in rows] == [
        ("a noisy photo", "en", "success"), ("gone", "de", "http_404")]
    if fmt == "webdataset":  # the image is in the tar, the metadata parquet has none
        assert schema.RAW_IMAGE not in rows[0] and sorted(os.listdir(out)) == [
            "00000.parquet", "00000.tar", "00000_stats.json", "download_plan.json", "summary.json"]
        with tarfile.open(out / "00000.tar") as tar:
            assert tar.getnames() == ["000000000.jpg", "000000000.txt", "000000000.json"]
            image = tar.extractfile("000000000.jpg").read()
            assert tar.extractfile("000000000.txt").read() == b"a noisy photo"
    else:
        image = rows[0][schema.RAW_IMAGE]
    assert Image.open(io.BytesIO(image)).size == (32, 32)
    assert (rows[0][schema.RAW_ORIGINAL_WIDTH], rows[0][schema.RAW_ORIGINAL_HEIGHT]) == (64, 48)


# ---- stalls, kills, img2dataset's schema -----------------------------------------------------------

ROOT = os.path.join(os.path.dirname(__file__), "..", "..")


def test_a_shard_with_stalled_urls_finishes_in_about_the_time_of_its_slowest_response(server, tmp_path):
    """4 URLs that take STALL_S = 2 s to answer, 40 rows apart among 156 fast ones, 8 threads. Were rows
    written in input order, each stall would hold the rows behind it and the shard would take at least
    4 x 2 s = 8 s. So all four stalled requests are asked for before the first one answers (the server saw
    them arrive within STALL_S of each other: a clock that load slows alike on both sides), and the shard
    takes well under the 8 s of stalls in a row."""
    server.reset()
    paths = [f"/stall-{i}" if i % 40 == 0 else "/ok.jpg" for i in range(160)]
    src = _write_input(tmp_path / "in.parquet", [server.url(p) for p in paths])
    job = ShardJob(src, str(tmp_path / "out"), {src: "parquet"}, InputColumns(), ShardNaming.for_plan(1, 160),
                   FetchConfig(timeout=STALL_S + 3, retries=0), RULES, threads=8)
    os.makedirs(tmp_path / "out")
    start = time.monotonic()
    stats = download_shard(job, ShardSpec(0, src, 0, 160))
    elapsed = time.monotonic() - start
    arrivals = sorted(t for t, _ in server.handler.stalls)
    assert len(arrivals) == 4 and arrivals[-1] - arrivals[0] < STALL_S, arrivals  # in flight together
    assert elapsed < 2 * STALL_S + 1.5, f"{elapsed:.1f} s"  # 8 s had each waited for the one before
    assert stats["successes"] == 160 and sum(server.hits[p] for p in server.hits if p.startswith("/stall")) == 4
    rows = _read_output(tmp_path / "out").to_pylist()
    assert [r[schema.RAW_KEY] for r in rows] == [f"00000{i:03d}" for i in range(160)]
    assert all(r[schema.RAW_IMAGE] == JPEG and r[schema.RAW_CAPTION] == f"caption {int(r[schema.RAW_KEY][5:])}"
               for r in rows)


class _DribblingHandler(http.server.BaseHTTPRequestHandler):
    """Answers a byte every 50 ms: the status line and headers (/headers) or, after them, the body (/body),
    100 bytes: about 5 s of answer, each byte well within a per-read timeout."""

    def log_message(self, *args):
        pass

    def do_GET(self):
        body = JPEG[:100]
        head = f"HTTP/1.1 200 OK\r\nContent-Type: image/jpeg\r\nContent-Length: {len(body)}\r\n\r\n".encode()
        slow, fast = (head + body, b"") if self.path.startswith("/headers") else (body, head)
        try:
            self.wfile.write(fast)
            for i in range(len(slow)):
                self.wfile.write(slow[i:i + 1])
                self.wfile.flush()
                time.sleep(0.05)
        except (BrokenPipeError, ConnectionResetError):  # the client gave up, as it should
            pass


def test_a_server_sending_a_byte_at_a_time_is_a_timeout_at_the_attempts_deadline(tmp_path):
    """Each read gets a byte well within the per-read timeout, so only the whole-attempt deadline can end
    these; it must, in the headers as in the body, within --timeout (2 s) of the start."""
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _DribblingHandler)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        urls = [f"http://127.0.0.1:{httpd.server_port}/{p}" for p in ("headers", "body")]
        src = _write_input(tmp_path / "in.parquet", urls)
        job = ShardJob(src, str(tmp_path / "out"), {src: "parquet"}, InputColumns(), ShardNaming.for_plan(1, 2),
                       FetchConfig(timeout=2, retries=0), RULES, threads=2)
        os.makedirs(tmp_path / "out")
        start = time.monotonic()
        download_shard(job, ShardSpec(0, src, 0, 2))
        elapsed = time.monotonic() - start
    finally:
        httpd.shutdown()
    assert elapsed < 3.0, f"{elapsed:.1f} s"
    assert [_reason(r) for r in _read_output(tmp_path / "out").to_pylist()] == ["timeout", "timeout"]
    assert json.loads((tmp_path / "out" / "00000_stats.json").read_text())["failures"] == {"timeout": 2}


KILLED_RUN = """
import sys
from diffusion.download.http import FetchConfig
from diffusion.download.image import ImageRules
from diffusion.download.plan import InputColumns, plan_shards
from diffusion.download.shard import ShardJob, ShardNaming, download_shard
src, out, fmt = sys.argv[1:]
shards, formats = plan_shards(src, InputColumns(), 40)
job = ShardJob(src, out, formats, InputColumns(), ShardNaming.for_plan(len(shards), 40),
               FetchConfig(timeout=5, retries=0), ImageRules(min_size=16), threads=4, output_format=fmt)
for spec in shards:  # what the job's Ray tasks run, one shard after another
    download_shard(job, spec)
"""


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_a_download_killed_mid_shard_resumes_to_the_same_rows(server, tmp_path, ray_local, fmt):
    """A process downloading 3 shards of 40 rows is killed (SIGKILL) while shard 1's rows are being
    fetched; re-running the job skips shard 0, downloads shards 1 and 2 again from their first row and
    ends with every row once: the counts of a run never interrupted."""
    import signal
    import subprocess
    import sys
    server.reset()
    paths = ["/missing" if i % 5 == 0 else f"/paced-{i}" for i in range(120)]  # each shard: 32 images, 8 404s
    src = _write_input(tmp_path / "in.parquet", [server.url(p) for p in paths])
    out = tmp_path / "out"
    os.makedirs(out)
    proc = subprocess.Popen([sys.executable, "-c", KILLED_RUN, src, str(out), fmt], cwd=ROOT)
    shard1 = {f"/paced-{i}" for i in range(40, 80)}
    deadline = time.monotonic() + 60
    while not any(server.hits[p] for p in shard1) and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    proc.send_signal(signal.SIGKILL)
    proc.wait()
    assert proc.returncode == -signal.SIGKILL  # killed, not finished
    left = sorted(os.listdir(out))
    assert "00000_stats.json" in left and "00001_stats.json" not in left and "00001.parquet.tmp" in left, left

    server.reset()
    config = DownloadConfig(input=src, output=str(out), rows_per_shard=40, threads=4, output_format=fmt,
                            fetch=FetchConfig(timeout=5, retries=0), image=RULES)
    again = download(config)
    assert (again.skipped_shards, again.downloaded) == (1, 80)
    assert not any(server.hits[f"/paced-{i}"] for i in range(40))  # shard 0 was not fetched again
    assert (again.count, again.successes, again.failures) == (120, 96, {"http_404": 24})
    assert not [f for f in os.listdir(out) if f.endswith(".tmp")]
    rows = _read_output(out).to_pylist()
    assert [r[schema.RAW_KEY] for r in rows] == [f"{s:05d}{i:02d}" for s in range(3) for i in range(40)]
    assert [_reason(r) for r in rows] == ["http_404" if i % 5 == 0 else "success" for i in range(120)]
    if fmt == "webdataset":
        names = [n for t in sorted(glob.glob(str(out / "*.tar"))) for n in tarfile.open(t).getnames()]
        assert sorted(names) == sorted(f"{r[schema.RAW_KEY]}{ext}" for r in rows if r[schema.RAW_STATUS] == "success"
                                       for ext in (".jpg", ".txt", ".json"))


# img2dataset's output, as its documentation and writer define it (its defaults: extract_exif on,
# compute_hash "sha256"): the columns in their order, their types, the status values, the stats fields.
IMG2DATASET_COLUMNS = [("url", pa.string()), ("caption", pa.string())]  # then the input columns it keeps
IMG2DATASET_META = [("key", pa.string()), ("status", pa.string()), ("error_message", pa.string()),
                    ("width", pa.int32()), ("height", pa.int32()), ("original_width", pa.int32()),
                    ("original_height", pa.int32()), ("exif", pa.string()), ("sha256", pa.string())]
IMG2DATASET_IMAGE = [("jpg", pa.binary())]  # parquet output only; webdataset's parquet holds the metadata
IMG2DATASET_STATUSES = {"success", "failed_to_download", "failed_to_resize"}
IMG2DATASET_STATS = {"count", "successes", "failed_to_download", "failed_to_resize", "duration", "start_time",
                     "end_time", "status_dict"}
FAILED_TO_RESIZE = {"not_image", "decode_error", "too_small"}  # bytes came back, but no usable image
SERVED = {"/ok.jpg": JPEG, "/ok.png": PNG, "/moved": JPEG, "/flaky": JPEG, "/exif.jpg": EXIF_JPEG}


def _download_cases(server, tmp_path, fmt):
    """CASES plus an image with EXIF, one shard, with a kept input column; the rows by key."""
    server.reset()
    paths = list(CASES) + ["/exif.jpg"]
    src = _write_input(tmp_path / "in.parquet", [server.url(p) for p in paths],
                       extra={"similarity": [0.25] * len(paths)})
    job = ShardJob(src, str(tmp_path / "out"), {src: "parquet"}, InputColumns(keep=("similarity",)),
                   ShardNaming.for_plan(1, 100), FETCH, RULES, threads=8, output_format=fmt)
    os.makedirs(tmp_path / "out")
    download_shard(job, ShardSpec(0, src, 0, len(paths)))
    return paths, pq.read_table(tmp_path / "out" / "00000.parquet")


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_output_has_img2dataset_columns_status_values_and_stats(server, tmp_path, fmt):
    paths, table = _download_cases(server, tmp_path, fmt)
    expected = IMG2DATASET_COLUMNS + [("similarity", pa.float64())] + IMG2DATASET_META + (
        IMG2DATASET_IMAGE if fmt == "parquet" else [])
    assert [(f.name, f.type) for f in table.schema] == expected
    rows = table.sort_by("key").to_pylist()
    assert len(rows) == len(paths) and {r["status"] for r in rows} == IMG2DATASET_STATUSES
    for path, row in zip(paths, rows):
        reason = CASES.get(path, "success")
        assert row["url"] == server.url(path) and row["similarity"] == 0.25
        if reason == "success":
            assert row["status"] == "success" and row["error_message"] is None
            assert row["sha256"] == hashlib.sha256(SERVED[path]).hexdigest()
            exif = json.loads(row["exif"])
            if path == "/exif.jpg":
                assert (exif["Image Make"], exif["EXIF ExposureTime"]) == ("Canon", "1/100")
            else:
                assert exif == {}
        else:
            assert row["status"] == ("failed_to_resize" if reason in FAILED_TO_RESIZE else "failed_to_download")
            assert row["error_message"].startswith(reason + ": ") and server.url(path) not in row["error_message"]
            assert (row["sha256"], row["exif"], row["width"], row["original_width"]) == (None, None, None, None)
        if fmt == "parquet":
            assert row["jpg"] == (SERVED[path] if reason == "success" else None)

    stats = json.loads((tmp_path / "out" / "00000_stats.json").read_text())
    assert IMG2DATASET_STATS <= set(stats)
    messages = collections.Counter(r["error_message"] or "success" for r in rows)
    assert stats["status_dict"] == dict(messages) and stats["status_dict"]["http_404: Not Found"] == 1
    assert (stats["count"], stats["successes"], stats["failed_to_resize"], stats["failed_to_download"]) == (
        15, 5, 3, 7)

    if fmt == "webdataset":
        with tarfile.open(tmp_path / "out" / "00000.tar") as tar:
            members = [(m.name, tar.extractfile(m).read()) for m in tar]
        names = [n for n, _ in members]
        samples = [names[i:i + 3] for i in range(0, len(names), 3)]  # each sample's members together
        assert samples == [[n[:-4] + ext for ext in (".jpg", ".txt", ".json")] for n, *_ in samples]
        assert sorted(n[:-4] for n, *_ in samples) == [r["key"] for r in rows if r["status"] == "success"]
        files = dict(members)
        for row, path in [(r, p) for p, r in zip(paths, rows) if r["status"] == "success"]:
            assert files[row["key"] + ".jpg"] == SERVED[path]
            assert files[row["key"] + ".txt"] == row["caption"].encode()
            assert json.loads(files[row["key"] + ".json"]) == row  # the parquet row, every column


@pytest.mark.parametrize("fmt", ["parquet", "webdataset"])
def test_the_converter_reads_the_download_output(server, tmp_path, fmt):
    """What the converter's reader takes from the output directory: the downloaded images only, each with
    its key and caption (the webdataset's metadata parquet is not read as data)."""
    from diffusion.convert.readers import iter_rows
    paths, table = _download_cases(server, tmp_path, fmt)
    read = sorted(iter_rows(str(tmp_path / "out")), key=lambda r: r[schema.RAW_KEY])
    ok = [(f"00000{i:02d}", f"caption {i}", SERVED[p]) for i, p in enumerate(paths) if p in SERVED]
    assert [(r[schema.RAW_KEY], r[schema.RAW_CAPTION], r[schema.RAW_IMAGE]) for r in read] == ok


# ---- --where and --dedupe-urls: rows decided in the driver, before any fetch ------------------------

def _stats(out) -> list[dict]:
    return [json.loads(open(f).read()) for f in sorted(glob.glob(os.path.join(out, "*_stats.json")))]


def test_where_drops_rows_before_fetching_counts_each_rule_and_is_part_of_the_plan(server, tmp_path, ray_local):
    server.reset()
    aesthetic = [6.0, 4.0, 5.5, 7.0, 3.0, 5.0, 6.5, 2.0, 8.0, 5.2]
    punsafe = [0.0, 0.0, 0.9, 0.1, 0.9, None, 0.2, 0.0, 0.0, 0.05]
    src = _write_input(tmp_path / "in.parquet", [server.url(f"/row-{i}") for i in range(10)],
                       extra={"aesthetic": aesthetic, "punsafe": punsafe})
    out = tmp_path / "out"
    where = "aesthetic >= 5 and punsafe < 0.5"
    summary = download(_config(src, out, where=where))

    kept = [0, 3, 6, 8, 9]  # 1, 4, 7 fail the first rule; 2 (0.9) and 5 (null) the second
    assert sorted(server.hits) == [f"/row-{i}" for i in kept]  # nothing else was requested
    assert summary.dropped == {"filtered: aesthetic >= 5": 3, "filtered: punsafe < 0.5": 2}
    assert "not fetched: filtered: aesthetic >= 5 3" in str(summary)
    assert (summary.count, summary.downloaded) == (5, 5)
    stats = _stats(out)  # shards of 4 rows: 0-3, 4-7, 8-9
    assert [s["dropped"] for s in stats] == [{"filtered: aesthetic >= 5": 1, "filtered: punsafe < 0.5": 1},
                                             {"filtered: aesthetic >= 5": 2, "filtered: punsafe < 0.5": 1}, {}]
    assert [s["count"] for s in stats] == [2, 1, 2]
    table = _read_output(out)
    assert table[schema.RAW_URL].to_pylist() == [server.url(f"/row-{i}") for i in kept]
    assert table[schema.RAW_KEY].to_pylist() == ["000000", "000003", "000012", "000020", "000021"]  # input positions

    server.reset()
    again = download(_config(src, out, where="aesthetic>=5   AND punsafe<0.5"))  # the same filter, other spacing
    assert again.skipped_shards == 3 and not server.hits and again.dropped == summary.dropped
    with pytest.raises(ValueError, match=r"different plan \(--where changed\)"):
        download(_config(src, out, where="aesthetic >= 6"))
    with pytest.raises(ValueError, match=r"different plan \(--where changed\)"):
        download(_config(src, out))  # no filter now: the shards would mean other rows
    assert sorted(server.hits) == [] and _read_output(out).num_rows == 5  # refused runs fetch and lose nothing


def test_dedupe_urls_fetches_each_url_once_in_input_order(server, tmp_path, ray_local):
    server.reset()
    os.makedirs(tmp_path / "in")
    # a.parquet: shards 0 (rows 0-3) and 1 (4-6); b.parquet: shard 2. Duplicates within a shard, across
    # shards and across files; row 6 of a (score 1) is dropped by --where, so its URL counts as unseen.
    a = ["/u0", "/u1", "/u0", "/u2", "/u1", "/u3", "/u5"]
    b = ["/u3", "/u4", "/u0", "/u5"]
    _write_input(tmp_path / "in" / "a.parquet", [server.url(p) for p in a], extra={"score": [9] * 6 + [1]})
    _write_input(tmp_path / "in" / "b.parquet", [server.url(p) for p in b], extra={"score": [9] * 4})
    out = tmp_path / "out"
    summary = download(_config(tmp_path / "in", out, dedupe_urls=True, where="score > 5"))
    assert server.hits == collections.Counter({f"/u{i}": 1 for i in range(6)})  # each URL fetched once
    assert summary.dropped == {"duplicate_url": 4, "filtered: score > 5": 1}
    assert [s["dropped"] for s in _stats(out)] == [{"duplicate_url": 1},
                                                   {"duplicate_url": 1, "filtered: score > 5": 1},
                                                   {"duplicate_url": 2}]
    table = _read_output(out)
    assert table[schema.RAW_KEY].to_pylist() == ["000000", "000001", "000003", "000011", "000021", "000023"]

    (out / "00001_stats.json").unlink()  # a resume recomputes the same duplicates
    server.reset()
    again = download(_config(tmp_path / "in", out, dedupe_urls=True, where="score > 5"))
    assert again.skipped_shards == 2 and server.hits == collections.Counter({"/u3": 1})
    assert again.dropped == summary.dropped and _read_output(out).num_rows == 6
    with pytest.raises(ValueError, match=r"different plan \(--dedupe-urls changed\)"):
        download(_config(tmp_path / "in", out, where="score > 5"))


def _cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "convert/download_laion.py", *map(str, args)], cwd=ROOT,
                          capture_output=True, text=True, timeout=120)


_EXIT_AFTER_READING_COLUMNS = """
import io, sys, time
import pyarrow.fs as pa_fs
from diffusion.download import select

class SlowBytesIO(io.BytesIO):  # a busy machine: the reader's read-ahead still runs when the process exits
    def readinto(self, buffer):
        time.sleep(0.02)
        return super().readinto(buffer)
    def read(self, *args):
        time.sleep(0.02)
        return super().read(*args)

select.io.BytesIO = SlowBytesIO
print(select.file_columns(pa_fs.LocalFileSystem(), sys.argv[1], "csv"))
sys.exit(2)  # what the CLI does next when the filter names a column the file lacks
"""


def test_reading_a_csvs_columns_leaves_nothing_running_at_exit(tmp_path):
    """The flaky abort at exit of a --where naming a missing column: Arrow's read-ahead threads were still
    reading the csv from a Python file object while the interpreter shut down."""
    path = tmp_path / "in.csv"
    path.write_text("URL,TEXT\n" + "".join(f"http://x/{i},caption {i}\n" for i in range(200_000)))
    for _ in range(3):
        done = subprocess.run([sys.executable, "-c", _EXIT_AFTER_READING_COLUMNS, str(path)], capture_output=True,
                              text=True, timeout=120)
        assert (done.returncode, done.stdout.strip()) == (2, "['URL', 'TEXT']"), done.stderr[-1000:]


@pytest.mark.parametrize("where,expected", [
    ("punsafe < 0.1", "--where 'punsafe < 0.1' names column 'punsafe' that {src} does not have; its columns are "
                      "URL, TEXT, aesthetic"),
    ("aesthetic >> 5", "--where 'aesthetic >> 5' is not a filter expression"),
    ("aesthetic > 100 and aesthetic < 200", "--where 'aesthetic > 100 and aesthetic < 200' keeps no row of the "
                                            "input: 'aesthetic > 100' removed 3 (of 3 rows); nothing was downloaded"),
    ("aesthetic in ['a',1]", "--where \"aesthetic in ['a',1]\" is not a filter expression: the values of aesthetic "
                             "in [...] mix numbers and strings"),
    ("aesthetic > " + "9" * 30, f"--where 'aesthetic > {'9' * 30}' is not a filter expression: the integer "
                                "99999999999999999999... (30 digits) is out of range"),
    ("(" * 1000 + "aesthetic > 1" + ")" * 1000, "--where '((((((((((((((((((((((((((((((((((((((((((((((((((((((("
                                                "(((((((((((((((((((((((((' ... '))))))))))))))))))))))))))))))))))))))))'"
                                                " (2013 characters) is not a filter expression: parentheses and 'not' "
                                                "are nested more than 100 deep"),
])
def test_a_filter_naming_a_missing_column_malformed_or_keeping_nothing_is_one_line_at_start(tmp_path, capsys,
                                                                                             monkeypatch, where,
                                                                                             expected):
    src = _write_input(tmp_path / "in.csv", ["http://127.0.0.1:1/a", "http://127.0.0.1:1/b", "http://127.0.0.1:1/c"],
                       "csv", extra={"aesthetic": [4.0, 5.0, 6.0]})
    argv = ["--input", str(src), "--output", str(tmp_path / "out"), "--where", where, "--dedupe-urls"]
    if where == "punsafe < 0.1":  # the real command: its exit status and stderr
        done = _cli(*argv)
        status, stderr = done.returncode, done.stderr
    else:  # the same cli.run the command calls, in this process (a process start each is most of the test)
        from diffusion import cli, cluster
        from diffusion.download import job
        monkeypatch.setattr(cluster, "init_ray", lambda *a, **k: pytest.fail("Ray started before the check"))
        with pytest.raises(SystemExit) as exited:
            cli.run(job.main, "download_laion", argv)
        status, stderr = exited.value.code, capsys.readouterr().err
    assert status == 2 and "Traceback" not in stderr
    lines = stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("download_laion: error: " + expected.format(src=src)), lines
    assert not (tmp_path / "out").exists()  # nothing written


def test_an_output_that_is_a_file_or_the_input_is_one_line_and_nothing_is_written(tmp_path, capsys):
    """--output naming a file (or a folder under one) was pyarrow's "[Errno 17] Cannot create directory ...
    Detail: ..." naming no flag; now one line, before any cluster starts, and the file stays as it was."""
    from diffusion import cli
    from diffusion.download import job
    src = _write_input(tmp_path / "in.csv", ["http://127.0.0.1:1/a"], "csv")
    taken = tmp_path / "earlier.parquet"
    taken.write_bytes(b"an earlier shard")
    for output in (taken, taken / "raw"):
        with pytest.raises(SystemExit):
            cli.run(job.main, "download_laion", ["--input", str(src), "--output", str(output)])
        assert capsys.readouterr().err == (f"download_laion: error: --output {output}: not a folder (it, or a folder "
                                           f"above it, is a file); give the folder to write the image shards in\n")
    assert taken.read_bytes() == b"an earlier shard"
    # the input folder as the output: its shards landed among the url lists, and the resuming re-run read
    # them as url lists ("00000_stats.json: no column ['URL', 'TEXT']")
    with pytest.raises(SystemExit):
        cli.run(job.main, "download_laion", ["--input", str(tmp_path), "--output", str(tmp_path)])
    assert capsys.readouterr().err == (f"download_laion: error: --output {tmp_path} is the --input folder: write the "
                                       f"image shards to a folder of their own\n")
    assert sorted(os.listdir(tmp_path)) == ["earlier.parquet", "in.csv"]
