"""Opening a checkpoint for rewriting: which tensors, in which order, and which other files."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

from ckptfix.core.errors import CkptfixError, UnsupportedFormatError, UsageError
from ckptfix.core.findings import Severity
from ckptfix.core.tensor import TensorInfo
from ckptfix.formats.index import read_index
from ckptfix.layouts.names import Family, scan_folder
from ckptfix.ops.inspect import inspect
from ckptfix.ops.report import Report
from ckptfix.write.extras import special_files
from ckptfix.write.staging import is_staging_folder

# Why an entry of a model folder is not copied to -o (`Checkpoint.left_out_reasons`).
OTHER_WEIGHTS = "other weight file"
VERSION_CONTROL = "version control"  # a clone of a Hub repository keeps every LFS object there
STAGING_FOLDER = "ckptfix staging folder"  # a killed run's, recognised by its marker
NOT_REGULAR = "not a regular file"  # FIFO, socket, device: never opened


@dataclass(frozen=True)
class Checkpoint:
    """A readable checkpoint: tensors in source order plus what surrounds them."""

    path: str
    is_folder: bool
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str]
    index_metadata: dict[str, Any]
    source_files: tuple[str, ...]
    extra_files: tuple[str, ...]
    left_out: tuple[str, ...]
    report: Report
    # Why each left-out entry is left out; nested special files are named by relative path.
    left_out_reasons: dict[str, str] = field(default_factory=dict)

    @property
    def training_checkpoint(self) -> bool:
        return any(item.code == "nested-checkpoint" for item in self.report.findings)


class InputRefusedError(CkptfixError):
    """The input has errors that make a faithful rewrite impossible."""


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
    more = f"; {len(errors) - 1} more error(s), see `ckptfix inspect`" if len(errors) > 1 else ""
    raise InputRefusedError(first.file, first.message + more)


TORCH_EXTS = ("bin", "torch")


def _choose_family(
    families: tuple[Family, ...], root: str, *, torch: bool, prefer_torch: bool
) -> Family:
    exts = ("safetensors", *TORCH_EXTS) if torch else ("safetensors",)
    candidates = [f for f in families if f.ext in exts and (f.files or f.index)]
    order = [("pytorch_model", "bin"), ("model", "safetensors")]
    for stem, ext in order if prefer_torch else reversed(order):
        preferred = [f for f in candidates if (f.stem, f.ext) == (stem, ext) and f.variant is None]
        if preferred:
            return preferred[0]
    if len(candidates) == 1:
        return candidates[0]
    if not candidates:
        raise UnsupportedFormatError(
            root,
            "folder holds no safetensors checkpoint",
            "use `ckptfix convert` for PyTorch files",
        )
    labels = ", ".join(family.label for family in candidates)
    raise UsageError(
        root,
        f"folder holds several safetensors checkpoints ({labels})",
        "pass one file, or move the others out",
    )


def _merged_metadata(paths: list[str], report: Report) -> dict[str, str]:
    """String metadata of the safetensors sources (torch files have none), as read by
    inspect: the first file's value wins."""
    metadata = {item.path: item.metadata or {} for item in report.files}
    merged: dict[str, str] = {}
    for path in paths:
        for key, value in metadata.get(path, {}).items():
            merged.setdefault(key, value)
    return merged


def open_checkpoint(
    path: str,
    *,
    max_shard: int = 5 * 10**9,
    key: str = "auto",
    torch: bool = False,
    prefer_torch: bool = False,
) -> Checkpoint:
    """Inspect a checkpoint file or model folder and refuse it if it has errors.

    Only safetensors is accepted unless `torch` allows PyTorch files too.
    """
    report = inspect(path, max_shard=max_shard, key=key)
    if not os.path.isdir(path):
        refuse_if_errors(report)
        allowed = ("safetensors", "torch-zip", "torch-legacy") if torch else ("safetensors",)
        if report.format not in allowed:
            raise UnsupportedFormatError(
                path, f"file is {report.format}, not safetensors", "use `ckptfix convert`"
            )
        return Checkpoint(
            path=path,
            is_folder=False,
            tensors=report.tensors,
            metadata=_merged_metadata([path], report),
            index_metadata={},
            source_files=(path,),
            extra_files=(),
            left_out=(),
            report=report,
        )
    layout = scan_folder(path)
    family = _choose_family(layout.families, path, torch=torch, prefer_torch=prefer_torch)
    index_metadata: dict[str, Any] = {}
    if family.index is not None:
        index_path = os.path.join(path, family.index)
        index = read_index(index_path, index_path, family.ext)
        names = sorted(index.shard_names)
        index_metadata = {k: v for k, v in index.metadata.items() if k != "total_size"}
    else:
        names = sorted(family.files)
    files = [os.path.join(path, name) for name in names]
    # Errors in other weight families do not stop a rewrite that leaves them out.
    index_file = {os.path.join(path, family.index)} if family.index else set()
    refuse_if_errors(report, set(files) | index_file | {path})
    order = {file: position for position, file in enumerate(files)}
    tensors = sorted(
        (tensor for tensor in report.tensors if tensor.file in order),
        key=lambda tensor: (order[tensor.file], tensor.byte_range),
    )
    ours = set(names) | ({family.index} if family.index else set())
    weights = set(layout.weight_files) | {f.index for f in layout.families if f.index}
    reasons: dict[str, str] = {}
    extra = []
    for entry in sorted(os.listdir(path)):
        if entry in ours:
            continue
        if entry in weights:
            reasons[entry] = OTHER_WEIGHTS
        elif entry == ".git":
            reasons[entry] = VERSION_CONTROL
        elif is_staging_folder(os.path.join(path, entry)):
            reasons[entry] = STAGING_FOLDER
        else:
            extra.append(entry)
    reasons.update(dict.fromkeys(special_files(path, extra), NOT_REGULAR))
    left_out = sorted(reasons)
    return Checkpoint(
        path=path,
        is_folder=True,
        tensors=tuple(tensors),
        metadata=_merged_metadata(files, report),
        index_metadata=index_metadata,
        source_files=tuple(files),
        extra_files=tuple(name for name in extra if name not in reasons),
        left_out=tuple(left_out),
        report=report,
        left_out_reasons={name: reasons[name] for name in left_out},
    )
