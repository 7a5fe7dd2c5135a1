"""Opening a checkpoint for rewriting: which tensors, in which order, and which other files."""

from __future__ import annotations

import os
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from typing import Any

from ckptfix import checks
from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.errors import UNREADABLE, CkptfixError, UnsupportedFormatError, UsageError
from ckptfix.core.findings import Severity, split_message
from ckptfix.core.memory import paused_gc
from ckptfix.core.sizes import DEFAULT_MAX_SHARD
from ckptfix.core.tensor import TensorInfo
from ckptfix.formats.base import ReadOptions
from ckptfix.io.folder import LOCAL
from ckptfix.layouts import model_files
from ckptfix.layouts.choice import Choice
from ckptfix.layouts.diffusers import no_weights_message
from ckptfix.layouts.gguf import SPLIT_KIND
from ckptfix.layouts.names import GGUF, FolderLayout, parse_weight_name
from ckptfix.ops.inspect import report_of
from ckptfix.ops.load import load
from ckptfix.ops.report import Report
from ckptfix.plan.alias_record import FIX, check_record, read_record, without_record
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
    # dropped -> kept: the names its ckptfix.dropped record declares (see `recorded`)
    aliases: dict[str, str] = field(default_factory=dict)
    # A GGUF checkpoint: the name its rewrites as GGUF keep (`name` of `name.gguf` or of a
    # split set's `name-00001-of-00003.gguf`); None for every other input.
    gguf_stem: str | None = None
    # Files of OUT made by the rewrite rather than copied (config.json of `convert --to-hf`),
    # by name; they are listed among extra_files.
    generated: dict[str, bytes] = field(default_factory=dict)

    @property
    def training_checkpoint(self) -> bool:
        """Names as a training framework saved them: `model.` counts as a wrapper prefix."""
        nested = any(item.code == "nested-checkpoint" for item in self.report.findings)
        return nested or checks.lightning_saved(self.checkpoint)

    def equal_groups(self, tensors: Sequence[TensorInfo]) -> list[list[TensorInfo]]:
        """The tensors with equal dtype, shape and bytes, read from this checkpoint's files
        (what `plan.select` merges with `by_content`)."""
        return checks.values.content_groups(tensors, self.checkpoint.source)

    @property
    def declared(self) -> tuple[TensorInfo, ...]:
        """Every name the checkpoint declares, in source order: each stored tensor, then
        the names its record dropped for it (each the kept tensor under its own name)."""
        if not self.aliases:
            return self.tensors  # no record: the stored tensors (1,000,000 occur), not a copy
        dropped_for: dict[str, list[str]] = {}
        for dropped, kept in self.aliases.items():
            dropped_for.setdefault(kept, []).append(dropped)
        return tuple(
            named
            for tensor in self.tensors
            for named in (
                tensor,
                *(replace(tensor, name=n) for n in dropped_for.get(tensor.name, ())),
            )
        )


def recorded(source: RewriteSource, fix: str = FIX) -> RewriteSource:
    """The source with its ckptfix.dropped record read and checked (`aliases`), and taken
    out of its metadata: a rewrite records the names it drops itself."""
    path = source.checkpoint.path
    aliases = read_record(source.metadata, source.index_metadata, path, fix)
    if aliases:  # (no record: nothing to check against the stored names)
        check_record(aliases, {tensor.name: tensor for tensor in source.tensors}, path, fix)
    return replace(
        source,
        aliases=aliases,
        metadata=without_record(source.metadata),
        index_metadata=without_record(source.index_metadata),
    )


class InputRefusedError(CkptfixError, ValueError):
    """The input has errors that make a faithful rewrite impossible; `code` is the first
    error finding's code, `rule` its rule (or code). A file the OS would not let us read
    (rule unreadable) makes an UnreadableInputError, a PermissionError."""

    kind = "input-refused"

    @classmethod
    def of(
        cls, path: str | None, what: str, fix: str | None, *, rule: str, code: str | None
    ) -> InputRefusedError:
        kind = UnreadableInputError if rule == UNREADABLE else cls
        error = kind(path, what, fix, rule=rule)
        error.code = code
        return error


class UnreadableInputError(InputRefusedError, PermissionError):
    """A file of the input could not be opened or listed (permissions, another user's)."""


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
    raise InputRefusedError.of(first.file, what, fix, rule=rule or first.code, code=first.code)


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
    gguf: bool = False,
) -> RewriteSource:
    """Load a checkpoint file or model folder once, check it, and refuse it if it has
    errors. Only safetensors is accepted unless `torch` allows every other input too
    (PyTorch files, training checkpoint folders, GGUF), or `gguf` allows GGUF."""
    with paused_gc():  # load, checks and choice: several passes over every tensor
        checkpoint = load(path, read)
        report = report_of(checkpoint, checks.run(checkpoint, checks.CheckOptions(max_shard)))
        return choose_source(checkpoint, report, torch=torch, gguf=gguf)


