"""A rewrite's output in an object store (`-o s3://bucket/prefix`): the prefix claimed as a
local OUT is (`claim_store`), then the planned shards streamed through a StoreSink
(`write_to_store`).

The claim follows the local rules: a prefix holding objects is refused unless --force (or
--resume), and one holding objects that are not a checkpoint's files unless --replace-any
too; an object whose name could not be a file's (control characters, `..`, a NUL) is never
touched and stops the run. Multipart uploads a killed ckptfix run left under the prefix (its
marker is there) are aborted; others are listed and left alone. Objects of the earlier
checkpoint that the new one does not hold are deleted only after the new index is published.
"""

from __future__ import annotations

import os
import tempfile
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace

from ckptfix.core.errors import RemoteError, UsageError, WriteError
from ckptfix.core.signals import writing_to
from ckptfix.core.text import redact, shown
from ckptfix.io.gather import Sources
from ckptfix.io.source import ByteSource, is_local
from ckptfix.io.urls import climbs_out
from ckptfix.layouts.names import CHECKPOINT_FILE
from ckptfix.plan.select import OutTensor
from ckptfix.plan.shards import ShardPlan
from ckptfix.write.output import index_bytes
from ckptfix.write.results import UploadReport, WriteResult, WrittenFile
from ckptfix.write.safetensors import ShardJob, produce, shard_header
from ckptfix.write.sink import CHUNK, ShardHeader
from ckptfix.write.store_sink import StoreSink, StoreState, is_index
from ckptfix.write.stores import open_store, store_scheme
from ckptfix.write.stores.base import Dangling, ObjectStore, StoredObject, StoreOptions
from ckptfix.write.stores.location import output_url, overlap


@dataclass
class StoreClaim:
    """An output prefix for one run: the store, what it held, what was done about leftovers."""

    out: str  # the URL as it may be printed
    store: ObjectStore
    options: StoreOptions
    state: StoreState
    replace_any: bool = False
    aborted: tuple[str, ...] = ()
    left: tuple[str, ...] = ()
    others: tuple[Dangling, ...] = ()  # the uploads `left` names, as the claim found them
    real: str = field(default="")

    def release(self) -> None:
        """Nothing is locked: a store has no folder lock (two runs to one prefix is the
        user's to avoid; the second finds the first's marker and objects)."""

    def __enter__(self) -> StoreClaim:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.release()


def _bad_name(name: str) -> bool:
    """No name a checkpoint's file can have: `..`/`.` segments (in any encoding), control or
    invisible characters, a trailing `/`."""
    return climbs_out(name) or shown(name) != name or name.endswith("/")


def _check_planned(store: ObjectStore, names: Sequence[str]) -> None:
    """The output's own names (the files carried beside the weights), before anything is
    sent: one that `_check_names` would refuse in the next run is not written in this one."""
    bad = next((name for name in names if _bad_name(name)), None)
    if bad is not None:
        raise WriteError(
            store.display,
            f"a file carried beside the weights is named {shown(bad)!r}, which ckptfix does not "
            "write to a store (not a name a checkpoint's file can have): nothing was sent",
            "rename or remove that file in the input",
        )


def _check_names(store: ObjectStore, objects: Sequence[StoredObject]) -> None:
    for item in objects:
        if _bad_name(item.name):
            raise RemoteError(
                store.display,
                "store-object-name",
                f"holds an object named {shown(item.name)!r}, which ckptfix will not replace "
                "or delete (not a name a checkpoint's file can have)",
                "choose another prefix, or remove that object yourself",
            )


