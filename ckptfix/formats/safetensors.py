"""safetensors headers: a strict, torch-free reader and the header encoder.

The reader validates every rule the reference implementation enforces and is stricter
where the reference is lax (duplicate names, NaN constants); see SECURITY.md. It reads
only the 8 + N header bytes, never tensor data.
"""

from __future__ import annotations

import json
import os
import struct
from dataclasses import dataclass
from itertools import chain
from operator import attrgetter
from typing import Any

from ckptfix.core.dtypes import SAFETENSORS_DTYPES, U64_MAX, DType
from ckptfix.core.errors import CorruptFileError
from ckptfix.core.findings import Finding, finding
from ckptfix.core.memory import paused_gc
from ckptfix.core.tensor import TensorInfo
from ckptfix.formats import sniff
from ckptfix.formats.base import FORMATS, FileRead, ReadOptions, empty_names
from ckptfix.formats.safetensors_columns import read_columns
from ckptfix.formats.safetensors_encode import (
    METADATA_KEY,
    Fields,
    HeaderEntry,
    encode_fields,
    encode_header,
    header_size,
)
from ckptfix.formats.strict_json import PART_SIZE, NotParts, object_parts, parse_header_json
from ckptfix.io.source import ByteSource, LocalFile

MAX_HEADER_SIZE = sniff.SAFETENSORS_MAX_HEADER
_TENSOR_FIELDS = ("dtype", "shape", "data_offsets")
_REEXPORT = "re-download or re-export the file"


@dataclass(frozen=True)
class SafetensorsHeader:
    """A validated header: string metadata and tensors in file (offset) order."""

    path: str
    header_size: int
    file_size: int
    metadata: dict[str, str] | None
    tensors: tuple[TensorInfo, ...]
    empty_names: int = 0

    @property
    def data_start(self) -> int:
        return 8 + self.header_size


def _is_uint(value: object) -> bool:
    return type(value) is int and 0 <= value <= U64_MAX


def _show(value: object) -> str:
    text = json.dumps(value, default=repr)
    return text if len(text) <= 60 else text[:57] + "..."


def _check_metadata(value: object, path: str) -> dict[str, str] | None:
    if value is None:
        return None
    if not isinstance(value, dict):
        raise CorruptFileError(
            path,
            "metadata-not-object",
            f"{METADATA_KEY} is {_show(value)}, not an object",
            _REEXPORT,
        )
    if set(_TENSOR_FIELDS) <= set(value):
        raise CorruptFileError(
            path,
            "metadata-as-tensor",
            f"{METADATA_KEY} holds a tensor entry; the name is reserved for string metadata",
            "rename the tensor and re-export",
        )
    for key, item in value.items():
        if not isinstance(item, str):
            raise CorruptFileError(
                path,
                "metadata-not-string",
                f"{METADATA_KEY} value for {key!r} is {_show(item)}, not a string",
                _REEXPORT,
            )
    return dict(value)


def _check_entry(name: str, entry: object, path: str) -> tuple[str, tuple[int, ...], int, int]:
    """Validate one tensor entry; returns (dtype, shape, begin, end) relative to the data.

    The authoritative path, taken when `_fast_entry` does not accept an entry: it names
    the rule an entry breaks.
    """
    if type(entry) is not dict:
        raise CorruptFileError(
            path,
            "tensor-not-object",
            f"tensor {name!r} is {_show(entry)}, not an object",
            _REEXPORT,
        )
    try:
        dtype_name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
    except KeyError as exc:
        raise CorruptFileError(
            path, "tensor-missing-field", f"tensor {name!r} has no {exc.args[0]!r}", _REEXPORT
        ) from None
    dtype = _entry_dtype(name, dtype_name, path)
    dims = _entry_shape(name, shape, path)
    begin, end = _entry_offsets(name, offsets, path)
    _check_size(name, dtype_name, dtype.bits, dims, (begin, end), path)
    return dtype_name, dims, begin, end


