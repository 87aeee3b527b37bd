import contextlib
import dataclasses
import hashlib
import io
import json
import os
import pathlib
import socket
import subprocess
import sys
import tarfile

import numpy as np
import pytest
from PIL import Image

from diffusion import schema
from diffusion.convert.pipeline import ConvertConfig, PoolPlan, plan_pools, run_conversion
from diffusion.convert.sink import TMP_PREFIX
from diffusion.convert.readers import iter_rows
from record_layout import records_named_json, to_old_layout
from tfrecord_writer import example, write_tfrecord

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
REASON = {"truncated": "undecodable", "not_image": "undecodable", "tiny": "too_small",
          "empty_caption": "empty_caption"}


def _expected_rejects(bad_kinds) -> dict:
    rejects = {}
    for kind in bad_kinds:
        rejects[REASON[kind]] = rejects.get(REASON[kind], 0) + 1
    return rejects


def _snapshot(directory) -> dict:
    """{relative path: sha1} of every file under ``directory``."""
    files = {}
    for root, _, names in os.walk(directory):
        for name in names:
            path = os.path.join(root, name)
            with open(path, "rb") as f:
                files[os.path.relpath(path, directory)] = hashlib.sha1(f.read()).hexdigest()
    return files


def _convert_cli(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "convert", "laion_to_mds.py"), "--no-progress",
                           *map(str, args)], capture_output=True, text=True, timeout=300)


def _read_back(local, remote=None):
    from streaming import StreamingDataset
    ds = StreamingDataset(local=str(local), remote=remote, shuffle=False, batch_size=1)
    return [ds[i] for i in range(len(ds))]


# ---- pool sizing (fast) ----------------------------------------------------------------------------

def test_two_cpus_leave_room_for_read_tasks():
    plan = plan_pools({"CPU": 2.0}, ConvertConfig(input="x", output="y", model="m"))
    assert plan.num_transformers == 1 and plan.num_encoders == 1 and plan.gpus_per_encoder == 0
    assert plan.num_transformers * plan.cpus_per_transformer + plan.cpus_per_encoder <= 1.0
    assert plan.cpus_per_task == 1.0  # one box: a read task keeps Ray's whole CPU


def test_two_one_cpu_nodes_give_read_tasks_the_half_cpu_each_node_keeps():
    """Two 1-CPU nodes total two CPUs, but Ray spreads the half-CPU actors one a node: a read task wanting
    a whole CPU never started (the conversion hung). Planned for two nodes, read and write tasks ask for
    what some node keeps however the actors land; a plan that still cannot be placed is one line."""
    from diffusion.convert.pipeline import CONVERT_PLACEMENT, check_placement
    from diffusion.errors import ConfigError
    cfg = ConvertConfig(input="x", output="y", model="m")
    one_box, two_nodes = plan_pools({"CPU": 2.0}, cfg), plan_pools({"CPU": 2.0}, cfg, nodes=2)
    assert two_nodes.cpus_per_task == 0.5
    assert dataclasses.replace(two_nodes, cpus_per_task=1.0) == one_box  # the same pools
    for layout in ([{"CPU": 1.0}, {"CPU": 1.0}], [{"CPU": 2.0}]):
        check_placement(layout, two_nodes, CONVERT_PLACEMENT)
    with pytest.raises(ConfigError, match=r"^the conversion cannot place its read tasks: each needs 1 CPU on one "
                                          r"node, and once the actors are placed the nodes have 0.5, 0.5 CPU left; "
                                          r"give the nodes more CPUs \(ray start --num-cpus\)"):
        check_placement([{"CPU": 1.0}, {"CPU": 1.0}], one_box, CONVERT_PLACEMENT)
    pinned = plan_pools({"CPU": 2.0}, dataclasses.replace(cfg, cpus_per_transformer=2.0), nodes=2)
    with pytest.raises(ConfigError, match=r"^the conversion cannot place a transformer \(2 CPU, 0 GPU\) on this "
                                          r"cluster: its nodes have 1 CPU/0 GPU, 1 CPU/0 GPU left"):
        check_placement([{"CPU": 1.0}, {"CPU": 1.0}], pinned, CONVERT_PLACEMENT)


