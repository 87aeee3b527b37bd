"""``--exclude FILE...``: blocklists of rows never to download, decode or train on (Re-LAION's form).

A blocklist is a text file, one entry a line (blank lines and ``#`` comments skipped), each entry one of

- ``url_sha256:HEX`` or a bare 64-digit hex string: the SHA-256 of a URL, as Re-LAION publishes its
  removed links (``url:https://...`` gives the URL itself, hashed here);
- ``image_sha256:HEX``: the SHA-256 of an image file's bytes as stored;
- ``key:KEY`` or any other bare line: a row key,

or a parquet file with any of the columns ``url_sha256``, ``image_sha256``, ``key``.

The kinds are read in any case (``URL_SHA256:``), and a file may start with a UTF-8 byte-order mark.
Refused, naming the file and line: a ``word:`` prefix of another kind, a bad hex value after a hash
kind, and a bare line of 32 to 128 hex digits other than 64 (a damaged hash; ``key:`` before it keeps it
as a key). A key with a colon in it is written ``key:KEY``.

Where each applies, always before the image is decoded:

- keys and URLs: in the downloader, before the URL is fetched (:mod:`diffusion.download.select`); in the
  converter, as the input is read (a URL from the parquet's or the tar's ``url``);
- image hashes: in the converter's read task, on the bytes read, before any decode.

Each removal is counted under its own reason: ``excluded: key``, ``excluded: url``, ``excluded: image``.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import os
import re

from diffusion.errors import ConfigError

EXCLUDED_KEY, EXCLUDED_URL, EXCLUDED_IMAGE = "excluded: key", "excluded: url", "excluded: image"
_HEX64 = re.compile(r"[0-9a-fA-F]{64}")
# a bare line of this many hex digits, not 64, is a damaged SHA-256 rather than a key (LAION's keys are 9 digits)
_HASH_LIKE = re.compile(r"[0-9a-fA-F]{32,128}")
_PREFIX = re.compile(r"([A-Za-z][A-Za-z0-9_]*)\s*:")  # "word:" before an entry: one of the kinds below
_KINDS = ("url_sha256", "image_sha256", "url", "key")


def url_digest(url: str) -> bytes:
    return hashlib.sha256(url.encode("utf-8", "surrogatepass")).digest()


@dataclasses.dataclass(frozen=True)
class Blocklist:
    keys: frozenset = frozenset()
    urls: frozenset = frozenset()  # SHA-256 digests (32 bytes) of URLs
    images: frozenset = frozenset()  # SHA-256 digests of image bytes

    def __bool__(self) -> bool:
        return bool(self.keys or self.urls or self.images)

    def url_blocked(self, url) -> bool:
        return bool(self.urls) and isinstance(url, str) and url_digest(url) in self.urls

    def reasons(self, batch: dict) -> dict[str, str]:
        """{key: reason} of a raw column batch's rows blocked by key or by image hash."""
        from diffusion import schema
        if not (self.keys or self.images):
            return {}
        out = {}
        for key, image in zip(batch[schema.RAW_KEY], batch[schema.RAW_IMAGE]):
            if key in self.keys:
                out[key] = EXCLUDED_KEY
            elif self.images and image and hashlib.sha256(image).digest() in self.images:
                out[key] = EXCLUDED_IMAGE
        return out


def _hex(value: str, path: str, line: int) -> bytes:
    if not _HEX64.fullmatch(value):
        raise ConfigError(f"--exclude {path}, line {line}: {value[:80]!r} is not a SHA-256 (64 hex digits)")
    return bytes.fromhex(value)


def _parquet(path: str, keys: set, urls: set, images: set) -> None:
    import pyarrow.parquet as pq
    try:
        names = pq.ParquetFile(path).schema_arrow.names
        wanted = [c for c in ("key", "url_sha256", "image_sha256") if c in names]
        if not wanted:
            raise ConfigError(f"--exclude {path}: a parquet blocklist needs a key, url_sha256 or image_sha256 column; "
                              f"it has {', '.join(names)}")
        table = pq.read_table(path, columns=wanted)
    except ConfigError:
        raise
    except Exception as e:
        raise ConfigError(f"--exclude {path}: not a readable parquet file ({type(e).__name__})") from None
    for column, into in (("key", keys), ("url_sha256", urls), ("image_sha256", images)):
        if column in wanted:
            for i, v in enumerate(table.column(column).to_pylist()):
                if v is None:
                    continue
                if column == "key":
                    into.add(str(v))
                else:
                    into.add(bytes(v) if isinstance(v, bytes) and len(v) == 32 else _hex(str(v), path, i + 1))


@functools.lru_cache(maxsize=4)
def _load(paths: tuple[str, ...]) -> Blocklist:
    keys, urls, images = set(), set(), set()
    for path in paths:
        if path.endswith(".parquet"):
            _parquet(path, keys, urls, images)
            continue
        try:
            with open(path, encoding="utf-8-sig") as f:  # a byte-order mark is no part of the first entry
                lines = f.read().splitlines()
        except (OSError, UnicodeDecodeError) as e:
            raise ConfigError(f"--exclude {path}: cannot be read as text ({type(e).__name__})") from None
        for n, line in enumerate(lines, 1):
            line = line.strip()
            if not line or line.startswith("#"):
                continue
            prefix = _PREFIX.match(line)
            kind = prefix.group(1).lower() if prefix else None
            value = line[prefix.end():].strip() if prefix else line
            if kind == "url_sha256":
                urls.add(_hex(value, path, n))
            elif kind == "image_sha256":
                images.add(_hex(value, path, n))
            elif kind == "url":
                urls.add(url_digest(value))
            elif kind == "key":
                keys.add(value)
            elif kind is not None:  # a misspelt kind was a key that never matched
                raise ConfigError(f"--exclude {path}, line {n}: {line[:80]!r} starts with {prefix.group(1)!r}:, not "
                                  f"one of {', '.join(k + ':' for k in _KINDS)} (a URL is written url:URL, a key with "
                                  f"a colon key:KEY)")
            elif _HEX64.fullmatch(line):
                urls.add(bytes.fromhex(line))
            elif _HASH_LIKE.fullmatch(line):  # a hash that lost or gained a digit was a key that never matched
                raise ConfigError(f"--exclude {path}, line {n}: {line[:80]!r} is {len(line)} hex digits, not a "
                                  f"SHA-256 (64); write key: before it if it is a key")
            else:
                keys.add(line)
    return Blocklist(frozenset(keys), frozenset(urls), frozenset(images))


def load_blocklists(paths) -> Blocklist:
    """The union of the blocklist files ``paths`` (ConfigError naming the file and line of a bad entry)."""
    return _load(tuple(os.path.abspath(os.path.expanduser(p)) for p in paths))
