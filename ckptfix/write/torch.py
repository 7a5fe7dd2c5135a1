"""`convert --to torch`: pytorch_model*.bin shards in the zip format `torch.save` writes
(`formats.torch_zip_writer`, with `formats.pickle_writer` for data.pkl), streamed the way
the safetensors writer streams: no tensor is ever held in memory, whatever its size.

The archive's layout is computed before anything is written (all sizes are known), so each
storage is copied straight into place: kernel to kernel where it is contiguous, through
bounded chunks where it is gathered or cast. Two worker threads read each storage back as it
is done, computing its CRC-32 and, unless --no-verify, comparing it with its source; the
data descriptors, the serialization id and the central directory are written once every
CRC is known. Each finished file is read back by ckptfix's own reader and by `zipfile`, and
must match the plan: names, dtypes, shapes, shared storages, byte ranges and CRCs.

Aliases (names the selection would drop as exact aliases of a kept tensor) are written as
names on the kept tensor's storage, as torch.save writes tied weights: `torch.load` gives
tensors that share storage, as the source had, and the bytes are stored once.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import zipfile
import zlib
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from functools import partial

from ckptfix.core.errors import (
    CkptfixError,
    OpenFilesError,
    PlanError,
    VerificationError,
)
from ckptfix.formats import read_file
from ckptfix.formats.pickle_writer import TensorEntry, state_dict_pickle, torch_can_store
from ckptfix.formats.torch_zip_writer import (
    FIRST_STORAGE,
    ZipEntry,
    central_directory,
    place,
    serialization_id,
    small_records,
    torch_records,
)
from ckptfix.io.gather import tensor_chunks
from ckptfix.io.source import LocalFile, pread_exact
from ckptfix.plan.select import OutTensor
from ckptfix.plan.shards import PlannedShard, ShardPlan
from ckptfix.platform import system
from ckptfix.write.copy import COMPARE_CHUNK, Cancelled, copy_from, write_all
from ckptfix.write.filejobs import MAX_OPEN_FILES
from ckptfix.write.output import open_output
from ckptfix.write.results import WrittenFile
from ckptfix.write.safetensors import (
    FLUSH_EVERY,
    FileWriter,
    ShardJob,
    produce,
    write_with_workers,
)

_BUG = "this is a bug; please report it"
READ_BACK_BATCH = 1024  # storages per read-back job, when they are small


def check_torch_dtypes(tensors: Iterable[OutTensor], out: str) -> None:
    """Refuse, before anything is written, a tensor whose dtype torch does not have."""
    missing = [tensor for tensor in tensors if not torch_can_store(tensor.dtype)]
    if missing:
        dtypes = ", ".join(sorted({tensor.dtype for tensor in missing}))
        raise PlanError(
            out,
            f"torch has no dtype for {dtypes} ({len(missing)} tensor(s), e.g. "
            f"{missing[0].name!r}), so a .bin cannot hold them",
            "convert to safetensors instead, or --exclude those tensors",
        )


def shard_entries(
    shard: PlannedShard, tensors: Mapping[str, OutTensor], shared: Mapping[str, str]
) -> tuple[list[TensorEntry], dict[str, OutTensor]]:
    """The state dict of one shard (every name, aliases on their kept tensor's storage) and
    its storages by key: keys numbered in order of first use, as torch numbers them."""
    storages: dict[str, OutTensor] = {}
    keys: dict[str, str] = {}
    entries = []
    for name in shard.tensors:
        kept = tensors[shared.get(name, name)]
        key = keys.setdefault(kept.name, str(len(keys)))
        storages[key] = kept
        entries.append(TensorEntry(name, key, kept.dtype, kept.nbytes, kept.shape))
    return entries, storages


@dataclass
class _Archive:
    """One shard file being written."""

    file: str
    path: str
    display: str
    fd: int
    reader: int  # a second descriptor, for reading back
    entries: tuple[ZipEntry, ...]  # every record, the serialization id last
    tensors: list[TensorEntry]
    crcs: list[int] = field(default_factory=list)  # one per record but the id (0 until known)
    # The storages' CRCs: each batch's read-back job, with the records it reads
    batches: list[tuple[Future[list[int]], list[int]]] = field(default_factory=list)


class _Writer(FileWriter):
    """Copies on the calling thread; two workers read back and verify, and a thread
    flushes, behind it."""

    def __init__(self, plan: ShardPlan, job: ShardJob, workers: ThreadPoolExecutor) -> None:
        super().__init__(plan, job, workers)
        self.unflushed = 0
        self.waiting: list[tuple[int, _ReadBack]] = []  # storages not yet handed over

    def open(self, shard: PlannedShard) -> _Archive:
        """Write a shard's records, all but the descriptors of its storages (CRCs still to
        come from the workers), the serialization id and the central directory."""
        entries, storages = shard_entries(shard, self.job.tensors, self.plan.shared)
        pickle = state_dict_pickle(entries)
        records = torch_records(len(pickle), [(k, t.nbytes) for k, t in storages.items()])
        path = os.path.join(self.job.staging, shard.file)
        reader, fd = open_output(path)
        self.files.open(reader, fd)
        display = os.path.join(self.job.out, shard.file)
        archive = _Archive(shard.file, path, display, fd, reader, place(records), entries)
        contents = small_records(pickle)
        for position, (name, _) in enumerate(records[:-1]):
            entry = archive.entries[position]
            if name in contents:
                archive.crcs.append(_write_record(fd, entry, contents[name]))
            else:
                archive.crcs.append(0)
                self.storage(archive, position, storages[name[len("data/") :]])
        self.hand_over(archive)
        return archive

    def storage(self, archive: _Archive, position: int, tensor: OutTensor) -> None:
        """Write one storage record but its descriptor."""
        entry = archive.entries[position]
        write_all(archive.fd, entry.local_header(), entry.header_offset)
        digest = self.tensor(archive.fd, entry.data_offset, tensor)
        check = _ReadBack(archive.reader, archive.display, entry, tensor, digest)
        self.waiting.append((position, check))
        self.unflushed += tensor.nbytes
        if self.unflushed >= FLUSH_EVERY:  # start writeback and reading back early
            self.files.flush(archive.reader, system().sync_data, archive.fd)
            self.unflushed = 0
            self.hand_over(archive)
        elif len(self.waiting) >= READ_BACK_BATCH:
            self.hand_over(archive)

    def hand_over(self, archive: _Archive) -> None:
        """The storages written since the last hand-over, to be read back by a worker."""
        if self.waiting:
            checks = [check for _, check in self.waiting]
            future = self.files.submit(archive.reader, _read_back, checks, archive.fd, self.job)
            archive.batches.append((future, [position for position, _ in self.waiting]))
            self.waiting = []

    def tensor(self, fd: int, offset: int, tensor: OutTensor) -> bytes | None:
        """Copy a tensor's bytes to `offset`; the digest of those that were produced."""
        if tensor.streamed:  # each run of each piece, kernel to kernel where it can
            for piece in tensor.source.pieces:
                source = self.job.sources(piece.source)
                for begin, at, length in piece.runs():
                    copy_from(source, begin, length, fd, offset + at, self.advance)
            return None
        hasher = hashlib.blake2b(digest_size=32)  # gathered or cast, in bounded chunks
        for chunk in produce(self.job.sources, tensor):
            write_all(fd, chunk, offset)
            hasher.update(chunk)
            offset += len(chunk)
            self.advance(len(chunk))
        return hasher.digest()

    def complete(self, archive: _Archive) -> WrittenFile:
        """The serialization id and the central directory, once every CRC is known; then
        fsync and verification on the workers."""
        crcs = archive.crcs
        for future, positions in archive.batches:
            for position, crc in zip(positions, future.result(), strict=True):
                crcs[position] = crc
        last = archive.entries[-1]
        crcs.append(_write_record(archive.fd, last, serialization_id(archive.entries[:-1], crcs)))
        end = last.end
        for piece in central_directory(archive.entries, crcs):
            write_all(archive.fd, piece, end)
            end += len(piece)
        self.files.flush(archive.reader, system().sync, archive.fd)
        if self.job.verify:
            self.files.submit(archive.reader, _verify_archive, archive)
        self.files.ended(archive.reader)  # closed once its jobs are done
        return WrittenFile(archive.file, end)