def test_gpus_get_one_encoder_each_and_flags_override():
    cfg = ConvertConfig(input="x", output="y", model="m", resolutions=(512,))
    plan = plan_pools({"CPU": 64.0, "GPU": 8.0}, cfg)
    assert (plan.num_encoders, plan.gpus_per_encoder, plan.encoder_batch) == (8, 1.0, 40)
    assert plan.num_transformers >= 40
    cfg = ConvertConfig(input="x", output="y", model="m", num_transformers=3, cpus_per_transformer=2,
                        encoder_gpus=0.5, encoder_batch_size=7)
    assert plan_pools({"CPU": 64.0, "GPU": 2.0}, cfg) == PoolPlan(3, 2, 4, 1.0, 0.5, 7)


def test_cli_wrong_column_names_file_and_columns(sample_data, tiny_kit):
    result = _convert_cli("--input", sample_data, "--output", "unused", "--model", tiny_kit, "--image-column", "img")
    assert result.returncode != 0
    assert "part-00000.parquet" in result.stderr and "'img'" in result.stderr and "url" in result.stderr
    assert "Traceback" not in result.stderr


def test_weightless_model_is_one_line_and_writes_nothing(sample_data, sd2_kit, tmp_path):
    out = tmp_path / "mds"
    result = _convert_cli("--input", sample_data, "--output", out, "--model", sd2_kit)
    assert result.returncode != 0 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "no weights" in result.stderr and "vae" in result.stderr
    assert not out.exists()


@pytest.mark.parametrize("overrides, said", [
    # each was a traceback: a ValueError, or a RayTaskError from the first write task a minute in
    (dict(resolutions=[63]), "--resolutions 63: not a multiple of 8, the downsampling of {kit}'s autoencoder; e.g. 56"),
    (dict(shard_size="abc"), "--shard-size 'abc': Unsupported value/suffix abc."),
    (dict(compression="bogus"), "--compression 'bogus': not one streaming writes; choose one of br, bz2, gz, snappy, "
                                "zstd (with :LEVEL, e.g. zstd:7), or none"),
    (dict(output="{tmp}/taken.parquet/mds"), "--output {tmp}/taken.parquet/mds: not a folder ({tmp}/taken.parquet is a "
                                             "file); give the folder to write the MDS shards in"),  # was "Not a directory"
    (dict(input="{tmp}/raw", output="{tmp}/raw"), "--output {tmp}/raw is the --input folder: write the MDS shards to a folder of "
                                          "their own"),  # it wrote convert.json into the raw data and went on
])
def test_writer_settings_and_an_output_under_a_file_are_one_line_before_any_worker(convert_config, tiny_kit, tmp_path,
                                                                                   overrides, said):
    from diffusion.convert.pipeline import run_conversion
    from diffusion.errors import ConfigError
    (tmp_path / "taken.parquet").write_bytes(b"an earlier shard")
    overrides = {k: v.format(tmp=tmp_path) if isinstance(v, str) else v for k, v in overrides.items()}
    raw = tmp_path / "raw"  # one part of the sample data, as an input folder of its own
    raw.mkdir()
    sample = convert_config(tmp_path).input
    part = sorted(n for n in os.listdir(sample) if n.endswith(".parquet"))[0]
    (raw / part).write_bytes((pathlib.Path(sample) / part).read_bytes())
    with pytest.raises(ConfigError) as refused:
        run_conversion(convert_config(overrides.pop("output", tmp_path / "out"), **overrides))
    assert str(refused.value).startswith(said.format(tmp=tmp_path, kit=tiny_kit)), str(refused.value)
    assert sorted(os.listdir(tmp_path)) == ["raw", "taken.parquet"] and os.listdir(raw) == [part]
    assert (tmp_path / "taken.parquet").read_bytes() == b"an earlier shard"


def test_failed_first_run_leaves_no_output_folder(convert_config, tmp_path, monkeypatch):
    from diffusion.convert import pipeline as convert

    def crash(*args, **kwargs):
        raise RuntimeError("a worker died before anything was committed")
    monkeypatch.setattr(convert, "_convert_into", crash)
    out = tmp_path / "new"
    with pytest.raises(RuntimeError):
        run_conversion(convert_config(out))
    assert not out.exists()
    existing = tmp_path / "existing"  # a folder the user made: never removed
    existing.mkdir()
    with pytest.raises(RuntimeError):
        run_conversion(convert_config(existing))
    assert existing.is_dir()


# ---- full conversions (Ray, tiny kit) ----------------------------------------------------------------

