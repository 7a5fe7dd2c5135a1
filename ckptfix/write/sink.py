"""Where the library's writers (`ckptfix.save`, `ckptfix.Writer`) put their files: a `Sink`.

This is the one seam between what those writers decide (a shard plan, each shard's header,
the bytes of each tensor as `Part`s) and where the bytes go. `LocalSink` is a staging folder
beside OUT (write.staging): each file is created there, written, read back and compared with
what was meant, fsynced, and the folder is swapped in as OUT by `commit()`; `discard()`
leaves OUT as it was. The sink for object stores (s3://; gs://, hf:// later) implements
the same methods (write.store_sink.StoreSink); nothing above this module changes.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Protocol

from ckptfix.core.errors import PlanError, VerificationError
from ckptfix.core.signals import Signals
from ckptfix.formats.safetensors import MAX_HEADER_SIZE
from ckptfix.formats.safetensors_encode import Fields, encode_fields
from ckptfix.io.source import ByteSource
from ckptfix.plan.shards import ShardPlan
from ckptfix.platform import system
from ckptfix.write.copy import Cancelled, copy_from, source_equal, write_all
from ckptfix.write.output import index_bytes, open_output, write_whole
from ckptfix.write.results import WrittenFile
from ckptfix.write.safetensors import verify_header
from ckptfix.write.staging import Claim, Staging

VERIFY_BATCH = 64 * 2**20  # bytes of tensors handed to a verifying worker at a time
CHUNK = 8 * 2**20  # bytes read back and compared at a time (a buffer per worker)
WRITE_CHUNK = 64 * 2**20  # bytes per write where they come straight from memory
SYNC_EVERY = 256 * 2**20  # written bytes after which writeback is started (as write.safetensors)


class Part(Protocol):
    """A tensor's bytes to write, in row-major order; `chunks()` may be called again (to
    verify what was written). Chunks are at most `chunk` bytes, or fewer where making them
    takes memory."""

    @property
    def nbytes(self) -> int: ...

    def chunks(self, chunk: int = CHUNK) -> Iterator[memoryview | bytes]: ...


@dataclass(frozen=True)
class FilePart:
    """A range of a local file (the Writer's spool): copied in the kernel, compared by reads."""

    source: ByteSource
    offset: int
    nbytes: int

    def chunks(self, chunk: int = CHUNK) -> Iterator[memoryview | bytes]:
        done = 0
        while done < self.nbytes:
            size = min(self.nbytes - done, chunk, CHUNK)
            yield self.source.read_at(self.offset + done, size)
            done += size


@dataclass(frozen=True)
class ShardHeader:
    """A safetensors shard's encoded header, with what it lists (checked after writing)."""

    data: bytes
    entries: tuple[Fields, ...]  # (name, dtype, shape, begin, end)
    metadata: Mapping[str, str]

    @property
    def nbytes(self) -> int:
        """The data section's size."""
        return self.entries[-1][4] if self.entries else 0


def shard_header(
    tensors: Sequence[tuple[str, str, tuple[int, ...], int]],
    metadata: Mapping[str, str],
    display: str,
) -> ShardHeader:
    """The header of a shard holding (name, dtype, shape, bytes) in that order; refused
    before anything is written when over the format's limit."""
    entries: list[Fields] = []
    offset = 0
    for name, dtype, shape, nbytes in tensors:
        entries.append((name, dtype, shape, offset, offset + nbytes))
        offset += nbytes
    data = encode_fields(entries, metadata)
    if len(data) - 8 > MAX_HEADER_SIZE:
        raise PlanError(
            display,
            f"its header would take {len(data) - 8} bytes, over the {MAX_HEADER_SIZE}-byte "
            f"limit of the format ({len(entries)} tensors)",
            "choose a smaller max_shard, so that each shard lists fewer tensors",
            rule="header-too-large",
        )
    return ShardHeader(data, tuple(entries), dict(metadata))


class Sink(Protocol):
    """Where a library write goes; nothing is visible at OUT before `commit()`."""

    @property
    def out(self) -> str: ...

    def write_shard(self, name: str, header: ShardHeader, parts: Sequence[Part]) -> WrittenFile:
        """Write one shard (header, then each part's bytes) and have it verified."""

    def write_file(self, name: str, data: bytes) -> WrittenFile:
        """A small file written whole (the index, config.json)."""

    def rename(self, old: str, new: str) -> None:
        """A written file takes its final name (the Writer learns the shard count last)."""

    def scratch(self) -> str:
        """A local folder for temporary files, removed with the output if it is discarded."""

    def commit(self) -> None:
        """Wait for every verification, then publish the output at OUT as one step."""

    def discard(self) -> None:
        """Publish nothing; remove what was written. Safe to call more than once."""


def write_plan(
    plan: ShardPlan,
    parts: Mapping[str, tuple[str, tuple[int, ...], Part]],
    metadata: Sequence[Mapping[str, str]],
    index_metadata: Mapping[str, Any],
    sink: Sink,
) -> list[WrittenFile]:
    """Write a planned set of shards (`parts`: name -> (dtype, shape, bytes)), then the
    index when the plan has one."""
    written = []
    for shard, shard_metadata in zip(plan.shards, metadata, strict=True):
        listed = [(name, *parts[name][:2], parts[name][2].nbytes) for name in shard.tensors]
        header = shard_header(listed, shard_metadata, os.path.join(sink.out, shard.file))
        shard_parts = [parts[name][2] for name in shard.tensors]
        written.append(sink.write_shard(shard.file, header, shard_parts))
    if plan.index_file is not None:
        written.append(sink.write_file(plan.index_file, index_bytes(plan, index_metadata)))
    return written


class _Verifier:
    """Two worker threads that read back what the calling thread wrote and compare it with
    what it was meant to be, and one that has the disk write it back (fdatasync, fsync); the
    first difference or failure is raised by `wait()`. The syncs have their own thread: one
    waits for the disk for as long as the data takes to reach it, and the checks queued
    behind it on a shared pool would then run only after the writing, not alongside it."""

    def __init__(self) -> None:
        self.workers = ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckptfix-verify")
        self.syncer = ThreadPoolExecutor(max_workers=1, thread_name_prefix="ckptfix-sync")
        self.jobs: list[Future[Any]] = []
        self.cancel = threading.Event()
        self.buffers = threading.local()

    def submit(self, function: Callable[..., Any], *args: Any, sync: bool = False) -> None:
        self.jobs.append((self.syncer if sync else self.workers).submit(function, *args))
        for finished in [job for job in self.jobs if job.done()]:
            finished.result()  # a difference found early stops the write early
            self.jobs.remove(finished)

    def wait(self) -> None:
        for job in self.jobs:
            job.result()
        self.jobs = []

    def stop(self) -> None:
        self.cancel.set()
        self.workers.shutdown(wait=True)
        self.syncer.shutdown(wait=True)
        for job in self.jobs:
            if job.done() and not job.cancelled():
                job.exception()  # retrieved: a Cancelled there is expected

    def same(self, reader: int, at: int, part: Part) -> bool:
        """Whether the file holds the part's bytes at `at` (a buffer reused per thread)."""
        return file_holds(reader, at, part, self.cancel, self.buffers)


def file_holds(
    fd: int,
    at: int,
    part: Part,
    cancel: threading.Event | None = None,
    buffers: threading.local | None = None,
) -> bool:
    """Whether the file `fd` holds the part's bytes at `at`, read back and compared."""
    if isinstance(part, FilePart):
        return source_equal(part.source, part.offset, fd, at, part.nbytes, cancel)
    for chunk in part.chunks():
        if cancel is not None and cancel.is_set():
            raise Cancelled
        buffer = _buffer(len(chunk), buffers)
        if system().read_into(fd, memoryview(buffer), at) != len(chunk) or not _equal(
            buffer, chunk
        ):
            return False
        at += len(chunk)
    return True


def _equal(buffer: bytearray, chunk: object) -> bool:
    return buffer == chunk  # memcmp: a bytearray compares any buffer's bytes at once


def _buffer(size: int, buffers: threading.local | None) -> bytearray:
    """A buffer of exactly `size` bytes (equality compares lengths too), the large ones
    kept in `buffers` for the next chunk of the same size."""
    held: bytearray | None = getattr(buffers, "held", None)
    if held is None or len(held) != size:
        held = bytearray(size)
        if buffers is not None and size >= 2**20:
            buffers.held = held
    return held


class LocalSink:
    """A staging folder beside OUT (see the module docstring). The caller's signal handlers
    stay the caller's: an exception, KeyboardInterrupt included, discards the output; a
    process killed meanwhile leaves a marked staging folder beside OUT, never OUT half
    written."""

    def __init__(self, claim: Claim) -> None:
        self.claim = claim
        self.staging = Staging(claim, Signals())
        self.verifier = _Verifier()
        self.closed = False

    @property
    def out(self) -> str:
        return self.claim.out

    def scratch(self) -> str:
        return self.staging.path

    def write_shard(self, name: str, header: ShardHeader, parts: Sequence[Part]) -> WrittenFile:
        """Write the shard on this thread while two workers read back and compare what is
        written; return once every part is verified (the caller may then free them). The
        shard's header is checked and the file fsynced behind, by `commit()`."""
        path = os.path.join(self.staging.path, name)
        display = os.path.join(self.out, name)
        reader, fd = open_output(path)  # room made among the sources' idle descriptors
        try:
            write_all(fd, header.data, 0)
            offset, placed, pending, unsynced = len(header.data), [], 0, 0
            for part in parts:
                _write_part(fd, offset, part)
                placed.append((offset, part))
                offset, pending = offset + part.nbytes, pending + part.nbytes
                if pending >= VERIFY_BATCH:
                    self.verifier.submit(self._verify, reader, display, placed)
                    placed, pending = [], 0
                    unsynced += VERIFY_BATCH
                if unsynced >= SYNC_EVERY:  # the disk writes back while copying goes on
                    self.verifier.submit(system().sync_data, fd, sync=True)
                    unsynced = 0
            self.verifier.submit(self._verify, reader, display, placed)
            self.verifier.wait()
        except BaseException:
            # The workers still reading `reader` stop first: a number closed under them
            # could be another file's by the time they read it. The write failed, so the
            # sink is discarded and needs no verifier any more.
            self.verifier.stop()
            os.close(fd)
            raise
        finally:
            os.close(reader)
        self.verifier.submit(verify_header, path, display, list(header.entries), header.metadata)
        self.verifier.submit(_sync_and_close, fd, sync=True)
        return WrittenFile(name, offset)

    def _verify(self, reader: int, display: str, placed: Sequence[tuple[int, Part]]) -> None:
        for at, part in placed:
            if not self.verifier.same(reader, at, part):
                raise VerificationError(
                    display,
                    f"the bytes written at offset {at} read back different from the tensor",
                    "check the disk, and that no other thread changes the tensors, then retry",
                )

    def write_file(self, name: str, data: bytes) -> WrittenFile:
        path = os.path.join(self.staging.path, name)
        write_whole(path, data)
        with open(path, "rb") as handle:
            if handle.read() != data:
                raise VerificationError(
                    os.path.join(self.out, name), "reads back different", "check the disk"
                )
        return WrittenFile(name, len(data))

    def rename(self, old: str, new: str) -> None:
        self.verifier.wait()  # the header checks behind read the files by their names
        os.rename(os.path.join(self.staging.path, old), os.path.join(self.staging.path, new))

    def commit(self) -> None:
        self.verifier.wait()
        self.verifier.stop()
        self.staging.commit()
        self.discard()  # releases the claim; the committed folder is OUT now

    def discard(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.verifier.stop()
        self.staging.remove()
        self.claim.release()


def _sync_and_close(fd: int) -> None:
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_part(fd: int, offset: int, part: Part) -> None:
    if isinstance(part, FilePart):
        copy_from(part.source, part.offset, part.nbytes, fd, offset, None)
        return
    for chunk in part.chunks(WRITE_CHUNK):
        write_all(fd, chunk, offset)
        offset += len(chunk)
