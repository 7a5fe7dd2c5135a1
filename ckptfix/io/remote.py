"""Remote files as ByteSources: every byte by a ranged request, counted.

A `RemoteSession` is one run's connection to one backend (io.remote_backends): it makes
every request, retries the transient failures with backoff, turns the others into one-line
RemoteErrors naming the URL, and counts requests and bytes. A `RemoteFile` is one object:
its size and change token come from one `info()` (or the folder listing that already said
them); `read_at` fetches exactly the range asked for, except that small reads fetch a whole
block of BLOCK bytes that later small reads are served from, so the sniff, a safetensors
header of up to 64 KiB, a zip's end records and `data.pkl` cost a request or two each.

Reads are pinned to the object that was listed where the backend can do it (S3 and HTTP:
If-Match on the ETag, or the S3 version; gs://: the generation; hf://: the commit): an object
replaced during the run is an error at the next read, and `change_token()` asks again, so the
writers' before/after comparison sees it too.
"""

from __future__ import annotations

import os
import random
import threading
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol, TypeVar

from ckptfix.core.errors import CkptfixError, RemoteChangedError, RemoteError
from ckptfix.io.remote_answers import longer
from ckptfix.io.remote_errors import (
    RANGE_FIX,
    changed,
    classify,
    is_precondition_failed,
    remote_error,
)
from ckptfix.io.source import past_end

T = TypeVar("T")

BLOCK = 64 * 2**10  # a small read fetches its aligned 64 KiB block; the first one is the head
CACHED_BLOCKS = 8  # per file, besides the head block
Info = dict[str, Any]


def _env_number(name: str, default: float) -> float:
    raw = os.environ.get(name)
    if raw is None or not raw.strip():
        return default
    try:
        value = float(raw)
    except ValueError as exc:
        raise RemoteError(
            name, "remote-settings", f"{name}={raw!r} is not a number", "set a number, e.g. 30"
        ) from exc
    if value < 0:
        raise RemoteError(
            name, "remote-settings", f"{name}={raw!r} is negative", "set a number, e.g. 30"
        )
    return value


@dataclass(frozen=True)
class Settings:
    """Limits of one run, from the environment: CKPTFIX_REMOTE_TIMEOUT (seconds a request
    may go without an answer, 60), CKPTFIX_REMOTE_RETRIES (further attempts after a
    transient failure, 4), CKPTFIX_REMOTE_CONCURRENCY (requests in flight, 16),
    CKPTFIX_REMOTE_BACKOFF (first wait between attempts, in seconds, 0.5; doubled each time)."""

    timeout: float = 60.0
    retries: int = 4
    concurrency: int = 16
    backoff: float = 0.5

    @staticmethod
    def from_env() -> Settings:
        return Settings(
            timeout=_env_number("CKPTFIX_REMOTE_TIMEOUT", 60.0) or 60.0,
            retries=int(_env_number("CKPTFIX_REMOTE_RETRIES", 4)),
            concurrency=max(1, int(_env_number("CKPTFIX_REMOTE_CONCURRENCY", 16))),
            backoff=_env_number("CKPTFIX_REMOTE_BACKOFF", 0.5),
        )


class Backend(Protocol):
    """One store, as the remote sources use it: botocore's S3 client (io.remote_s3) or an
    fsspec file system (io.remote_backends)."""

    scheme: str  # "s3", "gs", "hf", "http"

    def to_path(self, url: str) -> str:
        """The backend's path for a URL."""
        ...

    def info(self, path: str) -> Info:
        """Fresh details of one object or folder (never from a cache)."""
        ...

    def ls(self, path: str) -> list[Info]:
        """The entries of a folder, with `name`, `type` and, where known, `size`."""
        ...

    def read(self, path: str, start: int, end: int, info: Info) -> bytes:
        """Bytes [start, end) of the object `info` describes (pinned to it where possible)."""
        ...

    def token(self, info: Info) -> tuple[object, ...]:
        """What identifies this version of the object: size, ETag, version, ..."""
        ...


