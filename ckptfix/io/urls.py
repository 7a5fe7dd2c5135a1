"""Which inputs are URLs (read through the remote extra) rather than local paths."""

from __future__ import annotations

import os

from ckptfix.core.errors import UsageError

REMOTE_SCHEMES = ("s3", "gs", "gcs", "hf", "http", "https")
_UPLOAD = "name a local path, and copy the result to the URL afterwards"


def is_url(path: str) -> bool:
    """`s3://…`, `gs://…`, `hf://…`, `http(s)://…`: a remote file or folder."""
    scheme, sep, rest = path.partition("://")
    return bool(sep) and bool(rest) and scheme.lower() in REMOTE_SCHEMES


def refuse_url(path: str | os.PathLike[str], what: str, fix: str = _UPLOAD) -> None:
    """Outputs and manifests are local files: a URL given for one is a usage error (it was
    taken for a relative path, `s3:/bucket/x`, written there, and printed with its
    credentials). `what` completes "is a URL; ..."."""
    text = os.fspath(path)
    if is_url(text):
        raise UsageError(text, f"is a URL; {what}", fix)