def _entry_dtype(name: str, dtype_name: object, path: str) -> DType:
    dtype = SAFETENSORS_DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if dtype is None:
        raise CorruptFileError(
            path,
            "unknown-dtype",
            f"tensor {name!r} has unknown dtype {_show(dtype_name)} "
            "(dtypes are case-sensitive, e.g. F32, BF16, F8_E4M3)",
            _REEXPORT,
        )
    return dtype


def _entry_shape(name: str, shape: object, path: str) -> tuple[int, ...]:
    # `type(...) is int` on purpose: bool is an int subclass and `true` is no dimension.
    if type(shape) is not list or not all(
        type(dim) is int and 0 <= dim <= U64_MAX for dim in shape
    ):
        raise CorruptFileError(
            path,
            "bad-shape",
            f"tensor {name!r} has shape {_show(shape)}; a shape is a list of non-negative integers",
            _REEXPORT,
        )
    return tuple(shape)


def _entry_offsets(name: str, offsets: object, path: str) -> tuple[int, int]:
    if type(offsets) is not list or len(offsets) != 2 or not all(map(_is_uint, offsets)):
        raise CorruptFileError(
            path,
            "bad-offsets",
            f"tensor {name!r} has data_offsets {_show(offsets)}; expected two non-negative integers",
            _REEXPORT,
        )
    begin, end = offsets
    if begin > end:
        raise CorruptFileError(
            path,
            "bad-offsets",
            f"tensor {name!r} has data_offsets [{begin}, {end}]: begin > end",
            _REEXPORT,
        )
    return begin, end


def _check_size(
    name: str,
    dtype_name: str,
    bits_per_element: int,
    shape: tuple[int, ...],
    span: tuple[int, int],
    path: str,
) -> None:
    numel = 1
    for dim in shape:
        numel *= dim
    bits = numel * bits_per_element
    begin, end = span
    if bits > U64_MAX:
        what = (
            f"tensor {name!r} shape {list(shape)} has {numel} elements; its size overflows 64 bits"
        )
        raise CorruptFileError(path, "shape-overflow", what, _REEXPORT)
    if bits % 8:
        what = f"tensor {name!r} ({dtype_name}, {numel} elements) does not fill a whole number of bytes"
        raise CorruptFileError(path, "partial-byte", what, _REEXPORT)
    if bits // 8 != end - begin:
        raise CorruptFileError(
            path,
            "size-mismatch",
            f"tensor {name!r} ({dtype_name} {list(shape)}) needs {bits // 8} bytes "
            f"but data_offsets [{begin}, {end}] span {end - begin}",
            _REEXPORT,
        )


# Each dtype's name as one shared string (not one per tensor) and its bits.
_KNOWN = {name: (name, dtype.bits) for name, dtype in SAFETENSORS_DTYPES.items()}
_NAME = attrgetter("name")


def _fast_entry(entry: Any) -> tuple[str, tuple[int, ...], int, int] | None:
    """Accept a well-formed entry quickly, or return None to let _check_entry decide.

    Headers of 1,000,000 tensors occur (mixtures of experts), so the common case is kept to
    a few operations; anything unusual goes to the slow path, which is authoritative and
    names the broken rule. This must never accept what _check_entry rejects.
    """
    try:
        dtype_name, bits = _KNOWN[entry["dtype"]]
        shape, offsets = entry["shape"], entry["data_offsets"]
        begin, end = offsets
    except Exception:
        return None
    if (
        type(entry) is not dict
        or type(shape) is not list
        or type(offsets) is not list
        or type(begin) is not int
        or type(end) is not int
        or not 0 <= begin <= end <= U64_MAX
    ):
        return None
    numel = 1
    for dim in shape:
        if type(dim) is not int or dim < 0 or dim > U64_MAX:
            return None
        numel *= dim
    if numel * bits != (end - begin) * 8:
        return None
    return dtype_name, tuple(shape), begin, end