class RemoteSession:
    """Requests to one backend: retried, classified, counted (thread-safe)."""

    def __init__(self, backend: Backend, settings: Settings | None = None) -> None:
        self.backend = backend
        self.settings = settings or Settings.from_env()
        self._lock = threading.Lock()
        self.requests = 0
        self.bytes_fetched = 0
        self.retries = 0

    def _count(self, fetched: int = 0, *, request: bool = True) -> None:
        with self._lock:
            self.requests += int(request)
            self.bytes_fetched += fetched

    def call(self, url: str, request: Callable[[], T]) -> T:
        """Run one request; transient failures are tried again after a growing wait."""
        attempt = 0
        while True:
            attempt += 1
            self._count()
            try:
                return request()
            except CkptfixError:
                raise
            except Exception as exc:
                if is_precondition_failed(exc):
                    raise changed(url) from exc
                failure = classify(exc, self.backend.scheme)
                if failure is None:
                    raise
                if not failure.transient or attempt > self.settings.retries:
                    raise remote_error(url, failure, attempt) from exc
            with self._lock:
                self.retries += 1
            wait = self.settings.backoff * 2 ** (attempt - 1)
            time.sleep(min(wait, 20.0) * random.uniform(0.75, 1.25))

    def fetch(self, url: str, path: str, start: int, end: int, info: Info) -> bytes:
        """Bytes [start, end) of an object; exactly that many, or an error."""
        data = self.call(url, lambda: self.backend.read(path, start, end, info))
        self._count(len(data), request=False)
        if len(data) > end - start:  # each backend stops at the range: a new one might not
            raise RemoteError(url, "remote-no-range", str(longer(start, end)), RANGE_FIX)
        if len(data) < end - start:
            raise RemoteChangedError(
                url,
                f"the server sent {len(data):,} of the {end - start:,} bytes asked for: the "
                "object changed during the run, or the server cut its answer short",
            )
        return data

    def info(self, url: str, path: str) -> Info:
        return self.call(url, lambda: self.backend.info(path))

    def stats(self) -> dict[str, int]:
        with self._lock:
            return {
                "requests": self.requests,
                "bytes_fetched": self.bytes_fetched,
                "retries": self.retries,
            }


def size_of(url: str, info: Info) -> int:
    size = info.get("size")
    if not isinstance(size, int) or size < 0:
        raise RemoteError(
            url,
            "remote-no-size",
            "the server does not say the file's size",
            "serve it with a Content-Length header, or download it",
        )
    return size


class RemoteFile:
    """One remote object as a ByteSource (see the module docstring)."""

    def __init__(self, session: RemoteSession, url: str, path: str, info: Info | None) -> None:
        self.session = session
        self.url = url
        self.path = path
        self._info = info
        self._lock = threading.Lock()
        self._head: bytes | None = None
        self._blocks: OrderedDict[int, bytes] = OrderedDict()

    @property
    def label(self) -> str:
        return self.url

    def info(self) -> Info:
        """The details the file was first seen with (asked for once)."""
        if self._info is None or self._info.get("size") is None:
            self._info = self.session.info(self.url, self.path)
        return self._info

    @property
    def size(self) -> int:
        return size_of(self.url, self.info())

    def fileno(self) -> int | None:
        return None

    def change_token(self) -> tuple[object, ...]:
        return self.session.backend.token(self.session.info(self.url, self.path))

    def identity(self) -> tuple[object, ...]:
        """The version the file was first seen as (size, ETag, generation, blob id...)."""
        return self.session.backend.token(self.info())

    def close(self) -> None:
        with self._lock:
            self._head = None
            self._blocks.clear()

    def read_at(self, offset: int, size: int) -> bytes:
        total = self.size
        if offset < 0 or size < 0 or offset + size > total:
            raise past_end(self.url, offset + size, total)
        if size == 0:
            return b""
        cached = self._cached(offset, size)
        if cached is not None:
            return cached
        if size <= BLOCK:
            start = offset - offset % BLOCK
            end = min(max(start + BLOCK, offset + size), total)
            block = self._fetch(start, end)
            self._keep(start, block)
            return block[offset - start : offset - start + size]
        prefix = self._prefix(offset)  # a long read that starts in a cached block
        return prefix + self._fetch(offset + len(prefix), offset + size)

    def _fetch(self, start: int, end: int) -> bytes:
        return self.session.fetch(self.url, self.path, start, end, self.info())

    def _keep(self, start: int, block: bytes) -> None:
        with self._lock:
            if start == 0:
                self._head = block
                return
            self._blocks[start] = block
            self._blocks.move_to_end(start)
            while len(self._blocks) > CACHED_BLOCKS:
                self._blocks.popitem(last=False)

    def _candidates(self) -> list[tuple[int, bytes]]:
        with self._lock:
            found = list(self._blocks.items())
            if self._head is not None:
                found.append((0, self._head))
            return found

    def _cached(self, offset: int, size: int) -> bytes | None:
        for start, block in self._candidates():
            if start <= offset and offset + size <= start + len(block):
                return block[offset - start : offset - start + size]
        return None

    def _prefix(self, offset: int) -> bytes:
        for start, block in self._candidates():
            if start <= offset < start + len(block):
                return block[offset - start :]
        return b""
