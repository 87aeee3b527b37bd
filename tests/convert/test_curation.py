"""Curation from the pixels (issue 51): --embed with its scores and heads, --where on computed scores,
--dedupe near (two passes, killed and resumed), --exclude, --visualize-duplicates; one shared conversion.

The input: the sample data's good rows, with planted near-duplicates (re-encoded, resized, cropped,
mirrored, colour-jittered copies: diffusion.convert.planted), in two parquet shards with a url column.
"""

import hashlib
import json
import os

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diffusion import schema

ROWS = 36  # originals
COPIES = 2  # per transform


@pytest.fixture(scope="module")
def clip_kit(tiny_clip):
    return tiny_clip  # the session's tiny-clip kit (tests/conftest.py)


def _crop_scores(rows, clip_kit):
    """Each decodable row's scores as the stage computes them (the transform's 64 px crop, the kit's heads)."""
    from diffusion.convert.curate import Curator
    from diffusion.convert.transforms import ImageChecks, center_square_crops, decode_image
    heads = {k: os.path.join(clip_kit, "heads", f"{k}.safetensors") for k in ("aesthetic", "nsfw", "watermark")}
    curator = Curator(clip_kit, 64, heads)
    crops = [center_square_crops(decode_image(r["jpg"], 64, ImageChecks())[0], [64])[64] for r in rows]
    scores, images = curator.scores(crops, [r["caption"] for r in rows])
    return scores, images, curator


@pytest.fixture(scope="module")
def curated(sample_data, manifest, convert_config, clip_kit, tmp_path_factory, ray_local):
    """(out, first summary, summary, input rows, truth, scores by key, where, blocklist rows) of a
    conversion with --embed (three heads, stored embeddings), a --where on scores and an input column,
    --dedupe near, --exclude: "killed" (its largest part lost), a stale first pass left behind, then resumed."""
    import shutil
    from diffusion.convert.pipeline import run_conversion
    from diffusion.convert.planted import planted_rows
    from diffusion.convert.readers import iter_rows
    from diffusion.convert.sink import KEYS_RECORD
    from diffusion.convert.summary import summarize
    tmp = tmp_path_factory.mktemp("curation")
    good = [r for r in iter_rows(sample_data) if r[schema.RAW_KEY] not in manifest["bad_keys"]][:ROWS]
    rows, truth = planted_rows(good, COPIES, seed=1)
    raw = tmp / "raw"
    raw.mkdir()
    for i, part in enumerate((rows[::2], rows[1::2])):
        pq.write_table(pa.table({"key": [r["key"] for r in part], "caption": [r["caption"] for r in part],
                                 "jpg": [r["jpg"] for r in part], "url": [r["url"] for r in part],
                                 "aesthetic": [6.0] * len(part)}), raw / f"{i}.parquet")
    originals = [r for r in rows if r["key"] not in truth and r["key"] not in {o for o, _ in truth.values()}]
    blocked = {"key": originals[0]["key"], "url": originals[1]["key"], "image": originals[2]["key"]}
    blocklist = tmp / "blocklist.txt"
    blocklist.write_text(f"# Re-LAION style\nkey:{blocked['key']}\n{hashlib.sha256(originals[1]['url'].encode()).hexdigest()}\n"
                         f"image_sha256:{hashlib.sha256(originals[2]['jpg']).hexdigest()}\n")
    scores, _, _ = _crop_scores(rows, clip_kit)
    by_key = {r["key"]: {c: float(v[i]) for c, v in scores.items()} for i, r in enumerate(rows)}
    clip = np.sort(scores["clip_score"])
    cut = float(np.round((clip[5] + clip[6]) / 2, 4))  # between the 6th and 7th lowest: 6 rows fail
    where = f"clip_score >= {cut} and aesthetic >= 5 and nsfw < 0.5"
    heads = {f"{k}_head": os.path.join(clip_kit, "heads", f"{k}.safetensors") for k in ("aesthetic", "nsfw", "watermark")}
    options = dict(input=str(raw), resolutions=(64,), embed=clip_kit, store_embeddings=True, where=where,
                   dedupe="near", exclude=[str(blocklist)], visualize_duplicates=3, **heads)
    out = tmp / "mds"
    # the "kill": the output less its largest part (on 2 CPUs its only one), its index.json and dataset.json:
    # a write task killed before it committed that part, after the first pass and the rejects were recorded.
    # (Not a first run with --limit: that decides the duplicates among the rows it reads, a decision the
    # run without it would not resume.) duplicates.png is drawn by the run that finishes
    run_conversion(convert_config(out, **{**options, "visualize_duplicates": 0}))
    parts = sorted(out.glob("part-*"))
    shutil.rmtree(max(parts, key=lambda p: len(json.loads((p / KEYS_RECORD).read_text()))))
    for made_at_the_end in (out / "index.json", out / schema.DATASET_JSON, out / "duplicates.png"):
        made_at_the_end.unlink(missing_ok=True)
    first = summarize(str(out))
    stale = out / "curate" / "0123456789abcdef.tmp-deadbeef"  # a first pass killed half-way
    stale.mkdir()
    summary = run_conversion(convert_config(out, **options))
    assert not stale.exists()
    return str(out), first, summary, rows, truth, by_key, where, blocked


