"""--where: the filter grammar, and its errors at start (issue 15 item 1)."""

import os
import subprocess
import sys

import pyarrow as pa
import pytest

from diffusion.where import FilterSyntaxError, parse_where

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _convert_cli(*args):
    return subprocess.run([sys.executable, os.path.join(ROOT, "convert", "laion_to_mds.py"), "--no-progress",
                           *map(str, args)], capture_output=True, text=True, timeout=300)


def test_rules_blame_the_first_term_a_row_fails_and_nulls_fail():
    where = parse_where("aesthetic >= 5.0 AND punsafe < 0.1 and (LANGUAGE in ['en', \"de\"] or LANGUAGE is null) "
                       "and not pwatermark > 0.8")
    assert [text for text, _ in where.rules] == [
        "aesthetic >= 5.0", "punsafe < 0.1", "(LANGUAGE in ['en', 'de'] or LANGUAGE is null)", "not pwatermark > 0.8"]
    table = pa.table({"aesthetic": [6.0, 4.0, 7.0, 8.0, None, 6.0, 6.0],
                      "punsafe": [0.0, 0.5, 0.5, 0.0, 0.0, 0.0, 0.0],
                      "pwatermark": [0.1, 0.1, 0.1, 0.9, 0.1, 0.1, 0.1],
                      "LANGUAGE": ["en", "en", "en", None, "en", "fr", "de"]})
    assert where.blame(table) == [None, 0, 1, 3, 0, 2, None]
    assert where.reason(1) == "filtered: punsafe < 0.1"
    assert parse_where("aesthetic>=5.0 and   punsafe<0.1").text == parse_where("aesthetic >= 5.0 AND punsafe < 0.1").text


def test_or_binds_looser_than_and_and_not_in_and_is_not_null():
    where = parse_where("a > 1 and b == 'x' or c is not null")
    assert len(where.rules) == 1  # one rule: an or at the top
    table = pa.table({"a": [2, 0, 0], "b": ["x", "x", "y"], "c": [None, None, 1]})
    assert where.blame(table) == [None, 0, None]
    assert parse_where("b not in ['x']").blame(table) == [0, 0, None]


@pytest.mark.parametrize("text", ["aesthetic >=", "aesthetic >= 5 and", "(a > 1", "a in [1,", "a > b",
                                  "__import__('os').system('ls')", "a is 1", "a > 1 )", "a >> 1", ""])
def test_malformed_expressions_are_one_line_showing_them(text):
    with pytest.raises(FilterSyntaxError) as e:
        parse_where(text)
    assert repr(text) in str(e.value) and "\n" not in str(e.value)


def test_cli_malformed_filter_is_one_line_showing_it(sample_data, tiny_kit, tmp_path):
    result = _convert_cli("--input", sample_data, "--output", tmp_path / "mds", "--model", tiny_kit,
                          "--where", "aesthetic >= and punsafe < 0.1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "'aesthetic >= and punsafe < 0.1'" in result.stderr
    assert not (tmp_path / "mds").exists()


HOSTILE = [("aesthetic in ['a',1]", "mix numbers and strings"),
           ("aesthetic > " + "1" * 30, "the integer 11111111111111111111... (30 digits) is out of range"),
           ("aesthetic > 1e400", "out of range of a 64-bit float"),
           ("(" * 1000 + "aesthetic > 1" + ")" * 1000, "nested more than 100 deep"),
           ("not " * 1000 + "aesthetic > 1", "nested more than 100 deep"),
           (" or ".join(["aesthetic > 1"] * 5000), "more than 1000 comparisons")]  # pyarrow crashes on 5,000


@pytest.mark.parametrize("text, why", HOSTILE)
def test_hostile_expressions_are_one_line_naming_them_and_why(text, why):
    with pytest.raises(FilterSyntaxError) as e:
        parse_where(text)
    message = str(e.value)
    assert "\n" not in message and why in message and len(message) < 600
    assert message.startswith(f"--where {text[:20]!r}"[:-1])  # the expression, shortened if long


def test_cli_hostile_filters_are_one_line_without_a_traceback(sample_data, tiny_kit, tmp_path):
    for text, why in HOSTILE[::3]:
        result = _convert_cli("--input", sample_data, "--output", tmp_path / "mds", "--model", tiny_kit, "--where", text)
        assert result.returncode == 2 and "Traceback" not in result.stderr, result.stderr[-3000:]
        assert len(result.stderr.strip().splitlines()) == 1 and why in result.stderr
        assert not (tmp_path / "mds").exists()


def test_cli_filter_on_a_missing_column_lists_the_columns_there_are(sample_data, tiny_kit, tmp_path):
    result = _convert_cli("--input", sample_data, "--output", tmp_path / "mds", "--model", tiny_kit,
                          "--where", "AESTHETIC_SCORE >= 5 and punsafe < 0.1")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    line = result.stderr.strip()
    assert "'AESTHETIC_SCORE'" in line and "part-00000.parquet" in line
    for column in ("aesthetic", "punsafe", "pwatermark", "similarity", "LANGUAGE", "caption"):
        assert column in line
    assert not (tmp_path / "mds").exists()


def test_cli_filter_that_keeps_nothing_writes_nothing(sample_data, tiny_kit, tmp_path, manifest):
    result = _convert_cli("--input", sample_data, "--output", tmp_path / "mds", "--model", tiny_kit,
                          "--where", "similarity > 0.1 and aesthetic > 10")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert len(result.stderr.strip().splitlines()) == 1
    assert "keeps no row" in result.stderr and f"'aesthetic > 10' removed {manifest['rows']}" in result.stderr
    assert not (tmp_path / "mds").exists()


def test_filter_on_a_number_compared_with_text_is_refused_at_start(sample_data, tiny_kit, tmp_path):
    result = _convert_cli("--input", sample_data, "--output", tmp_path / "mds", "--model", tiny_kit,
                          "--where", "LANGUAGE > 3")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "LANGUAGE: string" in result.stderr and "'LANGUAGE > 3'" in result.stderr


def test_filter_on_inputs_without_columns_is_refused_by_name(tiny_kit, tmp_path):
    from PIL import Image
    raw = tmp_path / "raw"
    raw.mkdir()
    Image.new("RGB", (80, 80)).save(raw / "a.jpg")
    (raw / "a.txt").write_text("a black square")
    result = _convert_cli("--input", raw, "--output", tmp_path / "mds", "--model", tiny_kit,
                          "--where", "aesthetic > 5")
    assert result.returncode == 2 and "Traceback" not in result.stderr
    assert "a.jpg" in result.stderr and "no columns to filter on" in result.stderr