def _write_record(fd: int, entry: ZipEntry, data: bytes) -> int:
    """A record written whole, from memory; its CRC."""
    crc = zlib.crc32(data)
    write_all(fd, entry.local_header(), entry.header_offset)
    write_all(fd, data, entry.data_offset)
    write_all(fd, entry.descriptor(crc), entry.data_offset + entry.size)
    return crc


@dataclass(frozen=True, slots=True)
class _ReadBack:
    """A storage record read back from the file: its CRC-32, and (unless --no-verify) its
    bytes compared with the source's, or with the digest taken when they were produced."""

    reader: int
    display: str
    entry: ZipEntry
    tensor: OutTensor
    digest: bytes | None

    def expected(self, job: ShardJob) -> Iterator[bytes | int]:
        """The source's bytes in chunks, where they are compared; else chunk sizes."""
        if job.verify and self.digest is None:
            yield from tensor_chunks(job.sources, self.tensor.source, COMPARE_CHUNK)
            return
        for begin in range(0, self.entry.size, COMPARE_CHUNK):
            yield min(COMPARE_CHUNK, self.entry.size - begin)

    def run(self, job: ShardJob) -> int:
        crc, offset = 0, self.entry.data_offset
        hasher = hashlib.blake2b(digest_size=32)
        for want in self.expected(job):
            if job.cancel.is_set():
                raise Cancelled
            got = pread_exact(self.reader, offset, want if isinstance(want, int) else len(want))
            crc = zlib.crc32(got, crc)
            offset += len(got)
            if self.digest is not None:
                hasher.update(got)
            elif not isinstance(want, int) and got != want:
                self.mismatch()
        if offset != self.entry.data_offset + self.entry.size:
            self.mismatch()
        if job.verify and self.digest is not None and hasher.digest() != self.digest:
            self.mismatch()
        return crc

    def mismatch(self) -> None:
        raise VerificationError(
            self.display,
            f"tensor {self.tensor.name!r} reads back different from its source "
            f"{self.tensor.source.file}",
            "check the disk and the source, then run again",
        )


