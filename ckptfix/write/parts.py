"""A plan's shards written in slices, by other processes than the one that publishes them
(`--part I/N`, then `--commit`; the tasks of `--executor ray`), and what each slice leaves
for the publisher: a record of the plan it followed (`plan_digest`) and of every shard it
wrote (size, and a checksum: SHA-256 of a local file, the store's own for an object).

A slice is written whole or not at all: a local slice goes into a marked scratch folder of
its own inside the destination folder, and its shards are renamed into the destination only
once every one is written and verified (a retried or repeated slice replaces them); the
record comes last. In an object store each shard is completed under its final name, and no
index is put: nothing is published until the publisher checks every record.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import os
import secrets
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, replace

from ckptfix.core.errors import UsageError, VerificationError
from ckptfix.core.signals import Signals, writing_to
from ckptfix.io.gather import Sources
from ckptfix.plan.select import OutTensor
from ckptfix.plan.shards import ShardPlan
from ckptfix.platform import system
from ckptfix.write.output import index_bytes
from ckptfix.write.part_records import PartRecord, ShardRecord
from ckptfix.write.results import Progress
from ckptfix.write.safetensors import ShardJob, shard_header, write_shards
from ckptfix.write.staging import PREFIX as STAGING_PREFIX
from ckptfix.write.staging import is_staging_folder, write_marker
from ckptfix.write.store_sink import StoreSink, StoreState
from ckptfix.write.stores.base import ObjectStore, StoredObject, StoreOptions
from ckptfix.write.tree import remove_tree

PARTS_PREFIX = ".ckptfix-parts-"  # beside a local OUT: the folder the parts write into
_MAX_NAME = 255  # bytes of a file name (ext4, XFS, APFS, NTFS's UTF-16 units are fewer)
_READ = 16 * 2**20
# What opening a shard that is gone, a link or not a regular file raises (platform.common)
NOT_THE_FILE = frozenset({errno.ENOENT, errno.ENOTDIR, errno.ELOOP, errno.EINVAL, errno.EBUSY})


def plan_digest(
    plan: ShardPlan,
    tensors: Mapping[str, OutTensor],
    metadata: Sequence[Mapping[str, str]],
    index_metadata: Mapping[str, object],
    sources: Sources,
) -> str:
    """The SHA-256 of what a plan writes: every shard's name and header (names, dtypes,
    shapes, offsets, metadata), where each tensor's bytes are read from, and the index. A
    source file counts by what it is (ByteSource.identity: its size and modification time,
    an object's version), never by its path: parts of two checkpoints found one after the
    other behind one path differ, and one file spelled two ways (relative, absolute, from
    another folder) does not."""
    hasher = hashlib.sha256()
    identities: dict[str, bytes] = {}
    for shard, shard_metadata in zip(plan.shards, metadata, strict=True):
        header, _ = shard_header(shard, tensors, shard_metadata)
        hasher.update(shard.file.encode() + b"\0" + hashlib.sha256(header).digest())
        for name in shard.tensors:
            for piece in tensors[name].source.pieces:
                if piece.source not in identities:
                    identities[piece.source] = repr(sources(piece.source).identity()).encode()
                hasher.update(identities[piece.source] + repr(replace(piece, source="")).encode())
    if plan.index_file is not None:
        hasher.update(plan.index_file.encode() + index_bytes(plan, index_metadata))
    return hasher.hexdigest()


def part_of(plan: ShardPlan, part: int, count: int) -> list[int]:
    """The indexes of the shards of slice `part` (1-based) of `count` (see part_of_sizes)."""
    return part_of_sizes([shard.nbytes for shard in plan.shards], part, count)


def part_of_sizes(sizes: Sequence[int], part: int, count: int) -> list[int]:
    """The indexes of slice `part` (1-based) of `count` of shards of these sizes:
    consecutive shards of about equal bytes, each in the slice its middle byte falls into."""
    total = max(1, sum(sizes))
    chosen, at = [], 0
    for index, size in enumerate(sizes):
        if min(count - 1, (at + size // 2) * count // total) == part - 1:
            chosen.append(index)
        at += size
    return chosen


def sliced(plan: ShardPlan, job: ShardJob, indexes: Sequence[int]) -> tuple[ShardPlan, ShardJob]:
    """The plan and job of a slice: its shards, their metadata, no index."""
    shards = tuple(plan.shards[i] for i in indexes)
    metadata = [job.metadata[i] for i in indexes]
    return replace(plan, shards=shards, index_file=None), replace(job, metadata=metadata)


def file_sha256(path: str, *, follow: bool = True, limit: int | None = None) -> tuple[str, int]:
    """The SHA-256 (hex) of the regular file at `path` and its size, read in bounded
    pieces (at most `limit` bytes, if given); with follow=False a link is refused (an
    OSError), never read through."""
    fd = system().open_regular(path, follow=follow)
    try:
        hasher, at, buffer = hashlib.sha256(), 0, memoryview(bytearray(_READ))
        while limit is None or at < limit:
            wanted = buffer if limit is None else buffer[: min(_READ, limit - at)]
            count = system().read_into(fd, wanted, at)
            if not count:
                break
            hasher.update(wanted[:count])
            at += count
        return hasher.hexdigest(), at
    finally:
        os.close(fd)


def write_slice_to_folder(plan: ShardPlan, job: ShardJob, folder: str) -> list[ShardRecord]:
    """Write the slice's shards into a scratch folder inside `folder`, verify them, then
    rename them into `folder` (replacing what an earlier run of the slice left). SIGINT and
    SIGTERM stop it as they stop a run's write: the scratch folder is removed first."""
    with writing_to(folder) as signals:
        scratch = ""
        try:
            with signals.held():
                scratch = tempfile.mkdtemp(prefix=STAGING_PREFIX, dir=folder)
                write_marker(scratch)
            job.staging, job.progress = scratch, _checking(signals, job.progress)
            written = write_shards(plan, job)
            records = []
            for item in written:
                path = os.path.join(scratch, item.path)
                records.append(ShardRecord(item.path, item.bytes, ("sha256", file_sha256(path)[0])))
            signals.raise_deferred()
            placed = []
            for record in records:
                target = os.path.join(folder, record.file)
                system().replace(os.path.join(scratch, record.file), target)
                placed.append(replace(record, mtime_ns=os.stat(target).st_mtime_ns))
            system().sync_folder(folder)
            return placed
        finally:
            with signals.held():
                if scratch:
                    remove_tree(scratch)


def _checking(signals: Signals, progress: Progress | None) -> Progress:
    """`progress` and a safe point to stop at (a signal kept while other code ran)."""

    def advance(done: int, total: int) -> None:
        signals.raise_deferred()
        if progress is not None:
            progress(done, total)

    return advance


def write_slice_to_store(
    plan: ShardPlan,
    job: ShardJob,
    store: ObjectStore,
    options: StoreOptions,
    existing: Sequence[StoredObject],
) -> list[ShardRecord]:
    """Stream the slice's shards into the store under their final names (no index)."""
    from ckptfix.write.store_output import write_shards_to

    state = StoreState({item.name: item for item in existing})
    sink = StoreSink(store, options, state)
    sink.progress, sink.total = job.progress, plan.total_size
    try:
        write_shards_to(sink, plan, job)
    except BaseException:
        sink.discard()
        raise
    kept = set(state.kept)
    return [
        ShardRecord(name, stored.size, stored.checksum or ("none", ""), kept=name in kept)
        for name, stored in sink.stored.items()
    ]


def write_record(folder: str, record: PartRecord) -> None:
    """The record beside the slice's shards, replacing an earlier one atomically: written
    first to a new file of a name nobody can guess (created, never opened through a link or
    over a file that is there)."""
    path = os.path.join(folder, record.name)
    scratch = f"{path}.{os.getpid()}-{secrets.token_hex(8)}.tmp"
    fd = system().create(scratch, 0o644)
    try:
        try:
            system().write_all(fd, record.to_json(), 0)
            system().sync(fd)
        finally:
            os.close(fd)
        system().replace(scratch, path)
    except BaseException:
        with contextlib.suppress(OSError):
            system().remove_file(system().native(scratch))
        raise
    system().sync_folder(folder)


def ensure_parts_folder(folder: str, shown: str) -> None:
    """The folder the parts of a local OUT write into (marked: ckptfix's, safe to delete)."""
    os.makedirs(os.path.dirname(folder) or ".", exist_ok=True)
    try:
        os.mkdir(folder)
    except FileExistsError:
        check_parts_folder(folder, shown)
        return
    write_marker(folder)


def check_parts_folder(folder: str, shown: str) -> None:
    """A parts folder that exists must be one ckptfix made (its marker): never write into,
    or delete, a folder of the user's that happens to have its name."""
    if os.path.lexists(folder) and not is_staging_folder(folder):
        raise UsageError(
            shown,
            "exists and is not a folder of parts ckptfix made (no marker in it)",
            "move it away, or write to another OUT",
        )


def parts_folder(real_out: str) -> str:
    """The parts folder beside OUT: `.ckptfix-parts-NAME`, within the 255 bytes a name may
    hold (a long NAME cut, and told from the others cut alike by a hash of it)."""
    parent, name = os.path.split(real_out.rstrip(os.sep))
    folder = PARTS_PREFIX + name
    if len(os.fsencode(folder)) > _MAX_NAME:
        tag = "-" + hashlib.sha256(os.fsencode(name)).hexdigest()[:16]
        kept = os.fsencode(folder)[: _MAX_NAME - len(tag)]
        folder = kept.decode(errors="ignore") + tag  # a character cut in two is dropped
    return os.path.join(parent, folder)


def check_covered(plan: ShardPlan, records: Sequence[PartRecord], out: str) -> list[ShardRecord]:
    """Every planned shard written by the part the split gives it, in plan order."""
    result: list[ShardRecord] = []
    for record in records:
        wanted = [plan.shards[i].file for i in part_of(plan, record.part, record.count)]
        got = [shard.file for shard in record.shards]
        if got != wanted:
            raise VerificationError(
                f"{out}/{record.name}",
                f"part {record.part} of {record.count} lists other shards than the plan gives it",
                f"run the same command with --part {record.part}/{record.count} again",
            )
        result += record.shards
    if [shard.file for shard in result] != [shard.file for shard in plan.shards]:
        raise VerificationError(  # the parts' slices must be the plan's shards, no more or less
            out, "the parts' records do not list the plan's shards",
            "run every part again, then --commit",
        )  # fmt: skip
    return result


@dataclass(frozen=True)
class CommitCheck:
    """How --commit checked the parts' shards before it published them: local shards read
    back whole and hashed (`bytes_read`), or a store's objects by the checksum the store
    reports (nothing read)."""

    parts: int
    shards: int
    bytes_read: int
    by: str  # "sha256 read back" or "store checksum"

    def to_dict(self) -> dict[str, object]:
        return asdict(self)


def _changed(shown: str) -> VerificationError:
    return VerificationError(
        shown,
        "is missing or changed since its part wrote it",
        "run its part again, then --commit",
    )


def parts_moved(shown: str) -> VerificationError:
    """A shard gone from the parts folder as --commit moved it: another commit took it."""
    return VerificationError(
        shown,
        "a shard left the folder of parts while --commit moved it (another --commit?)",
        "let the other --commit finish, or run --commit again",
    )


def check_local(folder: str, shards: Sequence[ShardRecord], out: str) -> None:
    """Every shard in `folder` as its task left it (size and modification time): for the
    staging folder of a Ray run, which only that run writes into, minutes after its tasks
    verified every shard against the source."""
    for shard in shards:
        path = os.path.join(folder, shard.file)
        try:
            status = os.stat(path, follow_symlinks=False)
        except FileNotFoundError:
            status = None
        if status is None or (status.st_size, status.st_mtime_ns) != (shard.size, shard.mtime_ns):
            raise _changed(os.path.join(out, shard.file))


def check_read_back(folder: str, shards: Sequence[ShardRecord], out: str) -> int:
    """Every shard in `folder` holding the bytes its part recorded: read back whole, in
    bounded pieces, and its SHA-256 compared with the record's (a size and a modification
    time prove nothing: a file can be changed and its time set back; and parts may have
    run days before, anywhere). A link is refused, not followed. The bytes read."""
    read = 0
    for shard in shards:
        path = os.path.join(folder, shard.file)
        try:
            if shard.checksum[0] != "sha256" or os.lstat(path).st_size != shard.size:
                raise _changed(os.path.join(out, shard.file))
            # one byte past the record's size: a file that grew meanwhile is not read whole
            digest, size = file_sha256(path, follow=False, limit=shard.size + 1)
        except OSError as exc:  # missing, a link, not a regular file: not what the part wrote
            if exc.errno not in NOT_THE_FILE:
                raise
            raise _changed(os.path.join(out, shard.file)) from None
        read += size
        if (size, digest) != (shard.size, shard.checksum[1]):
            raise _changed(os.path.join(out, shard.file))
    return read


def check_stored(store: ObjectStore, shards: Sequence[ShardRecord]) -> None:
    """Every shard in the store with the size and checksum its part's upload completed."""
    for shard in shards:
        stored = store.stat(shard.file)
        if stored is None or (stored.size, stored.checksum) != (shard.size, shard.checksum):
            raise _changed(f"{store.display.rstrip('/')}/{shard.file}")
