"""Executing a RepairPlan into a staging folder: shards whose header changes go through the
streaming safetensors writer (and are verified against their sources like any rewrite);
shards already right are carried unchanged (hard-linked for --in-place, copied for -o),
under their new names where they are renumbered; the index is written or carried; what is
taken out goes into the aside folder (--in-place) by a hard link. Nothing here deletes a
file, nor places one through a link: the folders files go in are made real ones one by one
(write.tree.make_folders), and a sub-folder's copy leaves out the files the plan places."""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ckptfix.core.checkpoint import Checkpoint, FileRecord
from ckptfix.plan.repair import ASIDE, FamilyPlan, KeptFile, RepairPlan
from ckptfix.plan.select import OutTensor
from ckptfix.plan.shards import PlannedShard, ShardPlan
from ckptfix.write.extras import carry_extra, carry_file
from ckptfix.write.output import write_index
from ckptfix.write.results import Progress, WrittenFile
from ckptfix.write.safetensors import ShardJob, checked_headers, write_shards
from ckptfix.write.tree import first_link, make_folders
from ckptfix.write.zerocopy import Cloning, Tally, find_cloning, shareable_bytes, streamed_labels


@dataclass(frozen=True)
class Rewrite:
    """The shards of one family whose header changes, as the safetensors writer takes them."""

    plan: ShardPlan
    tensors: dict[str, OutTensor]
    metadata: list[dict[str, str]]
    headers: tuple[int, ...] = ()  # each new header's size, its 8-byte length included


def _source_label(checkpoint: Checkpoint, plan: RepairPlan, kept: KeptFile) -> str:
    return checkpoint.path if plan.single_file else os.path.join(checkpoint.path, kept.source)


def rewrites(checkpoint: Checkpoint, plan: RepairPlan, out: str) -> list[Rewrite]:
    """The shards to rewrite, family by family (tensor names are unique within one), each
    header checked against the format's size limit before anything is written."""
    records: Mapping[str, FileRecord] = {record.label: record for record in checkpoint.files}
    found = []
    for family in plan.families:
        rewritten = [kept for kept in family.files if kept.rewritten]
        if not rewritten:
            continue
        tensors: dict[str, OutTensor] = {}
        metadata: list[dict[str, str]] = []
        for kept in rewritten:
            record = records[_source_label(checkpoint, plan, kept)]
            wanted = set(kept.tensors)
            tensors.update({t.name: OutTensor.same(t) for t in record.tensors if t.name in wanted})
            metadata.append(
                {**(record.metadata or {}), **({"format": "pt"} if kept.add_format else {})}
            )
        shards = tuple(PlannedShard(kept.target, kept.tensors, kept.nbytes) for kept in rewritten)
        # No shard limit: a shard keeps its tensors, and may take up to one clone block of
        # padding after its header so that its data lines up with the source's blocks.
        shard_plan = ShardPlan(sys.maxsize, shards, None)
        sizes = checked_headers(shard_plan, tensors, metadata, out)
        found.append(Rewrite(shard_plan, tensors, metadata, tuple(sizes)))
    return found


def cloning_for(
    checkpoint: Checkpoint, plan: RepairPlan, found: Sequence[Rewrite], folder: str
) -> Cloning:
    """Which sources clone into `folder` (where staging will be): the rewritten shards'
    and the files carried whole."""
    labels = streamed_labels(t for rewrite in found for t in rewrite.tensors.values())
    labels += [_source_label(checkpoint, plan, kept) for kept in plan.kept_files]
    return find_cloning(dict.fromkeys(labels), checkpoint.source, folder)


def space_needed(job: RepairJob, found: Sequence[Rewrite], cloning: Cloning) -> int:
    """What the write takes on disk: the rewritten shards less the blocks they share with
    their sources (plus padding), and with -o the files carried whole unless they clone
    (--in-place links them)."""
    checkpoint, plan = job.checkpoint, job.plan
    needed = 0
    for rewrite in found:
        needed += sum(rewrite.headers) + rewrite.plan.total_size
        needed -= shareable_bytes(rewrite.plan, rewrite.tensors, rewrite.headers, cloning)
        needed += len(rewrite.plan.shards) * (cloning.block or 0)
    for kept in [] if job.in_place else plan.kept_files:
        if not kept.rewritten and _source_label(checkpoint, plan, kept) not in cloning.sources:
            needed += kept.nbytes
    return needed