def _samples(out):
    from streaming import StreamingDataset
    return list(StreamingDataset(local=out, shuffle=False, batch_size=1))


def test_scores_are_columns_and_where_filters_them_before_encoding(curated, clip_kit):
    out, first, summary, rows, truth, by_key, where, blocked = curated
    samples = _samples(out)
    assert summary.written == len(samples) and summary.rows_in == len(rows)
    cut = float(where.split()[2])
    rule = f"filtered: clip_score >= {cut}"
    assert summary.rejects.get(rule, 0) > 0  # counted under its own rule, as a metadata rule is
    for s in samples:  # every written row passes, on the stored (computed) columns
        assert s["clip_score"] >= cut and s["nsfw"] < 0.5
        assert set(s) >= {"clip_score", "aesthetic_score", "nsfw", "watermark", "clip_embeds"}
        assert s["clip_embeds"].shape == (32,) and abs(float(np.linalg.norm(s["clip_embeds"].astype(np.float32))) - 1) < 1e-2
        assert s["clip_score"] == pytest.approx(by_key[s[schema.KEY]]["clip_score"], abs=2e-3)
        assert s["aesthetic_score"] == pytest.approx(by_key[s[schema.KEY]]["aesthetic_score"], abs=2e-3)
    # the rows failing the score rule are exactly those the stage's scores put below the cut (less the
    # rows removed before scoring: blocklisted or duplicates)
    removed_first = {k for k, r in _rejects(out).items() if r.startswith(("excluded", "near_duplicate"))}
    expected = {k for k, v in by_key.items() if v["clip_score"] < cut} - removed_first
    assert {k for k, r in _rejects(out).items() if r == rule} == expected
    # histograms of the written rows' scores, in dataset.json and the summary
    info = schema.DatasetInfo.load(out)
    curation = info.extra["curation"]
    assert curation["width"] == 32 and curation["model"] == os.path.abspath(clip_kit)
    for column in ("clip_score", "aesthetic_score", "nsfw", "watermark"):
        assert sum(curation["histograms"][column]["counts"]) == summary.written
    assert info.extra["where"] == where
    table = summary.table()
    assert "score histograms" in table and "clip_score [" in table and f"rejected: {rule}" in table


def _rejects(out):
    from diffusion.convert.summary import done_keys
    return done_keys(out)[1]


def test_near_duplicates_removed_one_kept_per_group_by_clip_score(curated):
    out, first, summary, rows, truth, by_key, where, blocked = curated
    from diffusion.convert.neardup import CURATE_DIR, load_vectors
    written = {s[schema.KEY] for s in _samples(out)}
    rejects = _rejects(out)
    dups = {k for k, r in rejects.items() if r == "near_duplicate"}
    assert dups and summary.rejects["near_duplicate"] == len(dups)
    (folder,) = [os.path.join(out, CURATE_DIR, d) for d in os.listdir(os.path.join(out, CURATE_DIR))]
    meta, _ = load_vectors(folder)
    first_pass = dict(zip(meta.column("key").to_pylist(), meta.column("score").to_pylist()))
    found = 0
    for copy, (original, transform) in truth.items():
        group = {copy, original}
        if not group <= written | dups:  # a member filtered by --where takes no part in the decision
            continue
        found += 1
        kept = group & written
        assert len(kept) == 1, (transform, group, kept)  # one per group ...
        assert first_pass[kept.pop()] == max(first_pass[k] for k in group)  # ... the highest clip_score
    assert found >= 5
    # the planted copies, and a few of the sample's look-alike scenes (a purple circle on beige, twice):
    # ~0.4% of pairs of different scenes reach the threshold (bench/bench_curation.py)
    assert len(dups) <= found + 3
    assert os.path.getsize(os.path.join(out, "duplicates.png")) > 0