def check_prefix(
    store: ObjectStore, objects: Sequence[StoredObject], *, force: bool, replace_any: bool
) -> None:
    if not objects:
        return
    if not force:
        raise UsageError(
            store.display,
            f"output prefix is not empty ({len(objects)} object(s))",
            "pass --force to replace the checkpoint there, or --resume to keep what matches",
        )
    foreign = sorted(
        item.name for item in objects if not CHECKPOINT_FILE.fullmatch(item.name.rpartition("/")[2])
    )
    if foreign and not replace_any:
        some = ", ".join(shown(name) for name in foreign[:3])
        raise UsageError(
            store.display,
            f"output prefix holds objects that are not part of a checkpoint: {some}"
            + (f" and {len(foreign) - 3} more" if len(foreign) > 3 else ""),
            "pass --replace-any to replace them too, or choose another prefix",
        )


def _check_take_over(store: ObjectStore, ours: Sequence[Dangling], options: StoreOptions) -> None:
    """A ckptfix run's unfinished uploads are aborted only with --force or --resume: that
    run may still be writing."""
    if ours and not (options.force or options.resume):
        raise UsageError(
            store.display,
            f"another ckptfix run is writing here, or was killed while it did ({len(ours)} "
            f"unfinished upload(s), the first of {shown(ours[0].name)!r})",
            "wait for it to end; or pass --force (or --resume) to take over: its uploads "
            "are aborted",
        )


def claim_store(
    url: str, sources: Sequence[str], *, force: bool, replace_any: bool, write: bool,
    options: StoreOptions,
) -> StoreClaim:  # fmt: skip
    """Check that the prefix may be written (see the module docstring); for a write, abort
    a killed run's uploads. --resume counts as --force for the objects already there."""
    url = output_url(url)
    if options.hf_pr and store_scheme(url) != "hf":
        raise UsageError(
            "--hf-pr", f"opens a pull request on the Hub, not on {redact(url)}", "drop --hf-pr"
        )
    source = overlap(url, sources)
    if source is not None:
        raise UsageError(
            redact(url), f"output overlaps the input {redact(source)}", "choose another -o"
        )
    options = replace(options, force=force)
    store = open_store(url, options)
    objects = store.list()
    _check_names(store, objects)
    check_prefix(store, objects, force=force or options.resume, replace_any=replace_any)
    state = StoreState({item.name: item for item in objects})
    claim = StoreClaim(store.display, store, options, state, replace_any)
    if write:
        dangling = store.dangling()
        ours = [upload for upload in dangling if upload.ours]
        _check_take_over(store, ours, options)
        store.abort_dangling(ours)
        claim.aborted = tuple(upload.name for upload in ours)
        claim.others = tuple(upload for upload in dangling if not upload.ours)
        claim.left = tuple(upload.name for upload in claim.others)
    return claim


READ_AHEAD = 4  # ranged reads of a remote tensor in flight while its parts are sent
READ_PIECE = 8 * 2**20


@dataclass(frozen=True)
class TensorPart:
    """A planned tensor's output bytes (gathered, cast) as a sink's Part. A remote tensor
    stored whole in one range is read READ_AHEAD ranges at a time (S3 -> S3: the reads
    would otherwise wait for each other, one round trip each)."""

    sources: Sources
    tensor: OutTensor

    @property
    def nbytes(self) -> int:
        return self.tensor.nbytes

    def chunks(self, chunk: int = CHUNK) -> Iterator[bytes]:
        stored = self.tensor.source
        pieces = stored.pieces
        whole = len(pieces) == 1 and pieces[0].view is None and pieces[0].count == 1
        if whole and self.tensor.dtype == stored.dtype and stored.nbytes > READ_PIECE:
            source = self.sources(pieces[0].source)
            if not is_local(source):  # remote: every read is a round trip
                return _read_ahead(source, pieces[0].offset, stored.nbytes)
        return produce(self.sources, self.tensor)


def _read_ahead(source: ByteSource, offset: int, size: int) -> Iterator[bytes]:
    """[offset, offset + size) of `source` in order, READ_AHEAD reads in flight."""
    with ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="ckptfix-read") as pool:
        pending: deque[Future[bytes]] = deque()
        at = 0
        try:
            while at < size or pending:
                while at < size and len(pending) < READ_AHEAD:
                    count = min(READ_PIECE, size - at)
                    pending.append(pool.submit(source.read_at, offset + at, count))
                    at += count
                yield pending.popleft().result()
        finally:
            for future in pending:
                future.cancel()


