"""Opening a checkpoint for rewriting: which tensors, in which order, and which other files."""

from __future__ import annotations

import os
from dataclasses import dataclass
from typing import Any

from ckptfix.catalog import TensorInfo
from ckptfix.errors import CkptfixError, UnsupportedFormatError, UsageError
from ckptfix.findings import Severity
from ckptfix.folder import Family, scan_folder
from ckptfix.formats.index import read_index
from ckptfix.formats.safetensors import read_header
from ckptfix.inspect import inspect
from ckptfix.report import Report

# Never carried into an output folder: version-control state (a clone of a Hub repository
# keeps every LFS object under .git) and our own staging folders.
_NEVER_COPY = (".git", ".ckptfix-")


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


def _choose_family(families: tuple[Family, ...], root: str) -> Family:
    candidates = [
        family
        for family in families
        if family.ext == "safetensors" and (family.files or family.index)
    ]
    preferred = [f for f in candidates if f.stem == "model" and f.variant is None]
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


def _merged_metadata(paths: list[str]) -> dict[str, str]:
    merged: dict[str, str] = {}
    for path in paths:
        for key, value in (read_header(path).metadata or {}).items():
            merged.setdefault(key, value)  # the first file's value wins
    return merged


def open_checkpoint(path: str, *, max_shard: int = 5 * 10**9) -> Checkpoint:
    """Inspect a safetensors file or model folder and refuse it if it has errors."""
    report = inspect(path, max_shard=max_shard)
    if not os.path.isdir(path):
        refuse_if_errors(report)
        if report.format != "safetensors":
            raise UnsupportedFormatError(
                path, f"file is {report.format}, not safetensors", "use `ckptfix convert`"
            )
        return Checkpoint(
            path=path,
            is_folder=False,
            tensors=report.tensors,
            metadata=_merged_metadata([path]),
            index_metadata={},
            source_files=(path,),
            extra_files=(),
            left_out=(),
            report=report,
        )
    layout = scan_folder(path)
    family = _choose_family(layout.families, path)
    index_metadata: dict[str, Any] = {}
    if family.index is not None:
        index_path = os.path.join(path, family.index)
        index = read_index(index_path, index_path, "safetensors")
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
    extra, left_out = [], []
    for entry in sorted(os.listdir(path)):
        if entry in ours:
            continue
        if entry in weights or entry.startswith(_NEVER_COPY):
            left_out.append(entry)
        else:
            extra.append(entry)
    return Checkpoint(
        path=path,
        is_folder=True,
        tensors=tuple(tensors),
        metadata=_merged_metadata(files),
        index_metadata=index_metadata,
        source_files=tuple(files),
        extra_files=tuple(extra),
        left_out=tuple(left_out),
        report=report,
    )
