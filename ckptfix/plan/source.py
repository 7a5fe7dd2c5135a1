"""Opening a checkpoint for rewriting: which tensors, in which order, and which other files."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ckptfix import checks
from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.errors import CkptfixError, UnsupportedFormatError, UsageError
from ckptfix.core.findings import Severity, split_message
from ckptfix.core.memory import paused_gc
from ckptfix.core.sizes import DEFAULT_MAX_SHARD
from ckptfix.core.tensor import TensorInfo
from ckptfix.formats.base import ReadOptions
from ckptfix.layouts.choice import Choice
from ckptfix.layouts.diffusers import no_weights_message
from ckptfix.layouts.names import parse_weight_name
from ckptfix.ops.inspect import report_of
from ckptfix.ops.load import load
from ckptfix.ops.report import Report
from ckptfix.plan.repair import ASIDE
from ckptfix.write.extras import special_files
from ckptfix.write.staging import is_staging_folder

# Why an entry of a model folder is not copied to -o (`Checkpoint.left_out_reasons`).
OTHER_WEIGHTS = "other weight file"
VERSION_CONTROL = "version control"  # a clone of a Hub repository keeps every LFS object there
STAGING_FOLDER = "ckptfix staging folder"  # a killed run's, recognised by its marker
NOT_REGULAR = "not a regular file"  # FIFO, socket, device: never opened
ASIDE_FOLDER = "what ckptfix fix took out"  # plan.repair.ASIDE: stale weights, never copied


@dataclass(frozen=True)
class RewriteSource:
    """What a rewrite reads: the chosen checkpoint's tensors in source order, its metadata,
    and the other entries of the folder (copied or left out, with the reason)."""

    path: str
    is_folder: bool
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str]
    index_metadata: dict[str, Any]
    source_files: tuple[str, ...]
    extra_files: tuple[str, ...]
    left_out: tuple[str, ...]
    report: Report
    checkpoint: Checkpoint = field(repr=False, compare=False)
    # Why each left-out entry is left out; nested special files are named by relative path.
    left_out_reasons: dict[str, str] = field(default_factory=dict)
    # Output dtype of a tensor unless --dtype says otherwise (a training layout's choice).
    dtypes: dict[str, str] = field(default_factory=dict)
    # The family's name, kept by the output: `diffusion_pytorch_model`, variant `fp16`.
    stem: str = "model"
    variant: str | None = None

    @property
    def training_checkpoint(self) -> bool:
        return any(item.code == "nested-checkpoint" for item in self.report.findings)


class InputRefusedError(CkptfixError):
    """The input has errors that make a faithful rewrite impossible; `rule` is the code of
    the first error finding."""

    kind = "input-refused"


def refuse_if_errors(report: Report, files: set[str] | None = None) -> None:
    """Raise on the first error finding (about `files` only, when given)."""
    errors = [
        item
        for item in report.findings
        if item.severity is Severity.ERROR
        and (files is None or item.file is None or item.file in files)
    ]
    if not errors:
        return
    first = errors[0]
    what, rule, fix = split_message(first.message)
    if len(errors) > 1:
        more = f"{len(errors) - 1} more error(s), see `ckptfix inspect`"
        fix = f"{fix}; {more}" if fix else more
    raise InputRefusedError(first.file, what, fix, rule=rule or first.code)


def _merged_metadata(checkpoint: Checkpoint, paths: list[str]) -> dict[str, str]:
    """String metadata of the safetensors sources (torch files have none): the first
    file's value wins."""
    merged: dict[str, str] = {}
    for path in paths:
        record = checkpoint.record(path)
        for key, value in ((record.metadata if record else None) or {}).items():
            merged.setdefault(key, value)
    return merged


def open_checkpoint(
    path: str,
    *,
    max_shard: int = DEFAULT_MAX_SHARD,
    read: ReadOptions | None = None,
    torch: bool = False,
) -> RewriteSource:
    """Load a checkpoint file or model folder once, check it, and refuse it if it has
    errors. Only safetensors is accepted unless `torch` allows PyTorch files too (and
    training checkpoint folders, which hold PyTorch data)."""
    with paused_gc():  # load, checks and choice: several passes over every tensor
        checkpoint = load(path, read)
        report = report_of(checkpoint, checks.run(checkpoint, checks.CheckOptions(max_shard)))
        return choose_source(checkpoint, report, torch=torch)


def choose_source(checkpoint: Checkpoint, report: Report, *, torch: bool = False) -> RewriteSource:
    """The checkpoint a rewrite (or a hash) reads from what `load` found: the family chosen,
    its tensors in source order; refused if it has errors (see open_checkpoint)."""
    path = checkpoint.path
    if checkpoint.training is not None:
        return _training_source(checkpoint, report, torch=torch)
    if checkpoint.kind != "folder":
        return _single_file(checkpoint, report, torch=torch)
    choice = _checked_choice(checkpoint, torch=torch)
    family = choice.family
    assert family is not None  # _checked_choice refuses a folder without one
    names, index_metadata = _family_files(checkpoint, choice)
    files = [os.path.join(path, name) for name in names]
    # Errors in other weight families do not stop a rewrite that leaves them out.
    index_file = {os.path.join(path, choice.index)} if choice.index else set()
    refuse_if_errors(report, set(files) | index_file | {path})
    order = {file: position for position, file in enumerate(files)}
    tensors = sorted(
        (tensor for tensor in checkpoint.tensors if tensor.file in order),
        key=lambda tensor: (order[tensor.file], tensor.byte_range),
    )
    ours = set(names) | ({choice.index} if choice.index else set())
    extra, reasons = other_entries(checkpoint, ours)
    left_out = sorted(reasons)
    return RewriteSource(
        path=path,
        is_folder=True,
        tensors=tuple(tensors),
        metadata=_merged_metadata(checkpoint, files),
        index_metadata=index_metadata,
        source_files=tuple(files),
        extra_files=tuple(name for name in extra if name not in reasons),
        left_out=tuple(left_out),
        report=report,
        checkpoint=checkpoint,
        left_out_reasons={name: reasons[name] for name in left_out},
        stem=family.stem if family.stem != "loose" else "model",
        variant=family.variant,
    )