def _stale(claim: StoreClaim, written: Sequence[str]) -> list[str]:
    """Objects of the earlier output the new one does not hold (deleted after the index):
    checkpoint files, and with --replace-any the others too. Only the prefix's top level
    counts, as a local OUT's own entries do: an object under a sub-prefix (`-o s3://bucket`
    over a bucket holding other prefixes) is never deleted, only replaced by a file of the
    new output of that name."""
    new = set(written)
    return sorted(
        name
        for name in claim.state.existing
        if name not in new
        and "/" not in name
        and name not in claim.state.removed_first
        and (claim.replace_any or CHECKPOINT_FILE.fullmatch(name.rpartition("/")[2]))
    )


def _extra_files(folder: str) -> Iterator[tuple[str, str]]:
    """(object name, path) of every file under `folder`, sorted."""
    for root, folders, files in os.walk(folder):
        folders.sort()
        for name in sorted(files):
            path = os.path.join(root, name)
            yield os.path.relpath(path, folder).replace(os.sep, "/"), path


def _file_chunks(path: str) -> Callable[[], Iterator[bytes]]:
    def chunks() -> Iterator[bytes]:
        with open(path, "rb") as handle:
            while data := handle.read(CHUNK):
                yield data

    return chunks


def write_shards_to(
    sink: StoreSink, plan: ShardPlan, job: ShardJob, to: str = "safetensors"
) -> list[WrittenFile]:
    """Stream every planned shard (`to`: safetensors, torch or gguf) into the sink, completed
    under its final name."""
    if to == "torch":
        return _write_torch_shards(sink, plan, job)
    if to == "gguf":
        return _write_gguf_parts(sink, plan, job)
    # with --resume, the shards whose names are already there first (without --force, one
    # that does not match stops the run before anything new is sent)
    written = []
    shards = zip(plan.shards, job.metadata, strict=True)
    there = sink.state.existing if sink.options.resume else {}
    for shard, metadata in sorted(shards, key=lambda item: item[0].file not in there):
        data, entries = shard_header(shard, job.tensors, metadata)
        header = ShardHeader(data, tuple(entries), metadata)
        parts = [TensorPart(job.sources, job.tensors[name]) for name in shard.tensors]
        written.append(sink.write_shard(shard.file, header, parts))
    return written


def _write_torch_shards(sink: StoreSink, plan: ShardPlan, job: ShardJob) -> list[WrittenFile]:
    """pytorch_model*.bin shards, each streamed in file order (write.torch_stream)."""
    from ckptfix.write.torch_stream import torch_stream

    def of(tensor: OutTensor) -> Iterator[bytes]:
        return TensorPart(job.sources, tensor).chunks()

    written = []
    for shard in plan.shards:
        size, chunks = torch_stream(shard, job.tensors, plan.shared, of)
        written.append(sink.write_stream(shard.file, size, chunks, counted=True))
    return written


def _write_gguf_parts(sink: StoreSink, plan: ShardPlan, job: ShardJob) -> list[WrittenFile]:
    """GGUF parts, each streamed in file order (write.gguf.gguf_stream)."""
    from ckptfix.write.gguf import GgufJob, gguf_stream

    assert isinstance(job, GgufJob)
    written = []
    for number, shard in enumerate(plan.shards):
        size, chunks = gguf_stream(plan, job, number, lambda t: TensorPart(job.sources, t).chunks())
        written.append(sink.write_stream(shard.file, size, chunks, counted=True))
    return written


def _send_files(sink: StoreSink, folder: str) -> list[WrittenFile]:
    """Every file under `folder`: small ones kept for publication (with the index, which
    comes last), larger ones streamed now."""
    written = []
    for name, path in _extra_files(folder):
        size = os.path.getsize(path)
        if size <= CHUNK:
            with open(path, "rb") as handle:
                written.append(sink.write_file(name, handle.read()))
        else:
            written.append(sink.write_stream(name, size, _file_chunks(path)))
    return written


