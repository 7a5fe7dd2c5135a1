"""Write commands: plan, stage, write, verify, commit. `reshard` lives here."""

from __future__ import annotations

import errno
import os
import shutil
from dataclasses import dataclass, replace

from ckptfix.errors import UsageError
from ckptfix.plan import ShardPlan, plan_shards
from ckptfix.report import Report
from ckptfix.source import Checkpoint, open_checkpoint
from ckptfix.staging import check_output, staged
from ckptfix.writer import (
    Progress,
    WriteResult,
    WrittenFile,
    check_free_space,
    copy_extra,
    needed_bytes,
    wrap_os_error,
    write_shards,
)

DEFAULT_MAX_SHARD = 5 * 10**9


@dataclass(frozen=True)
class RewriteResult:
    """The source's report, the plan, and what was written (None for --dry-run)."""

    report: Report
    plan: ShardPlan
    written: WriteResult | None

    def to_dict(self) -> dict[str, object]:
        document = self.report.to_dict()
        document["plan"] = self.plan.to_dict()
        document["written"] = self.written.to_dict() if self.written else None
        return document


def _carry_over(checkpoint: Checkpoint, outputs: set[str]) -> tuple[list[str], list[str]]:
    """For --in-place: keep everything but the rewritten checkpoint itself.

    Returns (carried, replaced): names kept as they are, and left-out weight files whose
    name the new checkpoint takes.
    """
    carried = list(checkpoint.extra_files)
    replaced: list[str] = []
    for name in checkpoint.left_out:
        if name.startswith(".ckptfix-"):
            continue
        (replaced if name in outputs else carried).append(name)
    return sorted(carried), replaced


def _link_or_copy(source_root: str, names: list[str], staging: str) -> list[WrittenFile]:
    """Hard-link carried files into the staging folder (same filesystem: instant, no space);
    copy where links are not possible."""
    written = []
    for name in names:
        source, target = os.path.join(source_root, name), os.path.join(staging, name)
        if os.path.isdir(source) and not os.path.islink(source):
            shutil.copytree(source, target, symlinks=True, copy_function=_link_file)
        else:
            _link_file(source, target)
        written.append(WrittenFile(name, _tree_size(target)))
    return written


def _link_file(source: str, target: str) -> None:
    if os.path.islink(source):
        os.symlink(os.readlink(source), target)
        return
    try:
        os.link(source, target)
    except OSError as exc:
        if exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
            raise
        shutil.copy2(source, target)


def _tree_size(path: str) -> int:
    if not os.path.isdir(path) or os.path.islink(path):
        return os.lstat(path).st_size
    return sum(
        os.lstat(os.path.join(folder, name)).st_size
        for folder, _, names in os.walk(path)
        for name in names
    )


def reshard(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str] | None,
    *,
    max_shard: int = DEFAULT_MAX_SHARD,
    dry_run: bool = False,
    force: bool = False,
    in_place: bool = False,
    progress: Progress | None = None,
) -> RewriteResult:
    """Rewrite a safetensors checkpoint into shards of at most `max_shard` bytes."""
    source = os.fspath(src)
    if not os.path.exists(source):
        raise UsageError(source, "no such file or directory", "check the path")
    if in_place:
        if out is not None and os.path.abspath(os.fspath(out)) != os.path.abspath(source):
            raise UsageError("--in-place", "takes no -o folder other than SRC", "drop -o")
        if not os.path.isdir(source):
            raise UsageError(source, "--in-place needs a model folder", "use -o OUT for a file")
        target = source
    elif out is None:
        raise UsageError("-o", "an output folder is required", "pass -o OUT, or --in-place")
    else:
        target = os.fspath(out)
    check_output(target, [source], force=force, in_place=in_place)

    checkpoint = open_checkpoint(source, max_shard=max_shard)
    tensors = {tensor.name: tensor for tensor in checkpoint.tensors}
    plan = plan_shards([(t.name, t.nbytes) for t in checkpoint.tensors], max_shard)
    outputs = {shard.file for shard in plan.shards} | (
        {plan.index_file} if plan.index_file else set()
    )
    if in_place:
        carried, replaced = _carry_over(checkpoint, outputs)
        plan = replace(plan, copied_files=tuple(carried), left_out=tuple(replaced))
    else:
        plan = replace(plan, copied_files=checkpoint.extra_files, left_out=checkpoint.left_out)
    if dry_run:
        return RewriteResult(checkpoint.report, plan, None)

    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    check_free_space(parent, needed_bytes(plan, tensors, checkpoint.metadata), target)
    metadata = {**checkpoint.metadata, "format": "pt"}
    try:
        with staged(target) as staging:
            written = write_shards(
                plan,
                tensors,
                metadata,
                checkpoint.index_metadata,
                staging.path,
                target,
                progress=progress,
            )
            if in_place:
                written += _link_or_copy(source, list(plan.copied_files), staging.path)
            elif checkpoint.is_folder:
                written += copy_extra(source, plan.copied_files, staging.path)
            staging.commit()
    except OSError as exc:
        raise wrap_os_error(exc, target) from exc
    files = tuple(WrittenFile(os.path.join(target, item.path), item.bytes) for item in written)
    return RewriteResult(checkpoint.report, plan, WriteResult(target, files, verified=True))
