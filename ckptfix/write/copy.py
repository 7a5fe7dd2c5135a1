"""Moving and comparing byte ranges between files: in the kernel where it can
(`copy_file_range`, which shares extents on filesystems with reflinks), through bounded
buffers where it cannot (another filesystem, a source without a descriptor)."""

from __future__ import annotations

import errno
import os
import threading
from collections.abc import Callable, Iterator

from ckptfix.core.errors import SourceChangedError
from ckptfix.io.source import ByteSource, pread_exact

COPY_CHUNK = 64 * 2**20
COMPARE_CHUNK = 4 * 2**20


def write_all(fd: int, data: bytes, offset: int) -> None:
    view = memoryview(data)
    while view:
        written = os.pwrite(fd, view, offset)
        view = view[written:]
        offset += written


def _data_segments(
    fd: int, begin: int, end: int, path: str | None = None
) -> Iterator[tuple[int, int]]:
    """The parts of [begin, end) that hold data; holes of a sparse file are skipped (they read
    as zeros, as the unwritten parts of the new file do). Without SEEK_DATA support the
    whole range is one segment. A file now shorter than `end` changed under us: past its
    end, SEEK_DATA reports a hole, which must not be taken for zeros."""
    if os.fstat(fd).st_size < end:
        raise SourceChangedError(path)
    position = begin
    while position < end:
        try:
            data = os.lseek(fd, position, os.SEEK_DATA)
            hole = os.lseek(fd, data, os.SEEK_HOLE)
        except OSError as exc:
            if exc.errno == errno.ENXIO:  # nothing but hole up to the end of the file
                return
            yield position, end
            return
        if data >= end:
            return
        yield data, min(hole, end)
        position = hole


def copy_range(
    src: int,
    src_offset: int,
    length: int,
    dst: int,
    dst_offset: int,
    advance: Callable[[int], None] | None,
    src_path: str | None = None,
) -> None:
    """Copy bytes between files, in the kernel where it can (no user-space buffer)."""
    shift = dst_offset - src_offset
    end = src_offset + length
    done = src_offset
    for begin, stop in _data_segments(src, src_offset, end, src_path):
        if advance is not None and begin > done:
            advance(begin - done)  # a hole: nothing to copy, counted as done
        _copy_segment(src, begin, stop - begin, dst, begin + shift, advance, src_path)
        done = stop
    if end > done:  # a hole up to the end: extend the output now, so it is never short
        if os.fstat(dst).st_size < end + shift:
            os.ftruncate(dst, end + shift)
        if advance is not None:
            advance(end - done)


def _copy_segment(
    src: int,
    src_offset: int,
    length: int,
    dst: int,
    dst_offset: int,
    advance: Callable[[int], None] | None,
    src_path: str | None,
) -> None:
    use_kernel = hasattr(os, "copy_file_range")
    buffer: bytearray | None = None
    while length:
        size = min(length, COPY_CHUNK)
        copied = 0
        if use_kernel:
            try:
                copied = os.copy_file_range(src, dst, size, src_offset, dst_offset)
            except OSError as exc:
                if exc.errno not in (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP):
                    raise
                use_kernel = False
        if not use_kernel:
            if buffer is None:
                buffer = bytearray(min(COPY_CHUNK, length))
            view = memoryview(buffer)[: min(size, len(buffer))]
            copied = os.preadv(src, [view], src_offset)
            if copied:
                write_all(dst, view[:copied].tobytes(), dst_offset)
        if copied == 0:
            raise SourceChangedError(src_path)
        src_offset += copied
        dst_offset += copied
        length -= copied
        if advance is not None:
            advance(copied)


class Cancelled(Exception):
    """Verification stopped because the write was abandoned."""


def ranges_equal(
    src: int,
    src_offset: int,
    dst: int,
    dst_offset: int,
    length: int,
    cancel: threading.Event | None = None,
    src_path: str | None = None,
) -> bool:
    """Bitwise comparison of two byte ranges of two files, a window at a time.

    Read with pread rather than mapped: on these machines it is as fast (the comparison is
    a memcmp of two page-cache copies), holds two windows at most, and a source that
    someone truncates during the run gives a short read (an error) instead of SIGBUS.
    """
    while length:
        if cancel is not None and cancel.is_set():
            raise Cancelled
        size = min(length, COMPARE_CHUNK)
        if pread_exact(src, src_offset, size, src_path) != pread_exact(dst, dst_offset, size):
            return False
        src_offset += size
        dst_offset += size
        length -= size
    return True


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
    fd = source.fileno()
    if fd is not None:
        copy_range(fd, offset, length, dst, dst_offset, advance, source.label)
        return
    while length:
        size = min(length, COPY_CHUNK)
        write_all(dst, source.read_at(offset, size), dst_offset)
        offset, dst_offset, length = offset + size, dst_offset + size, length - size
        if advance is not None:
            advance(size)


def source_equal(
    source: ByteSource,
    offset: int,
    dst: int,
    dst_offset: int,
    length: int,
    cancel: threading.Event | None = None,
) -> bool:
    """Bitwise comparison of a source range with a range of a written file."""
    while length:
        if cancel is not None and cancel.is_set():
            raise Cancelled
        size = min(length, COMPARE_CHUNK)
        if source.read_at(offset, size) != pread_exact(dst, dst_offset, size):
            return False
        offset, dst_offset, length = offset + size, dst_offset + size, length - size
    return True
