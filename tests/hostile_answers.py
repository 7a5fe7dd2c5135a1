"""What the test servers send when a test tells them to misbehave (`Behaviour.hostile`): the
bodies of answers that a client reading them whole would hold in memory, and their names.

Every endless body stops after SERVER_CAP bytes (inflated, for a gzip one): enough for an
unbounded client to show as hundreds of MiB of memory, little enough that a test run of
the unbounded code does not take the machine down with it.
"""

from __future__ import annotations

import time
import zlib
from collections.abc import Callable, Iterator
from functools import cache

SERVER_CAP = 768 * 2**20  # bytes an endless body sends (inflated) before it gives up
_BLOCK = 2**20

# A 206 for the range asked (its Content-Range right) whose body is ...
RANGE_KINDS = (
    "gzip-range",  # ... gzip-encoded, chunked, and inflates to SERVER_CAP bytes of zeros
    "endless-range",  # ... chunked, without a Content-Length, and never ends
    "long-range",  # ... SERVER_CAP bytes longer than asked, and its Content-Length says so
)
# A folder listing (HTML page, Hub tree page, GCS or S3 listing page) that ...
LISTING_KINDS = (
    "huge-listing",  # ... is valid up to its first entries, then never ends
    "gzip-listing",  # ... is gzip-encoded and inflates to SERVER_CAP bytes of white space
    "endless-pages",  # ... holds no entry and says another page follows, always
    "many-entries",  # ... holds 10,000 new entries and says another page follows, always
)
# (An HTTP listing is one page: with "many-entries" it links 200,000 files, and
# "endless-pages" does not apply to it.)
PAGE_SIZES = {"endless-pages": 0, "many-entries": 10_000}
# A request for a file that is answered by a redirect ...
REDIRECT_KINDS = (
    "redirect-file",  # ... to file:///etc/passwd
    "redirect-ftp",  # ... to an ftp:// URL
    "redirect-data",  # ... to a data: URL holding a safetensors header
    "redirect-loop",  # ... to itself
    "redirect-chain",  # ... to another URL on the server, which redirects again, without end
)
KINDS = RANGE_KINDS + LISTING_KINDS + REDIRECT_KINDS


# Slow on purpose (not in KINDS): a listing whose body trickles in, 64 bytes every 50 ms;
# a 206 whose body is the range asked, right, one byte every 50 ms.
SLOW_KINDS = ("slow-listing", "slow-range")


def trickle(chunks: Iterator[bytes], pause: float, size: int = 64) -> Iterator[bytes]:
    """`chunks` cut into pieces of `size` bytes, one every `pause` seconds."""
    for chunk in chunks:
        for at in range(0, len(chunk), size):
            time.sleep(pause)
            yield chunk[at : at + size]


def applies(backend: str, kind: str) -> bool:
    """Whether a backend's server can answer as `kind` says (see LISTING_KINDS)."""
    return not (backend == "http" and kind == "endless-pages")


OTHER_SCHEMES = {
    "redirect-file": "file:///etc/passwd",
    "redirect-ftp": "ftp://127.0.0.1/model.safetensors",
    "redirect-data": "data:application/octet-stream;base64,CAAAAAAAAAB7fSAgICAgIA==",
}


def redirect_target(kind: str, path: str, hop: int) -> str:
    """Where a redirect of `kind` sends a request for `path` (the `hop`-th of a chain)."""
    if kind in OTHER_SCHEMES:
        return OTHER_SCHEMES[kind]
    if kind == "redirect-loop":
        return path
    return f"{path.partition('?')[0]}?hop={hop + 1}"


def endless(head: bytes, entry: Callable[[int], bytes], cap: int = SERVER_CAP) -> Iterator[bytes]:
    """`head`, then entries 0, 1, 2, ... in blocks of about 1 MiB until `cap` bytes."""
    yield head
    sent, index = len(head), 0
    while sent < cap:
        block = bytearray()
        while len(block) < _BLOCK:
            block += entry(index)
            index += 1
        sent += len(block)
        yield bytes(block)


@cache
def _gzip_blocks(head: bytes, filler: int) -> tuple[bytes, bytes]:
    """The gzip stream's start (header, `head` and one MiB of `filler`), and a block that
    inflates to one more MiB of it: after a full flush the compressor's state is the same,
    so the same input gives the same block, about 1 KiB."""
    compressor = zlib.compressobj(9, zlib.DEFLATED, 31)
    block = bytes([filler]) * _BLOCK
    first = compressor.compress(head + block) + compressor.flush(zlib.Z_FULL_FLUSH)
    again = compressor.compress(block) + compressor.flush(zlib.Z_FULL_FLUSH)
    return first, again


def gzip_bomb(head: bytes = b"", filler: int = 0, cap: int = SERVER_CAP) -> Iterator[bytes]:
    """A gzip stream of `head` and then `filler` bytes, sent until it inflates to `cap`
    bytes (it never ends properly: an unbounded client has inflated it all by then)."""
    first, again = _gzip_blocks(head, filler)
    yield first
    for _ in range(cap // _BLOCK):
        yield again


def zeros(count: int) -> Iterator[bytes]:
    """`count` zero bytes in blocks of 1 MiB."""
    block = bytes(_BLOCK)
    while count > 0:
        yield block[: min(count, _BLOCK)]
        count -= _BLOCK


def expected_rule(backend: str, kind: str) -> str:
    """The rule of the one error line an answer of `kind` from `backend` must give."""
    if kind in ("endless-range", "long-range"):
        return "remote-no-range"
    if backend == "s3" and kind.startswith("redirect-"):
        return "remote-http-error"  # botocore follows no redirect: a 3xx is an error status
    return "remote-error"
