import io
import json
import tarfile

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from diffusion import schema
from diffusion.convert.readers import InputError, RawColumns, check_inputs, iter_rows, read_raw
from tfrecord_writer import example, write_tfrecord


def _jpeg(size=(80, 60), color=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", size, color).save(buf, "JPEG")
    return buf.getvalue()


def test_parquet_rows_in_order_with_keys_and_captions(sample_data, manifest):
    rows = list(iter_rows(sample_data))
    assert len(rows) == manifest["rows"]
    assert [r[schema.RAW_KEY] for r in rows[:3]] == ["000000000", "000000001", "000000002"]
    assert all(isinstance(r[schema.RAW_IMAGE], bytes) for r in rows)


def test_configurable_columns_and_derived_stable_keys(tmp_path):
    table = pa.table({"image_bytes": [_jpeg(), _jpeg()], "text": ["a red square", "another"]})
    pq.write_table(table, tmp_path / "web-0007.parquet")
    columns = RawColumns(image="image_bytes", caption="text", key="id")
    first = [r[schema.RAW_KEY] for r in iter_rows(tmp_path, columns)]
    again = [r[schema.RAW_KEY] for r in iter_rows(tmp_path, columns)]
    assert first == again == ["web-0007.parquet:000000000", "web-0007.parquet:000000001"]
    assert [r[schema.RAW_CAPTION] for r in iter_rows(tmp_path, columns)] == ["a red square", "another"]


def test_wrong_column_names_the_file_and_its_columns(sample_data):
    with pytest.raises(InputError) as e:
        check_inputs(sample_data, RawColumns(image="image"))
    message = str(e.value)
    assert "part-00000.parquet" in message and "'image'" in message
    assert schema.RAW_IMAGE in message and schema.RAW_URL in message  # the columns it does have


def test_missing_and_unreadable_inputs_are_clear_errors(tmp_path):
    with pytest.raises(InputError, match="no such file"):
        check_inputs(tmp_path / "nope")
    (tmp_path / "broken.parquet").write_bytes(b"not parquet at all")
    with pytest.raises(InputError, match="broken.parquet"):
        check_inputs(tmp_path)


def test_download_output_keeps_only_successes(tmp_path):
    table = pa.table({schema.RAW_KEY: ["a", "b", "c"], schema.RAW_CAPTION: ["x", "y", "z"],
                      schema.RAW_IMAGE: [_jpeg(), None, _jpeg()],
                      schema.RAW_STATUS: ["success", "failed_to_download", "success"]})
    pq.write_table(table, tmp_path / "00000.parquet")
    assert [r[schema.RAW_KEY] for r in iter_rows(tmp_path)] == ["a", "c"]


def _write_tar(path, samples):
    with tarfile.open(path, "w") as tar:
        for key, parts in samples:
            for ext, data in parts.items():
                info = tarfile.TarInfo(f"{key}{ext}")
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))


def test_webdataset_tar_as_img2dataset_writes_it(tmp_path):
    meta = json.dumps({"url": "http://x", "width": 80, "height": 60, "status": "success"}).encode()
    _write_tar(tmp_path / "00000.tar", [
        ("000000010", {".jpg": _jpeg(), ".txt": b"a red square", ".json": meta}),
        ("000000011", {".jpg": _jpeg(), ".txt": b"a blue dot"}),
        ("000000012", {".txt": b"caption without image"}),
    ])
    rows = list(iter_rows(tmp_path))
    assert [(r[schema.RAW_KEY], r[schema.RAW_CAPTION]) for r in rows] == [
        ("00000.tar/000000010", "a red square"), ("00000.tar/000000011", "a blue dot")]  # keys unique across tars
    assert rows[0][schema.WIDTH] == 80


def test_folder_of_images_with_sidecars(tmp_path):
    (tmp_path / "cats").mkdir()
    (tmp_path / "cats" / "one.jpg").write_bytes(_jpeg())
    (tmp_path / "cats" / "one.txt").write_text("a red cat\n")
    (tmp_path / "two.png").write_bytes(_jpeg())  # content sniffed by PIL later, not by suffix
    rows = {r[schema.RAW_KEY]: r[schema.RAW_CAPTION] for r in iter_rows(tmp_path)}
    assert rows == {"cats/one.jpg": "a red cat", "two.png": None}  # a missing sidecar is a missing caption


