"""Write commands: plan, stage, write, verify, commit. `reshard` lives here."""

from __future__ import annotations

import json
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, replace
from functools import partial
from operator import attrgetter
from typing import Any

from ckptfix.checks.config import declared_ties
from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.errors import CkptfixError, UsageError, VerificationError
from ckptfix.core.memory import paused_gc
from ckptfix.core.tensor import TensorInfo
from ckptfix.formats.base import ReadOptions
from ckptfix.io.folder import LOCAL
from ckptfix.layouts.huggingface import MAX_CONFIG_SIZE
from ckptfix.ops.inspect import with_remote
from ckptfix.ops.report import Report
from ckptfix.ops.rewrite_claim import Destination, claim
from ckptfix.ops.rewrite_options import (
    ConvertOptions,
    DedupeOptions,
    PartRequest,
    ReshardOptions,
    RewriteOptions,
    WriteOptions,
)
from ckptfix.ops.source import STAGING_FOLDER, RewriteSource, open_checkpoint, recorded
from ckptfix.plan.alias_record import DROPPED_KEY
from ckptfix.plan.config_dtype import TARGET_NAMES, ConfigEdit, retype
from ckptfix.plan.coverage import missing_name
from ckptfix.plan.expansion import check_expansion
from ckptfix.plan.select import OutTensor, Selection, SelectOptions, out_sizes, select
from ckptfix.plan.shards import (
    PlannedShard,
    ShardPlan,
    metadata_per_shard,
    output_name,
    plan_shards,
    with_shared,
)
from ckptfix.write.cast import CAST_TARGETS
from ckptfix.write.config import config_text, retype_config
from ckptfix.write.extras import carried_as_file, copy_extra, write_generated
from ckptfix.write.output import check_free_space, check_names, check_quantized, wrap_os_error
from ckptfix.write.part_records import PartRecord
from ckptfix.write.parts import CommitCheck
from ckptfix.write.remote_extras import download_extra
from ckptfix.write.results import WriteResult, WrittenFile
from ckptfix.write.safetensors import ShardJob, checked_headers, write_shards
from ckptfix.write.staging import MARKER, Claim, staged
from ckptfix.write.store_output import StoreClaim, write_shards_to, write_to_store
from ckptfix.write.torch import check_torch_dtypes, write_torch_shards
from ckptfix.write.zerocopy import find_cloning, shareable_bytes, streamed_labels

_NAME = attrgetter("name")


@dataclass(frozen=True)
class RewriteResult:
    """The source's report, the plan, and what was written (None for --dry-run)."""

    report: Report
    plan: ShardPlan
    written: WriteResult | None
    destination: str | None = None  # an object-store OUT, as it may be printed
    part: PartRecord | None = None  # what a slice of a split run wrote (ops.rewrite_parts)
    commit: CommitCheck | None = None  # how --commit checked the parts it published

    def to_dict(self) -> dict[str, object]:
        document = self.report.to_dict()
        document["plan"] = self.plan.to_dict()
        document["written"] = self.written.to_dict() if self.written else None
        if self.destination is not None:
            document["destination"] = self.destination
        if self.part is not None:
            document["part"] = {"part": self.part.part, "of": self.part.count,
                                "plan_digest": self.part.digest}  # fmt: skip
        if self.commit is not None:
            document["commit"] = self.commit.to_dict()
        return document


def carry_over(checkpoint: RewriteSource, outputs: set[str]) -> tuple[list[str], list[str]]:
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


def nearest_folder(path: str) -> str:
    while not os.path.isdir(path):
        path = os.path.dirname(path)
    return path


