"""`ckptfix fix`: repair what the shard headers make recoverable, or refuse and write nothing.

Load and check once, plan the repair (plan.repair_plan: data), then write it as the other
write commands write: into a marked staging folder beside OUT (write.repair), read back and
checked as `inspect` checks it, and swapped in atomically (write.staging). `--in-place`
keeps every other entry of the folder by hard links and moves what it takes out into
PATH/ckptfix-aside/; `-o` copies the repaired checkpoint and the folder's other files.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from ckptfix import checks
from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.errors import (
    CkptfixError,
    InputNotFoundError,
    RepairRefusedError,
    UsageError,
    VerificationError,
)
from ckptfix.core.findings import Severity
from ckptfix.core.fixes import LEFT_AS_IS
from ckptfix.core.sizes import DEFAULT_MAX_SHARD
from ckptfix.io.folder import unlistable
from ckptfix.io.urls import is_url, refuse_unknown_scheme
from ckptfix.ops.inspect import report_of
from ckptfix.ops.load import load
from ckptfix.ops.report import Report
from ckptfix.ops.source import STAGING_FOLDER, other_entries
from ckptfix.plan.repair import ASIDE, RepairPlan
from ckptfix.plan.repair_plan import plan_repair
from ckptfix.write.output import check_free_space, wrap_os_error
from ckptfix.write.repair import (
    RepairJob,
    Rewrite,
    behind_links,
    cloning_for,
    fill,
    rewrites,
    space_needed,
)
from ckptfix.write.results import Progress, WriteResult, WrittenFile
from ckptfix.write.staging import Claim, claim_output, staged
from ckptfix.write.store_output import StoreClaim, claim_store, write_folder_to_store
from ckptfix.write.stores import check_flags
from ckptfix.write.stores.base import StoreOptions
from ckptfix.write.tree import first_link


@dataclass(frozen=True)
class FixOptions:
    in_place: bool = False
    dry_run: bool = False
    progress: Progress | None = None
    upload: StoreOptions = field(default_factory=StoreOptions)  # an object-store OUT


@dataclass(frozen=True)
class FixResult:
    """The source's report, the repair plan, what was written (None for --dry-run, and for
    --in-place when nothing needed repair) and, for --in-place, every file that moved: a
    shard renamed, or a file taken out into the aside folder."""

    report: Report
    plan: RepairPlan
    written: WriteResult | None
    moved: tuple[tuple[str, str], ...] = ()

    @property
    def exit_code(self) -> int:
        return 1 if self.plan.refused else 0

    def to_dict(self) -> dict[str, object]:
        document = self.report.to_dict()
        document["plan"] = self.plan.to_dict()
        document["written"] = self.written.to_dict() if self.written is not None else None
        document["moved"] = [{"from": old, "to": new} for old, new in self.moved]
        return document


def _check_arguments(source: str, out: str | os.PathLike[str] | None, in_place: bool) -> None:
    if is_url(source):
        raise UsageError(
            source, "fix repairs local checkpoints only", "download it, then fix the copy"
        )
    if not os.path.lexists(source):
        raise InputNotFoundError(source, "no such file or directory", "check the path")
    if in_place and out is not None and os.path.abspath(os.fspath(out)) != os.path.abspath(source):
        raise UsageError("--in-place", "takes no -o folder other than PATH", "drop -o")
    if not in_place and out is None:
        raise UsageError("-o", "an output folder is required", "pass -o OUT, or --in-place")
    if in_place:
        _refuse_hub_snapshot(source)


def _refuse_hub_snapshot(source: str) -> None:
    """A Hugging Face cache snapshot's files are links into the cache's blobs/, named by
    their hash: a file rewritten in their place would break the cache."""
    from ckptfix.layouts.hub import snapshot_of

    folder = source if os.path.isdir(source) else os.path.dirname(os.path.abspath(source))
    repo = snapshot_of(folder)
    if repo is not None:
        raise UsageError(
            source,
            f"is in a snapshot of the Hugging Face cache ({os.path.basename(repo)}), whose "
            "files are links into the cache's blobs/, which a repair in place would corrupt",
            "write the repaired checkpoint elsewhere with -o OUT",
        )


def _claim(
    source: str, out: str | os.PathLike[str] | None, options: FixOptions
) -> Claim | StoreClaim:
    if options.in_place and not os.path.isdir(source):  # one file: replaced by a rename
        return Claim(source, os.path.realpath(source), None, None)
    target = source if options.in_place else os.fspath(out or "")
    refuse_unknown_scheme(target)
    check_flags(target, options.upload)
    if is_url(target):  # a new (empty) prefix, as a new folder: fix has no --force
        return claim_store(
            target, [source], force=False, replace_any=False, write=not options.dry_run,
            options=options.upload,
        )  # fmt: skip
    try:
        return claim_output(target, [source], in_place=options.in_place, write=not options.dry_run)
    except CkptfixError:  # already one line (an unreadable file is an OSError too)
        raise
    except OSError as exc:
        raise wrap_os_error(exc, target) from exc


def _aside_contents(root: str) -> list[str]:
    """The paths already in the aside folder (what an earlier fix took out, and anything
    else there: a folder or a link of that name takes it too); nothing when it is not a real
    folder (refused by `_refuse_links` if anything is to go there)."""
    folder = os.path.join(root, ASIDE)
    if not os.path.lexists(folder) or first_link(root, ASIDE) is not None:
        return []

    def unreadable(exc: OSError) -> None:
        raise unlistable(exc.filename or folder, exc) from exc

    found = []
    for current, folders, files in os.walk(folder, onerror=unreadable):  # links not followed
        found += [os.path.relpath(os.path.join(current, name), folder) for name in folders + files]
    return found


def _changed_folders(plan: RepairPlan) -> list[tuple[str, str]]:
    """(folder, file) for each file --in-place writes, renames or takes out of a folder."""
    found = [
        (os.path.dirname(name), name)
        for kept in plan.kept_files
        if kept.how != "kept"
        for name in (kept.source, kept.target)
    ]
    return found + [(os.path.dirname(move.source), move.source) for move in plan.moves]


def _refuse_links(root: str, plan: RepairPlan) -> None:
    """--in-place writes only into real folders inside PATH: never into a sub-folder that is
    a link (the files behind it are outside PATH), nor into an aside folder that is one."""
    for folder, name in _changed_folders(plan):
        link = first_link(root, folder)
        if link is not None:
            raise UsageError(
                os.path.join(root, link),
                f"{_what_it_is(root, link)}, and fix --in-place would change {name} behind "
                f"it, outside {root}",
                "repair into a new folder with -o OUT, or replace the link with the folder it "
                "points to",
            )
    _refuse_taking_from_links(root, plan)
    for move in plan.moves:
        link = first_link(root, os.path.join(ASIDE, os.path.dirname(move.aside)))
        if link is not None:
            raise UsageError(
                os.path.join(root, link),
                f"{_what_it_is(root, link)}, not a folder: fix --in-place moves what it takes "
                f"out only into a real folder inside {root}",
                "remove the link, or repair into a new folder with -o OUT",
            )


def _refuse_taking_from_links(root: str, plan: RepairPlan) -> None:
    """A file kept behind a link stays where the link leads; the file fix would change or
    take out must not be that same file reached another way (`sub -> .` makes the shard
    sub/X and the "orphan" X one file: moving X aside would take it from under the link)."""
    behind: dict[tuple[int, int], tuple[str, str]] = {}
    for kept in plan.kept_files:
        link = first_link(root, os.path.dirname(kept.source)) if kept.how == "kept" else None
        if link is not None:
            with contextlib.suppress(OSError):
                behind[_file_id(os.path.join(root, kept.source))] = (link, kept.source)
    for _, name in _changed_folders(plan) if behind else []:
        try:
            link, reached = behind[_file_id(os.path.join(root, name))]
        except (OSError, KeyError):
            continue
        raise UsageError(
            os.path.join(root, link),
            f"{_what_it_is(root, link)}, and fix --in-place would take {name} out from under "
            f"it (it is {reached}, which the index reaches through the link)",
            "repair into a new folder with -o OUT, or replace the link with the folder it "
            "points to",
        )


def _file_id(path: str) -> tuple[int, int]:
    info = os.stat(path)
    return (info.st_dev, info.st_ino)


def _what_it_is(root: str, relative: str) -> str:
    path = os.path.join(root, relative)
    return f"is a link (to {os.readlink(path)})" if os.path.islink(path) else "is a file"


def _with_entries(plan: RepairPlan, checkpoint: Checkpoint, in_place: bool) -> RepairPlan:
    """The folder's other entries: copied to OUT (or carried, --in-place), or left out."""
    if plan.single_file or not plan.families:
        return plan
    ours = {kept.source for kept in plan.kept_files} | {move.source for move in plan.moves}
    ours |= {index.file for index in plan.indexes}
    extra, reasons = other_entries(checkpoint, {name for name in ours if "/" not in name})
    if in_place:  # everything stays but a killed run's staging folder
        kept = {n for n, why in reasons.items() if why != STAGING_FOLDER and "/" not in n}
        left = {n: why for n, why in reasons.items() if why == STAGING_FOLDER}
        # A special file is both an entry and a reason (left out by -o): carried once.
        return replace(plan, copied=tuple(sorted(kept.union(extra))), left_out=left)
    return replace(plan, copied=tuple(extra), left_out=dict(reasons))