def test_read_raw_skips_done_keys_before_decoding(sample_data, manifest, ray_local):
    skip = {f"{i:09d}" for i in range(10)}
    keys = [r[schema.RAW_KEY] for r in read_raw(sample_data, skip_keys=skip).take_all()]
    assert len(keys) == manifest["rows"] - 10 and not skip & set(keys)


def _colliding_input(root) -> int:
    """Inputs whose names collided under the old stem-based keys; returns the number of distinct rows."""
    table = pa.table({"jpg": [_jpeg(), _jpeg((70, 70))], "caption": ["a red square", "a blue circle"]})
    for sub in ("en", "multi"):
        (root / sub).mkdir(parents=True)
        pq.write_table(table, root / sub / "part-00000.parquet")
    pq.write_table(table, root / "laion.2023.parquet")
    pq.write_table(table, root / "laion.2024.parquet")
    return 8


def test_derived_keys_are_unique_across_files_with_the_same_stem(tmp_path):
    n = _colliding_input(tmp_path)
    keys = [r[schema.RAW_KEY] for r in iter_rows(tmp_path)]
    assert len(keys) == len(set(keys)) == n
    assert "en/part-00000.parquet:000000001" in keys and "multi/part-00000.parquet:000000001" in keys
    assert "laion.2023.parquet:000000000" in keys and "laion.2024.parquet:000000000" in keys


def test_folder_images_differing_only_in_suffix_are_two_samples(tmp_path):
    for name, fmt in (("img0.jpg", "JPEG"), ("img0.png", "PNG")):
        Image.new("RGB", (64, 64), (10, 200, 10)).save(tmp_path / name, fmt)
    assert sorted(r[schema.RAW_KEY] for r in iter_rows(tmp_path)) == ["img0.jpg", "img0.png"]


def test_repeated_keys_in_one_file_are_counted_duplicates_not_rows(tmp_path):
    table = pa.table({"jpg": [_jpeg()] * 3, "caption": ["a", "b", "c"], "key": ["k1", "k2", "k1"]})
    pq.write_table(table, tmp_path / "dup.parquet")
    tar_path = tmp_path / "tars"
    tar_path.mkdir()
    with tarfile.open(tar_path / "00000.tar", "w") as tar:
        for name, data in (("s0.jpg", _jpeg()), ("s0.txt", b"first"), ("s1.jpg", _jpeg()), ("s1.txt", b"x"),
                           ("s0.jpg", _jpeg()), ("s0.txt", b"again")):
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    from diffusion.convert.readers import iter_file_batches
    from diffusion.convert.rows import DUPLICATE_KEY
    for uri, fmt, expected in ((str(tmp_path / "dup.parquet"), "parquet", ["k1", "k2"]),
                               (str(tar_path / "00000.tar"), "webdataset", ["00000.tar/s0", "00000.tar/s1"])):
        recorded = {}
        keys = [k for batch in iter_file_batches(uri, fmt, RawColumns(), None, recorded.update)
                for k in batch[schema.RAW_KEY]]
        assert keys == expected, fmt
        assert list(recorded.values()) == [DUPLICATE_KEY], fmt