def check_space(
    plan: ShardPlan, job: ShardJob, headers: Sequence[int] | None, claim: Claim
) -> None:
    """Refuse a file system without room for the output where its staging folder will be,
    before anything is written; `headers`: the safetensors shards' header sizes (None for
    torch output), whose blocks shared with the source (cloned) take no space."""
    folder = nearest_folder(os.path.dirname(claim.real))
    needed = sum(headers or ()) + plan.total_size
    if headers is not None:
        job.cloning = find_cloning(streamed_labels(job.tensors.values()), job.sources, folder)
        needed -= shareable_bytes(plan, job.tensors, headers, job.cloning)
        needed += len(plan.shards) * (job.cloning.block or 0)  # padding
    check_free_space(folder, needed, claim.out)


def _plan(source: RewriteSource, selection: Selection, options: WriteOptions) -> ShardPlan:
    """Shards for a selection, and what happens to the folder's other entries."""
    ext = "bin" if options.to == "torch" else "safetensors"
    sizes = list(zip(map(_NAME, selection.tensors), out_sizes(selection.tensors), strict=True))
    name = output_name(source.stem, source.variant, ext)
    plan = plan_shards(sizes, options.max_shard, name)
    outputs = {shard.file for shard in plan.shards} | (
        {plan.index_file} if plan.index_file else set()
    )
    if options.in_place:
        copied, left_out = carry_over(source, outputs)
    else:
        copied, left_out = list(source.extra_files), list(source.left_out)
    dropped, shared = dict(selection.dropped), {}
    if options.to == "torch":  # a .bin keeps each alias as a name of its own
        dropped, shared = {}, dropped
        plan = replace(plan, shards=_with_aliases(source, selection, plan, shared))
    return replace(
        plan,
        copied_files=tuple(copied),
        left_out=tuple(left_out),
        left_out_reasons={name: source.left_out_reasons[name] for name in left_out},
        dropped=dropped,
        renamed=dict(selection.renamed),
        dropped_bytes=selection.dropped_bytes if dropped else 0,
        excluded=selection.excluded,
        kept_equal=selection.kept_equal,
        shared=shared,
        config_edits=_config_edits(source, copied, options.config_dtype, options.in_place),
    )


def _with_aliases(
    source: RewriteSource, selection: Selection, plan: ShardPlan, shared: dict[str, str]
) -> tuple[PlannedShard, ...]:
    """The shards with each alias listed beside its kept tensor, sharing its storage."""
    excluded = set(selection.excluded)
    declared = source.declared
    names = [selection.renamed.get(t.name, t.name) for t in declared]
    kept = [n for t, n in zip(declared, names, strict=True) if t.name not in excluded]
    return with_shared(plan.shards, kept, shared)


def _config_edits(
    source: RewriteSource, copied: Sequence[str], dtype: str | None, in_place: bool
) -> tuple[ConfigEdit, ...]:
    """The dtype values a cast changes in the config.json that is carried to the output: only
    one carried as a file of its own; a link is carried as a link, its target never read."""
    record = source.checkpoint.config
    if dtype is None or "config.json" not in copied or record is None or record.config is None:
        return ()
    remote = source.checkpoint.remote
    if remote is None and not carried_as_file(source.path, "config.json", link=in_place):
        return ()
    path = record.label
    data = (remote or LOCAL).read_small(path, path, MAX_CONFIG_SIZE, "config")
    return retype(config_text(data, path), dtype)[1]


def _metadata(source: RewriteSource, plan: ShardPlan) -> tuple[dict[str, str], dict[str, Any]]:
    """Header metadata ("format" added) and index metadata, with the dropped -> kept record
    where loaders and people can find it (torch output drops nothing: see _plan)."""
    metadata = dict(source.metadata)
    metadata.setdefault("format", "pt")  # an existing "np" or "mlx" is kept
    index_metadata = dict(source.index_metadata)
    if plan.dropped:
        if plan.index_file is None:
            metadata[DROPPED_KEY] = json.dumps(plan.dropped, sort_keys=True)
        else:
            index_metadata[DROPPED_KEY] = dict(sorted(plan.dropped.items()))
    return metadata, index_metadata


