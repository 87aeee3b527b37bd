"""The MDS write stage on its own: parts named by their rows, committed once, merged in order."""

import json
import os

import numpy as np
import pandas as pd
import pytest

from diffusion import schema
from diffusion.convert.sink import (INDEX_JSON, KEYS_RECORD, REJECTS_DIR, STATS_RECORD, MDSPartSink, committed_parts,
                                   migrate_records, part_name, remove_temporary_parts)
from record_layout import records_named_json, to_old_layout

DIM = 8


def _block(keys):
    rng = np.random.default_rng(len(keys))
    return pd.DataFrame({
        schema.vae_moments_column(32): [rng.standard_normal((8, 4, 4)).astype(np.float16) for _ in keys],
        schema.TEXT_EMBEDS: [rng.standard_normal((77, DIM)).astype(np.float16) for _ in keys],
        schema.INPUT_IDS: [np.arange(77, dtype=np.int32) for _ in keys],
        schema.TEXT_TOKENS: [5] * len(keys),
        schema.CAPTION: [f"caption {k}" for k in keys], schema.KEY: list(keys),
        schema.WIDTH: [32] * len(keys), schema.HEIGHT: [32] * len(keys),
        "_encode_seconds": [0.01] * len(keys),
    })


def _sink(out):
    return MDSPartSink(str(out), schema.mds_columns([32], DIM))


def test_a_part_is_named_by_its_keys_so_the_same_rows_make_the_same_part(tmp_path):
    first = _sink(tmp_path / "a").write([_block(["k1", "k2"]), _block(["k3"])], ctx=None)
    again = _sink(tmp_path / "b").write([_block(["k1", "k2", "k3"])], ctx=None)
    assert first == again == {"part": part_name(["k1", "k2", "k3"]), "count": 3}
    other = _sink(tmp_path / "a").write([_block(["k4"])], ctx=None)
    assert other["part"] != first["part"]
    stats = json.loads((tmp_path / "a" / first["part"] / STATS_RECORD).read_text())
    assert stats["count"] == 3 and abs(stats["encode_seconds"] - 0.03) < 1e-9


def test_a_retried_write_task_does_not_duplicate_its_rows(tmp_path):
    sink = _sink(tmp_path)
    sink.write([_block(["k1", "k2"])], ctx=None)
    sink.write([_block(["k1", "k2"])], ctx=None)  # Ray re-ran a task whose first attempt had committed
    sink.write([_block(["k3"])], ctx=None)
    assert sink.finalize() == 3
    parts = committed_parts(str(tmp_path))
    assert len(parts) == 2 and not [d for d in os.listdir(tmp_path) if d.startswith(".tmp")]
    assert sorted(k for p in parts for k in json.loads((tmp_path / p / KEYS_RECORD).read_text())) == ["k1", "k2", "k3"]
    index = json.loads((tmp_path / INDEX_JSON).read_text())
    assert [s["raw_data"]["basename"].split("/")[0] for s in index["shards"]] == sorted(parts)


# ---- damaged records never block a re-run (issue 17) ----------------------------------------------

def _damage(part_dir, how):
    if how == "keys_corrupt":
        (part_dir / KEYS_RECORD).write_text('["k1", "k')
    elif how == "keys_deleted":
        (part_dir / KEYS_RECORD).unlink()
    elif how == "index_corrupt":
        (part_dir / INDEX_JSON).write_bytes(b"\x00\x00")
    elif how == "stats_corrupt":
        (part_dir / STATS_RECORD).write_text("{")
    elif how == "shard_truncated":
        shard = next(p for p in part_dir.iterdir() if ".mds" in p.name)
        shard.write_bytes(shard.read_bytes()[:10])
    elif how == "keys_miscounted":
        (part_dir / KEYS_RECORD).write_text('["k1"]')


@pytest.mark.parametrize("how", ["keys_corrupt", "keys_deleted", "index_corrupt", "stats_corrupt", "shard_truncated",
                                 "keys_miscounted"])
def test_a_damaged_part_is_not_committed_and_its_rows_are_redone(tmp_path, how):
    from diffusion.convert.summary import done_keys, summarize
    sink = _sink(tmp_path)
    damaged = sink.write([_block(["k1", "k2"])], ctx=None)["part"]
    kept = sink.write([_block(["k3"])], ctx=None)["part"]
    _damage(tmp_path / damaged, how)
    assert committed_parts(str(tmp_path)) == [kept]
    assert done_keys(str(tmp_path))[0] == {"k3"} and summarize(str(tmp_path)).written == 1  # no JSONDecodeError
    assert sink.finalize() == 1  # the index leaves the damaged part out
    assert remove_temporary_parts(str(tmp_path)) == [damaged] and not (tmp_path / damaged).exists()
    # the re-run writes the same rows again: the same part name, committed without "Directory not empty"
    assert sink.write([_block(["k1", "k2"])], ctx=None)["part"] == damaged
    assert sorted(committed_parts(str(tmp_path))) == sorted([damaged, kept]) and sink.finalize() == 3


