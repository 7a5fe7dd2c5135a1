"""Moving and comparing byte ranges between files: whole blocks cloned (shared with the
source: `Platform.clone_range`, FICLONERANGE on Linux) where the caller found that the
filesystem allows it and the offsets agree, the rest in the kernel where it can
(`Platform.copy_range`, copy_file_range on Linux), through bounded buffers where it cannot
(another filesystem, another system, a source without a descriptor)."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator
from dataclasses import dataclass

from ckptfix.core.errors import SourceChangedError
from ckptfix.io.gather import Window
from ckptfix.io.source import ByteSource, descriptor, preadv_exact, read_into
from ckptfix.plan.align import aligned_split
from ckptfix.platform import system

COPY_CHUNK = 64 * 2**20
# A source without a descriptor (a URL) is copied through memory, this much at a time: its
# reader may hold a range twice while it assembles it, so memory is about twice this.
REMOTE_CHUNK = 16 * 2**20
COMPARE_CHUNK = 2 * 2**20
# One clone call at most this long, so that progress and Ctrl-C are seen between them.
CLONE_CHUNK = 2**30


def write_all(fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
    system().write_all(fd, data, offset)


def _data_segments(
    fd: int, begin: int, end: int, path: str | None = None
) -> Iterator[tuple[int, int]]:
    """The parts of [begin, end) that hold data; holes of a sparse file are skipped where the
    system can find them (they read as zeros, as the unwritten parts of the new file do). A
    file now shorter than `end` changed under us: past its end, SEEK_DATA reports a hole,
    which must not be taken for zeros."""
    if os.fstat(fd).st_size < end:
        raise SourceChangedError(path)
    return system().data_segments(fd, begin, end)


@dataclass(frozen=True)
class Transfer:
    """One file's bytes going into another: the descriptors, the source's label for
    errors, and who counts the bytes done. With `block`, whole blocks at congruent offsets
    are cloned (`Platform.clone_range`) and counted by `cloned` as well."""

    src: int
    dst: int
    label: str | None = None
    advance: Callable[[int], None] | None = None
    block: int | None = None
    cloned: Callable[[int], None] | None = None

    def done(self, count: int) -> None:
        if self.advance is not None:
            self.advance(count)


def copy_range(transfer: Transfer, src_offset: int, length: int, dst_offset: int) -> None:
    """Copy bytes between files, in the kernel where it can (no user-space buffer). An
    empty range copies nothing and reads nothing (an empty view may sit past the end of
    its storage, and of the file)."""
    if length <= 0:
        return
    shift = dst_offset - src_offset
    end = src_offset + length
    done = src_offset
    for begin, stop in _data_segments(transfer.src, src_offset, end, transfer.label):
        if begin > done:
            transfer.done(begin - done)  # a hole: nothing to copy, counted as done
        _place_segment(transfer, begin, stop - begin, begin + shift)
        done = stop
    if end > done:  # a hole up to the end: extend the output now, so it is never short
        if os.fstat(transfer.dst).st_size < end + shift:
            os.ftruncate(transfer.dst, end + shift)
        transfer.done(end - done)


def _place_segment(transfer: Transfer, src_offset: int, length: int, dst_offset: int) -> None:
    """Clone the whole blocks of a segment where allowed, copy the head and tail around them
    (and whatever a clone refused)."""
    head, body = aligned_split(src_offset, dst_offset, length, transfer.block or 0)
    if head:
        _copy_segment(transfer, src_offset, head, dst_offset)
    src_offset, dst_offset, length = src_offset + head, dst_offset + head, length - head
    while body:
        size = min(body, CLONE_CHUNK)
        if not system().clone_range(transfer.src, src_offset, size, transfer.dst, dst_offset):
            break  # copied below with the tail
        if transfer.cloned is not None:
            transfer.cloned(size)
        transfer.done(size)
        src_offset, dst_offset, length, body = (
            src_offset + size,
            dst_offset + size,
            length - size,
            body - size,
        )
    if length:
        _copy_segment(transfer, src_offset, length, dst_offset)


def _copy_segment(transfer: Transfer, src_offset: int, length: int, dst_offset: int) -> None:
    kernel = True
    while length:
        size = min(length, COPY_CHUNK)
        copied = _kernel_copy(transfer, src_offset, size, dst_offset) if kernel else None
        if copied is None:  # not between these files: through a buffer from now on
            kernel = False
            copied = _buffered_copy(transfer, src_offset, size, dst_offset)
        if copied == 0:
            raise SourceChangedError(transfer.label)
        src_offset, dst_offset, length = src_offset + copied, dst_offset + copied, length - copied
        transfer.done(copied)


def _kernel_copy(transfer: Transfer, src_offset: int, size: int, dst_offset: int) -> int | None:
    return system().copy_range(transfer.src, transfer.dst, size, src_offset, dst_offset)


def _buffered_copy(transfer: Transfer, src_offset: int, size: int, dst_offset: int) -> int:
    data = system().pread(transfer.src, size, src_offset)
    if data:
        write_all(transfer.dst, data, dst_offset)
    return len(data)


class Cancelled(Exception):
    """Verification stopped because the write was abandoned."""


@dataclass(frozen=True)
class Target:
    """Where copied bytes go: a descriptor and who counts the bytes done; with `block`,
    whole blocks are cloned from local sources where the offsets agree, counted by `cloned`."""

    fd: int
    advance: Callable[[int], None] | None = None
    block: int | None = None
    cloned: Callable[[int], None] | None = None


def copy_from(
    source: ByteSource,
    offset: int,
    length: int,
    dst: int,
    dst_offset: int,
    advance: Callable[[int], None] | None,
) -> None:
    """Copy a range of a byte source into a file: kernel copies for local files, bounded
    reads and writes for the others."""
    copy_to(source, offset, length, Target(dst, advance), dst_offset)


def copy_to(source: ByteSource, offset: int, length: int, target: Target, at: int) -> None:
    """Copy (or clone, see Target) a range of a byte source into a file at `at`."""
    with descriptor(source) as fd:
        if fd is not None:
            transfer = Transfer(
                fd, target.fd, source.label, target.advance, target.block, target.cloned
            )
            copy_range(transfer, offset, length, at)
            return
    while length:
        size = min(length, REMOTE_CHUNK)
        write_all(target.fd, source.read_at(offset, size), at)
        offset, at, length = offset + size, at + size, length - size
        if target.advance is not None:
            target.advance(size)


_THREAD = threading.local()


def compare_buffers() -> tuple[Window, bytearray]:
    """This thread's two COMPARE_CHUNK buffers, made on its first comparison and reused by
    every other: a verifying thread reads (or gathers) what a file should hold into the
    first and what it holds into the second, not into new memory for each chunk."""
    pair: tuple[Window, bytearray] | None = getattr(_THREAD, "pair", None)
    if pair is None:
        pair = _THREAD.pair = (Window(COMPARE_CHUNK), bytearray(COMPARE_CHUNK))
    return pair


def same_start(one: bytearray, two: bytearray, size: int) -> bool:
    """Whether the first `size` bytes of two buffers are equal, compared in place by
    `startswith` (memcmp): a comparison of views goes element by element, and of slices
    copies them."""
    return len(one) >= size and one.startswith(memoryview(two)[:size])


def written_equal(dst: int, dst_offset: int, expected: bytearray, size: int) -> bool:
    """Whether `size` bytes of a written file at `dst_offset` equal the start of
    `expected` (a buffer of compare_buffers)."""
    got = compare_buffers()[1]
    preadv_exact(dst, dst_offset, [memoryview(got)[:size]])
    return same_start(expected, got, size)


def source_equal(
    source: ByteSource,
    offset: int,
    dst: int,
    dst_offset: int,
    length: int,
    cancel: threading.Event | None = None,
) -> bool:
    """Bitwise comparison of a source range with a range of a written file, both read into
    this thread's buffers."""
    expected = compare_buffers()[0].buffer
    while length:
        if cancel is not None and cancel.is_set():
            raise Cancelled
        size = min(length, COMPARE_CHUNK)
        read_into(source, offset, memoryview(expected)[:size])
        if not written_equal(dst, dst_offset, expected, size):
            return False
        offset, dst_offset, length = offset + size, dst_offset + size, length - size
    return True
