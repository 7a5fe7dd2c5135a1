"""Write commands: plan, stage, write, verify, commit. `reshard` lives here."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, replace

from ckptfix.core.errors import UsageError
from ckptfix.core.sizes import DEFAULT_MAX_SHARD
from ckptfix.ops.report import Report
from ckptfix.plan.select import Selection, select
from ckptfix.plan.shards import ShardPlan, metadata_per_shard, plan_shards
from ckptfix.plan.source import STAGING_FOLDER, Checkpoint, open_checkpoint
from ckptfix.write.cast import CAST_TARGETS
from ckptfix.write.extras import copy_extra
from ckptfix.write.safetensors import (
    OutTensor,
    Progress,
    WriteResult,
    WrittenFile,
    check_free_space,
    checked_headers,
    wrap_os_error,
    write_shards,
)
from ckptfix.write.staging import MARKER, Claim, claim_output, staged

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

    Returns (carried, left out): names kept as they are (special files and .git too), and
    the weight files whose name the new checkpoint takes plus any staging folder a killed
    run left (recognised by its marker, not by its name).
    """
    carried = list(checkpoint.extra_files)
    left_out: list[str] = []
    for name in checkpoint.left_out:
        if os.sep in name:
            continue  # inside a carried folder, and carried with it
        reason = checkpoint.left_out_reasons.get(name)
        (left_out if name in outputs or reason == STAGING_FOLDER else carried).append(name)
    return sorted(carried), left_out


def _nearest_folder(path: str) -> str:
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    return path


def _claim(
    source: str,
    out: str | os.PathLike[str] | None,
    *,
    force: bool,
    replace_any: bool,
    in_place: bool,
    dry_run: bool,
) -> Claim:
    """Check the paths, then claim the output for the run (see staging.claim_output)."""
    if not os.path.exists(source):
        raise UsageError(source, "no such file or directory", "check the path")
    if replace_any and not force:
        raise UsageError(
            "--replace-any", "only applies with --force", "add --force, or drop --replace-any"
        )
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
    try:
        return claim_output(
            target,
            [source],
            force=force,
            replace_any=replace_any,
            in_place=in_place,
            write=not dry_run,
        )
    except OSError as exc:
        raise wrap_os_error(exc, target) from exc


def _write(
    checkpoint: Checkpoint,
    selection: Selection,
    claim: Claim,
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
        left_out_reasons={name: checkpoint.left_out_reasons[name] for name in left_out},
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
    target = claim.out
    headers = checked_headers(plan, tensors, shard_metadata, target) if to != "torch" else []
    if dry_run:
        return RewriteResult(checkpoint.report, plan, None)
    try:
        needed = sum(headers) + plan.total_size
        check_free_space(_nearest_folder(os.path.dirname(claim.real)), needed, target)
        with staged(claim) as staging:

            def advance(done: int, total: int) -> None:
                staging.checkpoint()  # a safe point to stop at, as the copy goes on
                if progress is not None:
                    progress(done, total)

            if to == "torch":
                from ckptfix.write.torch import write_torch_shards

                written = write_torch_shards(
                    plan,
                    tensors,
                    index_metadata,
                    staging.path,
                    target,
                    verify=verify,
                    progress=advance,
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
                    progress=advance,
                )
            staging.checkpoint()
            if MARKER in plan.copied_files:
                staging.unmark()  # the source's own file of that name takes its place
            if checkpoint.is_folder:
                written += copy_extra(
                    checkpoint.path, plan.copied_files, staging.path, link=in_place
                )
            staging.commit()
    except OSError as exc:
        raise wrap_os_error(exc, target) from exc
    kept = set(plan.copied_files) if in_place else set()  # carried over: not replaced
    replaced = tuple(os.path.join(target, name) for name in staging.replaced if name not in kept)
    files = tuple(WrittenFile(os.path.join(target, item.path), item.bytes) for item in written)
    result = WriteResult(target, files, verified=verify, replaced=replaced)
    return RewriteResult(checkpoint.report, plan, result)


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
    replace_any: bool = False,
    progress: Progress | None = None,
) -> RewriteResult:
    """Convert any supported checkpoint (safetensors or PyTorch) to safetensors or torch shards."""
    if to not in ("safetensors", "torch"):
        raise UsageError("--to", f"unknown format {to!r}", "use safetensors or torch")
    if dtype != "keep" and dtype not in CAST_TARGETS:
        raise UsageError("--dtype", f"unknown dtype {dtype!r}", "use bf16, fp16, fp32 or keep")
    source = os.fspath(src)
    with _claim(
        source, out, force=force, replace_any=replace_any, in_place=False, dry_run=dry_run
    ) as claim:
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
            claim,
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
    replace_any: bool = False,
    progress: Progress | None = None,
) -> RewriteResult:
    """Write aliases once (and, with `by_content`, identical tensors once) as safetensors."""
    source = os.fspath(src)
    with _claim(
        source, out, force=force, replace_any=replace_any, in_place=False, dry_run=dry_run
    ) as claim:
        checkpoint = open_checkpoint(source, max_shard=max_shard, torch=True)
        selection = select(checkpoint.tensors, keep=keep, clone=clone, by_content=by_content)
        return _write(
            checkpoint, selection, claim, max_shard=max_shard, dry_run=dry_run, progress=progress
        )


def reshard(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str] | None,
    *,
    max_shard: int = DEFAULT_MAX_SHARD,
    dry_run: bool = False,
    force: bool = False,
    replace_any: bool = False,
    in_place: bool = False,
    progress: Progress | None = None,
) -> RewriteResult:
    """Rewrite a safetensors checkpoint into shards of at most `max_shard` bytes."""
    source = os.fspath(src)
    with _claim(
        source, out, force=force, replace_any=replace_any, in_place=in_place, dry_run=dry_run
    ) as claim:
        checkpoint = open_checkpoint(source, max_shard=max_shard)
        selection = Selection(tuple(OutTensor.same(tensor) for tensor in checkpoint.tensors))
        return _write(
            checkpoint,
            selection,
            claim,
            max_shard=max_shard,
            in_place=in_place,
            dry_run=dry_run,
            progress=progress,
        )
