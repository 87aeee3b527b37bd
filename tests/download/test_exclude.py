"""--exclude in the downloader (issue 51): listed URLs (Re-LAION's sha256 form) and keys are never fetched."""

import hashlib

import pyarrow as pa
import pyarrow.parquet as pq

from diffusion.convert.exclude import load_blocklists
from diffusion.download.plan import InputColumns, open_filesystem, plan_shards
from diffusion.download.select import plan_drops


def test_blocklisted_urls_and_keys_are_dropped_before_fetching(tmp_path):
    urls = [f"http://127.0.0.1:1/{i}.jpg" for i in range(10)]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"URL": urls, "TEXT": ["a cat"] * 10, "key": [f"k{i}" for i in range(10)]}), src)
    blocklist = tmp_path / "relaion.txt"
    blocklist.write_text(f"# Re-LAION style: sha256 of the URL\n{hashlib.sha256(urls[2].encode()).hexdigest()}\n"
                         f"url_sha256:{hashlib.sha256(urls[7].encode()).hexdigest().upper()}\nkey:k5\n")
    shards, formats = plan_shards(str(src), InputColumns(), rows_per_shard=4)
    fs, _ = open_filesystem(str(src))
    drops = plan_drops(fs, formats, shards, InputColumns(), None, True, load_blocklists([str(blocklist)]))
    assert drops == {0: {2: "excluded: url"}, 1: {1: "excluded: key", 3: "excluded: url"}}
    assert plan_drops(fs, formats, shards, InputColumns(), None, False, None) == {}  # off: nothing dropped


def test_blocklist_lines_that_would_never_match_are_read_or_refused(tmp_path):
    """A Re-LAION list saved with a byte-order mark, a kind in capitals, a bare key and a derived key with
    a colon work; a hash one digit short, or an unknown kind, is refused naming the file and line (each
    became a key that never matched: nothing excluded, nothing counted, no error)."""
    import pytest
    from diffusion.errors import ConfigError
    digest = hashlib.sha256(b"http://example.com/a.jpg").hexdigest()
    good = tmp_path / "good.txt"
    good.write_text(f"{digest}\nURL_SHA256:{digest.upper()}\nKey: k1\n000000010\np0.parquet:000000002\n",
                    encoding="utf-8-sig")
    blocklist = load_blocklists([str(good)])
    assert blocklist.urls == {bytes.fromhex(digest)}
    assert blocklist.keys == {"k1", "000000010", "p0.parquet:000000002"}
    for name, line in (("short.txt", digest[:-1]), ("kind.txt", f"sha256:{digest}")):
        bad = tmp_path / name
        bad.write_text("key:k0\n" + line + "\n")
        with pytest.raises(ConfigError, match=rf"--exclude {bad}, line 2: "):
            load_blocklists([str(bad)])


def test_a_binary_url_column_is_deduplicated_and_blocklisted_as_its_text(tmp_path):
    """Shards read a parquet URL column of bytes as text; planning the drops read the bytes themselves:
    --dedupe-urls died (AttributeError) and --exclude url:... dropped nothing, so listed URLs were fetched."""
    from diffusion.download.select import DUPLICATE_URL
    urls = [b"http://127.0.0.1:1/a.jpg", b"http://127.0.0.1:1/a.jpg", b"http://127.0.0.1:1/b.jpg",
            b"http://127.0.0.1:1/b.jpg"]
    src = tmp_path / "in.parquet"
    pq.write_table(pa.table({"URL": pa.array(urls, pa.binary()), "TEXT": ["a cat"] * 4}), src)
    blocklist = tmp_path / "block.txt"
    blocklist.write_text("url:http://127.0.0.1:1/a.jpg\n")
    shards, formats = plan_shards(str(src), InputColumns(), rows_per_shard=4)
    fs, _ = open_filesystem(str(src))
    drops = plan_drops(fs, formats, shards, InputColumns(), None, True, load_blocklists([str(blocklist)]))
    assert drops == {0: {0: "excluded: url", 1: "excluded: url", 3: DUPLICATE_URL}}