@pytest.mark.slow
def test_sample_converts_with_exact_counts(converted, manifest):
    out, summary = converted
    expected_rejects = _expected_rejects(k for k, n in manifest["bad"].items() for _ in range(n))
    assert summary.written == manifest["good"] and summary.rejects == expected_rejects
    assert summary.rows_in == manifest["rows"]
    info = schema.DatasetInfo.load(out)
    assert (info.count, info.rows_in, info.rejects) == (manifest["good"], manifest["rows"], expected_rejects)
    assert info.resolutions == [32, 64]
    assert "rows in" in summary.table() and "rejected: undecodable" in summary.table()


@pytest.mark.slow
def test_shards_read_back_with_streaming(converted, manifest, sample_data):
    out, _ = converted
    samples = _read_back(out)
    good = {r[schema.RAW_KEY]: r for r in iter_rows(sample_data)
            if r[schema.RAW_KEY] not in manifest["bad_keys"]}
    assert sorted(s[schema.KEY] for s in samples) == sorted(good)
    info = schema.DatasetInfo.load(out)
    s = samples[0]
    for r in info.resolutions:
        assert s[schema.vae_moments_column(r)].shape == (8, r // info.downsample, r // info.downsample)
        assert s[schema.vae_moments_column(r)].dtype == np.float16
    assert s[schema.TEXT_EMBEDS].shape == (77, info.text_dim)
    assert schema.INPUT_IDS not in s and info.text == schema.TEXT_EMBEDS_ONLY  # the default, --text embeds
    assert len(info.empty_input_ids) == 77 and info.text_encoder == info.model
    assert s[schema.CAPTION] == good[s[schema.KEY]][schema.RAW_CAPTION]
    assert (s[schema.WIDTH], s[schema.HEIGHT]) == (good[s[schema.KEY]][schema.WIDTH],
                                                       good[s[schema.KEY]][schema.HEIGHT])
    with open(os.path.join(out, "index.json")) as f:
        shards = json.load(f)["shards"]
    assert all(sh["compression"] == "zstd" and sh["hashes"] for sh in shards)
    empty = np.load(os.path.join(out, schema.EMPTY_TEXT_EMBEDS))
    assert empty.shape == (77, info.text_dim)


@pytest.fixture(scope="module")
def ids_on_s3(sample_data, convert_config, ray_local, tmp_path_factory):
    """One conversion for the --text ids test and the S3 output test (fresh Ray actors and their imports are
    most of one): the sample's first 32 rows with --text ids, written to s3://laion/ids (a moto server) through
    a local staging folder. (staging folder, summary, the samples read back from S3, the bucket's objects.)"""
    import boto3
    tmp = tmp_path_factory.mktemp("ids_on_s3")
    with _s3_server() as endpoint:
        summary = run_conversion(convert_config("s3://laion/ids", local_dir=str(tmp / "staging"), text="ids",
                                                limit=32, deterministic=True))
        from_s3 = _read_back(tmp / "cache", remote="s3://laion/ids")
        names = {o["Key"] for o in boto3.client("s3", endpoint_url=endpoint).list_objects_v2(Bucket="laion")["Contents"]}
    return tmp / "staging", summary, from_s3, names


@pytest.mark.slow
def test_text_ids_stores_token_ids_and_no_embeddings(converted, ids_on_s3, tiny_kit):
    # The same rows as the shared conversion (its first 32), stored with --text ids: the moments are the
    # same, the embeddings are gone, the ids are the tokenizer's, and dataset.json says what it holds.
    from diffusion.models.loading import load_tokenizer
    ids_out, summary, _, _ = ids_on_s3
    ids_samples = {s[schema.KEY]: s for s in _read_back(ids_out)}
    embeds_samples = {s[schema.KEY]: s for s in _read_back(converted[0])}
    assert len(ids_samples) == summary.written > 20
    tokenizer = load_tokenizer(tiny_kit)
    for key, s in ids_samples.items():
        assert schema.TEXT_EMBEDS not in s and s[schema.INPUT_IDS].dtype == np.int32
        want = tokenizer(s[schema.CAPTION], padding="max_length", max_length=77, truncation=True)["input_ids"]
        assert s[schema.INPUT_IDS].tolist() == want
        np.testing.assert_array_equal(s[schema.vae_moments_column(32)], embeds_samples[key][schema.vae_moments_column(32)])
    info = schema.DatasetInfo.load(str(ids_out))
    assert info.text == "ids" and info.text_encoder == tiny_kit
    assert info.empty_input_ids == tokenizer("", padding="max_length", max_length=77)["input_ids"]
    # the text encoder's fingerprint, which training from these ids checks its encoder against
    probe = info.text_probe
    assert probe["input_ids"] == tokenizer(probe["captions"], padding="max_length", max_length=77)["input_ids"]
    assert np.asarray(probe["mean_embedding"]).shape == (len(probe["captions"]), info.text_dim)
    embeds_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(converted[0]) for f in fs
                       if ".mds" in f) / len(embeds_samples)
    ids_bytes = sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(ids_out) for f in fs
                    if ".mds" in f) / len(ids_samples)
    assert ids_bytes < embeds_bytes / 2  # even with the tiny kit's 64-wide text encoder