def _write(
    source: RewriteSource, selection: Selection, claim: Destination, options: WriteOptions
) -> RewriteResult:
    """Plan the shards for a selection, then stage, write, verify and commit them."""
    with paused_gc():  # several objects per tensor, none in a cycle
        plan = _plan(source, selection, options)
        lost = missing_name(source.declared, selection, plan)
        if lost is not None:  # the names' verification: the writers verify the output is the plan
            raise VerificationError(
                claim.out,
                f"the output would not keep every name: {lost}",
                "this is a bug; please report it",
            )
        metadata, index_metadata = _metadata(source, plan)
        shard_metadata, scope = metadata_per_shard(metadata, len(plan.shards))
        plan = replace(plan, metadata_scope=scope)
        tensors = dict(zip(map(_NAME, selection.tensors), selection.tensors, strict=True))
        torch = options.to == "torch"
        check_names(selection.tensors)
        check_quantized(selection.tensors, claim.out)
        check_expansion(selection.tensors, allowed=options.allow_expansion)
        if torch:
            check_torch_dtypes(selection.tensors, claim.out)
        headers = [] if torch else checked_headers(plan, tensors, shard_metadata, claim.out)
    if options.dry_run:
        destination = claim.out if isinstance(claim, StoreClaim) else None
        return RewriteResult(with_remote(source.report, source.checkpoint), plan, None, destination)
    if options.split is not None:  # --part, --commit, --executor ray (ops.rewrite_parts)
        from ckptfix.ops.rewrite_parts import write_split

        planned = (tensors, shard_metadata, index_metadata)
        done = write_split(source, plan, claim, options, planned)
        if done is not None:
            return done
    if isinstance(claim, StoreClaim):
        return _to_store(source, plan, claim, options, (tensors, shard_metadata, index_metadata))
    job = ShardJob(
        tensors,
        shard_metadata,
        index_metadata,
        source.checkpoint.source,
        staging="",
        out=claim.out,
        verify=options.verify,
    )
    try:
        check_space(plan, job, None if torch else headers, claim)
        return stage_and_commit(source, plan, job, claim, options)
    except CkptfixError:  # already one line (an unreadable file is an OSError too)
        raise
    except OSError as exc:
        raise wrap_os_error(exc, claim.out) from exc


def _to_store(
    source: RewriteSource,
    plan: ShardPlan,
    claim: StoreClaim,
    options: WriteOptions,
    planned: tuple[dict[str, OutTensor], Sequence[Mapping[str, str]], dict[str, Any]],
) -> RewriteResult:
    """The write step of an object-store OUT (write.store_output)."""
    tensors, shard_metadata, index_metadata = planned
    job = ShardJob(
        tensors, shard_metadata, index_metadata, source.checkpoint.source, staging="",
        out=claim.out, progress=options.progress,
    )  # fmt: skip
    shards = partial(write_shards_to, to=options.to)
    written = write_to_store(
        plan, job, claim, lambda folder: carry_files(source, plan, folder, options), shards
    )
    return RewriteResult(with_remote(source.report, source.checkpoint), plan, written, claim.out)


def carry_files(
    source: RewriteSource, plan: ShardPlan, folder: str, options: WriteOptions
) -> list[WrittenFile]:
    """The files beside the weights, carried into `folder`: copied from a local folder or
    downloaded from a remote one, the rewrite's own (generated) ones, config.json retyped."""
    written: list[WrittenFile] = []
    copied = [name for name in plan.copied_files if name not in source.generated]
    if source.is_folder and source.checkpoint.remote is not None:
        written += download_extra(source.checkpoint.remote, source.path, copied, folder)
    elif source.is_folder:
        written += copy_extra(source.path, copied, folder, link=options.in_place)
    written += write_generated(folder, source.generated)
    retype_config(folder, plan.config_edits, MAX_CONFIG_SIZE)
    return written


Write = Callable[[ShardPlan, ShardJob], list[WrittenFile]]


