"""Streaming safetensors writer: tensor bytes go from source file to output file in the
kernel (copy_file_range), never through a model-sized buffer; every file is verified by
reading it back and comparing each tensor's bytes with its source.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from ckptfix.core.dtypes import DTYPES
from ckptfix.core.errors import (
    CkptfixError,
    CorruptFileError,
    PlanError,
    SourceChangedError,
    VerificationError,
    WriteError,
)
from ckptfix.core.sizes import format_size
from ckptfix.core.tensor import TensorInfo
from ckptfix.formats.safetensors import (
    MAX_HEADER_SIZE,
    HeaderEntry,
    encode_header,
    read_header,
)
from ckptfix.io.gather import tensor_chunks
from ckptfix.io.source import ByteSource, LocalFile, pread_exact
from ckptfix.plan.shards import PlannedShard, ShardPlan
from ckptfix.write.cast import cast_bytes

COPY_CHUNK = 64 * 2**20
COMPARE_CHUNK = 4 * 2**20
FLUSH_EVERY = 256 * 2**20
# Called with (bytes copied so far, bytes to copy in all) as the copy advances.
Progress = Callable[[int, int], None]


@dataclass(frozen=True)
class WrittenFile:
    path: str
    bytes: int

    def to_dict(self) -> dict[str, object]:
        return {"path": self.path, "bytes": self.bytes}


@dataclass(frozen=True)
class WriteResult:
    """What a write command produced: the final paths and sizes, and what it replaced."""

    path: str
    files: tuple[WrittenFile, ...]
    verified: bool
    # What the write deleted: the old OUT's top-level entries (--force), or the old files of
    # the folder that were not carried over (--in-place).
    replaced: tuple[str, ...] = ()

    @property
    def bytes(self) -> int:
        return sum(item.bytes for item in self.files)

    def to_dict(self) -> dict[str, object]:
        return {
            "path": self.path,
            "files": [item.to_dict() for item in self.files],
            "bytes": self.bytes,
            "verified": self.verified,
            "replaced": list(self.replaced),
        }


@dataclass(frozen=True)
class OutTensor:
    """A tensor to write: its output name and dtype, and the source tensor it comes from."""

    name: str
    source: TensorInfo
    dtype: str

    @property
    def shape(self) -> tuple[int, ...]:
        return self.source.shape

    @property
    def nbytes(self) -> int:
        return self.source.numel * DTYPES[self.dtype].bits // 8

    @property
    def streamed(self) -> bool:
        """Copied as a byte range; otherwise gathered (strided view) or cast, in memory."""
        return self.source.contiguous and self.dtype == self.source.dtype

    @classmethod
    def same(cls, source: TensorInfo) -> OutTensor:
        return cls(source.name, source, source.dtype)


def produce(source: ByteSource, tensor: OutTensor) -> Iterator[bytes]:
    """The output bytes of a tensor that is not streamed, in bounded chunks: gathered
    (strided views), then cast if asked."""
    for chunk in tensor_chunks(source, tensor.source):
        if tensor.dtype != tensor.source.dtype:
            chunk = cast_bytes(chunk, tensor.source.dtype, tensor.dtype)
        yield chunk


class _Sources:
    """Source files, opened once each."""

    def __init__(self) -> None:
        self._files: dict[str, LocalFile] = {}
        self._lock = threading.Lock()

    def source(self, path: str) -> LocalFile:
        with self._lock:
            if path not in self._files:
                self._files[path] = LocalFile(path)
            return self._files[path]

    def fd(self, path: str) -> int:
        return self.source(path).fd()

    def close(self) -> None:
        for source in self._files.values():
            source.close()
        self._files.clear()


def _write_all(fd: int, data: bytes, offset: int) -> None:
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
                _write_all(dst, view[:copied].tobytes(), dst_offset)
        if copied == 0:
            raise SourceChangedError(src_path)
        src_offset += copied
        dst_offset += copied
        length -= copied
        if advance is not None:
            advance(copied)


class _Cancelled(Exception):
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
            raise _Cancelled
        size = min(length, COMPARE_CHUNK)
        if pread_exact(src, src_offset, size, src_path) != pread_exact(dst, dst_offset, size):
            return False
        src_offset += size
        dst_offset += size
        length -= size
    return True


def shard_header(
    shard: PlannedShard, tensors: Mapping[str, OutTensor], metadata: Mapping[str, str]
) -> tuple[bytes, list[HeaderEntry]]:
    entries, offset = [], 0
    for name in shard.tensors:
        tensor = tensors[name]
        entries.append(
            HeaderEntry(name, tensor.dtype, tensor.shape, offset, offset + tensor.nbytes)
        )
        offset += tensor.nbytes
    return encode_header(entries, metadata), entries


def _create(path: str) -> int:
    # 0o666 and the process umask: the permissions any ordinary tool would give the file.
    return os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o666)


def _verify_header(
    path: str, display: str, entries: Sequence[HeaderEntry], metadata: Mapping[str, str]
) -> None:
    """The finished file must pass every validation rule and match the plan exactly."""
    try:
        header = read_header(path, display)
    except CorruptFileError as exc:
        raise VerificationError(
            display,
            f"written file does not validate: {exc.detail()}",
            "this is a bug; please report it",
        ) from exc
    got = [(t.name, t.dtype, t.shape, t.byte_range) for t in header.tensors]
    start = header.data_start
    want = [(e.name, e.dtype, tuple(e.shape), (start + e.begin, start + e.end)) for e in entries]
    if got != want or (header.metadata or {}) != dict(metadata):
        raise VerificationError(
            display, "written header differs from the plan", "this is a bug; please report it"
        )


def _verify_tensors(
    dst: int,
    display: str,
    placed: Sequence[tuple[str, int]],
    tensors: Mapping[str, OutTensor],
    sources: _Sources,
    digests: Mapping[str, bytes],
    cancel: threading.Event,
) -> None:
    """Each tensor written at `(name, offset)` must equal its source: streamed ones compared
    bitwise with the source range, produced ones by the digest taken when they were made."""
    for name, offset in placed:
        tensor = tensors[name]
        source = tensor.source
        if tensor.streamed:
            same = ranges_equal(
                sources.fd(source.file),
                source.byte_range[0],
                dst,
                offset,
                source.nbytes,
                cancel,
                source.file,
            )
        else:
            same = _range_digest(dst, (offset, offset + tensor.nbytes)) == digests[name]
        if not same:
            raise VerificationError(
                display,
                f"tensor {name!r} reads back different from its source {source.file}",
                "check the disk and the source, then run again",
            )


def _write_produced(
    fd: int, offset: int, chunks: Iterable[bytes], advance: Callable[[int], None]
) -> bytes:
    """Write produced chunks one after another; return the digest of all of them."""
    hasher = hashlib.blake2b(digest_size=32)
    for chunk in chunks:
        _write_all(fd, chunk, offset)
        hasher.update(chunk)
        offset += len(chunk)
        advance(len(chunk))
    return hasher.digest()


def _range_digest(fd: int, byte_range: tuple[int, int]) -> bytes:
    hasher = hashlib.blake2b(digest_size=32)
    begin, end = byte_range
    while begin < end:
        chunk = os.pread(fd, min(COPY_CHUNK, end - begin), begin)
        if not chunk:
            break
        hasher.update(chunk)
        begin += len(chunk)
    return hasher.digest()


def _source_state(paths: Iterable[str]) -> dict[str, tuple[int, int, int]]:
    states = {}
    for path in paths:
        stat = os.stat(path)
        states[path] = (stat.st_ino, stat.st_size, stat.st_mtime_ns)
    return states


def checked_headers(
    plan: ShardPlan,
    tensors: Mapping[str, OutTensor],
    metadata: Sequence[Mapping[str, str]],
    out: str,
) -> list[int]:
    """The header size of every planned shard, refusing before anything is written a shard
    whose header would break the format's 100,000,000-byte limit (many tensor names, large
    metadata, or "format" added to a header already at the limit)."""
    sizes = []
    for shard, shard_metadata in zip(plan.shards, metadata, strict=True):
        size = len(shard_header(shard, tensors, shard_metadata)[0]) - 8
        if size > MAX_HEADER_SIZE:
            raise PlanError(
                os.path.join(out, shard.file),
                f"its header would take {size} bytes, over the {MAX_HEADER_SIZE}-byte limit "
                f"of the format ({len(shard.tensors)} tensors)",
                "choose a smaller --max-shard, so that each shard lists fewer tensors",
                rule="header-too-large",
            )
        sizes.append(size + 8)
    return sizes


def check_free_space(folder: str, needed: int, out: str) -> None:
    """Refuse up front a read-only or too-full file system, before anything is created."""
    stats = os.statvfs(folder)
    if stats.f_flag & os.ST_RDONLY:
        raise WriteError(
            out, f"cannot write: {os.strerror(errno.EROFS)}", "check the folder's permissions"
        )
    available = stats.f_bavail * stats.f_frsize
    margin = max(64 * 2**20, needed // 100)
    if needed + margin > available:
        raise WriteError(
            out,
            f"not enough free space: the output needs {format_size(needed)} "
            f"(+{format_size(margin)} margin) but {format_size(available)} is free",
            "free some space or choose another -o folder",
        )


def write_index(path: str, plan: ShardPlan, index_metadata: Mapping[str, Any]) -> int:
    document = {
        "metadata": {**index_metadata, "total_size": plan.total_size},
        "weight_map": plan.weight_map,
    }
    data = (json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()
    fd = _create(path)
    try:
        _write_all(fd, data, 0)
        os.fsync(fd)
    finally:
        os.close(fd)
    return len(data)


def write_shards(
    plan: ShardPlan,
    tensors: Mapping[str, OutTensor],
    metadata: Sequence[Mapping[str, str]],
    index_metadata: Mapping[str, Any],
    staging: str,
    out: str,
    *,
    verify: bool = True,
    progress: Progress | None = None,
) -> list[WrittenFile]:
    """Write every planned shard (and the index) into `staging`; verify each file.

    The main thread only copies (kernel to kernel, into the page cache). Two worker threads
    flush what has been copied so far every FLUSH_EVERY bytes, then verify and fsync each
    finished shard side by side, so the disk writes back while copying goes on.
    """
    sources = _Sources()
    before = _source_state({tensor.source.file for tensor in tensors.values()})
    digests: dict[str, bytes] = {}  # of tensors produced in memory, for verification
    written: list[WrittenFile] = []
    jobs: list[Future[None]] = []
    open_fds: list[int] = []
    cancel = threading.Event()
    done = 0

    def advance(count: int) -> None:
        nonlocal done
        done += count
        if progress is not None:
            progress(done, plan.total_size)

    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckptfix-finish") as workers:

        def check_later(reader: int, display: str, placed: list[tuple[str, int]]) -> Future[None]:
            return workers.submit(
                _verify_tensors, reader, display, placed, tensors, sources, digests, cancel
            )

        try:
            for shard, shard_metadata in zip(plan.shards, metadata, strict=True):
                path = os.path.join(staging, shard.file)
                header, entries = shard_header(shard, tensors, shard_metadata)
                fd = _create(path)
                open_fds.append(fd)
                reader = os.open(path, os.O_RDONLY)  # for verification (mmap needs read access)
                open_fds.append(reader)
                display = os.path.join(out, shard.file)
                placed: list[tuple[str, int]] = []  # copied, not yet verified
                unflushed = 0
                _write_all(fd, header, 0)
                offset = len(header)
                for name in shard.tensors:
                    tensor = tensors[name]
                    source = tensor.source
                    if tensor.streamed:
                        copy_range(
                            sources.fd(source.file),
                            source.byte_range[0],
                            source.nbytes,
                            fd,
                            offset,
                            advance,
                            source.file,
                        )
                    else:  # gathered or cast in bounded chunks
                        digests[name] = _write_produced(
                            fd, offset, produce(sources.source(source.file), tensor), advance
                        )
                    placed.append((name, offset))
                    offset += tensor.nbytes
                    unflushed += tensor.nbytes
                    if unflushed >= FLUSH_EVERY:
                        # Start writeback early and verify what is copied so far, while the
                        # main thread goes on copying.
                        jobs.append(workers.submit(os.fdatasync, fd))
                        if verify:
                            jobs.append(check_later(reader, display, placed))
                        placed, unflushed = [], 0
                os.ftruncate(fd, offset)  # a trailing hole in the source leaves it short
                if verify:
                    jobs.append(check_later(reader, display, placed))
                    jobs.append(
                        workers.submit(_verify_header, path, display, entries, shard_metadata)
                    )
                jobs.append(workers.submit(os.fsync, fd))
                written.append(WrittenFile(shard.file, offset))
                for job in [job for job in jobs if job.done()]:
                    job.result()  # surface a verification failure early
            if plan.index_file is not None:
                size = write_index(os.path.join(staging, plan.index_file), plan, index_metadata)
                written.append(WrittenFile(plan.index_file, size))
            for job in jobs:
                job.result()
        except BaseException:
            cancel.set()  # stop running verifications; the staging folder is discarded
            raise
        finally:
            workers.shutdown(wait=True)
            sources.close()
            for fd in open_fds:
                os.close(fd)
            for job in jobs:
                if job.done() and not job.cancelled():
                    job.exception()  # retrieved: a _Cancelled there is expected
    if _source_state(before) != before:
        raise WriteError(
            out, "a source file changed while it was being read", "run again on a stable copy"
        )
    return written


def wrap_os_error(exc: OSError, out: str) -> CkptfixError:
    """Turn an OSError from writing into a one-line error for the user."""
    if exc.errno == errno.ENOSPC:
        return WriteError(
            out,
            "no space left on device; nothing was written",
            "free some space or choose another -o folder",
        )
    if exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
        return WriteError(out, f"cannot write: {exc.strerror}", "check the folder's permissions")
    where = exc.filename or out
    return WriteError(str(where), f"write failed: {exc.strerror}", "check the disk and run again")
