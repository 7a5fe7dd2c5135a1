"""Which inputs are URLs (read through the remote extra) rather than local paths."""

from __future__ import annotations

import os
import re
from urllib.parse import unquote

from ckptfix.core.errors import UsageError
from ckptfix.core.text import redact

REMOTE_SCHEMES = ("s3", "gs", "gcs", "hf", "http", "https")
_SCHEME = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*")  # RFC 3986's scheme
_UPLOAD = "name a local path, and copy the result to the URL afterwards"


def is_url(path: str) -> bool:
    """`s3://…`, `gs://…`, `hf://…`, `http(s)://…`: a remote file or folder."""
    scheme, sep, rest = path.partition("://")
    return bool(sep) and bool(rest) and scheme.lower() in REMOTE_SCHEMES


def refuse_unknown_scheme(path: str) -> None:
    """A `scheme://…` that is none of REMOTE_SCHEMES (`ftp://`, `file://`, `az://`) is a usage
    error: taken for a local path it became a folder `ftp:` (with the URL's password in its
    name, and printed). One-letter schemes are left alone: `C://x` is a Windows path."""
    scheme, sep, rest = path.partition("://")
    if sep and scheme.lower() in REMOTE_SCHEMES and not rest.strip("/"):
        raise UsageError(
            redact(path),
            "names no bucket or repository",
            f"write {scheme}://BUCKET/PREFIX" if scheme.lower() != "hf" else "write hf://ORG/REPO",
        )
    if sep and len(scheme) > 1 and _SCHEME.fullmatch(scheme) and not is_url(path):
        raise UsageError(
            redact(path),
            f"{scheme}:// is not a URL scheme ckptfix reads or writes",
            "use s3://, gs://, hf://, http(s):// or a local path",
        )


def refuse_url(path: str | os.PathLike[str], what: str, fix: str = _UPLOAD) -> None:
    """Outputs and manifests are local files: a URL given for one is a usage error (it was
    taken for a relative path, `s3:/bucket/x`, written there, and printed with its
    credentials). `what` completes "is a URL; ..."."""
    text = os.fspath(path)
    refuse_unknown_scheme(text)
    if is_url(text):
        raise UsageError(text, f"is a URL; {what}", fix)


_DECODINGS = 8  # a name still decoding after as many rounds is no real name


def climbs_out(relative: str) -> bool:
    """Whether a path under a remote folder (what follows the folder's URL and its `/`)
    leaves the folder, or names it, in any form a server may give it: as written, and
    after each round of percent-decoding (`%2e%2e`, `%252e%252e`), each with backslashes
    taken as slashes and `;` parameters dropped (`..;`). Any `.` or `..` segment, or a
    NUL, in any form is refused: no checkpoint file is named so."""
    forms = [relative]
    while len(forms) <= _DECODINGS and (decoded := unquote(forms[-1])) != forms[-1]:
        forms.append(decoded)
    if len(forms) > _DECODINGS:
        return True
    return any(
        "\x00" in segment or segment.partition(";")[0] in (".", "..")
        for form in forms
        for segment in form.replace("\\", "/").split("/")
    )
