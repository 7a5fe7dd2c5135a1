"""GGUF rewrites: `reshard` of a GGUF file or llama.cpp split set into a split set (or into
one file, when it fits under --max-shard), and the metadata `convert` keeps of a GGUF
source. Planned by plan.gguf_parts, written by write.gguf; staged, verified and swapped in
as every rewrite is (ops.rewrite)."""

from __future__ import annotations

import os
from dataclasses import replace
from functools import partial

from ckptfix.core.errors import CkptfixError, PlanError
from ckptfix.formats.gguf_encode import (
    alignment_key,
    carried_keys,
    metadata_json,
    split_keys,
    tensor_info,
)
from ckptfix.formats.gguf_file import GgufFile
from ckptfix.formats.gguf_header import DEFAULT_ALIGNMENT
from ckptfix.formats.safetensors import MAX_HEADER_SIZE
from ckptfix.io.source import ByteSource
from ckptfix.ops.inspect import with_remote
from ckptfix.ops.rewrite import (
    RewriteResult,
    carry_files,
    carry_over,
    nearest_folder,
    stage_and_commit,
)
from ckptfix.ops.rewrite_options import WriteOptions
from ckptfix.ops.source import RewriteSource
from ckptfix.plan.gguf_parts import MAX_PARTS, PartEntry, PartKeys, plan_parts
from ckptfix.plan.select import OutTensor
from ckptfix.plan.shards import ShardPlan
from ckptfix.write.gguf import GgufJob, PartWriter, needed_bytes
from ckptfix.write.output import check_free_space, wrap_os_error
from ckptfix.write.safetensors import write_shards
from ckptfix.write.staging import Claim
from ckptfix.write.store_output import StoreClaim, write_shards_to, write_to_store
from ckptfix.write.zerocopy import find_cloning, streamed_labels

# The safetensors `__metadata__` entry that holds a converted GGUF's metadata (as JSON).
GGUF_METADATA_KEY = "gguf"


def head_of(source: RewriteSource) -> tuple[GgufFile, ByteSource]:
    """The GGUF file whose metadata the checkpoint carries (a split set's first part)."""
    label = source.source_files[0]
    record = source.checkpoint.record(label)
    assert record is not None and isinstance(record.read, GgufFile)
    return record.read, source.checkpoint.source(label)


def with_gguf_metadata(source: RewriteSource) -> RewriteSource:
    """The source with its GGUF metadata as one string entry of the safetensors metadata."""
    head, head_source = head_of(source)
    kept = metadata_json(head, head_source, MAX_HEADER_SIZE)
    return replace(source, metadata={GGUF_METADATA_KEY: kept})


def _plan(source: RewriteSource, head: GgufFile, carried: list[bytes], max_size: int) -> ShardPlan:
    entries = [
        PartEntry(t.name, t.nbytes, len(tensor_info(t.name, t.shape, t.dtype, 0)))
        for t in source.tensors
    ]
    split = sum(map(len, split_keys(0, 2, len(entries))))  # their size is fixed
    extra = len(alignment_key(head.alignment)) if head.alignment != DEFAULT_ALIGNMENT else 0
    keys = PartKeys(sum(map(len, carried)) + split, split + extra, split)
    assert source.gguf_stem is not None
    plan = plan_parts(entries, max_size, source.gguf_stem, keys, head.alignment)
    if len(plan.shards) > MAX_PARTS:
        raise PlanError(
            source.path,
            f"--max-shard {max_size} would split it into {len(plan.shards):,} parts; a GGUF "
            f"split set holds at most {MAX_PARTS:,} (split.count is a UINT16)",
            "choose a larger --max-shard",
            rule="gguf-split-count",
        )
    return plan


def _with_files(source: RewriteSource, plan: ShardPlan, options: WriteOptions) -> ShardPlan:
    """What happens to the folder's other entries (as for any rewrite: ops.rewrite)."""
    if options.in_place:
        copied, left_out = carry_over(source, {shard.file for shard in plan.shards})
    else:
        copied, left_out = list(source.extra_files), list(source.left_out)
    return replace(
        plan,
        copied_files=tuple(copied),
        left_out=tuple(left_out),
        left_out_reasons={name: source.left_out_reasons[name] for name in left_out},
    )


def write_gguf(
    source: RewriteSource, claim: Claim | StoreClaim, options: WriteOptions
) -> RewriteResult:
    """Plan the parts, then stage, write, verify and commit them (to a store: stream them,
    see store_output.write_to_store)."""
    head, head_source = head_of(source)
    carried = carried_keys(head, head_source)
    plan = _with_files(source, _plan(source, head, carried, options.max_shard), options)
    report = with_remote(source.report, source.checkpoint)
    if options.dry_run:
        destination = claim.out if isinstance(claim, StoreClaim) else None
        return RewriteResult(report, plan, None, destination)
    tensors = {tensor.name: OutTensor.same(tensor) for tensor in source.tensors}
    job = GgufJob(
        tensors,
        [{}] * len(plan.shards),
        {},
        source.checkpoint.source,
        staging="",
        out=claim.out,
        verify=options.verify,
        progress=options.progress,
        version=head.version,
        alignment=head.alignment,
        carried=tuple(carried),
    )
    if isinstance(claim, StoreClaim):
        carry = partial(carry_files, source, plan, options=options)
        written = write_to_store(plan, job, claim, carry, partial(write_shards_to, to="gguf"))
        return RewriteResult(report, plan, written, claim.out)
    try:
        folder = nearest_folder(os.path.dirname(claim.real))  # where staging will be
        job.cloning = find_cloning(streamed_labels(tensors.values()), job.sources, folder)
        check_free_space(folder, needed_bytes(plan, job), claim.out)
        write = partial(write_shards, writer_type=PartWriter)
        return stage_and_commit(source, plan, job, claim, options, write)
    except CkptfixError:  # already one line (an unreadable file is an OSError too)
        raise
    except OSError as exc:
        raise wrap_os_error(exc, claim.out) from exc