def _refused(plan: RepairPlan) -> RepairRefusedError:
    first = plan.refusals[0]
    fix = first.fix
    if len(plan.refusals) > 1:
        fix += f"; {len(plan.refusals) - 1} more, see `ckptfix fix {plan.path} --dry-run`"
    return RepairRefusedError(first.file, first.code, first.what, fix, rule=first.rule)


def fix(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str] | None = None,
    options: FixOptions | None = None,
) -> FixResult:
    """Repair a checkpoint folder or safetensors file into OUT, or in place. Raises
    RepairRefusedError (nothing written) when a finding cannot be repaired; with
    `dry_run`, returns the plan with its refusals instead."""
    options = options or FixOptions()
    source = os.fspath(src)
    _check_arguments(source, out, options.in_place)
    with _claim(source, out, options) as claim, load(source) as checkpoint:
        found = checks.run(checkpoint, checks.CheckOptions(DEFAULT_MAX_SHARD))
        report = report_of(checkpoint, found)
        taken = _aside_contents(source) if options.in_place and checkpoint.kind == "folder" else []
        plan = plan_repair(checkpoint, report.findings, taken=taken)
        plan = _with_entries(plan, checkpoint, options.in_place)
        behind: frozenset[str] = frozenset()
        if options.in_place and not plan.single_file:
            _refuse_links(source, plan)
            behind = behind_links(source, plan, in_place=True)
        if options.dry_run:
            return FixResult(report, plan, None)
        if plan.refused:
            raise _refused(plan)
        if options.in_place and not plan.changes:
            return FixResult(report, plan, None)
        return _write(checkpoint, report, plan, claim, options, behind)


