"""A rewrite's shards written in slices (write.parts): `--part I/N` writes slice I and its
record; `--commit` checks every slice's record against the plan made again here and
publishes; `--executor ray` runs the slices as tasks (an `ops.rewrite_options.ShardRunner`:
this module knows nothing of Ray) into the run's staging folder or the store, checks their
records and publishes as a local run does. Inside a task, `options.target` says where its
slice goes. The plan is the same everywhere because every process makes it from the same
SRC and options, and its digest (write.parts.plan_digest) says so."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, replace
from functools import partial
from typing import TYPE_CHECKING, Any

from ckptfix.core.errors import CkptfixError, SourceChangedError, UsageError
from ckptfix.ops.inspect import with_remote
from ckptfix.ops.rewrite_options import PartRequest, PartTarget, WriteOptions
from ckptfix.ops.source import RewriteSource
from ckptfix.plan.select import OutTensor
from ckptfix.plan.shards import ShardPlan
from ckptfix.write.output import check_free_space, wrap_os_error, write_index
from ckptfix.write.part_records import (
    MAX_RECORD,
    RECORD,
    PartRecord,
    ShardRecord,
    chosen_records,
    local_records,
    read_records,
    too_large,
)
from ckptfix.write.parts import (
    NOT_THE_FILE,
    CommitCheck,
    check_covered,
    check_local,
    check_parts_folder,
    check_read_back,
    check_stored,
    ensure_parts_folder,
    part_of,
    parts_folder,
    parts_moved,
    plan_digest,
    sliced,
    write_record,
    write_slice_to_folder,
    write_slice_to_store,
)
from ckptfix.write.results import WriteResult, WrittenFile
from ckptfix.write.safetensors import ShardJob, checked_headers
from ckptfix.write.staging import PREFIX as STAGING_PREFIX
from ckptfix.write.staging import Claim
from ckptfix.write.store_output import StoreClaim, check_prefix, write_to_store
from ckptfix.write.store_sink import StoreSink
from ckptfix.write.tree import remove_tree

if TYPE_CHECKING:
    from ckptfix.ops.rewrite import RewriteResult

Planned = tuple[Mapping[str, OutTensor], Sequence[Mapping[str, str]], Mapping[str, Any]]


@dataclass(frozen=True)
class _Run:
    """A split run's plan and where it goes: what every step below takes."""

    source: RewriteSource
    plan: ShardPlan
    job: ShardJob
    claim: Claim | StoreClaim
    options: WriteOptions
    request: PartRequest
    digest: str


def write_split(
    source: RewriteSource,
    plan: ShardPlan,
    claim: Claim | StoreClaim,
    options: WriteOptions,
    planned: Planned,
) -> RewriteResult | None:
    """The write step of a split run; None when the plan is one file with no index, which a
    Ray run writes here as a local run does (its completion would be its publication)."""
    request = options.split
    assert request is not None
    split = request.options
    if options.to != "safetensors":
        raise UsageError(
            "--to", "torch output is written by one process", "drop --part, --commit and --executor"
        )
    tensors, metadata, index_metadata = planned
    digest = plan_digest(plan, tensors, metadata, index_metadata, source.checkpoint.source)
    job = ShardJob(
        tensors, metadata, index_metadata, source.checkpoint.source, staging="",
        out=claim.out, verify=options.verify, progress=options.progress,
    )  # fmt: skip
    run = _Run(source, plan, job, claim, options, request, digest)
    if split.target is not None:
        return _task(run)
    if plan.index_file is None:
        if split.runner is not None:
            return None
        raise UsageError(
            "--part" if split.part else "--commit",
            "the plan is one file with no index: there is nothing to split",
            "run the command without --part",
        )
    try:
        if split.part is not None:
            return _part(run)
        return _commit(run) if split.commit else _on_runner(run)
    except CkptfixError:  # already one line (an unreadable file is an OSError too)
        raise
    except OSError as exc:  # as a run that is not split says it (disk full, read-only...)
        raise wrap_os_error(exc, claim.out) from exc


