"""The backends behind remote URLs, each used for ranged reads only.

s3:// is botocore's S3 client (io.remote_s3), hf:// the Hub's HTTP API (io.remote_hub). The
others are fsspec file systems, never
read through fsspec's buffered `open().read()`, whose read-ahead fetches megabytes per file:
every read is one request for exactly the range wanted. HTTP(S) reads go through the aiohttp
session of fsspec's HTTP file system with Range and If-Match, checked for a 206 before the
body is read (a server that ignores Range would otherwise send the whole file); gs:// uses
`cat_file(path, start, end)` pinned to the object's generation. Each
backend's packages are imported only when a URL of its scheme is read; without them the error
says how to install them.
"""

from __future__ import annotations

import logging
import posixpath
from collections.abc import Callable
from typing import Any, TypeVar
from urllib.parse import unquote

from ckptfix.core.errors import UsageError
from ckptfix.io.remote import Backend, Info, Settings, no_range, range_starts
from ckptfix.io.remote_errors import ObjectReplaced, UnexpectedAnswer

T = TypeVar("T")
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


class GcsBackend(GenericBackend):
    """gcsfs: each read is pinned to the generation the object was listed with. Cloud Storage
    answers 404 for a generation that is gone (the object was replaced or deleted), which is
    the object changing under the run, not a missing file. gcsfs parses the answers itself:
    its ValueError, KeyError, TypeError or AttributeError on a body that is not Cloud
    Storage's JSON (a proxy's page, another service) is an unexpected answer. gcsfs follows
    a listing's pages by itself: a listing gets LISTING_TIMEOUTS times the request timeout
    in all, so pages without end are an error, not a hang."""

    LISTING_TIMEOUTS = 10

    def __init__(self, scheme: str, fs: Any, timeout: float) -> None:
        super().__init__(scheme, fs)
        self.listing_deadline = max(timeout, 0.1) * self.LISTING_TIMEOUTS

    def to_path(self, url: str) -> str:
        scheme, _, rest = url.partition("://")
        return super().to_path(f"{scheme.lower()}://{rest}")

    def info(self, path: str) -> Info:
        return _parsed(lambda: super(GcsBackend, self).info(path))

    def ls(self, path: str) -> list[Info]:
        from fsspec.exceptions import FSTimeoutError

        deadline = self.listing_deadline
        try:  # fsspec's synchronous wrapper takes `timeout` for the whole call
            entries = _parsed(lambda: self.fs.ls(path, detail=True, timeout=deadline))
        except FSTimeoutError as exc:
            raise UnexpectedAnswer(f"the listing did not end within {deadline:g} s") from exc
        return [dict(entry) for entry in entries]

    def read(self, path: str, start: int, end: int, info: Info) -> bytes:
        generation = info.get("generation")
        if not generation:
            return _parsed(lambda: super(GcsBackend, self).read(path, start, end, info))
        try:
            return _parsed(
                lambda: bytes(self.fs.cat_file(path, start=start, end=end, generation=generation))
            )
        except FileNotFoundError as exc:
            raise ObjectReplaced(path) from exc


def _parsed(call: Callable[[], T]) -> T:
    try:
        return call()
    except (ValueError, KeyError, TypeError, AttributeError) as exc:
        what = f"not Cloud Storage's JSON ({type(exc).__name__}: {str(exc)[:80]})"
        raise UnexpectedAnswer(what) from exc


class HttpError(Exception):
    """An HTTP status, as the classifier reads it (`status`)."""

    def __init__(self, status: int, url: str) -> None:
        super().__init__(f"HTTP {status} for {url}")
        self.status = status


class HttpBackend(GenericBackend):
    """fsspec's HTTP file system: its session, its directory listings (links in an HTML
    page); HEAD for sizes and ETags, and our own ranged GETs."""

    def to_path(self, url: str) -> str:
        return url

    def info(self, path: str) -> Info:
        from fsspec.asyn import sync

        async def head() -> Info:
            session = await self.fs.set_session()
            headers = {"Accept-Encoding": "identity"}
            async with session.head(path, allow_redirects=True, headers=headers) as response:
                if response.status >= 400:
                    raise HttpError(response.status, path)
                return _head_info(path, response)

        return dict(sync(self.fs.loop, head))

    def ls(self, path: str) -> list[Info]:
        listing = path if path.endswith("/") else path + "/"
        self.fs.invalidate_cache(listing)
        entries = self.fs.ls(listing, detail=True)
        return [
            {**entry, "name": unquote(str(entry["name"]))}
            for entry in entries
            if str(entry["name"]).startswith(listing) and "?" not in str(entry["name"])
        ]

    def read(self, path: str, start: int, end: int, info: Info) -> bytes:
        from fsspec.asyn import sync

        headers = {"Range": f"bytes={start}-{end - 1}", "Accept-Encoding": "identity"}
        etag = info.get("ETag")
        if isinstance(etag, str) and not etag.startswith("W/"):
            headers["If-Match"] = etag  # a strong ETag: the same bytes or a 412

        async def get() -> bytes:
            session = await self.fs.set_session()
            async with session.get(path, headers=headers) as response:
                if response.status == 200:
                    raise no_range(path, start, end)  # before reading the body
                if response.status != 206:
                    raise HttpError(response.status, path)
                length = int(response.headers.get("Content-Length", end - start))
                if length > end - start or not range_starts(response, start):
                    raise no_range(path, start, end)
                return bytes(await response.read())  # a shorter one: the session says so

        return bytes(sync(self.fs.loop, get))

    def token(self, info: Info) -> tuple[object, ...]:
        return (info.get("size"), info.get("ETag"), info.get("Last-Modified"))


def _head_info(path: str, response: Any) -> Info:
    headers = response.headers
    size = headers.get("Content-Length")
    encoded = headers.get("Content-Encoding", "identity") not in ("identity", "")
    mimetype = headers.get("Content-Type", "").partition(";")[0].strip()
    return {
        "name": path,
        "type": "directory" if mimetype == "text/html" and _looks_like_folder(path) else "file",
        "size": int(size) if size is not None and size.isdigit() and not encoded else None,
        "ETag": headers.get("ETag"),
        "Last-Modified": headers.get("Last-Modified"),
        "mimetype": mimetype,
    }


def _looks_like_folder(url: str) -> bool:
    """An HTML page at a URL whose last part has no weight-file extension is a listing."""
    name = posixpath.basename(url.rstrip("/"))
    return url.endswith("/") or not name.endswith(
        (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".json", ".distcp", ".metadata")
    )


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

            return S3Backend(s3_client(settings))
        if scheme == "http":
            return HttpBackend(scheme, _http(settings))
        if scheme == "gs":
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


def _http(settings: Settings) -> Any:
    from fsspec.implementations.http import HTTPFileSystem

    return HTTPFileSystem(client_kwargs={"timeout": _timeout(settings)}, skip_instance_cache=True)


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
    return system(requests_timeout=_timeout(settings), skip_instance_cache=True)
