"""Streamed GGUF parts: a llama.cpp split set (reshard with a --max-shard smaller than the
model) or one GGUF file (a set merged), written the way the safetensors writer writes its
shards (write.safetensors.ShardWriter): tensor bytes kernel to kernel (`copy_file_range`),
workers verifying and flushing behind the copy, every part read back by ckptfix's own GGUF
reader and compared with the plan (its tensors as soon as the header is written, the header
bytes once the tensors are), every tensor compared with its source.

Where the output's filesystem has reflinks, a part's data start is moved (by a
`ckptfix.padding` string key, the only place a GGUF header has room) so that its tensors sit
at their source offsets modulo the block, and whole blocks are cloned (write.zerocopy).
Elsewhere the layout is exactly llama.cpp's `gguf-split`'s: the first part carries all the
metadata, every part `split.no`, `split.count` and `split.tensors.count`, tensors packed
in order, each padded to the alignment.
"""

from __future__ import annotations

import hashlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from ckptfix.core.errors import CorruptFileError, VerificationError
from ckptfix.core.sizes import padded
from ckptfix.formats.gguf_encode import (
    PartHeader,
    alignment_key,
    padding_key,
    padding_overhead,
    split_keys,
    tensor_info,
)
from ckptfix.formats.gguf_file import read_gguf
from ckptfix.formats.gguf_header import DEFAULT_ALIGNMENT, MAX_HEADER
from ckptfix.io.source import LocalFile
from ckptfix.plan.align import Run, residue, shareable
from ckptfix.plan.gguf_parts import StartRange, choose_start
from ckptfix.plan.select import OutTensor
from ckptfix.plan.shards import PlannedShard, ShardPlan
from ckptfix.write.copy import write_all
from ckptfix.write.results import WrittenFile
from ckptfix.write.safetensors import ShardJob, ShardWriter, range_digest
from ckptfix.write.zerocopy import NO_CLONING

_BUG = "this is a bug; please report it"


@dataclass
class GgufJob(ShardJob):
    """A ShardJob with what GGUF parts carry: the source's version and alignment, and its
    metadata records (copied as stored into the first part)."""

    version: int = 3
    alignment: int = DEFAULT_ALIGNMENT
    carried: tuple[bytes, ...] = ()
    layouts: dict[int, PartLayout] = field(default_factory=dict)  # laid out by needed_bytes


@dataclass(frozen=True)
class PartLayout:
    """A part as it will be written: its header (the pieces, their size and digest), each
    tensor's file offset, the file's size, and the tensor bytes that line up with their
    source's blocks (cloned where it can)."""

    header: tuple[bytes, ...]
    header_size: int
    header_digest: bytes
    placed: tuple[tuple[str, int], ...]
    end: int
    shareable: int = 0
    padding: int = 0  # bytes the padding key moved the data start by


def part_keys(job: GgufJob, number: int, count: int, tensors: int) -> list[bytes]:
    """A part's key/values: the carried metadata in the first; the split keys in every part
    of a set (and the alignment, where it is not ggml's default, which the others assume)."""
    keys = list(job.carried) if number == 0 else []
    if count > 1:
        keys += split_keys(number, count, tensors)
        if number > 0 and job.alignment != DEFAULT_ALIGNMENT:
            keys.append(alignment_key(job.alignment))
    return keys


def _runs(names: Sequence[str], relative: Sequence[int], job: GgufJob) -> list[Run]:
    """The runs of a part that come as they are from sources that clone, at offsets
    relative to its data start."""
    cloning = job.cloning or NO_CLONING
    runs = []
    for name, at in zip(names, relative, strict=True):
        tensor = job.tensors[name]
        if not tensor.streamed:
            continue
        for piece in tensor.source.pieces:
            if piece.source in cloning.sources:
                runs += [Run(piece.source, b, at + t, n) for b, t, n in piece.runs()]
    return runs


def layout_part(plan: ShardPlan, job: GgufJob, number: int) -> PartLayout:
    """Where everything of part `number` (from 0) goes (see the module docstring)."""
    shard, alignment = plan.shards[number], job.alignment
    keys = part_keys(job, number, len(plan.shards), len(job.tensors))
    infos, relative, at = [], [], 0
    for name in shard.tensors:
        tensor = job.tensors[name]
        infos.append(tensor_info(name, tensor.shape, tensor.dtype, at))
        relative.append(at)
        at += padded(tensor.nbytes, alignment)
    header = PartHeader(job.version, keys, infos)
    start = padded(header.size, alignment)
    runs = _runs(shard.tensors, relative, job)
    chosen = _data_start(plan, job, header.size, start + at, runs)
    if chosen != start:
        header = PartHeader(job.version, [*keys, padding_key(chosen - header.size)], infos)
    block = (job.cloning or NO_CLONING).block
    lined = sum(shareable(r, block) for r in runs if block and residue(r, block) == chosen % block)
    placed = tuple((name, chosen + rel) for name, rel in zip(shard.tensors, relative, strict=True))
    pieces = tuple(header.pieces())
    digest = hashlib.blake2b(digest_size=32)
    for piece in pieces:
        digest.update(piece)
    return PartLayout(
        pieces, header.size, digest.digest(), placed, chosen + at, lined, chosen - start
    )


