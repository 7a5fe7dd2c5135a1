"""Which inputs are URLs (read through the remote extra) rather than local paths."""

from __future__ import annotations

REMOTE_SCHEMES = ("s3", "gs", "gcs", "hf", "http", "https")


def is_url(path: str) -> bool:
    """`s3://…`, `gs://…`, `hf://…`, `http(s)://…`: a remote file or folder."""
    scheme, sep, rest = path.partition("://")
    return bool(sep) and bool(rest) and scheme.lower() in REMOTE_SCHEMES