def stage_and_commit(
    source: RewriteSource,
    plan: ShardPlan,
    job: ShardJob,
    claim: Claim,
    options: WriteOptions,
    write: Write = write_shards,
) -> RewriteResult:
    with staged(claim) as staging:

        def advance(done: int, total: int) -> None:
            staging.checkpoint()  # a safe point to stop at, as the copy goes on
            if options.progress is not None:
                options.progress(done, total)

        job.staging, job.progress = staging.path, advance
        written = write_torch_shards(plan, job) if options.to == "torch" else write(plan, job)
        staging.checkpoint()
        if MARKER in plan.copied_files:
            staging.unmark()  # the source's own file of that name takes its place
        written += carry_files(source, plan, staging.path, options)
        staging.commit()
    target = claim.out
    kept = set(plan.copied_files) if options.in_place else set()  # carried over: not replaced
    replaced = tuple(os.path.join(target, name) for name in staging.replaced if name not in kept)
    files = tuple(WrittenFile(os.path.join(target, item.path), item.bytes) for item in written)
    account = None if options.to == "torch" else job.tally.account(job.cloning, plan.total_size)
    result = WriteResult(target, files, options.verify, replaced, account)
    return RewriteResult(with_remote(source.report, source.checkpoint), plan, result)


@contextmanager
def _opened(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str] | None,
    options: RewriteOptions,
    *,
    in_place: bool = False,
    **open_options: Any,
) -> Iterator[tuple[RewriteSource, Destination]]:
    """Claim the output, then load and check the source once; release both at the end."""
    source = os.fspath(src)
    if options.is_split and in_place:
        raise UsageError("--in-place", "cannot be split into parts or tasks", "use -o OUT")
    if options.target is not None and out is not None:  # a task: the driver claimed OUT
        claimed: Destination = Claim(os.fspath(out), os.fspath(out), None, None)
    else:
        claimed = claim(source, out, options, in_place=in_place)
    with claimed:
        opened = open_checkpoint(source, max_shard=options.shard_bytes, **open_options)
        with opened.checkpoint:
            yield recorded(opened), claimed


def _split(
    command: str, src: str | os.PathLike[str], out: object, options: RewriteOptions
) -> PartRequest | None:
    """How the tasks of a split run make the same plan again (None: not split)."""
    if not options.is_split:
        return None
    where = os.fspath(out) if isinstance(out, (str, os.PathLike)) else ""
    return PartRequest(command, os.fspath(src), os.getcwd(), where, options)


def convert(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str] | None,
    options: ConvertOptions | None = None,
) -> RewriteResult:
    """Convert any supported checkpoint (safetensors or PyTorch) to safetensors or torch shards."""
    options = options or ConvertOptions()
    if options.to not in ("safetensors", "torch"):
        raise UsageError("--to", f"unknown format {options.to!r}", "use safetensors or torch")
    if options.dtype != "keep" and options.dtype not in CAST_TARGETS:
        raise UsageError(
            "--dtype", f"unknown dtype {options.dtype!r}", "use bf16, fp16, fp32 or keep"
        )
    if options.dequantize is not None and options.dequantize not in CAST_TARGETS:
        what = f"unknown dtype {options.dequantize!r}"
        raise UsageError("--dequantize", what, "use bf16, fp16 or fp32")
    with _opened(
        src,
        out,
        options,
        read=ReadOptions(key=options.key, zero_weights=options.zero_weights),
        torch=True,
    ) as (opened, claim):
        opened = _gguf_metadata_kept(opened, options.to)
        if options.to_hf is not None:
            from ckptfix.ops.to_hf import hf_source

            opened = hf_source(opened, options.to_hf, CAST_TARGETS.get(options.dtype))
        choice = SelectOptions(
            exclude=tuple(options.exclude),
            strip_prefix=options.strip_prefix,
            training_checkpoint=opened.training_checkpoint,
            keep=options.keep,
            clone=options.clone,
            dtype=CAST_TARGETS.get(options.dtype),
            dtypes=opened.dtypes,
            recorded=opened.aliases,
            dequantize=CAST_TARGETS.get(options.dequantize or ""),
        )
        selection = select(opened.declared, choice, opened.equal_groups)
        write = WriteOptions(
            options.shard_bytes,
            options.to,
            dry_run=options.dry_run,
            verify=options.verify,
            progress=options.progress,
            config_dtype=TARGET_NAMES.get(CAST_TARGETS.get(options.dtype, "")),
            allow_expansion=options.allow_expansion,
            split=_split("convert", src, out, options),
        )
        return _write(opened, selection, claim, write)