@pytest.mark.slow
def test_stored_moments_match_a_direct_vae_encode(converted, convert_config, tiny_kit):
    from diffusion.convert.preview import input_crops
    from diffusion.convert.encoders import TextEncoder, VaeEncoder
    out, _ = converted
    samples = _read_back(out)[:4]
    vae, text = VaeEncoder(tiny_kit, device="cpu"), TextEncoder(tiny_kit, device="cpu")
    crops = input_crops(convert_config(out), [s[schema.KEY] for s in samples])
    for r in (32, 64):
        direct = vae.moments(np.stack([crops[s[schema.KEY]][r] for s in samples])).astype(np.float32)
        stored = np.stack([s[schema.vae_moments_column(r)] for s in samples]).astype(np.float32)
        np.testing.assert_allclose(stored, direct, atol=1e-2, rtol=1e-2)
    embeds = text.encode_captions([s[schema.CAPTION] for s in samples]).astype(np.float32)
    np.testing.assert_allclose(np.stack([s[schema.TEXT_EMBEDS] for s in samples]).astype(np.float32),
                               embeds, atol=1e-2, rtol=1e-2)
    np.testing.assert_allclose(np.load(os.path.join(out, schema.EMPTY_TEXT_EMBEDS)).astype(np.float32),
                               text.encode_captions([""])[0].astype(np.float32), atol=1e-2, rtol=1e-2)


@pytest.mark.slow
def test_visualize_writes_crops_beside_decodings(converted):
    out, _ = converted
    image = Image.open(os.path.join(out, "visualize.png"))
    assert image.size == (2 * 64, 2 * 64)  # 2 samples: crop | decoding at the largest resolution


@pytest.fixture(scope="module")
def stopped_part_way(converted, tmp_path_factory):
    """(output dir, its counts) of the "crash": a copy of the clean output less its largest part, its index.json
    and dataset.json (a write task killed before it committed that part; one conversion fewer than a run
    stopped part-way, which test_colliding_names_... and test_where_and_dedupe.py resume from)."""
    import shutil
    from diffusion.convert.sink import KEYS_RECORD
    from diffusion.convert.summary import summarize
    out = tmp_path_factory.mktemp("stopped") / "mds"
    shutil.copytree(converted[0], out)
    parts = sorted(out.glob("part-*"))
    assert len(parts) > 1, "the clean output is one part: losing it leaves nothing to resume"
    shutil.rmtree(max(parts, key=lambda p: len(json.loads((p / KEYS_RECORD).read_text()))))
    for made_at_the_end in (out / "index.json", out / schema.DATASET_JSON):  # never made by the killed run
        made_at_the_end.unlink()
    return out, summarize(str(out))


def _copy_of(stopped, where):
    import shutil
    shutil.copytree(stopped, where)
    return where


@pytest.fixture(scope="module")
def resumed_from_crash(convert_config, stopped_part_way, tmp_path_factory):
    """A copy of the "crash" as a killed run leaves it at its worst, resumed once (one conversion for
    both resume tests: fresh Ray actors and their imports are most of one): a write task killed mid-part left
    a half-written temporary part, and the output is of the old records layout (written before the records
    were .jsonl), killed again while a re-run was renaming its records. (output dir, its parts before the
    re-run, the stale part, the re-run's summary.)"""
    out = _copy_of(stopped_part_way[0], tmp_path_factory.mktemp("resumed") / "mds")
    parts = sorted(p.name for p in out.glob("part-*"))
    to_old_layout(out, half_done_part=parts[0])
    assert (out / parts[-1] / "keys.json").exists() and sorted((out / "rejects").glob("*.json"))
    stale = out / f"{TMP_PREFIX}part-deadbeef"  # a part a killed write task left half-written
    stale.mkdir()
    (stale / "shard.00000.mds.zstd").write_bytes(b"half a shard")
    return out, parts, stale, run_conversion(convert_config(out))


