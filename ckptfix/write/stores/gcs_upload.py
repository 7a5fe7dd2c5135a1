"""One object streamed to Cloud Storage as a parallel composite upload (see `gcs`).

The bytes are cut into parts of `Layout.part_size`; each full part is uploaded, on the
store's worker threads, as a temporary object under `<prefix>/.ckptfix-upload/<run>/<name>/`
with the CRC-32C computed while its bytes arrived (Cloud Storage refuses a part whose bytes do
not match it, and the part's resource must report it back). `complete()` composes the parts
into the object (32 at a time, the API's limit: in rounds through intermediate objects for
more), compares the composed object's CRC-32C with the one of the whole stream, and deletes
the parts. An object of at most one part is one upload under its final name.
"""

from __future__ import annotations

import base64
import contextlib
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptfix.core.errors import UsageError, VerificationError
from ckptfix.write.stores.base import StoredObject, StoreOptions
from ckptfix.write.stores.common import mismatch

if TYPE_CHECKING:
    from ckptfix.write.stores.gcs import GcsStore

ALIGN = 256 * 2**10  # Cloud Storage's chunk unit
PART_MIN = 8 * 2**20
MAX_COMPONENTS = 1024  # components of one composite object
COMPOSE_MAX = 32  # sources of one compose request


@dataclass(frozen=True)
class Layout:
    """How one object is cut: parts of `part_size` bytes, `parts` of them (1: one upload)."""

    part_size: int
    parts: int


