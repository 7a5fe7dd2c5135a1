"""Streaming safetensors writer: tensor bytes go from source to output in the kernel
(copy_file_range) where they are contiguous, and through bounded buffers where they are
gathered or cast; never through a model-sized buffer. Where the output's filesystem has
reflinks, each shard's header is padded so that its data lines up with the source's blocks,
and whole blocks are cloned instead of copied (write.zerocopy). Every file is verified by
reading it back: its header against the plan, each tensor against its source.
"""

from __future__ import annotations

import hashlib
import os
import struct
import threading
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial
from itertools import accumulate, chain
from operator import attrgetter
from typing import Any, TypeVar

from ckptfix.core.dtypes import DTYPES
from ckptfix.core.errors import CorruptFileError, PlanError, VerificationError, WriteError
from ckptfix.core.tensor import Piece
from ckptfix.formats.safetensors import (
    MAX_HEADER_SIZE,
    METADATA_KEY,
    Fields,
    encode_fields,
    header_size,
    read_header,
)
from ckptfix.io.gather import CHUNK, Sources, Window, tensor_chunks, windows_into
from ckptfix.layouts.slices import cut
from ckptfix.plan.align import Run
from ckptfix.plan.select import OutTensor, out_sizes
from ckptfix.plan.shards import PlannedShard, ShardPlan
from ckptfix.platform import system
from ckptfix.write.cast import cast_bytes
from ckptfix.write.copy import (
    COMPARE_CHUNK,
    Cancelled,
    Target,
    compare_buffers,
    copy_from,
    write_all,
    written_equal,
)
from ckptfix.write.filejobs import FileJobs
from ckptfix.write.output import open_output, write_index
from ckptfix.write.results import Progress, WrittenFile
from ckptfix.write.zerocopy import (
    NO_CLONING,
    Cloning,
    HeldRuns,
    RunCheck,
    Tally,
    data_start,
    find_cloning,
    lines_up,
    streamed_labels,
)

FLUSH_EVERY = 256 * 2**20
# Small batches of verification: the last one, which only starts once the copying ends, is
# short, and the two workers share it with the one before.
VERIFY_EVERY = 32 * 2**20
_DTYPE, _SHAPE = attrgetter("dtype"), attrgetter("source.shape")  # OutTensor.shape
DECODED = 4 * 2**20  # F32 bytes a chunk of a block-quantized tensor decodes to, at most