@dataclass
class RepairJob:
    """Where and how to execute a plan: the staging folder, the output as shown, --in-place
    (links instead of copies, and the aside folder), and the safe point between files."""

    checkpoint: Checkpoint
    plan: RepairPlan
    staging: str
    out: str
    in_place: bool
    safe_point: Callable[[], None]
    progress: Progress | None = None
    cloning: Cloning | None = None  # None: the shard writer finds out
    tally: Tally = field(default_factory=Tally)  # summed over every family's shards
    behind_links: frozenset[str] = frozenset()  # see `behind_links`


def behind_links(root: str, plan: RepairPlan, in_place: bool) -> frozenset[str]:
    """--in-place: the files kept as they are that are reached through a link (`sub ->
    /elsewhere`): they stay where they are (the link is carried, nothing is placed behind
    it). Decided once, as the plan was checked (ops.fix refuses changes behind a link): a
    folder swapped for a link later is caught as a changed source, never followed."""
    if not in_place:
        return frozenset()
    return frozenset(
        kept.source
        for kept in plan.kept_files
        if kept.how == "kept" and first_link(root, os.path.dirname(kept.source)) is not None
    )


def _placed_nested(job: RepairJob) -> list[str]:
    """The planned files inside sub-folders: the copy of their folder leaves them out, for
    the plan places them (or, taken out, leaves them out)."""
    plan = job.plan
    names = {move.source for move in plan.moves} | {
        kept.source for kept in plan.kept_files if kept.source not in job.behind_links
    }
    return sorted(name for name in names if "/" in name)


def _folder_for(job: RepairJob, relative: str) -> str:
    """The staging path of `relative`, its folders made real ones (never links)."""
    make_folders(job.staging, os.path.dirname(relative), job.out)
    return os.path.join(job.staging, relative)


def _carry(job: RepairJob, family: FamilyPlan) -> list[WrittenFile]:
    written = []
    for kept in family.files:
        if kept.rewritten or kept.source in job.behind_links:
            continue
        target = _folder_for(job, kept.target)
        source = _source_label(job.checkpoint, job.plan, kept)
        read = job.checkpoint.source(source).change_token()  # the file that was checked
        size = carry_file(source, target, link=job.in_place, expected=read)
        written.append(WrittenFile(kept.target, size))
        job.safe_point()
    return written


def _index(job: RepairJob, family: FamilyPlan) -> list[WrittenFile]:
    index = family.index
    if index is None:
        return []
    path = os.path.join(job.staging, index.file)
    if not index.write:  # already exactly right: kept as it is
        source = os.path.join(job.checkpoint.path, index.file)
        return [WrittenFile(index.file, carry_file(source, path, link=job.in_place))]
    shards = ShardPlan(
        0, tuple(PlannedShard(k.target, k.tensors, k.nbytes) for k in family.files), index.file
    )
    metadata = {key: value for key, value in index.metadata.items() if key != "total_size"}
    return [WrittenFile(index.file, write_index(path, shards, metadata))]


def _aside(job: RepairJob) -> None:
    """--in-place: each file taken out is linked into the aside folder (the old folder, its
    other name, is removed by the swap)."""
    for move in job.plan.moves:
        target = _folder_for(job, os.path.join(ASIDE, move.aside))
        carry_file(os.path.join(job.checkpoint.path, move.source), target, link=True)
        job.safe_point()


def _write_rewrites(job: RepairJob, found: Sequence[Rewrite]) -> list[WrittenFile]:
    written = []
    for rewrite in found:
        for shard in rewrite.plan.shards:
            _folder_for(job, shard.file)
        shard_job = ShardJob(
            rewrite.tensors,
            rewrite.metadata,
            {},
            job.checkpoint.source,
            staging=job.staging,
            out=job.out,
            progress=_progress(job),
            cloning=job.cloning,
            tally=job.tally,
        )
        written += write_shards(rewrite.plan, shard_job)
    return written


def _progress(job: RepairJob) -> Progress:
    def advance(done: int, total: int) -> None:
        job.safe_point()
        if job.progress is not None:
            job.progress(done, total)

    return advance


def fill(job: RepairJob, found: Sequence[Rewrite]) -> list[WrittenFile]:
    """Everything the repaired checkpoint holds, in the staging folder (see the module
    docstring); returns the files written, copied or linked, with their sizes."""
    plan = job.plan
    written: list[WrittenFile] = []
    carried = None
    if not plan.single_file:
        leave = _placed_nested(job)
        carried = carry_extra(plan.path, plan.copied, job.staging, link=job.in_place, leave=leave)
        written += carried.written
    written += _write_rewrites(job, found)
    for family in plan.families:
        written += _carry(job, family)
        written += _index(job, family)
    if job.in_place and plan.moves:
        _aside(job)
    if carried is not None:
        carried.finish()  # the folders' own permissions, now that everything is in them
    return written