@pytest.mark.slow
def test_kill_and_resume_equals_a_clean_run(converted, manifest, stopped_part_way, resumed_from_crash):
    clean = sorted(s[schema.KEY] for s in _read_back(converted[0]))
    out, _, stale, second = resumed_from_crash
    first = stopped_part_way[1]  # the "crash": a part lost
    assert 0 < first.written < manifest["good"]
    keys = [s[schema.KEY] for s in _read_back(out)]
    assert sorted(keys) == clean and len(keys) == len(set(keys))
    assert second.written == manifest["good"] and second.written_this_run == manifest["good"] - first.written
    assert second.rejects == converted[1].rejects and not stale.exists()


@pytest.mark.slow
def test_streamings_merge_index_on_the_output_root_gives_every_sample(converted, tmp_path):
    """``streaming.base.util.merge_index(root)``, the call users make on a folder of MDS parts, writes
    the converter's own index, and streaming reads every sample back through it."""
    import shutil
    from streaming.base.util import merge_index
    out = tmp_path / "copy"
    shutil.copytree(converted[0], out)
    ours = json.loads((out / "index.json").read_text())
    (out / "index.json").unlink()
    merge_index(str(out))
    assert json.loads((out / "index.json").read_text()) == ours
    keys = [s[schema.KEY] for s in _read_back(out)]
    assert len(keys) == len(set(keys)) == converted[1].written
    assert sorted(keys) == sorted(s[schema.KEY] for s in _read_back(converted[0]))


@pytest.mark.slow
def test_an_output_of_the_old_layout_resumes_and_ends_in_the_new_one(converted, manifest, stopped_part_way,
                                                                     resumed_from_crash):
    """An output written before the records were .jsonl (killed part-way, and killed again while a
    re-run was renaming its records) finishes like a clean run, keeps what it had, and ends in the
    layout streaming's merge_index reads."""
    from streaming.base.util import merge_index
    out, parts, _, second = resumed_from_crash
    first = stopped_part_way[1]
    keys = [s[schema.KEY] for s in _read_back(out)]
    assert sorted(keys) == sorted(s[schema.KEY] for s in _read_back(converted[0])) and len(keys) == len(set(keys))
    assert second.written == manifest["good"] and second.rejects == converted[1].rejects
    assert second.written_this_run == manifest["good"] - first.written  # the old parts were kept, not redone
    assert set(parts) <= {p.name for p in out.glob("part-*")}
    assert records_named_json(out) == []
    ours = json.loads((out / "index.json").read_text())
    (out / "index.json").unlink()  # streaming's merge_index never replaces an index.json
    merge_index(str(out))
    assert json.loads((out / "index.json").read_text()) == ours


@pytest.mark.slow
@pytest.mark.parametrize("flag, value, setting", [("--resolutions", "32", "resolutions"),
                                                  ("--min-size", "80", "min_size"), ("--text", "ids", "text")])
def test_rerun_with_other_settings_is_refused_and_changes_nothing(converted, sample_data, tiny_kit, capsys,
                                                                 flag, value, setting):
    out, _ = converted
    before = _snapshot(out)
    argv = ["--input", sample_data, "--output", out, "--model", tiny_kit, "--resolutions", "32", "64", flag, value]
    if flag == "--resolutions":  # the real command: its exit status and stderr
        result = _convert_cli(*argv)
        status, stderr = result.returncode, result.stderr
    else:  # the same cli.run the command calls, in this process (a process start each is most of the test)
        from diffusion import cli
        from diffusion.convert.command import main
        with pytest.raises(SystemExit) as exited:
            cli.run(main, "laion_to_mds", ["--no-progress", *argv])
        status, stderr = exited.value.code, capsys.readouterr().err
    assert status != 0 and "Traceback" not in stderr
    assert len(stderr.strip().splitlines()) == 1
    assert out in stderr and setting in stderr and "new --output" in stderr
    assert _snapshot(out) == before  # dataset.json, index and parts untouched


