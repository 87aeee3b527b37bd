"""--where and --dedupe in a real (small) conversion, killed and resumed (issue 15 items 1, 2)."""

import os

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from diffusion import schema
from diffusion.convert.pipeline import run_conversion
from diffusion.convert.readers import iter_rows
from diffusion.errors import OutputMismatchError

WHERE = "aesthetic >= 5.0 and punsafe < 0.1"
AESTHETIC, PUNSAFE = "filtered: aesthetic >= 5.0", "filtered: punsafe < 0.1"


def _shards(raw, images, captions):
    """Two parquet shards; img N is ``images[N]``. Rows (key: image, aesthetic, punsafe) and their fate:

    a0: 0 ok | a1: 1 aes 4 (filtered) | a2: 2 punsafe .5 (filtered) | a3: 3 ok | a4: 3 (duplicate of a3)
    a5: 1 (a1 was filtered: kept) | a6: 4 ok | a7: 5 aes null (filtered)
    b0: 6 ok | b1: 3 (duplicate of a3, across shards) | b2: 0 aes 3 (filtered, not a duplicate)
    b3: 7 ok | b4: 6 (duplicate of b0) | b5: 5 (a7 was filtered: kept) | b6: 8 ok
    """
    raw.mkdir()
    rows = {"a": [(0, 6.0, 0.0), (1, 4.0, 0.0), (2, 6.0, 0.5), (3, 6.0, 0.0), (3, 6.0, 0.0), (1, 6.0, 0.0),
                  (4, 7.0, 0.01), (5, None, 0.0)],
            "b": [(6, 6.0, 0.0), (3, 6.0, 0.0), (0, 3.0, 0.0), (7, 5.0, 0.0), (6, 6.0, 0.0), (5, 9.0, 0.0),
                  (8, 5.5, 0.09)]}
    for shard, spec in rows.items():
        pq.write_table(pa.table({
            "key": [f"{shard}{i}" for i in range(len(spec))], "jpg": [images[n] for n, _, _ in spec],
            "caption": [f"{captions[n]} ({shard}{i})" for i, (n, _, _) in enumerate(spec)],
            "aesthetic": pa.array([a for _, a, _ in spec], pa.float64()),
            "punsafe": [p for _, _, p in spec]}), raw / f"{shard}.parquet")


@pytest.mark.slow
def test_filter_and_duplicates_across_shards_survive_kill_and_resume(sample_data, manifest, convert_config,
                                                                     tmp_path, ray_local):
    good = [r for r in iter_rows(sample_data) if r[schema.RAW_KEY] not in manifest["bad_keys"]][:9]
    raw = tmp_path / "raw"
    _shards(raw, [r[schema.RAW_IMAGE] for r in good], [r[schema.RAW_CAPTION] for r in good])
    out = tmp_path / "mds"
    options = dict(input=str(raw), resolutions=(32,), where=WHERE, dedupe="bytes")

    first = run_conversion(convert_config(out, limit=5, **options))  # the "crash": stopped after 5 rows
    assert 0 < first.written < 8
    lists = out / "dedupe"
    (lists / "0123456789abcdef.tmp-deadbeef").mkdir()  # a duplicate pass killed half-way, of another input
    summary = run_conversion(convert_config(out, **options))

    from streaming import StreamingDataset
    samples = list(StreamingDataset(local=str(out), shuffle=False, batch_size=1))
    keys = [s[schema.KEY] for s in samples]
    assert sorted(keys) == ["a0", "a3", "a5", "a6", "b0", "b3", "b5", "b6"] and len(keys) == len(set(keys))
    assert summary.written == 8 and summary.written_this_run == 8 - first.written
    rejects = {AESTHETIC: 3, PUNSAFE: 1, "duplicate_image": 3}
    assert summary.rejects == rejects
    info = schema.DatasetInfo.load(str(out))
    assert (info.count, info.rows_in, info.rejects) == (8, 15, rejects)
    assert info.extra["where"] == WHERE and info.extra["dedupe"] == "bytes"
    table = summary.table()
    assert f"rejected: {AESTHETIC}" in table and "rejected: duplicate_image" in table

    # a re-run asking for another filter, or none, is refused naming the setting; nothing changes
    for other in (dict(where="aesthetic >= 6.0"), dict(where=None), dict(dedupe="none")):
        with pytest.raises(OutputMismatchError) as e:
            run_conversion(convert_config(out, **{**options, **other}))
        assert next(iter(other)) in str(e.value) and "new --output" in str(e.value)
    assert schema.DatasetInfo.load(str(out)).count == 8
    assert len(os.listdir(lists)) == 1  # the killed pass's leftovers are gone, this input's lists kept


@pytest.mark.slow
def test_first_copy_wins_whatever_the_partitioning(sample_data, manifest, tmp_path, ray_local):
    """The duplicate pass on four files, its shuffle in 1 or 7 partitions and its read tasks run
    two at a time: the later copies are the same, the first in input order kept."""
    from diffusion.convert import dedupe
    from diffusion.convert.readers import RawColumns
    good = [r for r in iter_rows(sample_data) if r[schema.RAW_KEY] not in manifest["bad_keys"]][:4]
    images = [r[schema.RAW_IMAGE] for r in good]
    raw = tmp_path / "raw"
    raw.mkdir()
    layout = {"p0": [0, 1, 0], "p1": [2, 1], "p2": [3, 2, 0], "p3": [3]}
    for name, picks in layout.items():
        pq.write_table(pa.table({"jpg": [images[n] for n in picks], "caption": ["x"] * len(picks)}),
                       raw / f"{name}.parquet")
    expected = {"p0.parquet": {"p0.parquet:000000002"}, "p1.parquet": {"p1.parquet:000000001"},
                "p2.parquet": {"p2.parquet:000000001", "p2.parquet:000000002"}, "p3.parquet": {"p3.parquet:000000000"}}
    found = []
    for partitions in (1, 7):
        original = dedupe._partitions
        dedupe._partitions = lambda files, n=partitions: n
        try:
            folder = dedupe.find_duplicates(str(raw), RawColumns(), str(tmp_path / f"out{partitions}"))
        finally:
            dedupe._partitions = original
        found.append({name: set(dedupe.later_copies(folder, name)) for name in expected})
    assert found == [expected, expected]