def _result(run: _Run, written: WriteResult | None, record: PartRecord) -> RewriteResult:
    from ckptfix.ops.rewrite import RewriteResult

    report = with_remote(run.source.report, run.source.checkpoint)
    return RewriteResult(report, run.plan, written, part=record)


def _task(run: _Run) -> RewriteResult:
    """(In a task.) Write slice target.part of target.count where the driver said."""
    target, job = run.request.options.target, run.job
    assert target is not None
    if run.digest != target.digest:
        raise SourceChangedError(
            job.out,
            "the plan made on this node differs from the driver's: the source changed, or "
            "is not the same on every node",
        )
    plan_part, job_part = sliced(run.plan, job, part_of(run.plan, target.part, target.count))
    if target.folder is not None:
        records = write_slice_to_folder(plan_part, job_part, target.folder)
    else:
        from ckptfix.ops.rewrite_claim import store_options
        from ckptfix.write.stores import open_store

        assert target.store is not None
        options = store_options(run.request.options)
        store = open_store(target.store, options)
        records = write_slice_to_store(plan_part, job_part, store, options, target.existing)
        stats = store.stats()  # this task's: the driver adds them to the run's report
        record = PartRecord(run.digest, target.part, target.count, tuple(records),
                            stats.bytes_sent, stats.requests)  # fmt: skip
        return _result(run, None, record)
    record = PartRecord(run.digest, target.part, target.count, tuple(records))
    return _result(run, None, record)


def _part(run: _Run) -> RewriteResult:
    """--part I/N: slice I and its record, beside the other parts' (nothing published)."""
    claim, digest = run.claim, run.digest
    part, count = run.request.options.part or (1, 1)
    plan_part, job_part = sliced(run.plan, run.job, part_of(run.plan, part, count))
    if isinstance(claim, StoreClaim):
        _check_store_prefix(run)
        existing = tuple(claim.state.existing.values())
        records = write_slice_to_store(plan_part, job_part, claim.store, claim.options, existing)
        record = PartRecord(digest, part, count, tuple(records))
        claim.store.publish({record.name: record.to_json()}, [], message="ckptfix part")
        where = claim.out.rstrip("/")
    else:
        from ckptfix.ops.rewrite import nearest_folder

        where = parts_folder(claim.real)
        check_free_space(nearest_folder(os.path.dirname(where)), plan_part.total_size, claim.out)
        ensure_parts_folder(where, parts_folder(claim.out))
        records = write_slice_to_folder(plan_part, job_part, where)
        record = PartRecord(digest, part, count, tuple(records))
        write_record(where, record)
    files = [WrittenFile(f"{where}/{r.file}", r.size) for r in records]
    files.append(WrittenFile(f"{where}/{record.name}", len(record.to_json())))
    return _result(run, WriteResult(where, tuple(files), run.job.verify), record)


def _check_store_prefix(run: _Run) -> None:
    """The prefix may hold the parts' own records and shards; anything else follows the
    usual rules (--force, --replace-any), which the claim left to this check."""
    claim = run.claim
    assert isinstance(claim, StoreClaim)
    ours = {shard.file for shard in run.plan.shards}
    others = [
        item
        for name, item in claim.state.existing.items()
        if name not in ours and not RECORD.fullmatch(name)
    ]
    options = run.request.options
    check_prefix(claim.store, others, force=options.force or options.resume,
                 replace_any=options.replace_any)  # fmt: skip