ShardsTo = Callable[[StoreSink, ShardPlan, ShardJob], list[WrittenFile]]


def write_to_store(
    plan: ShardPlan,
    job: ShardJob,
    claim: StoreClaim,
    carry: Callable[[str], object],
    shards: ShardsTo = write_shards_to,
    also_delete: Sequence[str] = (),
) -> WriteResult:
    """Stream the planned shards (`shards`: here, e.g. write_shards_to with another `to`, or
    by others, checked), the carried files (`carry(folder)` puts them in a local scratch
    folder) and the index into the store; publish; delete what is stale (and
    `also_delete`)."""
    labels = {label for tensor in job.tensors.values() for label in tensor.source.sources}
    before = {label: job.sources(label).change_token() for label in labels}
    with writing_to(claim.out) as signals:
        sink = StoreSink(
            claim.store, claim.options, claim.state,
            single_file=plan.index_file is None, signals=signals,
        )  # fmt: skip
        sink.progress, sink.total = job.progress, plan.total_size
        try:
            extras = sink.scratch()  # the files beside the weights, by the local rules
            carry(extras)
            carried = [name for name, _ in _extra_files(extras)]
            _check_planned(claim.store, carried)
            planned = [shard.file for shard in plan.shards] + [plan.index_file or ""]
            sink.check_resume([*planned, *carried])
            written = shards(sink, plan, job) + _send_files(sink, extras)
            if plan.index_file is not None:
                data = index_bytes(plan, job.index_metadata)
                written.append(sink.write_file(plan.index_file, data))
            if {label: job.sources(label).change_token() for label in labels} != before:
                raise WriteError(
                    job.out,
                    "a source changed while it was being read",
                    "run again on a stable copy",
                )
            stale = _stale(claim, [item.path for item in written])
            sink.commit(sorted({*stale, *also_delete}))
        except BaseException:
            sink.discard()
            raise
    return _result(claim, written, sink)


def write_folder_to_store(claim: StoreClaim, fill: Callable[[str], str]) -> WriteResult:
    """An output that is built whole before it is sent (fix -o): `fill(scratch)` writes it
    into a local scratch folder and returns its path; every file is then streamed, the
    index published last, and what is stale deleted, as for the rewrites."""
    with tempfile.TemporaryDirectory(prefix="ckptfix-store-") as scratch:
        folder = fill(scratch)
        files = [name for name, _ in _extra_files(folder)]
        weights = [name for name in files if name.endswith((".safetensors", ".bin"))]
        single = len(weights) == 1 and not any(is_index(name) for name in files)
        with writing_to(claim.out) as signals:
            sink = StoreSink(
                claim.store, claim.options, claim.state, single_file=single, signals=signals
            )
            try:
                _check_planned(claim.store, files)
                sink.check_resume(files)
                written = _send_files(sink, folder)
                sink.commit(_stale(claim, [item.path for item in written]))
            except BaseException:
                sink.discard()
                raise
    return _result(claim, written, sink)


def _result(claim: StoreClaim, written: Sequence[WrittenFile], sink: StoreSink) -> WriteResult:
    stats, state = claim.store.stats(), claim.state
    url = claim.out.rstrip("/")
    report = UploadReport(
        stats.bytes_sent,
        stats.requests,
        state.bytes_kept,
        tuple(state.kept),
        tuple(f"{url}/{name}" for name in state.removed_first),
        claim.aborted,
        claim.left,
        claim.options.verify_readback,
    )
    files = tuple(WrittenFile(f"{url}/{item.path}", item.bytes) for item in written)
    removed = tuple(f"{url}/{name}" for name in [*state.removed_first, *state.removed])
    return WriteResult(url, files, True, removed, None, report)
