"""`inspect`: read a checkpoint's descriptors and report every problem found (read-only)."""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

from ckptfix import checks, values
from ckptfix.catalog import TensorInfo
from ckptfix.errors import (
    CkptfixError,
    CorruptFileError,
    InputNotFoundError,
    UsageError,
)
from ckptfix.findings import Finding, finding
from ckptfix.folder import Family, scan_folder
from ckptfix.formats.index import ShardIndex, read_index, read_small_file
from ckptfix.readers import WeightFile, read_weight_file
from ckptfix.report import FileSummary, Report
from ckptfix.sniff import FileFormat, sniff_path

DEFAULT_MAX_SHARD = 5 * 10**9
MAX_CONFIG_SIZE = 16 * 2**20


@dataclass
class _Collector:
    """What inspecting one PATH accumulates: files read, their tensors, findings."""

    root: str
    key: str = "auto"
    files: list[FileSummary] = field(default_factory=list)
    weights: dict[str, WeightFile] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)
    real_paths: dict[str, str] = field(default_factory=dict)

    def read(self, real: str, shown: str) -> WeightFile | None:
        """Read one weight file; problems become findings, never exceptions."""
        self.real_paths[shown] = real
        size = _size(real)
        try:
            weight_file = read_weight_file(real, shown, self.key)
        except CkptfixError as exc:
            if exc.code is None:
                raise
            self._failed(shown, sniff_path(real), size, exc.code, exc.detail())
            return None
        self.weights[shown] = weight_file
        self.files.append(
            FileSummary(
                shown,
                weight_file.format.value,
                size,
                len(weight_file.tensors),
                weight_file.metadata,
            )
        )
        return weight_file

    def _failed(self, shown: str, fmt: FileFormat, size: int, code: str, message: str) -> None:
        self.files.append(FileSummary(shown, fmt.value, size, 0))
        self.findings.append(finding(code, message, file=shown))

    def real(self, shown: str) -> str:
        return self.real_paths[shown]


def _size(path: str) -> int:
    """A file's size for the report; 0 when it cannot be read (its finding says why)."""
    try:
        return os.path.getsize(path)
    except OSError:
        return 0


def inspect(
    path: str | os.PathLike[str],
    *,
    max_shard: int = DEFAULT_MAX_SHARD,
    hash: bool = False,
    scan_values: bool = False,
    key: str = "auto",
) -> Report:
    """Inspect a checkpoint file or model folder without modifying it.

    Tensor data is read only with `hash` (duplicate-content) or `scan_values` (non-finite).
    """
    shown = os.fspath(path)
    if not os.path.exists(shown):
        raise InputNotFoundError(shown, "no such file or directory", "check the path")
    if os.path.isdir(shown):
        collector = _Collector(shown, key)
        _inspect_folder(collector)
        fmt = "folder"
    elif os.path.isfile(shown):
        collector = _Collector(os.path.dirname(shown), key)
        collector.read(shown, shown)
        fmt = collector.files[0].format
    else:
        raise UsageError(shown, "not a regular file or folder", "pass a checkpoint file or folder")

    tensors = [tensor for weight in collector.weights.values() for tensor in weight.tensors]
    for weight_file in collector.weights.values():
        if weight_file.format is FileFormat.SAFETENSORS:
            collector.findings.extend(checks.file_findings(weight_file))
        else:
            collector.findings.extend(checks.pickle_findings(weight_file))
    nested = any(weight.nested_key is not None for weight in collector.weights.values())
    collector.findings.extend(checks.wrapper_prefix_findings(tensors, training_checkpoint=nested))
    collector.findings.extend(checks.tensor_findings(tensors, max_shard))
    if hash:
        groups = values.content_groups(tensors, collector.real)
        collector.findings.extend(values.duplicate_content_findings(groups))
    if scan_values:
        collector.findings.extend(values.non_finite_findings(tensors, collector.real))
    if os.path.isdir(shown):
        collector.findings.extend(_config_findings(collector, tensors, hash))
    ordered = sorted(collector.findings, key=lambda item: -item.severity.rank)
    return Report(
        path=shown,
        format=fmt,
        files=tuple(collector.files),
        tensors=tuple(tensors),
        findings=tuple(ordered),
    )