def _read_back(checks: Sequence[_ReadBack], fd: int, job: ShardJob) -> list[int]:
    """Read back a batch of storages; write each one's data descriptor; their CRCs."""
    crcs = []
    for check in checks:
        crc = check.run(job)
        entry = check.entry
        write_all(fd, entry.descriptor(crc), entry.data_offset + entry.size)
        crcs.append(crc)
    return crcs


def _verify_archive(archive: _Archive) -> None:
    """The finished file, read back by ckptfix's reader and by zipfile, must be the plan:
    every name with its dtype, shape, storage and byte range, every record with its CRC."""
    storages = archive.entries[FIRST_STORAGE:]  # data/0, data/1, ... in key order
    want = (
        (t.name, t.dtype, t.shape, t.storage_key, True, storages[int(t.storage_key)].data_range)
        for t in archive.tensors
    )
    planned = (
        (e.name, e.header_offset, e.size, crc)
        for e, crc in zip(archive.entries, archive.crcs, strict=True)
    )
    try:
        same = not archive.tensors or _same(_read_tensors(archive), want)
        with zipfile.ZipFile(archive.path) as opened:
            records = ((i.filename, i.header_offset, i.file_size, i.CRC) for i in opened.filelist)
            same = same and _same(records, planned)
    except OpenFilesError:
        raise  # the limit's fault, not the file's
    except (CkptfixError, zipfile.BadZipFile) as exc:
        detail = exc.detail() if isinstance(exc, CkptfixError) else str(exc)
        raise VerificationError(
            archive.display, f"written file does not read back: {detail}", _BUG
        ) from exc
    if not same:
        raise VerificationError(archive.display, "written file differs from the plan", _BUG)


def _same(got: Iterable[object], want: Iterable[object]) -> bool:
    missing = object()
    return all(a == b for a, b in itertools.zip_longest(got, want, fillvalue=missing))


def _read_tensors(archive: _Archive) -> Iterator[tuple[object, ...]]:
    """The tensors of a written file as ckptfix's own reader sees them (a file of no
    tensors is not a checkpoint to it, so an empty shard is only checked by zipfile)."""
    with LocalFile(archive.path, archive.display) as source:
        tensors = read_file(source).tensors
    return ((t.name, t.dtype, t.shape, t.storage, t.contiguous, t.byte_range) for t in tensors)


def _write_all(writer: _Writer, shards: Sequence[PlannedShard]) -> list[WrittenFile]:
    """Each shard opened (its storages copied), then completed once its CRCs are known:
    the reading back of a few shards overlaps the copying of the next, and no more than
    MAX_OPEN_FILES wait to be completed."""
    written: list[WrittenFile] = []
    opened: deque[_Archive] = deque()
    for shard in shards:
        opened.append(writer.open(shard))
        if len(opened) > MAX_OPEN_FILES:
            written.append(writer.complete(opened.popleft()))
    written += [writer.complete(archive) for archive in opened]
    return written


def write_torch_shards(plan: ShardPlan, job: ShardJob) -> list[WrittenFile]:
    """Write every planned shard (and the index) into the staging folder; verify each file.

    The index's weight_map lists every name, aliases included, in the shard that holds
    their storage (as transformers' save_pretrained writes it for .bin shards).
    """
    return write_with_workers(
        plan, job, partial(_Writer, plan, job), lambda writer: _write_all(writer, plan.shards)
    )
