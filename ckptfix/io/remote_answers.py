"""How much of a server's answer ckptfix will take: every body is read against a bound
derived from what was asked, whichever library carries it (aiohttp for http(s):// and gs://,
httpx for hf://, botocore's urllib3 for s3://).

- A ranged read (`Range: bytes=a-b`) takes a 206 whose body is exactly the range: a 200
  (the whole file), a Content-Range that starts elsewhere, a Content-Length over the range or
  a body that goes on past it are refused, before or as soon as the extra byte arrives. Its
  body must arrive within ANSWER_TIMEOUTS request timeouts and a second per MIN_RATE bytes
  (a server that sends a byte now and then, never pausing for a whole timeout, ends).
- Nothing is ever inflated: every request asks for `Accept-Encoding: identity`, and an
  answer with a Content-Encoding is refused before its body is read.
- Any other answer (a listing page, a JSON document, an error page) may hold at most
  ANSWER_CAP bytes, and must arrive within ANSWER_TIMEOUTS request timeouts.
- A listing (all its pages) may have at most MAX_PAGES pages and MAX_ENTRIES entries, and
  must end within ANSWER_TIMEOUTS request timeouts (`Listing`).
- Redirects: at most remote_errors.MAX_REDIRECTS, to http(s) URLs only (`redirect_target`).

Nothing here imports a backend.
"""

from __future__ import annotations

import re
import threading
import time
from collections.abc import Iterator, Mapping
from contextlib import contextmanager

from ckptfix.io.remote_errors import RangeRefused, UnexpectedAnswer

ANSWER_CAP = 16 * 2**20  # bytes of any answer that is not a file's bytes
ANSWER_TIMEOUTS = 10  # request timeouts any answer's body, or a listing, may take
MIN_RATE = 16 * 2**10  # bytes a second a ranged answer averages, past that
MAX_PAGES = 1_000  # of one folder listing
MAX_ENTRIES = 100_000  # of one folder listing
IDENTITY = {"Accept-Encoding": "identity"}
# `aws-chunked` is a transfer framing some S3 uploads leave in an object's metadata: its
# bytes are not encoded.
_UNENCODED = {"", "identity", "aws-chunked"}
_RANGE = re.compile(r"^bytes=(\d+)-(\d+)$")
_SCHEME = re.compile(r"^([A-Za-z][A-Za-z0-9+.-]*):")  # RFC 3986; without one: relative
_local = threading.local()


def answer_seconds(timeout: float) -> float:
    """How long any answer's body, or a listing, may take: ANSWER_TIMEOUTS request timeouts
    (of at least 0.1 s)."""
    return max(timeout, 0.1) * ANSWER_TIMEOUTS


def asked_range(header: str | None) -> tuple[int, int] | None:
    """[start, end) of a `Range: bytes=a-b` request header, None for no (or another) range."""
    match = _RANGE.match(header or "")
    return (int(match.group(1)), int(match.group(2)) + 1) if match else None


def _span(start: int, end: int) -> str:
    return f"bytes {start}-{end - 1}"


def body_limit(asked: str | None, status: int, headers: Mapping[str, str]) -> int:
    """How many body bytes an answer to a request with Range header `asked` may carry (a
    2xx ranged answer must carry exactly that many), or an error before any is read."""
    encoding = str(headers.get("Content-Encoding", "")).strip().lower()
    if 200 <= status < 300 and encoding not in _UNENCODED:
        raise UnexpectedAnswer(
            f"the answer is {encoding[:40]}-encoded, though ckptfix asked for no encoding "
            "(Accept-Encoding: identity)"
        )
    wanted = asked_range(asked)
    if wanted is None or not 200 <= status < 300:
        return ANSWER_CAP
    start, end = wanted
    if status != 206:
        raise RangeRefused(
            f"the server ignores range requests (asked for {_span(start, end)}, it sent the "
            "whole file)"
        )
    answered = str(headers.get("Content-Range", "")).strip()
    unit, _, spec = answered.partition(" ")
    if answered and (unit != "bytes" or spec.split("-", 1)[0].strip() != str(start)):
        raise RangeRefused(f"the server answered {answered[:60]!r} to {_span(start, end)}")
    length = str(headers.get("Content-Length", "")).strip()
    if length.isdigit() and int(length) > end - start:
        raise longer(start, end)
    return end - start