def _checked_choice(checkpoint: Checkpoint, *, torch: bool) -> Choice:
    """The folder's checkpoint as its loader would choose it; refused when there are several
    separate ones, or when it is PyTorch and a safetensors-only command asked."""
    choice: Choice = checkpoint.choice
    path = checkpoint.path
    if len(choice.separate) > 1:
        listed = ", ".join(choice.separate[:3]) + (" ..." if len(choice.separate) > 3 else "")
        raise UsageError(
            path,
            f"folder holds {len(choice.separate)} separate checkpoints ({listed}), which are "
            "never merged",
            f"pass the one to use, e.g. {os.path.join(path, choice.separate[0])}",
        )
    if choice.family is None:
        raise InputRefusedError(path, no_weights_message(path))
    if not torch and choice.family.ext != "safetensors":
        raise UnsupportedFormatError(
            path,
            f"the folder's checkpoint is {choice.label}, not safetensors",
            "use `ckptfix convert`",
        )
    return choice


def _single_file(checkpoint: Checkpoint, report: Report, *, torch: bool) -> RewriteSource:
    refuse_if_errors(report)
    allowed = ("safetensors", "torch-zip", "torch-legacy") if torch else ("safetensors",)
    if report.format not in allowed:
        raise UnsupportedFormatError(
            checkpoint.path, f"file is {report.format}, not safetensors", "use `ckptfix convert`"
        )
    return RewriteSource(
        path=checkpoint.path,
        is_folder=False,
        tensors=checkpoint.tensors,
        metadata=_merged_metadata(checkpoint, [checkpoint.path]),
        index_metadata={},
        source_files=(checkpoint.path,),
        extra_files=(),
        left_out=(),
        report=report,
        checkpoint=checkpoint,
        **_file_name(checkpoint.path),
    )


def _file_name(path: str) -> dict[str, Any]:
    """A file named as a family's (`diffusion_pytorch_model.fp16.safetensors`) keeps its
    stem and variant in the output; any other name becomes `model`."""
    parsed = parse_weight_name(os.path.basename(path))
    if parsed is None:
        return {}
    return {"stem": parsed.stem, "variant": parsed.variant}


def _training_source(checkpoint: Checkpoint, report: Report, *, torch: bool) -> RewriteSource:
    """A DCP or DeepSpeed folder: the model's tensors in the model's order, nothing else of
    the folder copied (its other files are training state)."""
    assert checkpoint.training is not None
    if not torch:
        raise UnsupportedFormatError(
            checkpoint.path,
            f"folder is a {checkpoint.kind} training checkpoint, not safetensors",
            "use `ckptfix convert`",
        )
    refuse_if_errors(report)
    return RewriteSource(
        path=checkpoint.path,
        is_folder=True,
        tensors=checkpoint.tensors,
        metadata={},
        index_metadata={},
        source_files=tuple(record.label for record in checkpoint.files),
        extra_files=(),
        left_out=(),
        report=report,
        checkpoint=checkpoint,
        dtypes=dict(checkpoint.training.dtypes),
    )


def _family_files(checkpoint: Checkpoint, choice: Choice) -> tuple[list[str], dict[str, Any]]:
    """The chosen checkpoint's files (from its index when it has one) and index metadata."""
    if choice.index is None:
        return list(choice.files), {}
    label = os.path.join(checkpoint.path, choice.index)
    record = next(record for record in checkpoint.indexes if record.label == label)
    if record.index is None:  # refused below by its corrupt-file finding
        return [], {}
    metadata = {k: v for k, v in record.index.metadata.items() if k != "total_size"}
    return sorted(record.index.shard_names), metadata


def other_entries(checkpoint: Checkpoint, ours: set[str]) -> tuple[list[str], dict[str, str]]:
    """The folder's entries other than `ours`: those copied, and those left out with the
    reason."""
    path, layout = checkpoint.path, checkpoint.layout
    weights = set(layout.weight_files) | {f.index for f in layout.families if f.index}
    reasons: dict[str, str] = {}
    extra = []
    remote = checkpoint.remote  # a URL's folder (io.remote_folder), listed through it
    for entry in sorted(remote.listdir(path) if remote is not None else os.listdir(path)):
        if entry in ours:
            continue
        if entry in weights:
            reasons[entry] = OTHER_WEIGHTS
        elif entry == ".git":
            reasons[entry] = VERSION_CONTROL
        elif entry == ASIDE:
            reasons[entry] = ASIDE_FOLDER
        elif is_staging_folder(os.path.join(path, entry)):
            reasons[entry] = STAGING_FOLDER
        else:
            extra.append(entry)
    if remote is None:  # a remote folder holds no FIFOs, sockets or devices
        reasons.update(dict.fromkeys(special_files(path, extra), NOT_REGULAR))
    return extra, reasons