def _colliding_input(raw):
    """Files whose names shared a stem, images differing only in suffix, a key repeated in one file and a
    key repeated in another file. Returns (distinct rows, duplicate rows, the caption of keyed.parquet's k1)."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    from diffusion.kit.sample import render_scene
    rng = np.random.default_rng(0)

    def jpeg():
        image, caption = render_scene(rng, 96, 96)
        buf = io.BytesIO()
        image.save(buf, "JPEG")
        return buf.getvalue(), caption

    for name in ("en/part-00000.parquet", "multi/part-00000.parquet", "laion.2023.parquet", "laion.2024.parquet"):
        (raw / name).parent.mkdir(parents=True, exist_ok=True)
        images, captions = zip(*(jpeg() for _ in range(5)))
        pq.write_table(pa.table({"jpg": list(images), "caption": list(captions)}), raw / name)
    images, captions = zip(*(jpeg() for _ in range(4)))
    pq.write_table(pa.table({"jpg": list(images), "caption": list(captions), "key": ["k0", "k1", "k0", "k2"]}),
                   raw / "keyed.parquet")
    first_k1 = captions[1]
    images, captions = zip(*(jpeg() for _ in range(2)))
    pq.write_table(pa.table({"jpg": list(images), "caption": list(captions), "key": ["k1", "k3"]}),
                   raw / "keyed2.parquet")  # k1 is keyed.parquet's: a duplicate here
    return 4 * 5 + 3 + 1, 2, first_k1


def _tar_runs_keyed_alike(raw):
    """en/00000.tar and multi/00000.tar, both keying their samples 000000000.. in their .json sidecars;
    en's 000000003 has a caption not UTF-8 and 000000004 an empty one. Returns {(run, key): caption}."""
    from diffusion.kit.sample import render_scene
    rng = np.random.default_rng(0)
    captions = {}
    for run in ("en", "multi"):
        (raw / run).mkdir(parents=True, exist_ok=True)
        with tarfile.open(raw / run / "00000.tar", "w") as tar:
            for i in range(6):
                key = f"00000{i:04d}"
                image, caption = render_scene(rng, 96, 96)
                buf = io.BytesIO()
                image.save(buf, "JPEG")
                captions[run, key] = caption
                text = {("en", 3): b"\xff\xfe", ("en", 4): b" \t "}.get((run, i), caption.encode())  # not samples
                for ext, data in ((".jpg", buf.getvalue()), (".txt", text),
                                  (".json", json.dumps({"key": key, "status": "success"}).encode())):
                    info = tarfile.TarInfo(key + ext)
                    info.size = len(data)
                    tar.addfile(info, io.BytesIO(data))
    return captions


@pytest.mark.slow
def test_colliding_names_duplicate_keys_and_tar_runs_keyed_alike_survive_kill_and_resume(convert_config, tmp_path,
                                                                                         ray_local):
    """One input, one kill and re-run (a conversion pair fewer than a test each) for two promises:

    Files whose names shared a stem, images differing only in suffix, a key repeated in one file and a key
    repeated in another file: every row is written once or rejected once, before and after a kill and
    re-run, and dataset.json counts what a reader sees.

    en/00000.tar and multi/00000.tar both key their samples 000000000.. in their .json sidecars: each key
    is written once, with en's image; multi's rows with en's keys are counted duplicate_key rejects, the
    two whose keys en's rows (not samples: a caption not UTF-8, an empty one) left free are written,
    before and after a kill and re-run, and "rows in" counts every row."""
    raw = tmp_path / "raw"
    distinct, duplicates, first_k1 = _colliding_input(raw)
    captions = _tar_runs_keyed_alike(raw)
    out = tmp_path / "mds"
    # the "crash": in input order en/00000.tar (6 rows), then en/part-00000.parquet and keyed.parquet (9):
    # stopped before keyed2.parquet and multi/, whose duplicates are of keys the crashed run wrote
    run_conversion(convert_config(out, input=str(raw), resolutions=(32,), limit=15, deterministic=True))
    summary = run_conversion(convert_config(out, input=str(raw), resolutions=(32,)))
    samples = _read_back(out)
    keys = [s[schema.KEY] for s in samples]
    assert len(keys) == len(set(keys))
    tar_keys = {k for _, k in captions}
    colliding = [k for k in keys if k not in tar_keys]
    assert len(colliding) == distinct
    assert {s[schema.KEY]: s[schema.CAPTION] for s in samples}["k1"] == first_k1  # the first file's row
    written = {s[schema.KEY]: s[schema.CAPTION] for s in samples if s[schema.KEY] in tar_keys}
    expected = {k: captions["en", k] for k in ("000000000", "000000001", "000000002", "000000005")}
    assert written == {**expected, **{k: captions["multi", k] for k in ("000000003", "000000004")}}
    # the two inputs' counts: colliding's distinct rows and 2 duplicate keys; the tars' 6 samples, 4 duplicate
    # keys, a caption not UTF-8 and an empty one, of 12 rows
    assert summary.written == distinct + 6
    assert summary.rejects == {"duplicate_key": duplicates + 4, "bad_caption": 1, "empty_caption": 1}
    info = schema.DatasetInfo.load(str(out))
    assert (info.count, info.rows_in) == (distinct + 6, distinct + duplicates + 12) == (summary.written, summary.rows_in)