def test_blocklists_counted_before_decoding(curated):
    out, first, summary, rows, truth, by_key, where, blocked = curated
    rejects = _rejects(out)
    for kind, key in blocked.items():
        assert rejects[key] == f"excluded: {kind}"
        assert summary.rejects[f"excluded: {kind}"] == 1


def test_kill_and_resume_gives_the_clean_result(curated, convert_config):
    """The first run lost its (largest) part; the resumed one reused the first pass's decision (one folder,
    its stale sibling gone) and wrote the rest: every input row is written or rejected once."""
    from diffusion.convert.neardup import CURATE_DIR
    from diffusion.errors import OutputMismatchError
    from diffusion.convert.pipeline import run_conversion
    out, first, summary, rows, truth, by_key, where, blocked = curated
    assert 0 <= first.written < summary.written and first.rejects == summary.rejects
    assert summary.written_this_run == summary.written - first.written
    written = [s[schema.KEY] for s in _samples(out)]
    assert len(written) == len(set(written))
    assert set(written) | set(_rejects(out)) == {r["key"] for r in rows}
    assert len(os.listdir(os.path.join(out, CURATE_DIR))) == 1
    with open(os.path.join(out, "convert.json")) as f:
        assert json.load(f)["dedupe_threshold"] == 0.9
    with pytest.raises(OutputMismatchError, match="dedupe_threshold"):  # refused before anything is touched
        run_conversion(convert_config(out, input=os.path.join(os.path.dirname(out), "raw"), resolutions=(64,),
                                      embed=_kit(out), dedupe="near", dedupe_threshold=0.8,
                                      where=where, exclude=[os.path.join(os.path.dirname(out), "blocklist.txt")],
                                      store_embeddings=True, **_heads(out)))


def _kit(out):
    return schema.DatasetInfo.load(out).extra["curation"]["model"]


def _heads(out):
    return {f"{k}_head": v for k, v in schema.DatasetInfo.load(out).extra["curation"]["heads"].items()}


def test_embed_pool_leaves_a_cpu_for_reads_and_fits_one_gpu():
    """--embed's actors take a quarter CPU (CPU-only) or a quarter GPU beside the encoder: on 2 CPUs a
    whole CPU stays free for the read tasks (else Ray Data starves them and the job hangs), on one GPU
    the encoder and the curator fit it together."""
    from diffusion.convert.pipeline import ConvertConfig, plan_pools
    for resources in ({"CPU": 2.0}, {"CPU": 8.0, "GPU": 1.0}, {"CPU": 64.0, "GPU": 8.0}):
        plan = plan_pools(resources, ConvertConfig(input="x", output="y", model="m", embed="clip"))
        cpus = (plan.num_transformers * plan.cpus_per_transformer + plan.num_encoders * plan.cpus_per_encoder
                + plan.num_curators * plan.cpus_per_curator)
        assert plan.num_curators >= 1 and cpus <= resources["CPU"] - 1
        gpus = plan.num_encoders * plan.gpus_per_encoder + plan.num_curators * plan.gpus_per_curator
        assert gpus <= resources.get("GPU", 0)
    off = plan_pools({"CPU": 2.0}, ConvertConfig(input="x", output="y", model="m"))
    assert off.num_curators == 0


def test_heads_refuse_pickles_and_wrong_widths_in_one_line(clip_kit, tmp_path):
    from diffusion.convert.curate import Head, split_where
    from diffusion.errors import ConfigError
    pickle = tmp_path / "aesthetic.pth"
    pickle.write_bytes(b"\x80\x04")
    with pytest.raises(ConfigError, match="safetensors file only"):
        Head(str(pickle), "aesthetic")
    with pytest.raises(ConfigError, match="reads 32-wide embeddings, but the --embed model's are 768"):
        Head(os.path.join(clip_kit, "heads", "aesthetic.safetensors"), "aesthetic", 768)
    head = Head(os.path.join(clip_kit, "heads", "aesthetic.safetensors"), "aesthetic", 32)
    assert [tuple(w.shape) for w, _ in head.layers] == [(1024, 32), (128, 1024), (64, 128), (16, 64), (1, 16)]
    assert split_where("aesthetic >= 5 and clip_score > 0.28 and nsfw < 0.1", ["clip_score", "nsfw"]) == (
        "aesthetic >= 5", "clip_score > 0.28 and nsfw < 0.1")
    with pytest.raises(ConfigError, match="mixes computed scores"):
        split_where("clip_score > 0.3 or aesthetic > 5", ["clip_score"])


