"""safetensors headers: a strict, torch-free reader and the header encoder.

The reader validates every rule the reference implementation enforces and is stricter
where the reference is lax (duplicate names, NaN constants); see SECURITY.md. It reads
only the 8 + N header bytes, never tensor data.
"""

from __future__ import annotations

import json
import os
import re
import struct
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import orjson

from ckptfix.catalog import TensorInfo
from ckptfix.dtypes import DTYPES
from ckptfix.errors import CorruptFileError
from ckptfix.memory import paused_gc

MAX_HEADER_SIZE = 100_000_000
U64_MAX = 2**64 - 1
METADATA_KEY = "__metadata__"
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


class _Negative:
    """A negative JSON integer: kept apart so `-0` cannot pass as a valid 0."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


class _JsonRejected(Exception):
    def __init__(self, rule: str, what: str) -> None:
        super().__init__(what)
        self.rule = rule
        self.what = what


def _pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    result = dict(pairs)
    if len(result) != len(pairs):  # rare: find the culprit only then
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _JsonRejected("duplicate-key", f"key {key!r} appears twice in the header")
            seen.add(key)
    return result


def _reject_constant(name: str) -> Any:
    raise _JsonRejected("nan-constant", f"header contains the non-JSON constant {name}")


def _parse_int(text: str) -> int | _Negative:
    return _Negative(text) if text.startswith("-") else int(text)


# A JSON number token `-0` (possibly `-0` followed by nothing numeric). Python reads it as
# 0, serde refuses it; only when this pattern occurs do we pay for a per-integer hook.
_NEGATIVE_ZERO = re.compile(r"-0(?![0-9.eE])")
_NEGATIVE_ZERO_BYTES = re.compile(rb"-0(?![0-9.eE])")
# orjson reads integers past 64 bits as floats; the strict parser keeps them exact. A run of
# 20 digits is found by mapping digits to "0" and all else to " " (much faster than a regex).
_DIGITS_ONLY = bytes(ord("0") if chr(i).isdigit() and i < 128 else ord(" ") for i in range(256))
_LONG_DIGIT_RUN = b"0" * 20


# Whitespace before a colon (a run of it always ends in one of these pairs); see _fast_json.
_SPACED_COLONS = (b" :", b"\t:", b"\n:", b"\r:")


def _fast_json(raw: bytes) -> dict[str, Any] | None:
    """orjson's parse when it provably equals the strict parse below, else None.

    orjson is several times faster than json, refuses NaN, bad UTF-8 and integers past
    64 bits by itself, but keeps the last of duplicate keys. Duplicates are ruled out by
    counting: with no backslash in the text (so every quote delimits a string) and no space
    before a colon, each key ends in `":`; a count that differs from the keys parsed means
    a duplicate or something unusual, and the strict parser decides.
    """
    if (
        b"\\" in raw
        or any(pair in raw for pair in _SPACED_COLONS)
        or _NEGATIVE_ZERO_BYTES.search(raw)
        or _LONG_DIGIT_RUN in raw.translate(_DIGITS_ONLY)
    ):
        return None
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if type(parsed) is not dict:
        return None
    keys = len(parsed) + sum(len(value) for value in parsed.values() if type(value) is dict)
    return parsed if keys == raw.count(b'":') else None


def parse_header_json(raw: bytes, path: str) -> dict[str, Any]:
    """Decode header bytes as strict JSON with a top-level object."""
    fast = _fast_json(raw)
    return fast if fast is not None else strict_json(raw, path)


def strict_json(raw: bytes, path: str) -> dict[str, Any]:
    """The authoritative parse: every refusal names its rule."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptFileError(
            path, "header-not-utf8", f"header is not valid UTF-8 at byte {exc.start}", _REEXPORT
        ) from exc
    hooks: dict[str, Any] = {
        "object_pairs_hook": _pairs_hook,
        "parse_constant": _reject_constant,
    }
    if _NEGATIVE_ZERO.search(text):
        hooks["parse_int"] = _parse_int
    try:
        parsed = json.loads(text, **hooks)
    except _JsonRejected as exc:
        raise CorruptFileError(path, exc.rule, exc.what, _REEXPORT) from exc
    except json.JSONDecodeError as exc:
        raise CorruptFileError(
            path,
            "header-not-json",
            f"header is not valid JSON: {exc.msg} at char {exc.pos}",
            _REEXPORT,
        ) from exc
    except (ValueError, RecursionError) as exc:
        raise CorruptFileError(
            path, "header-not-json", f"header is not valid JSON: {str(exc)[:80]}", _REEXPORT
        ) from exc
    if not isinstance(parsed, dict):
        raise CorruptFileError(
            path,
            "header-not-object",
            f"header is a JSON {type(parsed).__name__}, not an object",
            _REEXPORT,
        )
    return parsed


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

    Written for speed: headers of 100,000 tensors are common in sharded folders.
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
    dtype = DTYPES.get(dtype_name) if type(dtype_name) is str else None
    if dtype is None:
        raise CorruptFileError(
            path,
            "unknown-dtype",
            f"tensor {name!r} has unknown dtype {_show(dtype_name)} "
            "(dtypes are case-sensitive, e.g. F32, BF16, F8_E4M3)",
            _REEXPORT,
        )
    numel = 1
    if type(shape) is list:
        for dim in shape:
            # `type(...) is int` on purpose: bool is an int subclass and `true` is no dimension.
            if type(dim) is not int or dim < 0 or dim > U64_MAX:
                break
            numel *= dim
        else:
            shape = tuple(shape)
    if type(shape) is not tuple:
        raise CorruptFileError(
            path,
            "bad-shape",
            f"tensor {name!r} has shape {_show(shape)}; a shape is a list of non-negative integers",
            _REEXPORT,
        )
    if (
        type(offsets) is not list
        or len(offsets) != 2
        or not (_is_uint(offsets[0]) and _is_uint(offsets[1]))
    ):
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
    bits = numel * dtype.bits
    if bits > U64_MAX:
        raise CorruptFileError(
            path,
            "shape-overflow",
            f"tensor {name!r} shape {list(shape)} has {numel} elements; its size overflows 64 bits",
            _REEXPORT,
        )
    if bits % 8:
        raise CorruptFileError(
            path,
            "partial-byte",
            f"tensor {name!r} ({dtype_name}, {numel} elements) does not fill a whole number of bytes",
            _REEXPORT,
        )
    if bits // 8 != end - begin:
        raise CorruptFileError(
            path,
            "size-mismatch",
            f"tensor {name!r} ({dtype_name} {list(shape)}) needs {bits // 8} bytes "
            f"but data_offsets [{begin}, {end}] span {end - begin}",
            _REEXPORT,
        )
    return dtype_name, shape, begin, end


