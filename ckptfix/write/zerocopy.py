"""Zero-copy shards on filesystems with reflinks: which sources clone into the output's
filesystem, where each shard's data starts so that its bytes line up with their source's
blocks (plan.align), how a cloned range is verified (write.extents), and the tally of what
was shared and how each byte was verified.

Where nothing clones (ext4, tmpfs, another filesystem, a remote source), every shard is laid
out and written exactly as without this module.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace

from ckptfix.core.dtypes import DTYPES
from ckptfix.formats.safetensors import MAX_HEADER_SIZE
from ckptfix.io.gather import Sources
from ckptfix.io.source import ByteSource, descriptor
from ckptfix.plan.align import (
    Alignment,
    Run,
    aligned_split,
    choose_data_start,
    residue,
    shareable,
)
from ckptfix.plan.select import OutTensor
from ckptfix.plan.shards import PlannedShard, ShardPlan
from ckptfix.platform import system
from ckptfix.write.copy import Target, copy_to, source_equal
from ckptfix.write.extents import same_blocks
from ckptfix.write.results import ByteAccount


@dataclass(frozen=True)
class Cloning:
    """The output filesystem's clone block and the labels of the sources that clone into
    it; `block` None: nothing clones, nothing is padded."""

    block: int | None = None
    sources: frozenset[str] = frozenset()


NO_CLONING = Cloning()


def find_cloning(labels: Iterable[str], sources: Sources, folder: str) -> Cloning:
    """Try each local source once per filesystem (`Platform.clone_block`) against
    `folder`, where the output files will be created."""
    by_device: dict[int, int | None] = {}
    found: dict[str, int] = {}
    for label in labels:
        with descriptor(sources(label)) as fd:
            if fd is None:
                continue  # a remote source: copied
            device = os.fstat(fd).st_dev
            if device not in by_device:
                by_device[device] = system().clone_block(fd, folder)
        block = by_device[device]
        if block is not None:
            found[label] = block
    if not found:
        return NO_CLONING
    # Blocks are powers of two: the largest is a multiple of every other.
    return Cloning(max(found.values()), frozenset(found))


def streamed_labels(tensors: Iterable[OutTensor]) -> list[str]:
    """The sources whose bytes are copied as they are (the ones that could be cloned)."""
    labels = (label for tensor in tensors if tensor.streamed for label in tensor.source.sources)
    return list(dict.fromkeys(labels))


def shard_runs(
    shard: PlannedShard, tensors: Mapping[str, OutTensor], cloning: Cloning
) -> Iterator[Run]:
    """The byte runs of a shard that come as they are from a source that clones."""
    at = 0
    for name in shard.tensors:
        tensor = tensors[name]
        if tensor.streamed:
            for piece in tensor.source.pieces:
                if piece.source in cloning.sources:
                    for begin, offset, length in piece.runs():
                        yield Run(piece.source, begin, at + offset, length)
        at += tensor.nbytes


def lines_up(tensor: OutTensor, offset: int, cloning: Cloning) -> bool:
    """Whether every byte run of `tensor`, written at file offset `offset`, comes from a
    source that clones and lands at its source offset modulo the block: then all its whole
    blocks are cloned, and only partial ones copied."""
    if cloning.block is None or not tensor.streamed:
        return False
    return all(
        piece.source in cloning.sources and (begin - offset - at) % cloning.block == 0
        for piece in tensor.source.pieces
        for begin, at, _ in piece.runs()
    )


def data_start(
    shard: PlannedShard,
    tensors: Mapping[str, OutTensor],
    header_size: int,
    cloning: Cloning,
    max_shard: int,
) -> int:
    """Where the shard's data starts: right after its header (`header_size`, the 8-byte
    length included), or up to one block later so that the most bytes can be cloned. The
    padding never takes the shard past `max_shard` (a shard of one oversized tensor is past it
    already) nor its header past the format's limit."""
    if cloning.block is None:
        return header_size
    room = cloning.block - 1
    if shard.nbytes <= max_shard:
        room = min(room, max_shard - shard.nbytes)
    room = min(room, MAX_HEADER_SIZE + 8 - header_size)
    runs = shard_runs(shard, tensors, cloning)
    alignment = Alignment(_elements(shard, tensors, cloning))
    return choose_data_start(header_size, runs, cloning.block, room, alignment)