def _commit(run: _Run) -> RewriteResult:
    """--commit: every part's record checked against this plan, then the index published."""
    claim, plan, digest = run.claim, run.plan, run.digest
    if isinstance(claim, StoreClaim):
        _check_store_prefix(run)
        found = sorted(name for name in claim.state.existing if RECORD.fullmatch(name))
        records = chosen_records(
            read_records(_stored_records(claim, found), digest, claim.out), digest, claim.out
        )
        shards = check_covered(plan, records, claim.out)
        check_stored(claim.store, shards)
        checked = CommitCheck(len(records), len(shards), 0, "store checksum")
        return replace(_publish_store(run, lambda: shards, sorted(found)), commit=checked)
    folder, shown = parts_folder(claim.real), parts_folder(claim.out)
    check_parts_folder(folder, shown)
    records = chosen_records(
        read_records(local_records(folder, shown), digest, shown), digest, shown
    )
    shards = check_covered(plan, records, shown)
    read_back = 0

    def move(plan: ShardPlan, job: ShardJob) -> list[WrittenFile]:
        # Moved first, then read back where nobody else writes: what is checked is what is
        # published; whatever stops the commit before the swap puts them back (Staging.adopt).
        nonlocal read_back
        assert isinstance(claim, Claim) and claim.staging is not None
        try:
            claim.staging.adopt(folder, [shard.file for shard in shards])
        except OSError as exc:
            if exc.errno not in NOT_THE_FILE:
                raise
            raise parts_moved(shown) from None
        read_back = check_read_back(job.staging, shards, shown)
        return _with_index(plan, job, shards)

    result = _publish_local(run, move)
    remove_tree(folder)  # published: the parts are in OUT now, the records served
    return replace(
        result, commit=CommitCheck(len(records), len(shards), read_back, "sha256 read back")
    )


def _stored_records(
    claim: StoreClaim, names: Sequence[str]
) -> Iterator[tuple[str, Callable[[], bytes]]]:
    """The record objects of the prefix, each read when asked (at most MAX_RECORD bytes:
    a larger one is an error naming it)."""
    for name in names:
        item, shown = claim.state.existing[name], f"{claim.out.rstrip('/')}/{name}"
        if item.size > MAX_RECORD:
            raise too_large(shown)
        yield name, partial(claim.store.read, name, 0, item.size)


def _with_index(plan: ShardPlan, job: ShardJob, shards: Sequence[ShardRecord]) -> list[WrittenFile]:
    """The shards written by the slices, and the index written here into the staging folder."""
    written = [WrittenFile(shard.file, shard.size) for shard in shards]
    assert plan.index_file is not None
    path = os.path.join(job.staging, plan.index_file)
    display = os.path.join(job.out, plan.index_file)
    written.append(
        WrittenFile(plan.index_file, write_index(path, plan, job.index_metadata, display))
    )
    return written


def _publish_local(
    run: _Run, write: Callable[[ShardPlan, ShardJob], list[WrittenFile]]
) -> RewriteResult:
    """Stage the output, `write` its shards and index there, and swap it in as OUT."""
    from ckptfix.ops.rewrite import stage_and_commit

    assert isinstance(run.claim, Claim)
    return stage_and_commit(run.source, run.plan, run.job, run.claim, run.options, write)


def _publish_store(
    run: _Run, shards: Callable[[], Sequence[ShardRecord]], records: Sequence[str]
) -> RewriteResult:
    """Publish the shards the slices put in the store (`shards()`: their records, checked;
    called once the prefix passed the checks a local run makes before it sends anything):
    the carried files, the index last, the records (`records`) and what is stale deleted."""
    from ckptfix.ops.rewrite import RewriteResult, carry_files

    source, plan, claim, options = run.source, run.plan, run.claim, run.options
    assert isinstance(claim, StoreClaim)

    def checked(sink: StoreSink, plan: ShardPlan, job: ShardJob) -> list[WrittenFile]:
        return [WrittenFile(shard.file, shard.size) for shard in shards()]

    written = write_to_store(
        plan,
        run.job,
        claim,
        lambda folder: carry_files(source, plan, folder, options),
        checked,
        records,
    )
    report = with_remote(source.report, source.checkpoint)
    return RewriteResult(report, plan, written, claim.out)