_BITS = {name: dtype.bits for name, dtype in DTYPES.items()}


def _fast_entry(entry: Any) -> tuple[str, tuple[int, ...], int, int] | None:
    """Accept a well-formed entry quickly, or return None to let _check_entry decide.

    Headers of 100,000 tensors are common, so the common case is kept to a few
    operations; anything unusual goes to the slow path, which is authoritative and
    names the broken rule. This must never accept what _check_entry rejects.
    """
    try:
        dtype_name, shape, offsets = entry["dtype"], entry["shape"], entry["data_offsets"]
        bits = _BITS[dtype_name]
        begin, end = offsets
    except Exception:
        return None
    if (
        type(entry) is not dict
        or type(dtype_name) is not str
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


def read_header(path: str | os.PathLike[str], display: str | None = None) -> SafetensorsHeader:
    """Read and validate a safetensors header; raises CorruptFileError naming the rule."""
    shown = display if display is not None else os.fspath(path)
    fd = os.open(path, os.O_RDONLY)
    try:
        file_size = os.fstat(fd).st_size
        if file_size < 8:
            raise CorruptFileError(
                shown,
                "too-small",
                f"file has {file_size} bytes; a safetensors file needs at least 8",
                "re-download the file",
            )
        (header_size,) = struct.unpack("<Q", os.pread(fd, 8, 0))
        if header_size > MAX_HEADER_SIZE:
            first = os.pread(fd, 8, 0)
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
        raw = _pread_exact(fd, header_size, 8)
    finally:
        os.close(fd)
    return parse_header(raw, header_size=header_size, file_size=file_size, path=shown)


def _pread_exact(fd: int, size: int, offset: int) -> bytes:
    chunks: list[bytes] = []
    while size:
        chunk = os.pread(fd, size, offset)
        if not chunk:
            break
        chunks.append(chunk)
        size -= len(chunk)
        offset += len(chunk)
    return b"".join(chunks)


def parse_header(raw: bytes, *, header_size: int, file_size: int, path: str) -> SafetensorsHeader:
    """Validate header bytes already read; offsets are checked against `file_size`."""
    with paused_gc():
        parsed = parse_header_json(raw, path)
        metadata = _check_metadata(parsed.pop(METADATA_KEY, None), path)
        empty_names = 1 if "" in parsed else 0
        tensors = _tensor_infos(parsed, 8 + header_size, path)
        tensors.sort(key=_byte_range)
    _check_coverage(tensors, file_size - 8 - header_size, header_size, file_size, path)
    return SafetensorsHeader(
        path=path,
        header_size=header_size,
        file_size=file_size,
        metadata=metadata,
        tensors=tuple(tensors),
        empty_names=empty_names,
    )


def _byte_range(tensor: TensorInfo) -> tuple[int, int]:
    return tensor.byte_range


def _tensor_infos(parsed: dict[str, Any], data_start: int, path: str) -> list[TensorInfo]:
    """Descriptors in header order. Entries are popped as they are converted, so the parsed
    JSON and the descriptors are never both whole in memory."""
    tensors: list[TensorInfo] = []
    add, fast = tensors.append, _fast_entry
    while parsed:
        name, entry = parsed.popitem()  # last first: reversed below
        dtype_name, shape, begin, end = fast(entry) or _check_entry(name, entry, path)
        add(
            TensorInfo(
                name, dtype_name, shape, end - begin, path, (data_start + begin, data_start + end)
            )
        )
    tensors.reverse()
    return tensors


@dataclass(frozen=True)
class HeaderEntry:
    """What the encoder needs of a tensor: offsets are relative to the data section."""

    name: str
    dtype: str
    shape: Sequence[int]
    begin: int
    end: int


def encode_header(entries: Iterable[HeaderEntry], metadata: Mapping[str, str] | None) -> bytes:
    """The 8-byte length plus the JSON header, space-padded so data starts 8-byte aligned."""
    header: dict[str, Any] = {}
    if metadata:
        header[METADATA_KEY] = dict(metadata)
    for entry in entries:
        header[entry.name] = {
            "dtype": entry.dtype,
            "shape": list(entry.shape),
            "data_offsets": [entry.begin, entry.end],
        }
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body