def test_a_key_repeated_across_files_is_kept_in_the_first_file_and_a_counted_duplicate_in_the_others(tmp_path):
    # b.parquet gives k1 (a's) and 7 (c's int 7); c.parquet gives 7 again; derived keys never collide.
    for name, keys, captions in (("a", ["k1", "k2"], ["a1", "a2"]), ("b", ["k3", "k1", "7", None], ["b1", "b2", "b3", "b4"]),
                                 ("c", [None, "8", "7"], ["c1", "c2", "c3"])):
        pq.write_table(pa.table({"jpg": [_jpeg()] * len(keys), "caption": captions, "key": keys}),
                       tmp_path / f"{name}.parquet")
    pq.write_table(pa.table({"jpg": [_jpeg()], "caption": ["d1"], "key": pa.array([7], pa.int64())}),
                   tmp_path / "d.parquet")
    from diffusion.convert.rows import DUPLICATE_KEY
    for _ in range(2):  # the same choice every time
        recorded = {}
        rows = list(iter_rows(tmp_path, on_reject=recorded.update))
        assert [(r[schema.RAW_KEY], r[schema.RAW_CAPTION]) for r in rows] == [
            ("k1", "a1"), ("k2", "a2"), ("k3", "b1"), ("7", "b3"), ("b.parquet:000000003", "b4"),
            ("c.parquet:000000000", "c1"), ("8", "c2")]
        assert recorded == {"k1#b.parquet:1": DUPLICATE_KEY, "7#c.parquet:2": DUPLICATE_KEY,
                            "7#d.parquet:0": DUPLICATE_KEY}


# ---- hostile rows, broken files, mixed formats (issue 17) ----------------------------------------

def _batches_of(uri, fmt, name=None):
    """(keys read, {reject id: reason}) of one file."""
    from diffusion.convert.readers import iter_file_batches
    recorded = {}
    keys = [k for batch in iter_file_batches(str(uri), fmt, RawColumns(), name, recorded.update)
            for k in batch[schema.RAW_KEY]]
    return keys, recorded


@pytest.mark.parametrize("column, values, expected", [
    # an int or list caption, bytes that are not UTF-8: bad_caption; bytes in UTF-8 are text
    ("caption", pa.array([7, 8]), ["bad_caption", "bad_caption"]),
    ("caption", pa.array([["a"], ["b", "c"]]), ["bad_caption", "bad_caption"]),
    ("caption", pa.array([b"\xff\xfe", b"caf\xc3\xa9"], pa.binary()), ["bad_caption", None]),
    # widths: "abc" and negatives are bad_size; "640", 640.0, NaN (pandas' missing) and 0 are fine
    ("width", pa.array(["abc", "640"]), ["bad_size", None]),
    ("width", pa.array([float("nan"), 640.0]), [None, None]),
    ("width", pa.array([-5, 0]), ["bad_size", None]),
    # keys: whole numbers are keys (LAION's int64 SAMPLE_ID), fractions and lists are not
    ("key", pa.array([1.5, 3.0]), ["bad_key", None]),
    ("key", pa.array([["x"], ["y"]]), ["bad_key", "bad_key"]),
])
def test_hostile_values_reject_their_row_by_reason(tmp_path, column, values, expected):
    table = {"jpg": [_jpeg(), _jpeg()], "caption": ["a red square", "a blue dot"], "key": ["k0", "k1"], column: values}
    pq.write_table(pa.table(table), tmp_path / "h.parquet")
    keys, recorded = _batches_of(tmp_path / "h.parquet", "parquet")
    assert sorted(recorded.values()) == sorted(r for r in expected if r)
    assert len(keys) == expected.count(None)
    if column == "key" and expected[1] is None:
        assert keys == ["3"] and list(recorded) == ["h.parquet:000000000#bad_key"]  # no usable key: file and row


def test_int_keys_are_their_digits_and_rows_are_typed_for_arrow(tmp_path):
    from diffusion.convert.readers import _arrow_batch, iter_file_batches
    table = pa.table({"jpg": [_jpeg(), _jpeg()], "caption": [b"a red square", b"\xef\xbb\xbfa bom"],
                      "key": pa.array([0, 12], pa.int64()), "width": ["80", None]})
    pq.write_table(table, tmp_path / "ints.parquet")
    (batch,) = iter_file_batches(str(tmp_path / "ints.parquet"), "parquet")
    assert batch[schema.RAW_KEY] == ["0", "12"] and batch[schema.WIDTH] == [80, None]
    assert batch[schema.RAW_CAPTION] == ["a red square", "\ufeffa bom"]  # the transform strips the BOM
    assert _arrow_batch(batch).num_rows == 2