def _write(
    checkpoint: Checkpoint,
    report: Report,
    plan: RepairPlan,
    claim: Claim | StoreClaim,
    options: FixOptions,
    behind: frozenset[str],
) -> FixResult:
    if isinstance(claim, StoreClaim):  # built and checked in a scratch folder, then sent

        def fill(scratch: str) -> str:
            local = os.path.join(scratch, "out")
            with claim_output(local, []) as staged_claim:
                _write(checkpoint, report, plan, staged_claim, options, behind)
            return local

        return FixResult(report, plan, write_folder_to_store(claim, fill))
    found = rewrites(checkpoint, plan, claim.out)
    job = RepairJob(
        checkpoint, plan, "", claim.out, options.in_place, lambda: None, options.progress
    )
    job.behind_links = behind  # as the plan was checked
    try:
        _check_space(job, found, claim)
        written = _stage(job, found, claim)
    except CkptfixError:  # already one line (an unreadable file is an OSError too)
        raise
    except OSError as exc:
        raise wrap_os_error(exc, claim.out) from exc
    moved: tuple[tuple[str, str], ...] = ()
    if options.in_place:
        root = claim.out
        renamed = [
            (os.path.join(root, kept.source), os.path.join(root, kept.target))
            for kept in plan.kept_files
            if kept.target != kept.source
        ]
        moved = tuple(renamed) + tuple(
            (os.path.join(root, move.source), os.path.join(root, ASIDE, move.aside))
            for move in plan.moves
        )
    return FixResult(report, plan, written, moved)