def _config_ties(checkpoint: Checkpoint, tensors: Sequence[TensorInfo]) -> dict[str, str]:
    """{head: embedding} for the tie config.json declares; {} without a readable config."""
    record = checkpoint.config
    if record is None or record.config is None:
        return {}
    return declared_ties(record.config, [t.name for t in tensors])


def _gguf_metadata_kept(opened: RewriteSource, to: str) -> RewriteSource:
    """A GGUF source written as safetensors keeps its metadata as one JSON header entry, by
    every command that writes it so (torch files have no place for it)."""
    if opened.gguf_stem is None or to != "safetensors":
        return opened
    from ckptfix.ops.rewrite_gguf import with_gguf_metadata

    return with_gguf_metadata(opened)


def dedupe(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str] | None,
    options: DedupeOptions | None = None,
) -> RewriteResult:
    """Write aliases once (and, with `by_content`, identical tensors once) as safetensors."""
    options = options or DedupeOptions()
    with _opened(src, out, options, torch=True) as (opened, claim):
        opened = _gguf_metadata_kept(opened, "safetensors")
        choice = SelectOptions(
            keep=options.keep,
            clone=options.clone,
            by_content=options.by_content,
            ties=_config_ties(opened.checkpoint, opened.tensors),
            recorded=opened.aliases,
        )
        selection = select(opened.declared, choice, opened.equal_groups)
        write = WriteOptions(
            options.shard_bytes,
            dry_run=options.dry_run,
            progress=options.progress,
            allow_expansion=options.allow_expansion,
            split=_split("dedupe", src, out, options),
        )
        return _write(opened, selection, claim, write)


def _as_they_are(source: RewriteSource) -> Selection:
    """Every stored tensor as it is, and every name its record dropped still dropped."""
    with paused_gc():  # an object per tensor, none in a cycle
        tensors = OutTensor.unchanged(source.tensors)
    if not source.aliases:
        return Selection(tensors)
    nbytes = {tensor.name: tensor.nbytes for tensor in source.tensors}
    return Selection(
        tensors,
        dropped=dict(source.aliases),
        dropped_bytes=sum(nbytes[kept] for kept in source.aliases.values()),
    )


def reshard(
    src: str | os.PathLike[str],
    out: str | os.PathLike[str] | None,
    options: ReshardOptions | None = None,
) -> RewriteResult:
    """Rewrite a safetensors checkpoint into shards of at most `max_shard` bytes, or a GGUF
    file or split set into a llama.cpp split set (one file when it fits)."""
    options = options or ReshardOptions()
    with _opened(src, out, options, in_place=options.in_place, gguf=True) as (opened, claim):
        write = WriteOptions(
            options.shard_bytes,
            in_place=options.in_place,
            dry_run=options.dry_run,
            progress=options.progress,
            split=_split("reshard", src, out, options),
        )
        if opened.gguf_stem is not None:  # a GGUF file or split set: GGUF parts
            from ckptfix.ops.rewrite_gguf import write_gguf

            if write.split is not None:
                raise UsageError(
                    claim.out,
                    "GGUF output is written by one process",
                    "write it without --part or --executor ray",
                )
            return write_gguf(opened, claim, replace(write, to="gguf"))
        return _write(opened, _as_they_are(opened), claim, write)