def choose_source(
    checkpoint: Checkpoint, report: Report, *, torch: bool = False, gguf: bool = False
) -> RewriteSource:
    """The checkpoint a rewrite (or a hash) reads from what `load` found: the family chosen,
    its tensors in source order; refused if it has errors (see open_checkpoint)."""
    path = checkpoint.path
    if checkpoint.training is not None:
        return _training_source(checkpoint, report, torch=torch)
    if checkpoint.kind in (GGUF, SPLIT_KIND):
        return _gguf_source(checkpoint, report, allowed=torch or gguf)
    if checkpoint.kind != "folder":
        return _single_file(checkpoint, report, torch=torch)
    choice = _checked_choice(checkpoint, torch=torch, gguf=gguf)
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
        stem=family.stem if family.stem != "loose" and family.ext != GGUF else "model",
        variant=family.variant,
        gguf_stem=gguf_stem(family.stem, names) if family.ext == GGUF else None,
    )


def gguf_stem(stem: str, names: list[str]) -> str:
    """The name a GGUF checkpoint's rewrites keep: a split set's prefix, a file's name; a
    file named only `.gguf` has none, and its parts (`-00001-of-00003.gguf`) would not be
    named as parts, so they get the default name."""
    return (names[0].removesuffix(".gguf") if stem == "loose" else stem) or "model"


def _gguf_source(checkpoint: Checkpoint, report: Report, *, allowed: bool) -> RewriteSource:
    """A GGUF file, or a split set named by its first part: its tensors in file order."""
    refuse_if_errors(report)
    path = checkpoint.path
    if not allowed:
        raise UnsupportedFormatError(path, "file is GGUF, not safetensors", "use `ckptfix convert`")
    labels = tuple(record.label for record in checkpoint.files)
    names = [os.path.basename(label) for label in labels]
    stem = checkpoint.layout.families[0].stem if checkpoint.kind == SPLIT_KIND else "loose"
    return RewriteSource(
        path=path,
        is_folder=False,
        tensors=checkpoint.tensors,
        metadata={},
        index_metadata={},
        source_files=labels,
        extra_files=(),
        left_out=(),
        report=report,
        checkpoint=checkpoint,
        gguf_stem=gguf_stem(stem, names),
    )


def _checked_choice(checkpoint: Checkpoint, *, torch: bool, gguf: bool = False) -> Choice:
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
    if choice.family is None:  # the line names the finding inspect reports, as fix's does
        what, _, fix = split_message(no_weights_message(path))
        raise InputRefusedError.of(path, what, fix, rule="no-weights", code="no-weights")
    if not torch and choice.family.ext not in ("safetensors", GGUF if gguf else "safetensors"):
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
    """A training folder (DCP, accelerate, DeepSpeed, per-rank HF): the model's tensors in the
    model's order, and of the folder's other entries only what a loader of the model reads
    (config, tokenizer: layouts.model_files); the training state is left out, and said so."""
    layout = checkpoint.training
    assert layout is not None
    refuse_if_errors(report)  # a broken file first, as for a single file
    if not torch:
        raise UnsupportedFormatError(
            checkpoint.path,
            f"folder is a {checkpoint.kind} training checkpoint, not safetensors",
            "use `ckptfix convert`",
        )
    if layout.separate:
        one = os.path.join(checkpoint.path, layout.separate[-1])
        raise UsageError(
            checkpoint.path,
            f"folder holds {len(layout.separate)} models ({', '.join(layout.separate[:3])}), "
            "which are never merged",
            f"pass the one to use, e.g. {one}"
            if os.path.exists(one)  # not a DCP save or a per-rank set: those are whole folders
            else "move all but one of them to a folder of their own",
        )
    sources = tuple(record.label for record in checkpoint.files)
    ours = {os.path.relpath(label, checkpoint.path).split(os.sep)[0] for label in sources}
    extra, reasons = other_entries(checkpoint, ours)
    return RewriteSource(
        path=checkpoint.path,
        is_folder=True,
        tensors=checkpoint.tensors,
        metadata={},
        index_metadata={},
        source_files=sources,
        extra_files=tuple(name for name in extra if name not in reasons),
        left_out=tuple(sorted(reasons)),
        report=report,
        checkpoint=checkpoint,
        left_out_reasons=reasons,
        dtypes=dict(layout.dtypes),
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
    reason. In a training run's folder only the model's own files are copied
    (layouts.model_files)."""
    path, layout = checkpoint.path, checkpoint.layout
    weights = set()  # a Hugging Face folder's weight files (a Megatron layout lists none)
    if isinstance(layout, FolderLayout):
        weights = set(layout.weight_files) | {f.index for f in layout.families if f.index}
    reasons: dict[str, str] = {}
    extra = []
    remote = checkpoint.remote  # a URL's folder (io.remote_folder), listed through it
    listing = sorted(remote.listdir(path) if remote is not None else os.listdir(path))
    folder = remote or LOCAL
    training = checkpoint.training is not None or model_files.is_training_folder(listing)
    code = model_files.code_modules(path, listing, folder) if training else set()
    for entry in listing:
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
        elif training and not model_files.is_model_entry(
            entry, folder.is_dir(os.path.join(path, entry)), code
        ):
            reasons[entry] = model_files.left_out_reason(entry)
        else:
            extra.append(entry)
    if remote is None:  # a remote folder holds no FIFOs, sockets or devices
        reasons.update(dict.fromkeys(special_files(path, extra), NOT_REGULAR))
    return extra, reasons