def longer(start: int, end: int) -> RangeRefused:
    return RangeRefused(
        f"the server sent more than the {end - start:,} bytes asked for ({_span(start, end)})"
    )


class Body:
    """An answer's body as it arrives, refused once it passes its bound (`limit` bytes; for
    a ranged answer, `ranged` is what was asked) or its `deadline` (time.monotonic)."""

    def __init__(
        self,
        limit: int,
        ranged: tuple[int, int] | None,
        deadline: float,
        late: str = "the answer did not end in time",
    ) -> None:
        self.limit = limit
        self.ranged = ranged
        self.deadline = deadline
        self.late = late  # what passing the deadline means
        self.size = 0
        self._chunks: list[bytes] = []

    def add(self, chunk: bytes) -> None:
        self.size += len(chunk)
        if self.size > self.limit:
            if self.ranged is not None:
                raise longer(*self.ranged)
            raise UnexpectedAnswer(f"an answer longer than {self.limit // 2**20} MiB")
        if time.monotonic() > self.deadline:
            raise UnexpectedAnswer(self.late)
        self._chunks.append(chunk)

    def room(self, most: int = 2**16) -> int:
        """How many bytes to ask the connection for next (`most` at most): never more than
        one past the bound."""
        return max(1, min(most, self.limit + 1 - self.size))

    def data(self) -> bytes:
        return b"".join(self._chunks)


def new_body(asked: str | None, status: int, headers: Mapping[str, str], seconds: float) -> Body:
    """The Body of an answer (see `body_limit`), which must end within `seconds`: a ranged
    read's within a second more per MIN_RATE bytes asked, any other by the deadline of the
    listing this thread is reading, if that comes first (`Listing.pages_of_this_thread`)."""
    limit = body_limit(asked, status, headers)
    ranged = asked_range(asked) if 200 <= status < 300 else None
    if ranged is not None:
        allowed = seconds + limit / MIN_RATE
        late = f"the answer to {_span(*ranged)} did not arrive within {allowed:.3g} s"
        return Body(limit, ranged, time.monotonic() + allowed, late)
    listing: Listing | None = getattr(_local, "listing", None)
    deadline = time.monotonic() + seconds
    if listing is not None and listing.deadline < deadline:
        return Body(limit, None, listing.deadline, listing.late())
    return Body(limit, None, deadline)


class Listing:
    """The bounds of one folder listing: pages, entries, and time (`seconds` in all)."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self.deadline = time.monotonic() + seconds
        self.pages = 0
        self.entries = 0

    def page(self, entries: int, more: bool) -> None:
        """Count a page of `entries`, after which `more` pages follow; refuse the listing
        once it passes a bound (before another page is asked for)."""
        self.pages += 1
        self.entries += entries
        if self.entries > MAX_ENTRIES:
            raise UnexpectedAnswer(f"a listing of more than {MAX_ENTRIES:,} entries")
        if more and self.pages >= MAX_PAGES:
            raise UnexpectedAnswer(f"the listing did not end after {MAX_PAGES:,} pages")
        if more and time.monotonic() > self.deadline:
            raise UnexpectedAnswer(self.late())

    def late(self) -> str:
        return f"the listing did not end within {self.seconds:g} s"

    def remaining(self) -> float:
        return max(self.deadline - time.monotonic(), 0.001)

    @contextmanager
    def pages_of_this_thread(self) -> Iterator[None]:
        """While inside, answers read on this thread (synchronous clients) end by the
        listing's deadline."""
        _local.listing = self
        try:
            yield
        finally:
            del _local.listing


def redirect_target(location: str | None) -> str:
    """A redirect's target, refused unless it is an http(s) URL (relative ones are)."""
    target = (location or "").strip()
    scheme = _SCHEME.match(target)
    if not target:
        raise UnexpectedAnswer("the server redirected to no URL")
    if scheme and scheme.group(1).lower() not in ("http", "https"):
        shown = scheme.group(1)[:20]
        raise UnexpectedAnswer(f"the server redirected to a URL that is not HTTP(S) ({shown}:)")
    return target