def _bad_kinds(rows, manifest):
    return [manifest["bad_keys"][r[schema.RAW_KEY]] for r in rows if r[schema.RAW_KEY] in manifest["bad_keys"]]


def _img2dataset_output(folder, layout, rows):
    """``rows`` as img2dataset writes them with ``output_format=layout`` (webdataset, files or
    tfrecord): two shards, each its samples (KEY.jpg, KEY.txt, KEY.json) in NNNNN.tar or NNNNN/ (or
    Examples of key, jpg, txt and metadata in NNNNN.tfrecord), beside NNNNN.parquet,
    the shard's metadata (no images; one more row, a failed download), and NNNNN_stats.json."""
    import pyarrow as pa
    import pyarrow.parquet as pq
    folder.mkdir()
    half = len(rows) // 2
    for shard, shard_rows in (("00000", rows[:half]), ("00001", rows[half:])):
        keys = [r[schema.RAW_KEY] for r in shard_rows] + [f"{shard}-failed"]
        pq.write_table(pa.table({schema.RAW_KEY: keys, schema.RAW_URL: [f"http://x/{k}" for k in keys],
                                 schema.RAW_CAPTION: [r[schema.RAW_CAPTION] for r in shard_rows] + ["lost"],
                                 schema.RAW_STATUS: ["success"] * len(shard_rows) + ["failed_to_download"]}),
                       folder / f"{shard}.parquet")
        (folder / f"{shard}_stats.json").write_text(json.dumps({"count": len(keys), "successes": len(shard_rows)}))
        samples = [(r[schema.RAW_KEY], {".jpg": r[schema.RAW_IMAGE], ".txt": r[schema.RAW_CAPTION].encode(),
                                        ".json": json.dumps({"key": r[schema.RAW_KEY], "status": "success"}).encode()})
                   for r in shard_rows]
        if layout == "tfrecord":
            write_tfrecord(folder / f"{shard}.tfrecord", [
                example({"key": key, "jpg": parts[".jpg"], "txt": parts[".txt"], "status": "success",
                         "error_message": None, "width": 0, "height": 0}) for key, parts in samples])
        elif layout == "webdataset":
            with tarfile.open(folder / f"{shard}.tar", "w") as tar:
                for key, parts in samples:
                    for ext, data in parts.items():
                        info = tarfile.TarInfo(key + ext)
                        info.size = len(data)
                        tar.addfile(info, io.BytesIO(data))
        else:
            (folder / shard).mkdir()
            for key, parts in samples:
                for ext, data in parts.items():
                    (folder / shard / f"{key}{ext}").write_bytes(data)