def _on_runner(run: _Run) -> RewriteResult:
    """--executor ray: the slices run as tasks into the staging folder (a local OUT) or the
    store; their records are checked, then the index published here."""
    request, plan, claim, digest = run.request, run.plan, run.claim, run.digest
    assert request.options.runner is not None
    runner = request.options.runner
    task_options = replace(request.options, progress=None, runner=None, part=None)
    request = replace(request, tensors=len(run.job.tensors))
    sizes = [shard.nbytes for shard in plan.shards]

    def slices(target: PartTarget, progress: Any) -> list[PartRecord]:
        return runner(
            replace(request, options=replace(task_options, target=target)), sizes, progress
        )

    if isinstance(claim, StoreClaim):
        for shard in plan.shards:  # an earlier index must not list a shard being replaced
            if shard.file in claim.state.existing:
                StoreSink(claim.store, claim.options, claim.state).before_replacing(shard.file)
                break
        existing = tuple(
            item
            for name, item in claim.state.existing.items()
            if name not in claim.state.removed_first
        )
        target = PartTarget(digest, store=request.out, existing=existing)
        records: list[PartRecord] = []

        def uploaded() -> list[ShardRecord]:
            records.extend(slices(target, run.options.progress))
            shards = check_covered(plan, records, claim.out)
            check_stored(claim.store, shards)
            _abort_dead_attempts(claim, shards)
            for kept in (record for record in shards if record.kept):
                claim.state.kept.append(kept.file)
                claim.state.bytes_kept += kept.size
            return shards

        return _with_tasks_uploads(_publish_store(run, uploaded, ()), records)

    from ckptfix.ops.rewrite import check_space  # a local run's check, before any task

    job = run.job
    check_space(plan, job, checked_headers(plan, job.tensors, job.metadata, claim.out), claim)

    def tasks(plan: ShardPlan, job: ShardJob) -> list[WrittenFile]:
        records = slices(PartTarget(digest, folder=job.staging), job.progress)
        shards = check_covered(plan, records, job.out)
        check_local(job.staging, shards, job.out)
        _remove_dead_attempts(job.staging)
        return _with_index(plan, job, shards)

    return _publish_local(run, tasks)


def _remove_dead_attempts(staging: str) -> None:
    """A task Ray ran again after its worker died left its scratch folder in the staging
    folder (a task that ends removes its own): removed before the folder is published.
    Every `.ckptfix-*` folder there is one, marked or not (a worker killed between making
    it and marking it): only this run's tasks have written into the staging folder yet."""
    for entry in os.scandir(staging):
        if entry.name.startswith(STAGING_PREFIX) and entry.is_dir(follow_symlinks=False):
            remove_tree(entry.path)


def _abort_dead_attempts(claim: StoreClaim, shards: Sequence[ShardRecord]) -> None:
    """A task Ray ran again after its worker died may have left an upload its first attempt
    started. Once every task returned, an upload under way that the claim did not find, at
    a shard's name and recorded by a ckptfix process (only this run's tasks have written
    since the claim; the driver sends nothing before this) is such a one: aborted, as a
    killed run's are. Any other new one (a worker killed before it put the record, or
    another program's) is left and reported, as the claim reports those it finds."""
    before = {(upload.name, upload.upload_id) for upload in claim.others}
    planned = {shard.file for shard in shards}
    new = [
        upload
        for upload in claim.store.dangling(own=True)
        if (upload.name, upload.upload_id) not in before
    ]
    dead = [upload for upload in new if upload.ours and upload.name in planned]
    claim.store.abort_dangling(dead)
    claim.aborted += tuple(upload.name for upload in dead)
    claim.left += tuple(upload.name for upload in new if upload not in dead)


def _with_tasks_uploads(result: RewriteResult, records: Sequence[PartRecord]) -> RewriteResult:
    """The run's upload report with what its tasks sent (each to a store of its own) added
    to what the driver sent."""
    written = result.written
    assert written is not None and written.upload is not None
    upload = replace(
        written.upload,
        bytes_sent=written.upload.bytes_sent + sum(record.sent for record in records),
        requests=written.upload.requests + sum(record.requests for record in records),
    )
    return replace(result, written=replace(written, upload=upload))