def _elements(
    shard: PlannedShard, tensors: Mapping[str, OutTensor], cloning: Cloning
) -> Iterator[tuple[int, int, int | None]]:
    """(offset in the data, element size in bytes, residue or None: see plan.align.Alignment)
    of each tensor of the shard."""
    at = 0
    for name in shard.tensors:
        tensor = tensors[name]
        pieces = tensor.source.pieces
        whole = tensor.streamed and len(pieces) == 1 and pieces[0].count == 1
        lands = None
        if whole and cloning.block and pieces[0].source in cloning.sources:
            lands = (pieces[0].offset - at) % cloning.block
        yield at, DTYPES[tensor.dtype].bits // 8, lands
        at += tensor.nbytes


def shareable_bytes(
    plan: ShardPlan,
    tensors: Mapping[str, OutTensor],
    headers: Sequence[int],
    cloning: Cloning,
) -> int:
    """How many tensor bytes the write can share rather than copy: what the free-space check
    need not count."""
    if cloning.block is None:
        return 0
    total = 0
    for shard, header in zip(plan.shards, headers, strict=True):
        start = data_start(shard, tensors, header, cloning, plan.max_shard)
        wanted = start % cloning.block
        total += sum(
            shareable(run, cloning.block)
            for run in shard_runs(shard, tensors, cloning)
            if residue(run, cloning.block) == wanted
        )
    return total


@dataclass
class Tally:
    """What a write shared and how it verified each byte; added to from several threads."""

    cloned: int = 0
    padding: int = 0
    extents: int = 0
    compared: int = 0
    digest: int = 0
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)

    def add(self, what: str, count: int) -> None:
        with self.lock:
            setattr(self, what, getattr(self, what) + count)

    def add_cloned(self, count: int) -> None:
        self.add("cloned", count)

    def account(self, cloning: Cloning | None, total: int) -> ByteAccount:
        """The tally as a result, for a write of `total` tensor bytes."""
        return ByteAccount(
            (cloning or NO_CLONING).block,
            self.cloned,
            total - self.cloned,
            self.padding,
            verified_by={
                "extents": self.extents,
                "compared": self.compared,
                "digest": self.digest,
            },
        )


class HeldRuns:
    """Runs from cloning sources, held back while each next one continues the last in both
    its source and the shard, then copied as one (write.copy.copy_to: whole blocks cloned):
    so the blocks that straddle two tensors are shared too, not only those inside one."""

    def __init__(self, target: Target) -> None:
        self.target = target
        self.source: ByteSource | None = None
        self.run: Run | None = None

    def add(self, source: ByteSource, run: Run) -> None:
        held = self.run
        if (
            held is not None
            and run.source == held.source
            and run.offset == held.offset + held.length
            and run.at == held.at + held.length
        ):
            self.run = replace(held, length=held.length + run.length)
            return
        self.write()
        self.source, self.run = source, run

    def write(self) -> None:
        """Copy what is held (call before anything else is written or read back)."""
        if self.source is not None and self.run is not None:
            run = self.run
            copy_to(self.source, run.offset, run.length, self.target, run.at)
        self.source, self.run = None, None


@dataclass(frozen=True)
class RunCheck:
    """Verifies runs written into one output file: the whole blocks of a cloned run by
    their physical extents where both files share them, every other byte by comparison."""

    dst: int
    cloning: Cloning
    tally: Tally
    cancel: threading.Event | None = None

    def equal(self, source: ByteSource, run: Run) -> bool:
        """Whether the output bytes at `run.at` (an offset in the file) equal the source's."""
        parts = [(run.offset, run.at, run.length)]
        with descriptor(source) as fd:
            head, body = run.length, 0
            if fd is not None and self.cloning.block and run.source in self.cloning.sources:
                head, body = aligned_split(run.offset, run.at, run.length, self.cloning.block)
            if body and fd is not None:
                middle = (run.offset + head, run.at + head)
                if same_blocks(fd, middle[0], self.dst, middle[1], body):
                    self.tally.add("extents", body)
                    rest = run.length - head - body
                    parts = [(run.offset, run.at, head), (middle[0] + body, middle[1] + body, rest)]
        for offset, at, length in parts:
            if length and not source_equal(source, offset, self.dst, at, length, self.cancel):
                return False
            self.tally.add("compared", length)
        return True