def _check_coverage(
    tensors: list[TensorInfo], data_size: int, header_size: int, file_size: int, path: str
) -> None:
    """Tensors (sorted by offset) must tile the data section exactly: no gap, no overlap, no
    trailing bytes."""
    expected = 0
    data_start = 8 + header_size
    for tensor in tensors:
        name = tensor.name
        begin, end = tensor.byte_range[0] - data_start, tensor.byte_range[1] - data_start
        if begin > expected:
            raise CorruptFileError(
                path,
                "offset-gap",
                f"tensor {name!r} starts at data byte {begin} but the previous tensor ends at "
                f"{expected}: {begin - expected} bytes belong to no tensor",
                _REEXPORT,
            )
        if begin < expected:
            raise CorruptFileError(
                path,
                "offset-overlap",
                f"tensor {name!r} starts at data byte {begin}, inside the previous tensor "
                f"(which ends at {expected})",
                _REEXPORT,
            )
        expected = end
    if expected > data_size:
        raise CorruptFileError(
            path,
            "truncated",
            f"file is truncated: its header needs {8 + header_size + expected} bytes "
            f"but the file has {file_size}",
            "re-download the file",
        )
    if expected < data_size:
        raise CorruptFileError(
            path,
            "trailing-bytes",
            f"file has {data_size - expected} bytes after the last tensor "
            f"(expected {8 + header_size + expected} bytes, found {file_size})",
            _REEXPORT,
        )


def read_header(
    file: str | os.PathLike[str] | ByteSource, display: str | None = None
) -> SafetensorsHeader:
    """Read and validate a safetensors header; raises CorruptFileError naming the rule."""
    if isinstance(file, ByteSource):
        return _read_header(file)
    with LocalFile(os.fspath(file), display) as source:
        return _read_header(source)


def _read_header(source: ByteSource) -> SafetensorsHeader:
    shown, file_size = source.label, source.size
    if file_size < 8:
        raise CorruptFileError(
            shown,
            "too-small",
            f"file has {file_size} bytes; a safetensors file needs at least 8",
            "re-download the file",
        )
    first = source.read_at(0, 8)
    (header_size,) = struct.unpack("<Q", first)
    if header_size > MAX_HEADER_SIZE:
        text = first.decode("ascii", "replace")
        looks = f"; the file starts with text {text!r}" if text.isprintable() else ""
        raise CorruptFileError(
            shown,
            "header-too-large",
            f"header length {header_size} exceeds the {MAX_HEADER_SIZE}-byte limit{looks}",
            "this is not a safetensors file, or it is damaged; re-download it",
        )
    if 8 + header_size > file_size:
        raise CorruptFileError(
            shown,
            "bad-header-length",
            f"header length {header_size} needs {8 + header_size} bytes but the file has "
            f"{file_size}",
            "re-download the file",
        )
    raw = source.read_at(8, header_size)
    return parse_header(raw, header_size=header_size, file_size=file_size, path=shown)


def parse_header(raw: bytes, *, header_size: int, file_size: int, path: str) -> SafetensorsHeader:
    """Validate header bytes already read; offsets are checked against `file_size`."""
    data_start, data_size = 8 + header_size, file_size - 8 - header_size
    with paused_gc():
        read = read_columns(raw, data_start, data_size, path)  # in order, covering the data
        if read is None:
            read = _read_in_parts(raw, data_start, path) or _read_whole(raw, data_start, path)
            read[2].sort(key=attrgetter("byte_range"))
            _check_coverage(read[2], data_size, header_size, file_size, path)
    metadata, empty_names, tensors = read
    return SafetensorsHeader(
        path=path,
        header_size=header_size,
        file_size=file_size,
        metadata=metadata,
        tensors=tuple(tensors),
        empty_names=empty_names,
    )


_Read = tuple[dict[str, str] | None, int, list[TensorInfo]]  # metadata, empty names, tensors