def test_webdataset_bad_sidecars_are_rejects_and_a_truncated_tar_keeps_what_came_before(tmp_path):
    good = json.dumps({"width": 80, "height": 60, "status": "success"}).encode()
    _write_tar(tmp_path / "a.tar", [
        ("s0", {".jpg": _jpeg(), ".txt": b"a red square", ".json": good}),
        ("s1", {".jpg": _jpeg(), ".txt": b"a blue dot", ".json": b"{not json"}),
        ("s2", {".jpg": _jpeg(), ".txt": b"a list", ".json": b"[1, 2]"}),
        ("s3", {".jpg": _jpeg(), ".txt": b"\xff\xfe", ".json": good}),
        ("s4", {".jpg": _jpeg(), ".txt": b"a width", ".json": json.dumps({"width": "wide"}).encode()}),
        ("s5", {".jpg": _jpeg(), ".txt": b"fine"}),
    ])
    keys, recorded = _batches_of(tmp_path / "a.tar", "webdataset")
    assert keys == ["a.tar/s0", "a.tar/s5"]
    assert recorded == {"a.tar/s1": "bad_metadata", "a.tar/s2": "bad_metadata", "a.tar/s3": "bad_caption",
                        "a.tar/s4": "bad_size"}

    data = (tmp_path / "a.tar").read_bytes()
    (tmp_path / "cut").mkdir()
    (tmp_path / "cut" / "a.tar").write_bytes(data[: len(data) // 2])  # a download cut short
    failed = []
    rows = list(iter_rows(tmp_path / "cut", on_failed_file=lambda name, error: failed.append((name, error))))
    assert [r[schema.RAW_KEY] for r in rows] == ["a.tar/s0"]  # read before the damage
    assert len(failed) == 1 and failed[0][0] == "a.tar" and "a.tar" in failed[0][1]


def test_unreadable_files_are_skipped_not_fatal_unless_nothing_is_readable(tmp_path):
    pq.write_table(pa.table({"jpg": [_jpeg()], "caption": ["a red square"]}), tmp_path / "a.parquet")
    (tmp_path / "b.parquet").write_bytes(b"")  # zero bytes, sorts after a readable file
    (tmp_path / "c.parquet").write_text("not parquet")
    assert check_inputs(tmp_path) == ("parquet", 3)  # the run skips and records them
    failed = {}
    rows = list(iter_rows(tmp_path, on_failed_file=failed.__setitem__))
    assert [r[schema.RAW_KEY] for r in rows] == ["a.parquet:000000000"]
    assert sorted(failed) == ["b.parquet", "c.parquet"] and all("parquet" in e for e in failed.values())
    (tmp_path / "a.parquet").unlink()
    with pytest.raises(InputError, match="no input file can be read"):
        check_inputs(tmp_path)
    pq.write_table(pa.table({"jpg": [_jpeg()], "text": ["x"]}), tmp_path / "d.parquet")
    with pytest.raises(InputError, match="d.parquet has no column 'caption'"):  # a flag's fault: at start
        check_inputs(tmp_path)


def test_mixed_formats_are_all_read_but_a_tars_metadata_parquet_is_not(tmp_path):
    pq.write_table(pa.table({"jpg": [_jpeg()] * 2, "caption": ["a", "b"], "key": ["p0", "p1"]}), tmp_path / "p.parquet")
    _write_tar(tmp_path / "00000.tar", [("t0", {".jpg": _jpeg(), ".txt": b"c"}),
                                        ("t1", {".jpg": _jpeg(), ".txt": b"d"})])
    pq.write_table(pa.table({"key": ["t0", "t1"], "caption": ["c", "d"], "status": ["success"] * 2}),
                   tmp_path / "00000.parquet")  # img2dataset's metadata of 00000.tar: no images
    (tmp_path / "img.png").write_bytes(_jpeg())
    (tmp_path / "img.txt").write_text("e")
    assert check_inputs(tmp_path) == ("parquet+webdataset+folder", 3)
    assert sorted(r[schema.RAW_KEY] for r in iter_rows(tmp_path)) == ["00000.tar/t0", "00000.tar/t1", "img.png",
                                                                       "p0", "p1"]


# ---- img2dataset's output layouts, read by folder (issue 18) -------------------------------------

def _img2dataset_metadata(keys, statuses) -> pa.Table:
    """The metadata parquet img2dataset writes beside each shard (no image column)."""
    n = len(keys)
    return pa.table({schema.RAW_KEY: keys, schema.RAW_URL: [f"http://x/{k}.jpg" for k in keys],
                     schema.RAW_CAPTION: [f"caption {k}" for k in keys], schema.RAW_STATUS: statuses,
                     "error_message": [None if s == "success" else "timeout" for s in statuses],
                     schema.WIDTH: [80] * n, schema.HEIGHT: [60] * n})


def _write_img2dataset(folder, layout, shards=("00000", "00001")):
    """img2dataset's output in ``layout`` (parquet, webdataset or files): two shards of three rows,
    the last of each a failed download; each shard with its NNNNN_stats.json."""
    folder.mkdir()
    for shard in shards:
        keys = [f"{shard}{i:04d}" for i in range(3)]
        statuses = ["success", "success", "failed_to_download"]
        meta = _img2dataset_metadata(keys, statuses)
        (folder / f"{shard}_stats.json").write_text(json.dumps({"count": 3, "successes": 2}))
        if layout == "parquet":
            pq.write_table(meta.append_column(schema.RAW_IMAGE, pa.array([_jpeg(), _jpeg(), None], pa.binary()))
                           .append_column("txt", meta.column(schema.RAW_CAPTION)), folder / f"{shard}.parquet")
            continue
        pq.write_table(meta, folder / f"{shard}.parquet")
        samples = [(k, {".jpg": _jpeg(), ".txt": f"caption {k}".encode(),
                        ".json": json.dumps({"key": k, "status": "success", "width": 80, "height": 60}).encode()})
                   for k in keys[:2]]
        if layout == "webdataset":
            _write_tar(folder / f"{shard}.tar", samples)
        elif layout == "tfrecord":  # features key, jpg, txt and the metadata, as img2dataset writes them
            write_tfrecord(folder / f"{shard}.tfrecord", [
                example({"key": k, "jpg": parts[".jpg"], "txt": parts[".txt"], "url": f"http://x/{k}.jpg",
                         "status": "success", "error_message": None, "width": 80, "height": 60})
                for k, parts in samples])
        else:
            (folder / shard).mkdir()
            for key, parts in samples:
                for ext, data in parts.items():
                    (folder / shard / f"{key}{ext}").write_bytes(data)


@pytest.mark.parametrize("layout, fmt, files, key", [("parquet", "parquet", 2, "{}".format),
                                                     ("webdataset", "webdataset", 2, "{}".format),
                                                     ("files", "folder", 4, "{}.jpg".format),
                                                     ("tfrecord", "tfrecord", 2, "{}".format)])
def test_each_img2dataset_output_layout_is_read_by_folder(tmp_path, layout, fmt, files, key):
    _write_img2dataset(tmp_path / layout, layout)
    assert check_inputs(tmp_path / layout) == (fmt, files)  # data files: the metadata parquets are not
    rows = list(iter_rows(tmp_path / layout))
    keys = ["000000000", "000000001", "000010000", "000010001"]
    expected = [key(f"{k[:5]}/{k}" if layout == "files" else k) for k in keys]
    assert [r[schema.RAW_KEY] for r in rows] == expected  # successes only
    assert [r[schema.RAW_CAPTION] for r in rows] == [f"caption {k}" for k in keys]
    assert {(r[schema.WIDTH], r[schema.HEIGHT]) for r in rows} <= {(80, 60), (None, None)}


def test_a_tfrecord_cut_short_keeps_its_records_before_the_damage(tmp_path):
    _write_img2dataset(tmp_path / "tfr", "tfrecord", shards=("00000",))
    path = tmp_path / "tfr" / "00000.tfrecord"
    path.write_bytes(path.read_bytes()[:-100])  # the second record cut short
    failed = []
    rows = list(iter_rows(tmp_path / "tfr", on_failed_file=lambda name, error: failed.append((name, error))))
    assert [r[schema.RAW_KEY] for r in rows] == ["000000000"]
    assert failed == [("00000.tfrecord", f"cannot read {path} as a tfrecord file: record 1 is cut short")]


def test_a_shards_parquet_with_images_is_data_and_a_damaged_one_is_metadata(tmp_path):
    _write_img2dataset(tmp_path / "wds", "webdataset")
    # 00001.parquet now holds images: data beside its tar, read with it (as any mixed folder is)
    pq.write_table(pa.table({schema.RAW_IMAGE: [_jpeg()], schema.RAW_CAPTION: ["a parquet row"],
                             schema.RAW_KEY: ["p0"]}), tmp_path / "wds" / "00001.parquet")
    (tmp_path / "wds" / "00000.parquet").write_bytes(b"cut short")  # img2dataset killed mid-write
    assert check_inputs(tmp_path / "wds") == ("parquet+webdataset", 3)
    keys = [r[schema.RAW_KEY] for r in iter_rows(tmp_path / "wds")]
    assert sorted(keys) == ["000000000", "000000001", "000010000", "000010001", "p0"]


def test_a_folder_without_images_names_the_layouts_looked_for(tmp_path):
    (tmp_path / "urls.csv").write_text("url,caption\n")
    (tmp_path / "00000_stats.json").write_text("{}")
    with pytest.raises(InputError) as e:
        check_inputs(tmp_path)
    message = str(e.value)
    assert str(tmp_path) in message and "it holds 2 files (1 .csv, 1 .json)" in message
    for layout in ("parquet", "webdataset", "files", "tfrecord", "images with .txt captions"):
        assert layout in message
    pq.write_table(_img2dataset_metadata(["k0"], ["success"]), tmp_path / "urls.parquet")  # no tar beside it
    with pytest.raises(InputError, match="urls.parquet has no column 'jpg'.*download_laion"):
        check_inputs(tmp_path)


# ---- keys across files of every layout (issue 24 item 2) -----------------------------------------

def _two_img2dataset_runs(root):
    """Two img2dataset runs merged into one input: en/00000.tar and multi/00000.tar, both keyed from
    000000000 in their .json sidecars, and a tfrecord run keyed the same. en's 000000001 has a caption
    that is not UTF-8 (not a sample), so multi's 000000001 keeps that key."""
    def sample(key, caption):
        return (key, {".jpg": _jpeg(), ".txt": caption,
                      ".json": json.dumps({"key": key, "status": "success"}).encode()})
    for run in ("en", "multi"):
        (root / run).mkdir(parents=True)
        _write_tar(root / run / "00000.tar", [sample(f"00000{i:04d}", f"{run} {i}".encode() if (run, i) != ("en", 1)
                                                     else b"\xff\xfe") for i in range(3)])
    (root / "tf").mkdir()
    write_tfrecord(root / "tf" / "00000.tfrecord", [example({"key": "000000002", "jpg": _jpeg(), "txt": b"tf 2"}),
                                                    example({"key": "tf-own", "jpg": _jpeg(), "txt": b"tf own"})])


def test_webdataset_and_tfrecord_keys_repeated_across_files_are_kept_once_and_counted(tmp_path):
    from diffusion.convert.rows import BAD_CAPTION, DUPLICATE_KEY
    _two_img2dataset_runs(tmp_path)
    for _ in range(2):  # the same choice every time
        recorded = {}
        rows = list(iter_rows(tmp_path, on_reject=recorded.update))
        assert [(r[schema.RAW_KEY], r[schema.RAW_CAPTION]) for r in rows] == [
            ("000000000", "en 0"), ("000000002", "en 2"), ("000000001", "multi 1"), ("tf-own", "tf own")]
        # every row not kept is a reject of its own, named by its file (so "rows in" counts each)
        assert recorded == {"en/00000.tar:000000001#bad_caption": BAD_CAPTION,
                            "000000000#multi/00000.tar:0": DUPLICATE_KEY, "000000002#multi/00000.tar:2": DUPLICATE_KEY,
                            "000000002#00000.tfrecord:0": DUPLICATE_KEY}
    # keys derived from file and row instead (a key column the inputs lack): every row is its own
    keys = [r[schema.RAW_KEY] for r in iter_rows(tmp_path, RawColumns(key="none"))]
    assert keys == ["en/00000.tar/000000000", "en/00000.tar/000000002", "multi/00000.tar/000000000",
                    "multi/00000.tar/000000001", "multi/00000.tar/000000002", "00000.tfrecord:000000000",
                    "00000.tfrecord:000000001"]


def test_a_key_whose_first_row_is_no_sample_goes_to_a_later_files_sample(tmp_path):
    """a.parquet's rows keyed k1 (an empty caption) and k2 (no image) and en/00000.tar's 000000001 (a
    0-byte image) are not samples: the later files' rows with those keys are kept, not lost as
    duplicate_key, and the rows that are none are counted by their own reason; a key whose first
    row is a sample (k0) stays that file's. The same on every run."""
    from diffusion.rejects import DUPLICATE_KEY, EMPTY_CAPTION, UNDECODABLE
    pq.write_table(pa.table({"key": ["k0", "k1", "k2"], "caption": ["a0", " \u200b ", "a2"],
                             "jpg": pa.array([_jpeg(), _jpeg(), None], pa.binary())}), tmp_path / "a.parquet")
    pq.write_table(pa.table({"key": ["k0", "k1", "k2"], "caption": ["b0", "b1", "b2"],
                             "jpg": [_jpeg(), _jpeg(), _jpeg()]}), tmp_path / "b.parquet")
    for run in ("en", "multi"):
        (tmp_path / run).mkdir()
        _write_tar(tmp_path / run / "00000.tar", [
            (key, {".jpg": b"" if (run, key) == ("en", "000000001") else _jpeg(), ".txt": f"{run} {key}".encode(),
                   ".json": json.dumps({"key": key, "status": "success"}).encode()})
            for key in ("000000000", "000000001")])
    for _ in range(2):
        recorded = {}
        rows = list(iter_rows(tmp_path, on_reject=recorded.update))
        assert [(r[schema.RAW_KEY], r[schema.RAW_CAPTION]) for r in rows] == [
            ("k0", "a0"), ("k1", "b1"), ("k2", "b2"), ("000000000", "en 000000000"), ("000000001", "multi 000000001")]
        assert recorded == {"a.parquet:000000001#empty_caption": EMPTY_CAPTION,
                            "a.parquet:000000002#undecodable": UNDECODABLE, "k0#b.parquet:0": DUPLICATE_KEY,
                            "en/00000.tar:000000001#undecodable": UNDECODABLE,
                            "000000000#multi/00000.tar:0": DUPLICATE_KEY}


def test_the_files_layout_keys_carry_their_folder(tmp_path):
    for run in ("en", "multi"):
        (tmp_path / run / "00000").mkdir(parents=True)
        (tmp_path / run / "00000" / "000000000.jpg").write_bytes(_jpeg())
        (tmp_path / run / "00000" / "000000000.json").write_text(json.dumps({"key": "000000000"}))
    assert [r[schema.RAW_KEY] for r in iter_rows(tmp_path)] == ["en/00000/000000000.jpg", "multi/00000/000000000.jpg"]


def test_the_key_pass_reads_tars_only_where_their_metadata_shows_a_repeated_key(tmp_path, monkeypatch):
    from diffusion.convert import shared_keys
    read = []
    real = shared_keys.file_keys
    monkeypatch.setattr(shared_keys, "file_keys", lambda uri, *a: read.append(uri) or real(uri, *a))
    for run in ("en", "multi"):
        _write_img2dataset(tmp_path / run, "webdataset", shards=("00000", "00001") if run == "en" else ("00002",))
    assert len(list(iter_rows(tmp_path))) == 6 and read == []  # keys of 3 shards, none repeated: no tar read
    _write_img2dataset(tmp_path / "again", "webdataset", shards=("00001",))  # en's 00001 keys once more
    recorded = {}
    rows = list(iter_rows(tmp_path, on_reject=recorded.update))
    assert sorted(read) == [str(tmp_path / "again" / "00001.tar"), str(tmp_path / "en" / "00001.tar")]
    # "again" comes first in input order: it keeps the keys
    assert len(rows) == 6 and sorted(recorded) == ["000010000#en/00001.tar:0", "000010001#en/00001.tar:1"]
