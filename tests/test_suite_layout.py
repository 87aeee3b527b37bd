"""The suite collects on a fresh clone: pytest's default import mode names a test module by its file's
basename (the folders are not packages), so two test files with one name stop collection."""

import collections
import pathlib

TESTS = pathlib.Path(__file__).parent


def test_every_test_file_has_its_own_name():
    names = collections.Counter(path.name for path in TESTS.rglob("test_*.py"))
    assert [name for name, count in names.items() if count > 1] == []
