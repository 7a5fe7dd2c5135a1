"""The backends behind remote URLs, each used for ranged reads only.

s3:// is botocore's S3 client (io.remote_s3), hf:// the Hub's HTTP API (io.remote_hub),
http(s):// ckptfix's own requests on fsspec's aiohttp session (io.remote_http). gs:// is
gcsfs's file system, never read through fsspec's buffered `open().read()`, whose read-ahead
fetches megabytes per file: every read is `cat_file(path, start, end)`, one request for
exactly the range wanted, pinned to the object's generation. The aiohttp sessions of both
read every answer against remote_answers' bounds (io.remote_aiohttp). Each
backend's packages are imported only when a URL of its scheme is read; without them the error
says how to install them.
"""

from __future__ import annotations

import logging
from typing import Any

from ckptfix.core.errors import UsageError
from ckptfix.io.remote import Backend, Info, Settings
from ckptfix.io.remote_answers import answer_seconds

SCHEMES = {"s3": "s3", "gs": "gs", "gcs": "gs", "hf": "hf", "http": "http", "https": "http"}
_PACKAGES = {
    "s3": "botocore",
    "gs": "fsspec and gcsfs",
    "hf": "huggingface_hub",
    "http": "fsspec and aiohttp",
}


def scheme_of(url: str) -> str:
    return SCHEMES[url.split("://", 1)[0].lower()]


def missing_extra(url: str, exc: ImportError) -> UsageError:
    missing = exc.name.partition(".")[0] if exc.name else str(exc)
    return UsageError(
        url,
        f"reading {url.split('://', 1)[0]}:// URLs needs {_PACKAGES[scheme_of(url)]} "
        f"({missing} is not installed)",
        "pip install 'ckptfix[remote]'",
    )


class GenericBackend:
    """An fsspec file system read with `cat_file(path, start, end)`: the base of the gs://
    and http(s):// backends."""

    def __init__(self, scheme: str, fs: Any) -> None:
        self.scheme = scheme
        self.fs = fs

    def to_path(self, url: str) -> str:
        return str(self.fs._strip_protocol(url))

    def info(self, path: str) -> Info:
        self.fs.invalidate_cache(path)
        return dict(self.fs.info(path))

    def ls(self, path: str) -> list[Info]:
        return [dict(entry) for entry in self.fs.ls(path, detail=True)]

    def read(self, path: str, start: int, end: int, info: Info) -> bytes:
        return bytes(self.fs.cat_file(path, start=start, end=end))

    def token(self, info: Info) -> tuple[object, ...]:
        return tuple(info.get(key) for key in ("size", "etag", "generation", "updated"))


def _quiet(*names: str) -> None:
    """Keep libraries' log records off the terminal when nobody configured logging: gcsfs
    logs every failed request with its traceback, and the error line already says what
    failed. A handler the application set up (on the root logger) still receives them."""
    for name in names:
        logger = logging.getLogger(name)
        if not any(isinstance(handler, logging.NullHandler) for handler in logger.handlers):
            logger.addHandler(logging.NullHandler())


def make_backend(url: str, settings: Settings) -> Backend:
    """The backend for a URL's scheme; a missing package is a usage error (exit 2)."""
    scheme = scheme_of(url)
    try:
        if scheme == "s3":
            from ckptfix.io.remote_s3 import S3Backend, s3_client

            return S3Backend(s3_client(settings), settings.timeout)
        if scheme == "http":
            from ckptfix.io.remote_http import HttpBackend

            return HttpBackend(_http(settings), settings.timeout)
        if scheme == "gs":
            from ckptfix.io.remote_gcs import GcsBackend

            return GcsBackend(scheme, _gcs(settings), settings.timeout)
        import huggingface_hub  # noqa: F401  (first: without it, the missing-extra error)

        from ckptfix.io.remote_hub import HubBackend

        return HubBackend(settings.timeout)
    except ImportError as exc:
        raise missing_extra(url, exc) from exc


def _timeout(settings: Settings) -> Any:
    """aiohttp's limits for one request: to connect, and between bytes of the answer."""
    import aiohttp

    return aiohttp.ClientTimeout(
        total=None, sock_connect=settings.timeout, sock_read=settings.timeout
    )


def _answers(settings: Settings) -> dict[str, Any]:
    """An aiohttp session's options for bounded, unencoded answers (io.remote_aiohttp)."""
    from ckptfix.io.remote_aiohttp import session_options

    return session_options(answer_seconds(settings.timeout))


def _http(settings: Settings) -> Any:
    from fsspec.implementations.http import HTTPFileSystem

    options = {"timeout": _timeout(settings), **_answers(settings)}
    return HTTPFileSystem(client_kwargs=options, skip_instance_cache=True)


def _gcs(settings: Settings) -> Any:
    """gcsfs's JSON API file system, one attempt per request.

    Not `gcsfs.GCSFileSystem`, which is an extended subclass that asks the gRPC storage
    control API for each bucket's layout (and warns when it cannot): object reads need none
    of it. And without gcsfs's own retries: it tries a failed request 6 times, waiting up to
    32 s between tries, whatever its `retries` argument says; the session retries instead,
    as CKPTFIX_REMOTE_RETRIES and CKPTFIX_REMOTE_BACKOFF say."""
    import gcsfs

    _quiet("gcsfs", "fsspec")
    plain = gcsfs.core.GCSFileSystem
    one_attempt = getattr(plain._request, "__wrapped__", None)
    methods = {"_request": one_attempt} if one_attempt is not None else {}
    system = type("OneAttemptGCSFileSystem", (plain,), methods)
    return system(
        requests_timeout=_timeout(settings),
        session_kwargs=_answers(settings),
        skip_instance_cache=True,
    )