def test_a_score_compared_with_text_is_refused_before_ray_starts():
    """--where on a computed score (float32) compared with a string: one line from the settings' checks, as
    the same mistake on an input column is (it was a 54-line Arrow traceback from the curation actors,
    after the output folder was made)."""
    from diffusion.convert.config import ConvertConfig
    from diffusion.errors import ConfigError
    with pytest.raises(ConfigError, match=r"""--where "clip_score >= 'high'" cannot be evaluated on the computed """
                                          r"scores \(clip_score: float\)"):
        ConvertConfig(input="x", output="y", model="m", embed="clip", where="aesthetic > 5 and clip_score >= 'high'")
    ConvertConfig(input="x", output="y", model="m", embed="clip", where="aesthetic > 5 and clip_score >= 0.28")


def test_online_mode_runs_the_embed_stage_and_blocklists_from_its_settings(tmp_path):
    """data.online takes the same curation settings (PipelineSettings): the stream's pipeline gets the
    --embed stage, its pool fits 2 CPUs beside the training workers with a CPU for the read, and the
    blocklist's URLs are checked as the input is read."""
    from diffusion.stream.stream_source import convert_config, plan_online_pools
    from diffusion.train.config import load_config
    blocklist = tmp_path / "block.txt"
    blocklist.write_text("url:https://example.com/a.jpg\n")
    yaml = os.path.join(os.path.dirname(__file__), "..", "..", "yamls", "tiny-cpu.yaml")
    cfg = load_config(yaml, ["data.online.input=x", "data.online.embed=clip", f"data.online.exclude=[{blocklist}]"])
    stream = convert_config(cfg, str(tmp_path))
    assert stream.embed == "clip" and stream.raw_columns().exclude_urls == {
        hashlib.sha256(b"https://example.com/a.jpg").digest()}
    plan = plan_online_pools({"CPU": 2.0}, cfg)
    o = cfg.data.online
    held = (o.num_train_workers * o.train_cpus + plan.num_transformers * plan.cpus_per_transformer
            + plan.num_encoders * plan.cpus_per_encoder + plan.num_curators * plan.cpus_per_curator)
    assert plan.num_curators == 1 and held <= 2.0 - 1.0


def test_semantic_decision_keeps_the_best_of_each_group_across_clusters_deterministically():
    """SemDeDup's decision on clustered unit vectors (k-means forced to several clusters): every planted
    copy found, the highest-priority member of each group kept, no other row removed, the same set twice."""
    from diffusion.convert.neardup import duplicate_groups
    rng = np.random.default_rng(0)
    x = rng.standard_normal((600, 64)).astype(np.float32)
    src = rng.choice(600, 40, replace=False)
    copies = x[src] + 0.02 * rng.standard_normal((40, 64)).astype(np.float32)
    x = np.concatenate([x, copies])
    x /= np.linalg.norm(x, axis=1, keepdims=True)
    priority = rng.random(len(x)).astype(np.float32)
    removed, partner = duplicate_groups(x.astype(np.float16), priority, 0.95, cluster_rows=100)
    again, _ = duplicate_groups(x.astype(np.float16), priority, 0.95, cluster_rows=100)
    assert (removed == again).all() and removed.sum() == 40
    for k, s in enumerate(src):
        pair = [int(s), 600 + k]
        loser = min(pair, key=lambda i: priority[i])
        assert removed[loser] and not removed[max(pair, key=lambda i: priority[i])]
        assert partner[loser] == max(pair, key=lambda i: priority[i])