def _read_whole(raw: bytes, data_start: int, path: str) -> _Read:
    parsed = parse_header_json(raw, path)
    metadata = _check_metadata(parsed.pop(METADATA_KEY, None), path)
    empty_names = 1 if "" in parsed else 0
    return metadata, empty_names, _tensor_infos(parsed, data_start, path)


def _read_in_parts(raw: bytes, data_start: int, path: str, size: int = PART_SIZE) -> _Read | None:
    """_read_whole's result for a large header, parsed and converted a part at a time
    (strict_json.Parts): its parsed JSON is never whole in memory. None when anything is
    unusual (a part that does not parse, a name given twice, an error): the whole read then
    decides, and names the rule as it always does."""
    parts = object_parts(raw, size)
    if parts is None:
        return None
    metadata: list[Any] = []
    empty_names, batches = 0, []
    try:
        for part in parts:
            if METADATA_KEY in part:
                metadata.append(part.pop(METADATA_KEY))
            empty_names += "" in part
            batches.append(_tensor_infos(part, data_start, path))
        tensors = list(chain.from_iterable(batches))
        if (
            not parts.complete()
            or len(metadata) > 1
            or len(set(map(_NAME, tensors))) < len(tensors)
        ):
            return None
        return _check_metadata(metadata[0] if metadata else None, path), empty_names, tensors
    except (NotParts, CorruptFileError):
        return None


def _tensor_infos(parsed: dict[str, Any], data_start: int, path: str) -> list[TensorInfo]:
    """Descriptors in header order. Entries are popped as they are converted, so the parsed
    JSON and the descriptors are never both whole in memory; equal shapes share one tuple
    (the experts of a mixture repeat a few shapes thousands of times)."""
    tensors: list[TensorInfo] = []
    add, fast = tensors.append, _fast_entry
    shapes: dict[tuple[int, ...], tuple[int, ...]] = {}
    shared = shapes.setdefault
    while parsed:
        name, entry = parsed.popitem()  # last first: reversed below
        dtype_name, shape, begin, end = fast(entry) or _check_entry(name, entry, path)
        add(
            TensorInfo(
                name,
                dtype_name,
                shared(shape, shape),
                end - begin,
                path,
                (data_start + begin, data_start + end),
            )
        )
    tensors.reverse()
    return tensors


@dataclass(frozen=True)
class SafetensorsFile(FileRead):
    empty_names: int = 0


class SafetensorsFormat:
    """`.safetensors`: a u64 header length, a JSON header, then the tensors back to back."""

    name = "safetensors"
    description = "a safetensors file"

    def sniff(self, head: bytes) -> bool:
        return sniff.safetensors(head)

    def read(self, source: ByteSource, options: ReadOptions) -> FileRead:
        header = read_header(source)
        return SafetensorsFile(
            source.label,
            self.name,
            header.file_size,
            header.tensors,
            header.metadata,
            header.empty_names,
        )

    def checks(self, file: FileRead) -> list[Finding]:
        from ckptfix.formats.hf_sharding import piece_findings

        found: list[Finding] = piece_findings(file)
        if "format" not in (file.metadata or {}):
            found.append(
                finding(
                    "missing-format-metadata",
                    'header __metadata__ has no "format" entry, which some loaders require '
                    '(rewrite with `ckptfix reshard`, which adds "format": "pt")',
                    file=file.label,
                )
            )
        found += empty_names(
            file.empty_names if isinstance(file, SafetensorsFile) else 0, file.label
        )
        return found


SAFETENSORS = FORMATS.register(SafetensorsFormat())

# The encoder lives in safetensors_encode; its names are ckptfix.formats.safetensors's too.
__all__ = [
    "MAX_HEADER_SIZE",
    "METADATA_KEY",
    "SAFETENSORS",
    "Fields",
    "HeaderEntry",
    "SafetensorsFile",
    "SafetensorsFormat",
    "SafetensorsHeader",
    "encode_fields",
    "encode_header",
    "header_size",
    "parse_header",
    "read_header",
]
