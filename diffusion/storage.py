"""Reaching files: one function turns a local path or a URI into a pyarrow filesystem, for every stage.

Remote storage is reached one way everywhere (download, convert, online): ``s3://bucket/key`` with the
endpoint from ``AWS_ENDPOINT_URL`` (the variable boto3 and the AWS CLI read; ``S3_ENDPOINT_URL``,
streaming's, is honoured too), or from the URI itself (``s3://bucket/key?endpoint_override=host:port&
scheme=http``, pyarrow's form). Training reads remote MDS through streaming, which is handed the
same endpoint (:func:`share_endpoint_with_streaming`).
"""

from __future__ import annotations

import os
import posixpath
import urllib.parse


def same_place_key(path: str) -> str:
    """One spelling of where ``path`` is, so two spellings of one dataset compare equal: a URI with its path
    normalised (``s3://b/x/./a/`` is ``s3://b/x/a``), a local path absolute with its links resolved."""
    parts = urllib.parse.urlsplit(path)
    if parts.scheme in ("", "file"):
        return os.path.realpath(os.path.expanduser(parts.path if parts.scheme else path))
    where = posixpath.normpath(parts.path) if parts.path.strip("/") else ""
    return urllib.parse.urlunsplit((parts.scheme, parts.netloc, where, parts.query, ""))


def s3_endpoint() -> str | None:
    """The S3 endpoint every stage uses, or None for AWS itself."""
    return os.environ.get("AWS_ENDPOINT_URL") or os.environ.get("S3_ENDPOINT_URL")


def filesystem_for(uri: str):
    """(pyarrow filesystem, path inside it) for a local path or a URI such as ``s3://bucket/x``."""
    import pyarrow.fs as pafs
    uri = os.fspath(uri)
    if "://" not in uri:
        return pafs.LocalFileSystem(), os.path.abspath(os.path.expanduser(uri))
    if uri.startswith("s3://") and "?" not in uri:
        endpoint = s3_endpoint()
        options = {"endpoint_override": endpoint} if endpoint else {}
        if endpoint and endpoint.startswith("http://"):
            options["scheme"] = "http"
        return pafs.S3FileSystem(**options), uri[len("s3://"):]
    return pafs.FileSystem.from_uri(uri)  # pyarrow's own URIs, options in the query


def share_endpoint_with_streaming() -> None:
    """Let streaming's downloader find the endpoint set the common way (it reads ``S3_ENDPOINT_URL``)."""
    endpoint = s3_endpoint()
    if endpoint:
        os.environ.setdefault("S3_ENDPOINT_URL", endpoint)