@pytest.mark.slow
def test_img2dataset_webdataset_files_and_tfrecord_folders_convert(sample_data, manifest, convert_config, tmp_path,
                                                                  ray_local):
    """img2dataset's webdataset, files and tfrecord outputs, each given by its folder: the metadata
    parquets beside the shards are not read as data; every sample is written or rejected by reason.
    The three folders are one conversion's inputs (a folder's files are named within their format, so
    its keys are those it gets alone): each layout's written keys and rejects by reason are checked on
    its own, and the summary's counts are their sums (one conversion, not three: fresh Ray actors and
    their imports are most of one)."""
    from collections import Counter
    from diffusion.convert.summary import done_keys
    rows = list(iter_rows(sample_data))[:24]
    # a tar or tfrecord sample takes its key from its metadata; an image file is keyed by its path
    layouts = (("webdataset", rows[:8], "{}".format), ("files", rows[8:16], None), ("tfrecord", rows[16:], "{}".format))
    for layout, part, _ in layouts:
        _img2dataset_output(tmp_path / layout, layout, part)
    out = tmp_path / "out"
    summary = run_conversion(convert_config(out, input=[str(tmp_path / layout) for layout, _, _ in layouts],
                                            resolutions=(32,)))
    samples = _read_back(out)
    keys = [s[schema.KEY] for s in samples]
    assert len(keys) == len(set(keys))
    _, rejected = done_keys(str(out))
    all_bad = []
    for layout, part, key in layouts:
        bad = _bad_kinds(part, manifest)
        all_bad += bad
        shard_of = {r[schema.RAW_KEY]: "00000" if i < len(part) // 2 else "00001" for i, r in enumerate(part)}
        key = key or (lambda k, shard_of=shard_of: f"{shard_of[k]}/{k}.jpg")
        good = {key(r[schema.RAW_KEY]) for r in part if r[schema.RAW_KEY] not in manifest["bad_keys"]}
        assert set(keys) & {key(r[schema.RAW_KEY]) for r in part} == good, layout
        assert len(good) == len(part) - len(bad), layout
        layout_rejects = Counter(reason for k, reason in rejected.items()
                                 if k in {key(r[schema.RAW_KEY]) for r in part})
        assert dict(layout_rejects) == _expected_rejects(bad), layout
    assert summary.written == len(keys) == len(rows) - len(all_bad)
    assert summary.rejects == _expected_rejects(all_bad) and len(rejected) == len(all_bad)
    assert summary.failed_inputs == {}


def test_transform_actors_tokenize_without_torch_and_as_the_driver_does(tiny_kit, tiny_t5_kit, ray_local):
    """A transform actor (a Ray actor of its own, as the pipeline's ImageCaptionTransform runs) imports transformers
    without torch (about 100 MB a process instead of about 490 MB) and gives the token ids the driver's tokenizer,
    with torch, gives: CLIP's and T5's, accents, emoji and an over-long caption included."""
    from diffusion.convert.transforms import ImageCaptionTransform
    from diffusion.models.loading import load_tokenizer
    from diffusion.models.tokens import tokenize

    @ray_local.remote(num_cpus=0.1)
    class Transform:  # one actor process for both kits: a process start is most of this test
        def tokenize(self, model, captions):
            import sys
            return ImageCaptionTransform(model, [32]).tokenize(captions), "torch" in sys.modules

    captions = ["a red circle", "Crème brûlée on a café table 🍰", "  two\tspaces ", "word " * 100]
    actor = Transform.remote()
    for kit in (tiny_kit, tiny_t5_kit):
        (ids, counts), torch_loaded = ray_local.get(actor.tokenize.remote(kit, captions))
        assert not torch_loaded, kit
        expected_ids, expected_counts = tokenize(load_tokenizer(kit), captions)
        np.testing.assert_array_equal(ids, expected_ids)
        np.testing.assert_array_equal(counts, expected_counts)
    ray_local.kill(actor)


def test_cli_folder_without_images_lists_the_layouts_looked_for(tiny_kit, tmp_path):
    (tmp_path / "raw").mkdir()
    (tmp_path / "raw" / "urls.csv").write_text("url,caption\nhttp://x/a.jpg,a red circle\n")
    result = _convert_cli("--input", tmp_path / "raw", "--output", tmp_path / "mds", "--model", tiny_kit)
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    line = result.stderr.strip()
    assert str(tmp_path / "raw") in line and "1 .csv" in line
    for layout in ("parquet", "webdataset", "files", "images with .txt captions"):
        assert layout in line
    assert not (tmp_path / "mds").exists()


@contextlib.contextmanager
def _s3_server():
    """A moto S3 server with the bucket "laion", and the environment pointing at it, for the ``with`` block."""
    from moto.server import ThreadedMotoServer
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    server.start()
    endpoint = f"http://127.0.0.1:{port}"
    try:
        with pytest.MonkeyPatch.context() as patch:
            for name, value in {"AWS_ACCESS_KEY_ID": "testing", "AWS_SECRET_ACCESS_KEY": "testing",
                                "AWS_DEFAULT_REGION": "us-east-1", "AWS_ENDPOINT_URL": endpoint,
                                "S3_ENDPOINT_URL": endpoint}.items():
                patch.setenv(name, value)
            import boto3
            boto3.client("s3", endpoint_url=endpoint).create_bucket(Bucket="laion")
            yield endpoint
    finally:
        server.stop()


@pytest.mark.slow
def test_s3_output_reads_back_from_s3(sample_data, manifest, ids_on_s3):
    rows = list(iter_rows(sample_data))[:32]
    _, summary, samples, names = ids_on_s3  # the --text ids conversion's output, written to s3://laion/ids
    expected = {r[schema.RAW_KEY] for r in rows} - set(manifest["bad_keys"])
    assert {s[schema.KEY] for s in samples} == expected and summary.written == len(expected)
    assert {"ids/index.json", "ids/dataset.json", f"ids/{schema.EMPTY_TEXT_EMBEDS}"} <= names