def test_a_damaged_part_left_in_place_is_replaced_when_its_rows_are_written_again(tmp_path):
    sink = _sink(tmp_path)
    part = sink.write([_block(["k1", "k2"])], ctx=None)["part"]
    (tmp_path / part / KEYS_RECORD).unlink()  # a run that did not clean up first
    assert sink.write([_block(["k1", "k2"])], ctx=None)["part"] == part
    assert committed_parts(str(tmp_path)) == [part]


def test_corrupt_reject_files_are_removed_and_their_rows_redone(tmp_path):
    from diffusion.convert.summary import done_keys, summarize
    from diffusion.convert.transforms import write_rejects
    rejects = tmp_path / REJECTS_DIR
    good = write_rejects(str(rejects), {"r1": "too_small"})
    bad = write_rejects(str(rejects), {"r2": "undecodable"})
    with open(bad, "w") as f:
        f.write('{"r2": "undec')  # cut short
    (rejects / "ab.jsonl.tmp").write_text("{")  # a kill mid-write
    (rejects / "list.jsonl").write_text("[1, 2]")  # JSON, but not {key: reason}
    assert done_keys(str(tmp_path))[1] == {"r1": "too_small"} and summarize(str(tmp_path)).rejects == {"too_small": 1}
    remove_temporary_parts(str(tmp_path))  # what a re-run does first
    assert os.listdir(rejects) == [os.path.basename(good)]


def test_shards_record_xxh3_64_which_the_loader_checks(tmp_path):
    from diffusion.loader.shard_checks import pick_hash
    part = _sink(tmp_path).write([_block(["k1", "k2"])], ctx=None)["part"]
    for shard in json.loads((tmp_path / part / INDEX_JSON).read_text())["shards"]:
        for data in (shard["raw_data"], shard["zip_data"]):
            assert sorted(data["hashes"]) == ["sha1", "xxh3_64"]
            assert pick_hash(data["hashes"]) == "xxh3_64"


# ---- streaming's own tools on the output; outputs of the old layout (issue 18) ---------------------

def _sink_output(out):
    """An output as the converter leaves it, made by the sink alone: two parts, a reject file, a failed
    input record and the root's own files."""
    from diffusion.convert.failed_inputs import FAILED_INPUTS_DIR, record_failed_input
    from diffusion.convert.transforms import write_rejects
    sink = _sink(out)
    sink.write([_block(["k1", "k2"])], ctx=None)
    sink.write([_block(["k3"])], ctx=None)
    write_rejects(str(out / REJECTS_DIR), {"r1": "too_small"})
    record_failed_input(str(out / FAILED_INPUTS_DIR), "broken.tar", "/in/broken.tar", OSError("truncated"), 0)
    (out / "convert.json").write_text("{}")
    (out / schema.DATASET_JSON).write_text("{}")
    sink.finalize()
    return sink


def test_streamings_merge_index_on_the_output_root_writes_the_same_index(tmp_path):
    from streaming import StreamingDataset
    from streaming.base.util import merge_index
    _sink_output(tmp_path)
    ours = json.loads((tmp_path / INDEX_JSON).read_text())
    (tmp_path / INDEX_JSON).unlink()
    merge_index(str(tmp_path))  # the form a user calls on a folder of MDS parts
    assert json.loads((tmp_path / INDEX_JSON).read_text()) == ours
    ds = StreamingDataset(local=str(tmp_path), shuffle=False, batch_size=1)  # it decompresses the shards
    assert sorted(ds[i][schema.KEY] for i in range(len(ds))) == ["k1", "k2", "k3"]


def test_an_output_of_the_old_layout_is_migrated_and_keeps_its_parts_rejects_and_failures(tmp_path):
    from diffusion.convert.failed_inputs import FAILED_INPUTS_DIR, read_failed_inputs
    from diffusion.convert.summary import done_keys, summarize
    _sink_output(tmp_path)
    parts = committed_parts(str(tmp_path))
    to_old_layout(tmp_path, half_done_part=parts[0])
    assert records_named_json(tmp_path)  # what made streaming's merge_index fail
    assert migrate_records(str(tmp_path)) == 2 + 1 + 1 + 1  # keys x2, the other part's stats, reject, failure
    assert records_named_json(tmp_path) == [] and migrate_records(str(tmp_path)) == 0
    assert committed_parts(str(tmp_path)) == parts and remove_temporary_parts(str(tmp_path)) == []
    assert done_keys(str(tmp_path)) == ({"k1", "k2", "k3"}, {"r1": "too_small"})
    assert summarize(str(tmp_path)).written == 3
    assert list(read_failed_inputs(str(tmp_path / FAILED_INPUTS_DIR))) == ["broken.tar"]
