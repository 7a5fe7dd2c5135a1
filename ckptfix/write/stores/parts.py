"""Cutting an object's byte stream into upload parts and sending several at once, in bounded
memory: what every multipart store (S3 today, GCS composed uploads) needs the same way.

`part_size` picks the part size from the object's size and the store's part-count limit;
`PartPump` takes the bytes in order, fills one part at a time and hands each full part to a
worker thread, blocking while `concurrency` parts are in flight. Memory is therefore at most
(concurrency + 1) parts; `in_flight` chooses a concurrency that keeps that under a byte bound.
The first failure of any part stops the stream: `feed`, `finish` raise it.
"""

from __future__ import annotations

import queue
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Generic, TypeVar

T = TypeVar("T")

MIB = 2**20
PREFERRED_PART = (
    8 * MIB
)  # as boto3's transfer manager: small enough to overlap, few enough requests


def part_size(size: int, *, max_parts: int, minimum: int, preferred: int = PREFERRED_PART) -> int:
    """The part size for an object of `size` bytes: `preferred`, or the smallest whole MiB
    that keeps the object within `max_parts` parts; never under `minimum`."""
    needed = -(-size // max_parts)
    needed = -(-needed // MIB) * MIB
    return max(preferred, minimum, needed)


def in_flight(part: int, concurrency: int, max_bytes: int) -> int:
    """Parts sent at once so that those and the one being filled stay within `max_bytes`
    (at least one: a part larger than the bound is sent alone)."""
    return max(1, min(concurrency, max_bytes // part - 1))


class PartPump(Generic[T]):
    """See the module docstring. `send(number, data)` runs on a worker thread (numbers from
    1) and returns what `finish` gives back, in part order. The parts are `concurrency + 1`
    buffers of `part` bytes, filled in turn and reused once their part is sent: memory is
    exactly that, whatever the allocator does with buffers freed by other threads."""

    def __init__(self, send: Callable[[int, bytearray], T], part: int, concurrency: int) -> None:
        self._send = send
        self.part = part
        self._free: queue.Queue[bytearray] = queue.Queue()
        self._made = 0
        self._limit = concurrency + 1
        self._pool = ThreadPoolExecutor(concurrency, thread_name_prefix="ckptfix-upload")
        self._buffer: bytearray | None = None
        self._filled = 0
        self._futures: list[Future[T]] = []
        self._closed = False

    def feed(self, data: bytes | memoryview) -> None:
        view = memoryview(data).cast("B")
        while len(view):
            buffer = self._current()
            take = min(self.part - self._filled, len(view))
            buffer[self._filled : self._filled + take] = view[:take]
            view, self._filled = view[take:], self._filled + take
            if self._filled == self.part:
                self._flush()

    def _current(self) -> bytearray:
        if self._buffer is None:
            if self._made < self._limit and self._free.empty():
                self._made += 1
                self._buffer = bytearray(self.part)
            else:
                self._buffer = self._take()
        return self._buffer

    def _take(self) -> bytearray:
        """A buffer whose part has been sent (waiting while every one is in flight)."""
        while True:
            self._raise_failed()
            try:
                return self._free.get(timeout=0.1)
            except queue.Empty:
                continue

    def finish(self) -> list[T]:
        """Send what is left, wait for every part; their results in order (again if
        called again)."""
        if not self._closed and (self._filled or not self._futures):
            self._current()
            self._flush()
        results = [future.result() for future in self._futures]
        self.close()
        return results

    def close(self) -> None:
        """Stop: parts not started are dropped, those under way are waited for; the buffers
        are let go now (the upload that owns this pump is in a cycle with it, and the
        cyclic collector may not run for a long time)."""
        if not self._closed:
            self._closed = True
            self._pool.shutdown(wait=True, cancel_futures=True)
        self._buffer, self._free = None, queue.Queue()

    def _flush(self) -> None:
        self._raise_failed()
        buffer, filled = self._buffer, self._filled
        assert buffer is not None
        self._buffer, self._filled = None, 0
        number = len(self._futures) + 1
        self._futures.append(self._pool.submit(self._run, number, buffer, filled))

    def _run(self, number: int, buffer: bytearray, filled: int) -> T:
        try:
            # the last part is shorter: its own copy (the buffer goes back to the pool)
            return self._send(number, buffer if filled == len(buffer) else buffer[:filled])
        finally:
            self._free.put(buffer)

    def _raise_failed(self) -> None:
        for future in self._futures:
            if future.done() and not future.cancelled() and future.exception() is not None:
                future.result()