def test_conversion_reuses_the_first_pass_scores_instead_of_a_second_model_pass(curated, clip_kit):
    """--dedupe near with --embed: the first pass kept every score (and the embedding) per key, and the
    conversion's curation stage read them instead of running the model again (its time is recorded as
    curate_reused, none as curate); the stored columns are what the model gives for the same crop and
    caption, in the same dtypes. A batch with a key the first pass did not score runs the model."""
    out, first, summary, rows, truth, by_key, where, blocked = curated
    assert summary.stage_seconds.get("curate_reused_seconds", 0) > 0
    assert summary.stage_seconds.get("curate_seconds", 0) == 0
    assert "images/s per curate_reused worker" in summary.table()
    from diffusion.convert.curate import Curator
    from diffusion.convert.neardup import CURATE_DIR, SCORES_FILE
    from diffusion.convert.transforms import clean_caption
    samples = _samples(out)
    by_row = {r["key"]: r for r in rows}
    _, images, curator = _crop_scores([by_row[s[schema.KEY]] for s in samples], clip_kit)
    model, _ = curator.scores(_crops([by_row[s[schema.KEY]] for s in samples]),
                              [clean_caption(by_row[s[schema.KEY]]["caption"]) for s in samples])
    for i, s in enumerate(samples):
        for column in ("clip_score", "aesthetic_score", "nsfw", "watermark"):
            assert isinstance(s[column], (np.float32, float))
            assert s[column] == pytest.approx(float(model[column][i]), abs=1e-6), column
        assert s["clip_embeds"].dtype == np.float16
        assert np.abs(s["clip_embeds"].astype(np.float32) - images[i].astype(np.float16).astype(np.float32)).max() < 1e-3
    (folder,) = [os.path.join(out, CURATE_DIR, d) for d in os.listdir(os.path.join(out, CURATE_DIR))]
    keys = [s[schema.KEY] for s in samples[:3]]
    heads = {k: os.path.join(clip_kit, "heads", f"{k}.safetensors") for k in ("aesthetic", "nsfw", "watermark")}
    reuse = Curator(clip_kit, 64, heads, store_embeddings=True, record_timing=True,
                    reuse=os.path.join(folder, SCORES_FILE))
    batch = {schema.KEY: np.array(keys, dtype=object),
             schema.CAPTION: np.array([clean_caption(by_row[k]["caption"]) for k in keys], dtype=object),
             schema.image_column(64): np.stack(_crops([by_row[k] for k in keys]))}
    reused = reuse(batch)
    assert reuse.reuse is not None and not hasattr(reuse, "embedder")  # no model loaded
    for i, s in enumerate(samples[:3]):
        assert reused["clip_score"][i] == s["clip_score"] and (reused["clip_embeds"][i] == s["clip_embeds"]).all()
    batch[schema.KEY] = np.array(keys[:2] + ["not-in-the-first-pass"], dtype=object)
    ran = reuse(batch)
    assert reuse.embedder is not None and ran["_curate_seconds"].sum() > 0
    assert ran["_curate_reused_seconds"].sum() == 0 and reused["_curate_seconds"].sum() == 0
    assert ran["clip_score"][0] == pytest.approx(float(reused["clip_score"][0]), abs=1e-6)


def _crops(rows):
    from diffusion.convert.transforms import ImageChecks, center_square_crops, decode_image
    return [center_square_crops(decode_image(r["jpg"], 64, ImageChecks())[0], [64])[64] for r in rows]


def test_non_finite_heads_are_refused_and_non_finite_scores_rejected(clip_kit, tmp_path):
    """A head holding a NaN (or inf) weight is refused in one line naming the file and tensor (it was
    accepted, then every write task crashed: "cannot convert float NaN to integer"); a row whose score is
    NaN or inf anyway is rejected under its own reason, never written, and the histograms bin what is."""
    from diffusion.convert.curate import Curator, Head, save_head
    from diffusion.convert.sink import _bin
    from diffusion.convert.summary import done_keys
    from diffusion.errors import ConfigError
    kit_head = Head(os.path.join(clip_kit, "heads", "aesthetic.safetensors"), "aesthetic", 32)
    for bad in (float("nan"), float("inf")):
        layers = [(w.clone(), b.clone()) for w, b in kit_head.layers]
        layers[0][0][:] = bad
        path = tmp_path / f"aesthetic-{bad}.safetensors"
        save_head(str(path), layers, "aesthetic")
        with pytest.raises(ConfigError, match=rf"--aesthetic-head {path}: tensor 'layers.0.weight' holds non-finite"):
            Head(str(path), "aesthetic", 32)
    spec = (0.0, 10.0, 20)
    assert (_bin(spec, float("inf")), _bin(spec, float("-inf")), _bin(spec, float("nan")), _bin(spec, 5.0)) == (
        19, 0, None, 10)
    curator = Curator(clip_kit, 64, where="clip_score >= 0", rejects_dir=str(tmp_path / "rejects"))
    clip = np.array([0.5, np.nan, np.inf, -0.5], np.float32)
    curator.scores = lambda crops, captions: ({"clip_score": clip}, np.zeros((4, 32), np.float32))
    batch = {schema.KEY: np.array(["a", "b", "c", "d"], dtype=object),
             schema.CAPTION: np.array(["x"] * 4, dtype=object),
             schema.image_column(64): np.zeros((4, 64, 64, 3), np.uint8)}
    out = curator(batch)
    assert list(out[schema.KEY]) == ["a"]
    assert done_keys(str(tmp_path))[1] == {"b": "non_finite_score", "c": "non_finite_score",
                                           "d": "filtered: clip_score >= 0"}