def _check_space(job: RepairJob, found: list[Rewrite], claim: Claim) -> None:
    """Refuse before writing when the output's filesystem lacks the room (write.repair.
    space_needed); the sources that clone there are kept on the job for the writer."""
    folder = os.path.dirname(claim.real)
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    job.cloning = cloning_for(job.checkpoint, job.plan, found, folder)
    check_free_space(folder, space_needed(job, found, job.cloning), claim.out)


def _stage(job: RepairJob, found: list[Rewrite], claim: Claim) -> WriteResult:
    plan, in_place = job.plan, job.in_place
    with staged(claim) as staging:
        job.staging, job.safe_point = staging.path, staging.checkpoint
        written = fill(job, found)
        staging.checkpoint()
        name = plan.kept_files[0].target if plan.single_file else None
        _verify(plan, staging.path, name, claim.out)
        if plan.single_file and in_place:
            staging.commit_file(name or "", claim.real, _unchanged(claim.real))
        else:
            staging.commit()
    where = claim.out
    account = job.tally.account(job.cloning, sum(r.plan.total_size for r in found))
    if plan.single_file and in_place:  # the file itself, its header rewritten
        only = (WrittenFile(where, written[0].bytes),)
        return WriteResult(where, only, True, replaced=(where,), account=account)
    files = tuple(WrittenFile(os.path.join(where, item.path), item.bytes) for item in written)
    replaced: tuple[str, ...] = ()
    if in_place:
        replaced = tuple(
            os.path.join(where, kept.source)
            for kept in plan.kept_files
            if kept.add_format and not kept.dropped
        )
    return WriteResult(where, files, verified=True, replaced=replaced, account=account)


def _unchanged(path: str) -> Callable[[], bool]:
    before = _identity(path)
    return lambda: _identity(path) == before


def _identity(path: str) -> tuple[int, int, int, int]:
    info = os.stat(path)
    return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)


def _verify(plan: RepairPlan, staging: str, name: str | None, out: str) -> None:
    """Read what was staged back as `inspect` would: no finding at warning level or above,
    and exactly the planned tensors in the planned files."""
    path = os.path.join(staging, name) if name is not None else staging
    with load(path) as result:
        found = checks.run(result, checks.CheckOptions(DEFAULT_MAX_SHARD))
        held = {(tensor.name, os.path.relpath(tensor.file, staging)) for tensor in result.tensors}
    bad = [
        item
        for item in found
        if item.severity.rank >= Severity.WARNING.rank and item.code not in LEFT_AS_IS
    ]
    planned = {(tensor, kept.target) for kept in plan.kept_files for tensor in kept.tensors}
    if bad or (held != planned and not plan.single_file):
        what = f"{bad[0].code}: {bad[0].message}" if bad else "tensors differ from the plan"
        raise VerificationError(
            out,
            f"the repaired checkpoint does not check out ({what})",
            "this is a bug; please report it",
        )