def layout(url: str, size: int, options: StoreOptions) -> Layout:
    """The part size for an object of `size` bytes: enough that the object fits in
    MAX_COMPONENTS parts; otherwise PART_MIN to 64 MiB, within what lets a part filling and
    one in flight fit in `options.max_in_flight`; no more than the object."""
    needed = -(-size // MAX_COMPONENTS)
    cap = max(ALIGN, options.max_in_flight // 2 // ALIGN * ALIGN)
    wanted = min(max(PART_MIN, cap), 64 * 2**20, cap)
    part = max(needed, min(wanted, max(size, 1)))
    part = -(-part // ALIGN) * ALIGN
    if part > options.max_in_flight:
        raise UsageError(
            url,
            f"an object of {size:,} bytes needs parts of {part:,} bytes (Cloud Storage "
            f"composes at most {MAX_COMPONENTS} parts), more than the {options.max_in_flight:,} "
            "bytes of parts allowed in memory",
            "allow more memory for upload parts",
        )
    return Layout(part, max(1, -(-size // part)))


def crc32c(data: bytes, crc: int = 0) -> int:
    import google_crc32c

    return int(google_crc32c.extend(crc, data))


def crc_text(crc: int) -> str:
    """A CRC-32C as Cloud Storage writes it: base64 of its 4 big-endian bytes."""
    return base64.b64encode(crc.to_bytes(4, "big")).decode()


class Crc32cHash:
    """The CRC-32C of bytes fed in order, as Cloud Storage reports it (`GcsStore.stat`)."""

    def __init__(self) -> None:
        self.crc = 0

    def update(self, data: bytes | memoryview) -> None:
        self.crc = crc32c(bytes(data), self.crc)

    def value(self) -> tuple[str, str]:
        return "crc32c", crc_text(self.crc)


@dataclass(frozen=True)
class Part:
    key: str
    generation: str


class GcsUpload:
    """One object (see the module docstring); made by `GcsStore.begin`."""

    def __init__(self, store: GcsStore, name: str, size: int) -> None:
        self.store, self.name, self.size = store, name, size
        self.url = store.url_of(name)
        self.layout = layout(self.url, size, store.options)
        self.crc = self.part_crc = self.received = self.fill = 0
        self.buffer: bytearray | None = None
        self.parts: dict[int, Part] = {}
        self.tried: set[str] = set()  # every temporary key asked for: deleted on abort
        self.futures: list[Future[None]] = []
        self.pool: ThreadPoolExecutor | None = None
        self.failure: BaseException | None = None
        self.state = "open"
        self._lock = threading.Lock()

    def send(self, data: bytes | memoryview) -> None:
        self._check_open()
        piece = bytes(data)  # the caller may reuse its buffer; google_crc32c reads bytes only
        if self.received + len(piece) > self.size:
            self.abort()
            raise _size_error(self.url, self.received + len(piece), self.size)
        self.received += len(piece)
        self.crc = crc32c(piece, self.crc)
        offset = 0
        while offset < len(piece):
            buffer = self._buffer()
            taken = min(len(piece) - offset, len(buffer) - self.fill)
            # a copy only where the bytes straddle two parts
            segment = piece if taken == len(piece) else piece[offset : offset + taken]
            buffer[self.fill : self.fill + taken] = segment
            self.part_crc = crc32c(segment, self.part_crc)
            self.fill += taken
            offset += taken
            if self.fill == len(buffer) and self.layout.parts > 1:
                self._ship()

    def _buffer(self) -> bytearray:
        """The part being filled, taken from the store's budget when it starts."""
        if self.buffer is None:
            left = self.size - len(self.futures) * self.layout.part_size
            size = min(self.layout.part_size, max(left, 0))
            if not self.store.budget.take(size, lambda: self.failure is not None):
                self._raise_failure()
                raise ValueError(f"the upload of {self.name} was aborted")
            self.buffer = bytearray(size)
        return self.buffer

    def _ship(self) -> None:
        """Hand the full buffer to a worker; the next bytes go to a new one."""
        buffer, crc, index = self.buffer, self.part_crc, len(self.futures)
        assert buffer is not None
        self.buffer, self.fill, self.part_crc = None, 0, 0
        size = len(buffer)  # the callback stays with the future: it must not hold the bytes
        if self.pool is None:  # the upload's own workers: gone when it ends
            workers = max(1, self.store.options.concurrency)
            self.pool = ThreadPoolExecutor(workers, "ckptfix-gcs-part")
        future = self.pool.submit(self._upload_part, index, buffer, crc)
        del buffer
        future.add_done_callback(lambda done: self._done(done, size))
        self.futures.append(future)

    def _upload_part(self, index: int, buffer: bytearray, crc: int) -> None:
        if self.failure is not None or self.state != "open":
            return
        key = self.store.temp_key(self.name, f"part-{index:05d}")
        with self._lock:
            self.tried.add(key)
        resource = self.store.put(key, memoryview(buffer), crc, part=index)
        with self._lock:
            self.parts[index] = Part(key, str(resource.get("generation", "")))

    def _done(self, future: Future[None], size: int) -> None:
        self.store.budget.give(size)
        error = future.exception() if not future.cancelled() else None
        if error is not None and self.failure is None:
            self.failure = error

    def complete(self) -> StoredObject:
        self._check_open()
        if self.received != self.size:
            self.abort()
            raise _size_error(self.url, self.received, self.size)
        try:
            found = self._single() if self.layout.parts == 1 else self._composed()
        except BaseException:
            self.abort()
            raise
        self.state = "done"
        self._stop_workers()
        return found

    def _stop_workers(self) -> None:
        if self.pool is not None:
            self.pool.shutdown(wait=True, cancel_futures=True)
            self.pool = None

    def _single(self) -> StoredObject:
        buffer = self._buffer()
        try:
            self.store.put(self.store.key(self.name), memoryview(buffer), self.crc)
        finally:
            self.buffer = None
            self.store.budget.give(len(buffer))
        return StoredObject(self.name, self.size, ("crc32c", crc_text(self.crc)))

    def flush(self) -> None:
        """Send what is left and wait until every part is stored and checked; nothing is
        visible yet (an object of one part is sent whole by `complete`)."""
        self._check_open()
        if self.received != self.size:
            self.abort()
            raise _size_error(self.url, self.received, self.size)
        if self.layout.parts > 1:
            self._wait_parts()

    def _wait_parts(self) -> None:
        if self.fill or self.buffer is not None:
            self._ship()
        for future in self.futures:
            future.exception()  # wait for every part
        self._raise_failure()

    def _composed(self) -> StoredObject:
        self._wait_parts()
        sources = [self.parts[index] for index in range(len(self.futures))]
        round_number = 0
        while len(sources) > COMPOSE_MAX:
            round_number += 1
            sources = self._compose_round(sources, round_number)
        resource = self.store.compose(self.store.key(self.name), sources)
        self._check_composed(resource)
        self._delete_parts()
        return StoredObject(self.name, self.size, ("crc32c", crc_text(self.crc)))

    def _compose_round(self, sources: list[Part], round_number: int) -> list[Part]:
        """Compose each group of COMPOSE_MAX sources into one intermediate object."""
        made = []
        for start in range(0, len(sources), COMPOSE_MAX):
            key = self.store.temp_key(self.name, f"round-{round_number}-{start // COMPOSE_MAX:05d}")
            with self._lock:
                self.tried.add(key)
            resource = self.store.compose(key, sources[start : start + COMPOSE_MAX])
            made.append(Part(key, str(resource.get("generation", ""))))
        return made

    def _check_composed(self, resource: dict[str, Any]) -> None:
        size, crc = resource.get("size"), resource.get("crc32c")
        problem = None
        if str(size) != str(self.size):
            problem = ("a size of", f"{size} bytes", f"{self.size:,} bytes")
        elif crc != crc_text(self.crc):
            problem = ("CRC-32C", str(crc), crc_text(self.crc))
        if problem is not None:
            self.store.remove(self.store.key(self.name))  # this run's own object: not kept
            raise mismatch(self.url, *problem)

    def _delete_parts(self) -> None:
        with self._lock:
            keys = sorted(self.tried)
            self.tried = set()
        self.store._remove_all(keys)

    def abort(self) -> None:
        """Stop: wait for the parts in flight, delete every temporary object (what cannot be
        deleted is found as a dangling upload by the next run). Safe to call again."""
        if self.state != "open":
            return
        self.state = "aborted"
        self.failure = self.failure or _Aborted()
        for future in self.futures:
            future.cancel()
        for future in self.futures:
            if not future.cancelled():
                future.exception()
        if self.buffer is not None:
            self.store.budget.give(len(self.buffer))
            self.buffer = None
        self._stop_workers()
        with contextlib.suppress(Exception):  # left for the next run's `dangling()`
            self._delete_parts()

    def _check_open(self) -> None:
        if self.state != "open":
            raise ValueError(f"the upload of {self.name} is {self.state}")
        self._raise_failure()

    def _raise_failure(self) -> None:
        if self.failure is not None and not isinstance(self.failure, _Aborted):
            failure = self.failure
            self.abort()
            raise failure


class _Aborted(Exception):
    """What stops the parts of an aborted upload."""


def _size_error(url: str, got: int, size: int) -> VerificationError:
    return VerificationError(
        url,
        f"{got:,} bytes were sent for an object of {size:,} bytes: nothing was published",
        "report this as a bug of ckptfix",
    )