def test_bytes_dedupe_leaves_excluded_rows_out_of_the_comparison(sample_data, manifest, tmp_path, ray_local):
    """--dedupe bytes with --exclude: a row excluded by key is no original of its copies, so its
    byte-identical copy under another key is written (it was rejected as duplicate_image too: the image
    was gone entirely, while excluding by URL kept the copy); another blocklist decides again."""
    from diffusion.convert.dedupe import _fingerprint, find_duplicates, later_copies
    from diffusion.convert.exclude import load_blocklists
    from diffusion.convert.files import RawColumns, input_files
    from diffusion.convert.readers import iter_rows
    good = [r for r in iter_rows(sample_data) if r[schema.RAW_KEY] not in manifest["bad_keys"]][:3]
    raw = tmp_path / "raw"
    raw.mkdir()
    keys = ["k0", "k1", "k2", "copy1", "copy2"]
    images = [r[schema.RAW_IMAGE] for r in good] + [good[1][schema.RAW_IMAGE], good[2][schema.RAW_IMAGE]]
    pq.write_table(pa.table({"key": keys, "jpg": images, "caption": ["x"] * 5}), raw / "0.parquet")
    blocklist = tmp_path / "block.txt"
    blocklist.write_text("key:k1\n")
    stat = os.stat(blocklist)
    exclude = [[str(blocklist), stat.st_size, stat.st_mtime_ns]]
    out = str(tmp_path / "out")
    excluded = find_duplicates(str(raw), RawColumns(), out, load_blocklists([str(blocklist)]), exclude)
    assert set(later_copies(excluded, "0.parquet")) == {"copy2"}  # copy1's original is excluded: copy1 stays
    formats = input_files(str(raw), RawColumns())  # another blocklist (or none) is not the cached decision
    assert os.path.basename(excluded) == _fingerprint(formats, RawColumns(), exclude) != _fingerprint(formats,
                                                                                                      RawColumns())


