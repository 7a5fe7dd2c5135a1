"""Write commands: plan, stage, write, verify, commit. `reshard` lives here."""

from __future__ import annotations

import errno
import json
import os
import shutil
from dataclasses import dataclass, replace

from ckptfix.cast import CAST_TARGETS
from ckptfix.errors import UsageError
from ckptfix.plan import ShardPlan, metadata_per_shard, plan_shards
from ckptfix.report import Report
from ckptfix.sizes import DEFAULT_MAX_SHARD
from ckptfix.source import Checkpoint, open_checkpoint
from ckptfix.staging import check_output, staged
from ckptfix.transform import Selection, select
from ckptfix.writer import (
    OutTensor,
    Progress,
    WriteResult,
    WrittenFile,
    check_free_space,
    checked_headers,
    copy_extra,
    wrap_os_error,
    write_shards,
)

# Where dropped aliases are recorded: header __metadata__ (as a JSON string) or index metadata.
DROPPED_KEY = "ckptfix.dropped"


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


def _resolve_output(
    source: str, out: str | os.PathLike[str] | None, *, force: bool, in_place: bool
) -> str:
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
    return target


def _write(
    checkpoint: Checkpoint,
    selection: Selection,
    target: str,
    *,
    max_shard: int,
    to: str = "safetensors",
    in_place: bool = False,
    dry_run: bool = False,
    verify: bool = True,
    progress: Progress | None = None,
) -> RewriteResult:
    """Plan the shards for a selection, then stage, write, verify and commit them."""
    tensors = {tensor.name: tensor for tensor in selection.tensors}
    stem, ext = ("pytorch_model", "bin") if to == "torch" else ("model", "safetensors")
    plan = plan_shards(
        [(t.name, t.nbytes) for t in selection.tensors], max_shard, stem=stem, ext=ext
    )
    outputs = {shard.file for shard in plan.shards} | (
        {plan.index_file} if plan.index_file else set()
    )
    if in_place:
        copied, left_out = _carry_over(checkpoint, outputs)
    else:
        copied, left_out = list(checkpoint.extra_files), list(checkpoint.left_out)
    plan = replace(
        plan,
        copied_files=tuple(copied),
        left_out=tuple(left_out),
        dropped=dict(selection.dropped),
        renamed=dict(selection.renamed),
        dropped_bytes=selection.dropped_bytes,
        excluded=selection.excluded,
    )
    metadata = {**checkpoint.metadata, "format": "pt"}
    index_metadata = dict(checkpoint.index_metadata)
    if selection.dropped:  # dropped -> kept, where loaders and people can find it
        if plan.index_file is None:
            metadata[DROPPED_KEY] = json.dumps(selection.dropped, sort_keys=True)
        else:
            index_metadata[DROPPED_KEY] = dict(sorted(selection.dropped.items()))
    shard_metadata, scope = metadata_per_shard(metadata, len(plan.shards))
    plan = replace(plan, metadata_scope=scope)
    headers = checked_headers(plan, tensors, shard_metadata, target) if to != "torch" else []
    if dry_run:
        return RewriteResult(checkpoint.report, plan, None)
    parent = os.path.dirname(os.path.abspath(target))
    os.makedirs(parent, exist_ok=True)
    check_free_space(parent, sum(headers) + plan.total_size, target)
    try:
        with staged(target) as staging:
            if to == "torch":
                from ckptfix.torch_writer import write_torch_shards

                written = write_torch_shards(
                    plan,
                    tensors,
                    index_metadata,
                    staging.path,
                    target,
                    verify=verify,
                    progress=progress,
                )
            else:
                written = write_shards(
                    plan,
                    tensors,
                    shard_metadata,
                    index_metadata,
                    staging.path,
                    target,
                    verify=verify,
                    progress=progress,
                )
            if in_place:
                written += _link_or_copy(checkpoint.path, list(plan.copied_files), staging.path)
            elif checkpoint.is_folder:
                written += copy_extra(checkpoint.path, plan.copied_files, staging.path)
            staging.commit()
    except OSError as exc:
        raise wrap_os_error(exc, target) from exc
    files = tuple(WrittenFile(os.path.join(target, item.path), item.bytes) for item in written)
    return RewriteResult(checkpoint.report, plan, WriteResult(target, files, verified=verify))


def convert(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str] | None,
    *,
    to: str = "safetensors",
    dtype: str = "keep",
    key: str = "auto",
    strip_prefix: str | None = None,
    exclude: tuple[str, ...] | list[str] = (),
    keep: str = "first",
    clone: bool = False,
    max_shard: int = DEFAULT_MAX_SHARD,
    verify: bool = True,
    dry_run: bool = False,
    force: bool = False,
    progress: Progress | None = None,
) -> RewriteResult:
    """Convert any supported checkpoint (safetensors or PyTorch) to safetensors or torch shards."""
    if to not in ("safetensors", "torch"):
        raise UsageError("--to", f"unknown format {to!r}", "use safetensors or torch")
    if dtype != "keep" and dtype not in CAST_TARGETS:
        raise UsageError("--dtype", f"unknown dtype {dtype!r}", "use bf16, fp16, fp32 or keep")
    source = os.fspath(src)
    target = _resolve_output(source, out, force=force, in_place=False)
    checkpoint = open_checkpoint(
        source, max_shard=max_shard, key=key, torch=True, prefer_torch=True
    )
    selection = select(
        checkpoint.tensors,
        exclude=exclude,
        strip_prefix=strip_prefix,
        training_checkpoint=checkpoint.training_checkpoint,
        keep=keep,
        clone=clone,
        dtype=CAST_TARGETS.get(dtype),
    )
    return _write(
        checkpoint,
        selection,
        target,
        max_shard=max_shard,
        to=to,
        dry_run=dry_run,
        verify=verify,
        progress=progress,
    )


def dedupe(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str] | None,
    *,
    by_content: bool = False,
    clone: bool = False,
    keep: str = "first",
    max_shard: int = DEFAULT_MAX_SHARD,
    dry_run: bool = False,
    force: bool = False,
    progress: Progress | None = None,
) -> RewriteResult:
    """Write aliases once (and, with `by_content`, identical tensors once) as safetensors."""
    source = os.fspath(src)
    target = _resolve_output(source, out, force=force, in_place=False)
    checkpoint = open_checkpoint(source, max_shard=max_shard, torch=True)
    selection = select(checkpoint.tensors, keep=keep, clone=clone, by_content=by_content)
    return _write(
        checkpoint, selection, target, max_shard=max_shard, dry_run=dry_run, progress=progress
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
    target = _resolve_output(source, out, force=force, in_place=in_place)
    checkpoint = open_checkpoint(source, max_shard=max_shard)
    selection = Selection(tuple(OutTensor.same(tensor) for tensor in checkpoint.tensors))
    return _write(
        checkpoint,
        selection,
        target,
        max_shard=max_shard,
        in_place=in_place,
        dry_run=dry_run,
        progress=progress,
    )
