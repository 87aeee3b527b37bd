"""The reject vocabulary: why a row is skipped and counted, and how the rejects are recorded.

The reasons are the keys of ``rejects`` in the converter's and the downloader's stats and in
``dataset.json``; every stage names a reject with one of these, so a summary adds them up by name.
"""

from __future__ import annotations

import json
import os
import uuid

# Rejection reasons (the keys of ``rejects`` in stats and dataset.json).
UNDECODABLE = "undecodable"
TOO_MANY_PIXELS = "too_many_pixels"
TOO_SMALL = "too_small"
ASPECT_RATIO = "aspect_ratio"
EMPTY_CAPTION = "empty_caption"  # no caption, or nothing visible in it once invisible characters are removed
UNSUPPORTED_MODE = "unsupported_mode"  # decoded, but its pixel format cannot be turned into 8-bit RGB
# Memory and time bombs, refused before the work (converter and downloader):
TOO_LARGE = "too_large"  # an image file (a tar member, a tfrecord record, a file) over the byte limit: not read
TOO_MANY_SCANS = "too_many_scans"  # a JPEG of more scans than the bound (each is a pass over the whole image)
CAPTION_TOO_LONG = "caption_too_long"  # a caption over the length limit: neither tokenized nor stored
# Rows whose values are of the wrong kind (found by the readers, before anything is decoded):
BAD_CAPTION = "bad_caption"  # not text: a number, a list, bytes that are not UTF-8
BAD_KEY = "bad_key"  # a key that is not text or a whole number
BAD_SIZE = "bad_size"  # a width/height that is not a whole number of pixels
BAD_METADATA = "bad_metadata"  # a webdataset sample whose .json sidecar is not a JSON object
# Rows dropped before any image is read:
DUPLICATE_IMAGE = "duplicate_image"  # the same image bytes as an earlier row (--dedupe)
DUPLICATE_KEY = "duplicate_key"  # a key already given to an earlier row (this file or an earlier one)
DUPLICATE_URL = "duplicate_url"  # the downloader's --dedupe-urls: a URL an earlier row already fetched
REJECT = "_reject"  # a row generator yields {REJECT: reason, RAW_KEY: key or None} for a sample it cannot make


class Rejected(Exception):
    """A row that is skipped and counted, with its reason."""

    def __init__(self, reason: str, detail: str = ""):
        super().__init__(f"{reason}: {detail}" if detail else reason)
        self.reason = reason


# The converter's own records below an output's root (parts' keys and stats, rejects, failed inputs)
# are one line of JSON each, named *.jsonl: streaming's merge_index(root) takes every *.json below the
# root for a part's index.json, so none of them may end in .json. Outputs written before used .json;
# a re-run renames them (diffusion.convert.sink.migrate_records).
RECORD_SUFFIX = ".jsonl"
LEGACY_RECORD_SUFFIX = ".json"


def write_rejects(directory: str, rejects: dict[str, str]) -> str:
    """Record rejected keys (key -> reason) in a new small file, atomically, for counting and resume."""
    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{uuid.uuid4().hex}{RECORD_SUFFIX}")
    with open(path + ".tmp", "w") as f:
        json.dump(rejects, f)
    os.replace(path + ".tmp", path)
    return path