def _inspect_folder(collector: _Collector) -> None:
    root = collector.root
    layout = scan_folder(root)

    def shown(name: str) -> str:
        return os.path.join(root, name)

    for name in layout.weight_files:
        collector.read(shown(name), shown(name))

    indexed: set[str] = set()
    for family in layout.families:
        if family.index is None:
            continue
        index = _read_index(collector, family)
        if index is None:
            continue
        indexed.update(index.shard_names)
        _check_index(collector, family, index)

    # A loose file that an index lists belongs to that index's checkpoint.
    for family in layout.families:
        if family.stem == "loose":
            family.files = [name for name in family.files if name not in indexed]
    for family in layout.families:
        if family.stem == "loose" or family.index is not None:
            continue
        collector.findings.extend(
            checks.shard_numbering_findings(family, family.files, shown(family.files[0]))
        )
        read = [collector.weights[shown(n)] for n in family.files if shown(n) in collector.weights]
        collector.findings.extend(checks.duplicate_name_findings(read))
    collector.findings.extend(checks.mixed_format_findings(layout.families))
    if not collector.files:
        collector.findings.append(
            finding(
                "no-weights",
                "folder holds no weight file (*.safetensors, *.bin, *.pt, ...) and no shard index "
                "(check the path, or download the weights)",
                file=root,
            )
        )


def _read_index(collector: _Collector, family: Family) -> ShardIndex | None:
    assert family.index is not None
    real = os.path.join(collector.root, family.index)
    weight_ext = family.ext if family.ext in ("safetensors", "bin") else None
    try:
        index = read_index(real, real, weight_ext)
    except CorruptFileError as exc:
        collector.files.append(FileSummary(real, FileFormat.INDEX.value, _size(real), 0))
        collector.findings.append(finding("corrupt-file", exc.detail(), file=real))
        return None
    collector.files.append(
        FileSummary(real, FileFormat.INDEX.value, _size(real), len(index.weight_map))
    )
    return index


def _check_index(collector: _Collector, family: Family, index: ShardIndex) -> None:
    root = collector.root
    exists: dict[str, bool] = {}
    read: dict[str, WeightFile] = {}
    display: dict[str, str] = {name: os.path.join(root, name) for name in family.files}
    display[index.path] = family.index or index.path
    for shard in index.shard_names:
        real = os.path.join(root, shard)
        display[shard] = real
        exists[shard] = os.path.isfile(real)
        if not exists[shard]:
            continue
        if real not in collector.real_paths:  # e.g. a shard in a sub-folder
            collector.read(real, real)
        if real in collector.weights:
            read[shard] = collector.weights[real]
    collector.findings.extend(checks.index_findings(family, index, read, exists, display))
    collector.findings.extend(checks.duplicate_name_findings(read.values()))
    collector.findings.extend(
        checks.shard_numbering_findings(family, index.shard_names, index.path)
    )


def _config_findings(
    collector: _Collector, tensors: Sequence[TensorInfo], hashed: bool
) -> list[Finding]:
    config_path = os.path.join(collector.root, "config.json")
    if not os.path.isfile(config_path):
        return []
    try:
        config = json.loads(read_small_file(config_path, config_path, MAX_CONFIG_SIZE, "config"))
    except CorruptFileError as exc:
        return [finding("corrupt-file", exc.detail(), file=config_path)]
    except (ValueError, RecursionError) as exc:
        return [
            finding(
                "corrupt-file",
                f"config.json is not valid JSON: {str(exc)[:80]} (rule config-not-json; fix or "
                "re-download it)",
                file=config_path,
            )
        ]
    if not isinstance(config, dict):
        return [
            finding(
                "corrupt-file",
                "config.json is not a JSON object (rule config-not-object; fix or re-download it)",
                file=config_path,
            )
        ]

    def same_bytes(first: str, second: str) -> bool | None:
        a = next(tensor for tensor in tensors if tensor.name == first)
        b = next(tensor for tensor in tensors if tensor.name == second)
        if a.storage is not None and (a.file, a.storage, a.byte_range, a.strides) == (
            b.file,
            b.storage,
            b.byte_range,
            b.strides,
        ):
            return True  # aliases of one storage: tied in the file itself
        if not hashed:
            return None
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            return False
        return values.digest(collector.real(a.file), a) == values.digest(collector.real(b.file), b)

    return checks.tied_config_findings(config, config_path, tensors, same_bytes)