def produce(sources: Sources, tensor: OutTensor) -> Iterator[bytes]:
    """The output bytes of a tensor that is not streamed, in bounded chunks: gathered
    (strided views), then cast (or dequantized) if asked. A block-quantized source is read
    in smaller chunks, so that what it decodes to (DECODED bytes of F32, and the decoder's
    temporaries, several times that) stays small."""
    stored = DTYPES[tensor.source.dtype]
    chunk = CHUNK
    if stored.quantized:  # each block of block_bytes decodes to `block` F32 values
        chunk = max(DECODED * stored.block_bytes // (4 * stored.block), stored.block_bytes)
    for data in tensor_chunks(sources, tensor.source, chunk):
        if tensor.dtype != tensor.source.dtype:
            data = cast_bytes(data, tensor.source.dtype, tensor.dtype)
        yield data


def shard_header(
    shard: PlannedShard, tensors: Mapping[str, OutTensor], metadata: Mapping[str, str]
) -> tuple[bytes, list[Fields]]:
    """The shard's encoded header, and its entries (offsets relative to the data)."""
    entries: list[Fields] = []
    offset = 0
    add = entries.append
    for name in shard.tensors:
        tensor = tensors[name]
        size = tensor.nbytes
        add((name, tensor.dtype, tensor.shape, offset, offset + size))
        offset += size
    return encode_fields(entries, metadata), entries


def pad_header(header: bytes, start: int) -> bytes:
    """The encoded header (8-byte length + JSON) with spaces after the JSON, which the format
    allows, so that the data starts at byte `start`."""
    if start <= len(header):
        return header
    body = header[8:] + b" " * (start - len(header))
    return struct.pack("<Q", len(body)) + body


def checked_headers(
    plan: ShardPlan,
    tensors: Mapping[str, OutTensor],
    metadata: Sequence[Mapping[str, str]],
    out: str,
) -> list[int]:
    """The header size of every planned shard, refusing before anything is written a shard
    whose header would break the format's 100,000,000-byte limit (many tensor names, large
    metadata, or "format" added to a header already at the limit), or that would hold a
    tensor under the key the format keeps for its metadata (a GGUF or torch name)."""
    sizes = []
    each = zip(plan.shards, _by_shard(plan, tensors), metadata, strict=True)
    for shard, outs, shard_metadata in each:
        if METADATA_KEY in shard.tensors:
            raise PlanError(
                os.path.join(out, shard.file),
                f"a tensor named {METADATA_KEY!r} cannot be written: safetensors keeps that "
                "key for the header's string metadata",
                f"leave it out (`ckptfix convert --exclude {METADATA_KEY}`), or write torch "
                "files (`--to torch`)",
                rule="metadata-as-tensor",
            )
        offsets = list(accumulate(out_sizes(outs), initial=0))
        dtypes, shapes = list(map(_DTYPE, outs)), list(map(_SHAPE, outs))
        size = header_size(shard.tensors, dtypes, shapes, offsets, shard_metadata) - 8
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


def _by_shard(plan: ShardPlan, tensors: Mapping[str, OutTensor]) -> Iterator[list[OutTensor]]:
    """The tensors of each shard: runs of `tensors` (in its order) when the shards list them
    in that order, as a plan does, without a look-up per name; else looked up by name."""
    if list(chain.from_iterable(shard.tensors for shard in plan.shards)) != list(tensors):
        for shard in plan.shards:
            yield list(map(tensors.__getitem__, shard.tensors))
        return
    values, start = list(tensors.values()), 0
    for shard in plan.shards:
        yield values[start : start + len(shard.tensors)]
        start += len(shard.tensors)


def verify_header(
    path: str, display: str, entries: Sequence[Fields], metadata: Mapping[str, str]
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
    start = header.data_start
    same = len(header.tensors) == len(entries) and all(
        (got.name, got.dtype, got.shape, got.byte_range)
        == (name, dtype, tuple(shape), (start + begin, start + end))
        for got, (name, dtype, shape, begin, end) in zip(header.tensors, entries, strict=True)
    )
    if not same or (header.metadata or {}) != dict(metadata):
        raise VerificationError(
            display, "written header differs from the plan", "this is a bug; please report it"
        )


def range_digest(fd: int, byte_range: tuple[int, int]) -> bytes:
    hasher = hashlib.blake2b(digest_size=32)
    begin, end = byte_range
    while begin < end:
        chunk = system().pread(fd, min(COMPARE_CHUNK, end - begin), begin)
        if not chunk:
            break
        hasher.update(chunk)
        begin += len(chunk)
    return hasher.digest()


@dataclass
class ShardJob:
    """What write_shards needs besides the plan."""

    tensors: Mapping[str, OutTensor]
    metadata: Sequence[Mapping[str, str]]  # one per shard
    index_metadata: Mapping[str, Any]
    sources: Sources
    staging: str
    out: str
    verify: bool = True
    progress: Progress | None = None
    digests: dict[str, bytes] = field(default_factory=dict)  # of tensors produced in memory
    cancel: threading.Event = field(default_factory=threading.Event)
    # which sources clone into the output (None: write_shards finds out in the staging folder)
    cloning: Cloning | None = None
    tally: Tally = field(default_factory=Tally)  # cloned bytes, and how each was verified


class FileWriter:
    """What the safetensors and torch writers share: the plan and job, the worker jobs of
    each output file (`write_with_workers` runs them) and the bytes written so far."""

    def __init__(self, plan: ShardPlan, job: ShardJob, workers: ThreadPoolExecutor) -> None:
        self.plan, self.job = plan, job
        self.files = FileJobs(workers)
        self.done = 0

    def advance(self, count: int) -> None:
        self.done += count
        if self.job.progress is not None:
            self.job.progress(self.done, self.plan.total_size)


class ShardWriter(FileWriter):
    """Copies on the calling thread; two workers verify, and a thread flushes and fsyncs,
    behind it."""

    def __init__(self, plan: ShardPlan, job: ShardJob, workers: ThreadPoolExecutor) -> None:
        super().__init__(plan, job, workers)
        self.fd = self.reader = -1  # the file last opened: its writer's and verifier's
        self.window: Window | None = None  # where runs are gathered (made on first use)

    def verify_later(self, reader: int, display: str, placed: list[Part]) -> None:
        if self.job.verify:
            self.files.submit(reader, _verify_tensors, reader, display, placed, self.job)

    def header(
        self, shard: PlannedShard, metadata: Mapping[str, str]
    ) -> tuple[bytes, list[Fields]]:
        """The shard's header, padded where that lets its data be cloned, and its entries."""
        header, entries = shard_header(shard, self.job.tensors, metadata)
        cloning = self.job.cloning or Cloning()
        start = data_start(shard, self.job.tensors, len(header), cloning, self.plan.max_shard)
        self.job.tally.add("padding", start - len(header))
        return pad_header(header, start), entries

    def shard(self, shard: PlannedShard, metadata: Mapping[str, str]) -> WrittenFile:
        header, entries = self.header(shard, metadata)
        placed, offset = [], len(header)
        for name in shard.tensors:
            placed.append((name, offset))
            offset += self.job.tensors[name].nbytes
        path, display = self.open(shard.file, header, offset)
        self.copy_tensors(placed, display)
        os.ftruncate(self.fd, offset)
        if self.job.verify:
            self.submit(verify_header, path, display, entries, metadata)
        self.close_file()
        return WrittenFile(shard.file, offset)

    def open(self, file: str, header: bytes, size: int) -> tuple[str, str]:
        """Create a file of the staging folder holding `header`: (path, path shown). Its
        descriptors become `fd` (the writer's) and `reader` (the verifier's)."""
        path = os.path.join(self.job.staging, file)
        self.reader, self.fd = open_output(path)
        self.files.open(self.reader, self.fd)
        if self.job.cloning and self.job.cloning.block:
            # Sized up front: a write past the end would make XFS reserve blocks after it
            # (speculative preallocation) that the clones then leave allocated.
            os.ftruncate(self.fd, size)
        write_all(self.fd, header, 0)
        return path, os.path.join(self.job.out, file)

    def submit(self, function: Callable[..., object], *args: object) -> None:
        """Run `function` behind the copy, among the jobs of the file last opened."""
        self.files.submit(self.reader, function, *args)

    def copy_tensors(self, placed: Sequence[tuple[str, int]], display: str) -> None:
        """Copy each tensor to its file offset in the file last opened, verifying what was
        copied every VERIFY_EVERY bytes and flushing it every FLUSH_EVERY."""
        fd, reader = self.fd, self.reader
        held = HeldRuns(self.target(fd, self.job.cloning))
        done: list[Part] = []
        unverified = unflushed = 0
        for name, offset in placed:
            tensor = self.job.tensors[name]
            # Cloned bytes leave nothing to write back: they do not count (cutting the held
            # run would copy the block it is cut in).
            cloned = lines_up(tensor, offset, self.job.cloning or NO_CLONING)
            for part in _parts(name, offset, tensor, cloned):
                self.tensor(held, part, tensor)
                done.append(part)
                unverified += 0 if cloned else part.end - part.begin
                if unverified >= VERIFY_EVERY:  # start verification, and writeback, early
                    held.write()
                    unflushed += unverified
                    if unflushed >= FLUSH_EVERY:
                        self.files.flush(reader, system().sync_data, fd)
                        unflushed = 0
                    self.verify_later(reader, display, done)
                    done, unverified = [], 0
        held.write()
        self.verify_later(reader, display, done)

    def close_file(self) -> None:
        """fsync the file last opened (behind the copy); it is closed once its jobs are
        done (a failure seen so far is raised early)."""
        self.files.flush(self.reader, system().sync, self.fd)
        self.files.ended(self.reader)

    def target(self, fd: int, cloning: Cloning | None) -> Target:
        """Where a shard's cloned runs go: whole blocks cloned, the rest copied."""
        block = cloning.block if cloning is not None else None
        return Target(fd, self.advance, block, self.job.tally.add_cloned)

    def tensor(self, held: HeldRuns, part: Part, tensor: OutTensor) -> None:
        """Copy a part of a tensor (a streamed one's), or all of it."""
        fd, cloning, offset = held.target.fd, self.job.cloning or Cloning(), part.offset
        if tensor.streamed:  # each run of each piece, kernel to kernel where it can
            for piece in part.pieces(tensor):
                source = self.job.sources(piece.source)
                for begin, at, length in piece.runs():
                    if piece.source in cloning.sources:  # cloned, with the runs it continues
                        held.add(source, Run(piece.source, begin, offset + at, length))
                    else:
                        held.write()
                        copy_from(source, begin, length, fd, offset + at, self.advance)
            return
        held.write()
        if tensor.gathered_runs:  # read straight into a window, written at once
            if self.window is None:
                self.window = Window(COMPARE_CHUNK)
            windows = windows_into(self.job.sources, tensor.source, self.window)
            _write_produced(fd, offset, windows, self.advance, False)
            return
        chunks = produce(self.job.sources, tensor)  # strided or cast, in bounded chunks
        digest = _write_produced(fd, offset, chunks, self.advance, True)
        if digest is not None:
            self.job.digests[tensor.name] = digest


@dataclass(frozen=True)
class Part:
    """Tensor bytes [begin, end) of the tensor `name` written at file offset `offset`: what
    is copied, then verified, in one go."""

    name: str
    offset: int
    begin: int
    end: int

    def pieces(self, tensor: OutTensor) -> Sequence[Piece]:
        """The pieces that hold the part's bytes, placed in the tensor."""
        if (self.begin, self.end) == (0, tensor.nbytes):
            return tensor.source.pieces
        return cut(tensor.source.pieces, self.begin, self.end, self.begin)


def _parts(name: str, offset: int, tensor: OutTensor, cloned: bool) -> list[Part]:
    """A tensor copied and verified part by part: VERIFY_EVERY bytes at a time if it is
    streamed and copied (so a large last tensor is verified while it is copied, not all
    after the copy), else whole (gathered, cast, or cloned)."""
    size = tensor.nbytes
    if not tensor.streamed or cloned or size <= VERIFY_EVERY:
        return [Part(name, offset, 0, size)]
    cuts = range(0, size, VERIFY_EVERY)
    return [Part(name, offset, begin, min(begin + VERIFY_EVERY, size)) for begin in cuts]


def _write_produced(
    fd: int,
    offset: int,
    chunks: Iterable[bytes | memoryview],
    advance: Callable[[int], None],
    digest: bool,
) -> bytes | None:
    """Write produced chunks one after another; return the digest of all of them when asked."""
    hasher = hashlib.blake2b(digest_size=32) if digest else None
    for chunk in chunks:
        write_all(fd, chunk, offset)
        if hasher is not None:
            hasher.update(chunk)
        offset += len(chunk)
        advance(len(chunk))
    return hasher.digest() if hasher is not None else None


def _equal_gathered(dst: int, offset: int, tensor: OutTensor, job: ShardJob) -> bool:
    """Whether the output at `offset` holds the tensor's runs, gathered again from their
    sources (the bytes compared, window by window, in this thread's buffers)."""
    expected = compare_buffers()[0]
    for window in windows_into(job.sources, tensor.source, expected):
        if job.cancel.is_set():
            raise Cancelled
        if not written_equal(dst, offset, expected.buffer, len(window)):
            return False
        offset += len(window)
    job.tally.add("compared", tensor.nbytes)
    return True


def _verify_tensors(dst: int, display: str, placed: Sequence[Part], job: ShardJob) -> None:
    """Each part written (a whole tensor, or a range of a streamed one) must equal its
    source: streamed ones compared bitwise with the source range (or, for whole blocks
    cloned from it, by their physical extents: see write.zerocopy.RunCheck), runs gathered
    in memory by gathering them again, cast or strided ones by the digest taken when they
    were made."""
    check = RunCheck(dst, job.cloning or Cloning(), job.tally, job.cancel)
    for part in placed:
        name, offset = part.name, part.offset
        tensor = job.tensors[name]
        source = tensor.source
        if tensor.streamed:
            same = all(
                check.equal(
                    job.sources(piece.source), Run(piece.source, begin, offset + at, length)
                )
                for piece in part.pieces(tensor)
                for begin, at, length in piece.runs()
            )
        elif tensor.gathered_runs:
            same = _equal_gathered(dst, offset, tensor, job)
        else:
            same = range_digest(dst, (offset, offset + tensor.nbytes)) == job.digests[name]
            job.tally.add("digest", tensor.nbytes)
        if not same:
            raise VerificationError(
                display,
                f"tensor {name!r} reads back different from its source {source.file}",
                "check the disk and the source, then run again",
            )


def write_shards(
    plan: ShardPlan, job: ShardJob, writer_type: type[ShardWriter] = ShardWriter
) -> list[WrittenFile]:
    """Write every planned shard (and the index) into the staging folder; verify each file.

    The main thread only copies (kernel to kernel, into the page cache). Two worker threads
    verify what has been copied every VERIFY_EVERY bytes, side by side, and a third flushes
    it every FLUSH_EVERY bytes and fsyncs each finished shard (FileJobs.flush), so the disk
    writes back while copying and verification go on.
    """
    if job.cloning is None:
        job.cloning = find_cloning(streamed_labels(job.tensors.values()), job.sources, job.staging)

    def shards(writer: ShardWriter) -> list[WrittenFile]:
        return [
            writer.shard(shard, metadata)
            for shard, metadata in zip(plan.shards, job.metadata, strict=True)
        ]

    return write_with_workers(plan, job, partial(writer_type, plan, job), shards)


_W = TypeVar("_W", bound=FileWriter)


def write_with_workers(
    plan: ShardPlan,
    job: ShardJob,
    writer: Callable[[ThreadPoolExecutor], _W],
    shards: Callable[[_W], list[WrittenFile]],
) -> list[WrittenFile]:
    """Run a writer (made on two worker threads that verify and sync each file it closes)
    over the plan's shards, then write the index: the staging folder's contents, or an
    error that cancels the verifications left (the staging folder is then discarded), or a
    WriteError when a source changed while it was read (the safetensors and torch writers)."""
    labels = {label for tensor in job.tensors.values() for label in tensor.source.sources}
    before = {label: job.sources(label).change_token() for label in labels}
    written: list[WrittenFile] = []
    with ThreadPoolExecutor(max_workers=2, thread_name_prefix="ckptfix-finish") as workers:
        made = writer(workers)
        try:
            written += shards(made)
            if plan.index_file is not None:
                path = os.path.join(job.staging, plan.index_file)
                display = os.path.join(job.out, plan.index_file)
                size = write_index(path, plan, job.index_metadata, display)
                written.append(WrittenFile(plan.index_file, size))
            made.files.finish()
        except BaseException:
            job.cancel.set()  # stop running verifications; the staging folder is discarded
            raise
        finally:
            workers.shutdown(wait=True)
            made.files.close()
    if {label: job.sources(label).change_token() for label in labels} != before:
        raise WriteError(
            job.out, "a source file changed while it was being read", "run again on a stable copy"
        )
    return written