def _data_start(plan: ShardPlan, job: GgufJob, header: int, size: int, runs: list[Run]) -> int:
    """The part's data start: right after its header, or later where that lets its tensors
    be cloned and the part stays within --max-shard (unless it is over it already)."""
    start = padded(header, job.alignment)
    block = (job.cloning or NO_CLONING).block
    if not block or not runs:
        return start
    low = padded(header + padding_overhead(), job.alignment)
    room = low - start + block - 1
    if size <= plan.max_shard:
        room = min(room, plan.max_shard - size)
    room = min(room, MAX_HEADER - header)
    return choose_start(StartRange(start, low, room, job.alignment), runs, block)


def check_part(path: str, display: str, planned: Sequence[object]) -> None:
    """The part, at its final size with its header written, must pass every rule of the
    GGUF reader and list exactly the planned tensors (names, dtypes, shapes, byte ranges).
    Run while its tensors are copied: the header is not written again, which `same_header`
    proves once they are."""
    with LocalFile(path, display) as written:
        try:
            read = read_gguf(written)
        except CorruptFileError as exc:
            raise VerificationError(
                display, f"written file does not validate: {exc.detail()}", _BUG
            ) from exc
    if [(t.name, t.dtype, t.shape, t.byte_range) for t in read.tensors] != list(planned):
        raise VerificationError(display, "written header differs from the plan", _BUG)


def same_header(reader: int, display: str, layout: PartLayout) -> None:
    """The finished part still holds exactly the planned header bytes (by their digest, read
    back in chunks)."""
    if range_digest(reader, (0, layout.header_size)) != layout.header_digest:
        raise VerificationError(display, "written header differs from the plan", _BUG)


class PartWriter(ShardWriter):
    """ShardWriter's copying, flushing and verification, for GGUF parts."""

    def __init__(self, plan: ShardPlan, job: ShardJob, workers: ThreadPoolExecutor) -> None:
        super().__init__(plan, job, workers)
        self.numbers = {shard.file: number for number, shard in enumerate(plan.shards)}

    def shard(self, shard: PlannedShard, metadata: Mapping[str, str]) -> WrittenFile:
        job = self.job
        assert isinstance(job, GgufJob)
        number = self.numbers[shard.file]
        layout = job.layouts.pop(number, None) or layout_part(self.plan, job, number)
        job.tally.add("padding", layout.padding)
        path, display = self.open(shard.file, b"", layout.end)
        at = 0
        for piece in layout.header:
            write_all(self.fd, piece, at)
            at += len(piece)
        if job.verify:  # the header is read back while the tensors are copied
            os.ftruncate(self.fd, layout.end)
            planned = [_planned(job.tensors[name], offset) for name, offset in layout.placed]
            self.submit(check_part, path, display, planned)
        self.copy_tensors(layout.placed, display)
        os.ftruncate(self.fd, layout.end)
        if job.verify:  # the verifier needs the digest, not the bytes
            self.submit(same_header, self.reader, display, replace(layout, header=()))
        self.close_file()
        return WrittenFile(shard.file, layout.end)


def gguf_stream(
    plan: ShardPlan, job: GgufJob, number: int, of: Callable[[OutTensor], Iterable[bytes]]
) -> tuple[int, Callable[[], Iterator[bytes]]]:
    """Part `number` as one stream of bytes in file order, for an object store's upload:
    (its size, a function that yields them). Laid out as without reflinks (`job.cloning`
    None: the data right after the header), every gap the zeros a local part holds there;
    `of(tensor)` yields a tensor's bytes in bounded chunks."""
    layout = layout_part(plan, job, number)

    def chunks() -> Iterator[bytes]:
        yield from layout.header
        at = layout.header_size
        for name, offset in layout.placed:
            yield bytes(offset - at)  # padding to the alignment: less than one unit
            yield from of(job.tensors[name])
            at = offset + job.tensors[name].nbytes
        yield bytes(layout.end - at)

    return layout.end, chunks


def _planned(tensor: OutTensor, offset: int) -> tuple[object, ...]:
    return (tensor.name, tensor.dtype, tensor.shape, (offset, offset + tensor.nbytes))


def needed_bytes(plan: ShardPlan, job: GgufJob) -> int:
    """The disk space the parts take: their sizes, less what cloning shares. The layouts
    are kept for the writer (`job.layouts`, each taken once): laying out a first part
    encodes and digests all of its metadata."""
    job.layouts = {number: layout_part(plan, job, number) for number in range(len(plan.shards))}
    return sum(layout.end - layout.shareable for layout in job.layouts.values())