def test_a_head_saved_with_normalize_false_reads_the_unnormalised_features(clip_kit, tmp_path):
    """normalize=false in a head's metadata: the head reads the model's image features as they come (it
    got the L2-normalised embedding anyway, so the setting changed nothing); the default (true), clip_score
    and the stored embedding stay on the unit vectors. A linear probe without bias shows it: its score
    scales with the features' length."""
    import torch
    from diffusion.convert.curate import Curator, Head, save_head
    from diffusion.errors import ConfigError
    probe = [(torch.linspace(-1, 1, 32).view(1, 32), torch.zeros(1))]
    paths = {}
    for normalize in ("true", "false"):
        paths[normalize] = str(tmp_path / f"aesthetic-{normalize}.safetensors")
        save_head(paths[normalize], probe, "aesthetic", normalize=normalize)
    crops = list(np.random.default_rng(0).integers(0, 256, (3, 64, 64, 3), dtype=np.uint8))
    captions = ["a red square"] * 3
    curator = Curator(clip_kit, 64, {"aesthetic": paths["true"]})
    unit, images = curator.scores(crops, captions)
    curator.heads = {"aesthetic": Head(paths["false"], "aesthetic", 32)}
    raw, raw_images = curator.scores(crops, captions)
    assert not np.allclose(raw["aesthetic_score"], unit["aesthetic_score"], rtol=1e-3)
    norms = np.linalg.norm(curator.embedder.image_features(crops), axis=1)
    assert not np.allclose(norms, 1, atol=1e-3)  # the tiny CLIP's features are not unit vectors
    np.testing.assert_allclose(raw["aesthetic_score"], unit["aesthetic_score"] * norms, rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(unit["aesthetic_score"], images @ probe[0][0][0].numpy(), rtol=1e-4, atol=1e-6)
    np.testing.assert_allclose(raw["clip_score"], unit["clip_score"], atol=1e-6)
    np.testing.assert_allclose(raw_images, images, atol=1e-6)
    save_head(str(tmp_path / "maybe.safetensors"), probe, "aesthetic", normalize="maybe")
    with pytest.raises(ConfigError, match="metadata normalize='maybe'"):
        Head(str(tmp_path / "maybe.safetensors"), "aesthetic", 32)


def test_limit_counts_the_first_rows_read_and_excludes_only_among_them(tmp_path, ray_local):
    """--limit 4 with --exclude of a key within the first 4 rows and one beyond them: the read yields rows
    0-3 less the excluded one, and only that one is recorded (the blocklist's rows were dropped before
    the limit, for whole files: rows 0-4 were read and the row beyond the limit counted as excluded)."""
    from diffusion.convert.exclude import load_blocklists
    from diffusion.convert.readers import read_raw
    from diffusion.convert.summary import done_keys
    raw = tmp_path / "raw"
    raw.mkdir()
    keys = [f"k{i}" for i in range(8)]
    pq.write_table(pa.table({"key": keys, "jpg": [b"not decoded here %d" % i for i in range(8)],
                             "caption": ["x"] * 8}), raw / "0.parquet")
    blocklist = tmp_path / "block.txt"
    blocklist.write_text("key:k1\nkey:k6\n")
    ds = read_raw(str(raw), limit=4, rejects_dir=str(tmp_path / "rejects"),
                  blocklist=load_blocklists([str(blocklist)]))
    assert sorted(r[schema.RAW_KEY] for r in ds.take_all()) == ["k0", "k2", "k3"]
    assert done_keys(str(tmp_path))[1] == {"k1": "excluded: key"}


def test_limit_records_rows_filtered_while_reading_only_up_to_its_last_row(tmp_path, ray_local):
    """--limit 4 with --where on an input column: rows k1, k6 and k7 fail it; the read yields the first 4 rows
    that pass, and only the row filtered among them (k1) is recorded (all three were, the whole file being read
    ahead: rows_in and the filtered count depended on the cluster). A limit past the file's last kept row
    records the rows filtered after it too."""
    from diffusion.convert.files import RawColumns
    from diffusion.convert.readers import read_raw
    from diffusion.convert.summary import done_keys
    raw = tmp_path / "raw"
    raw.mkdir()
    keys = [f"k{i}" for i in range(8)]
    pq.write_table(pa.table({"key": keys, "jpg": [b"not decoded here %d" % i for i in range(8)], "caption": ["x"] * 8,
                             "score": [1, 0, 1, 1, 1, 1, 0, 0]}), raw / "0.parquet")
    for limit, rows, filtered in ((4, ["k0", "k2", "k3", "k4"], ["k1"]),
                                  (5, ["k0", "k2", "k3", "k4", "k5"], ["k1", "k6", "k7"])):
        out = tmp_path / f"out{limit}"
        ds = read_raw(str(raw), RawColumns(where="score >= 1"), limit=limit, rejects_dir=str(out / "rejects"))
        assert sorted(r[schema.RAW_KEY] for r in ds.take_all()) == rows
        assert sorted(done_keys(str(out))[1]) == filtered


def _removed(folder):
    from diffusion.convert.neardup import removed_groups
    return {k for removed in removed_groups(folder).values() for k in removed}


def _first_pass_here(config, folder, blocklist):
    """The first pass of ``config``'s --dedupe over its whole input (no --limit), its files embedded and
    decided in this process as find_near_duplicates' actor and driver do (a Ray job costs ~10 s more)."""
    from diffusion.convert.files import file_names, input_files
    from diffusion.convert.neardup import _EmbedFiles, decide
    from diffusion.convert.shared_keys import keys_taken_by_earlier_files
    from diffusion.convert.transforms import ImageChecks
    columns = config.raw_columns()
    formats = input_files(config.input, columns)
    names = file_names(formats)
    embed = _EmbedFiles(formats, names, columns, keys_taken_by_earlier_files(formats, names, columns),
                        max(config.resolutions), ImageChecks(), config.dedupe, config.embed, config.heads(),
                        config.split_where()[1], blocklist)
    os.makedirs(os.path.join(folder, "vectors"))
    for i, table in enumerate(embed({"path": list(formats), "order": list(range(len(formats)))})):
        pq.write_table(table, os.path.join(folder, "vectors", f"{i}.parquet"))
    decide(folder, config.dedupe, config.threshold())
    return folder


def test_limit_decides_near_duplicates_among_the_rows_it_reads(curated, convert_config, clip_kit, tmp_path):
    """--limit N with --dedupe near: the first pass reads the N rows the conversion reads (a row failing
    --where on an input column is not among them, an excluded one is) and decides among them alone, as
    over an input holding only those rows. A planted pair straddles the limit, its lower clip_score copy
    within the N: that copy is written (it was removed as a duplicate of the copy beyond the N, which is
    never written: the image was lost), and the decision's counts are of the N rows. A re-run with the
    same --limit reuses the decision; another --limit is refused in one line naming it."""
    from diffusion.convert.exclude import load_blocklists
    from diffusion.convert.neardup import CURATE_DIR, find_near_duplicates, load_vectors
    from diffusion.convert.pipeline import run_conversion
    from diffusion.errors import OutputMismatchError
    out, first, summary, rows, truth, by_key, where, blocked = curated
    (folder,) = [os.path.join(out, CURATE_DIR, d) for d in os.listdir(os.path.join(out, CURATE_DIR))]
    meta, vectors = load_vectors(folder)
    index = {k: i for i, k in enumerate(meta.column("key").to_pylist())}
    score = meta.column("score").to_numpy()
    unit = vectors.astype(np.float32)
    unit /= np.linalg.norm(unit, axis=1, keepdims=True)

    def similar(a, b):
        return float(unit[index[a]] @ unit[index[b]]) >= 0.9

    pair = next((c, o) for c, (o, _) in truth.items() if c in index and o in index and similar(c, o)
                and score[index[c]] != score[index[o]])
    loser, winner = sorted(pair, key=lambda k: score[index[k]])
    related = set(truth) | {o for o, _ in truth.values()} | set(blocked.values())
    fillers = []  # unplanted rows unlike the pair and each other
    for k in index:
        if len(fillers) < 5 and k not in related and not any(similar(k, o) for o in (loser, winner, *fillers)):
            fillers.append(k)
    by_row = {r["key"]: r for r in rows}

    def write(path, keys, aesthetic=None):
        pq.write_table(pa.table({"key": keys, "caption": [by_row[k]["caption"] for k in keys],
                                 "jpg": [by_row[k]["jpg"] for k in keys],
                                 "aesthetic": aesthetic or [6.0] * len(keys)}), path)

    f0, low, f1, excluded, f3 = fillers
    raw, cut = tmp_path / "raw", tmp_path / "cut"
    raw.mkdir()
    cut.mkdir()
    # the first 4 rows read: f0, loser, f1 (low fails --where as it is read), the excluded row; then winner
    write(raw / "0.parquet", [f0, low, loser, f1], [6.0, 1.0, 6.0, 6.0])
    write(raw / "1.parquet", [excluded, winner, f3])
    write(cut / "0.parquet", [f0, loser, f1, excluded])  # an input holding only those 4 rows
    blocklist = tmp_path / "block.txt"
    blocklist.write_text(f"key:{excluded}\n")
    options = dict(resolutions=(64,), embed=clip_kit, dedupe="near", where="aesthetic >= 5",
                   exclude=[str(blocklist)])
    limited = run_conversion(convert_config(tmp_path / "limited", input=str(raw), limit=4, **options))
    alone = _first_pass_here(convert_config(tmp_path / "alone", input=str(cut), **options),
                             str(tmp_path / "alone"), load_blocklists([str(blocklist)]))
    written = {s[schema.KEY] for s in _samples(str(tmp_path / "limited"))}
    assert loser in written and winner not in written
    assert written == {f0, loser, f1} - _removed(alone)
    assert _rejects(str(tmp_path / "limited")) == {low: "filtered: aesthetic >= 5", excluded: "excluded: key"}
    (decided,) = [os.path.join(tmp_path, "limited", CURATE_DIR, d)
                  for d in os.listdir(tmp_path / "limited" / CURATE_DIR)]
    assert _removed(decided) == _removed(alone)
    (meta, vectors), (meta_alone, vectors_alone) = load_vectors(decided), load_vectors(alone)
    assert meta.column("key").to_pylist() == meta_alone.column("key").to_pylist()
    assert np.array_equal(vectors, vectors_alone)
    with open(os.path.join(decided, "decision.json")) as f, open(os.path.join(alone, "decision.json")) as g:
        assert {**json.load(f), "limit": None} == json.load(g)
    assert limited.written == len(written)
    config = convert_config(tmp_path / "limited", input=str(raw), limit=4, **options)
    assert find_near_duplicates(config, str(tmp_path / "limited"), load_blocklists([str(blocklist)])) == decided
    for other in (5, None):  # refused before anything is touched
        with pytest.raises(OutputMismatchError, match=rf"limit: output has 4, this run asks for {other}.*--limit"):
            run_conversion(convert_config(tmp_path / "limited", input=str(raw), limit=other, **options))
