"""GGUF files read into descriptors: the header (`gguf_header`: strict, bounded, never
mapped) turned into tensor descriptors, with the layout checked the way ggml loads it: every
tensor a known ggml type with whole blocks per row, at an aligned offset, packed in order
(each padded to `general.alignment`), inside the file; the split keys; and a look at the
last bytes of tensor data.

Shapes are row-major, as gguf-py's reader shapes a tensor's data: GGUF stores ggml's dims
with the fastest axis first, so they are reversed. Block-quantized tensors have their ggml
dtype name (`Q4_K`, ...), whose bytes core.dtypes counts by blocks.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from ckptfix.core.dtypes import DTYPES, byte_size
from ckptfix.core.errors import CorruptFileError
from ckptfix.core.sizes import padded
from ckptfix.core.tensor import TensorInfo
from ckptfix.formats.base import FileRead
from ckptfix.formats.gguf_header import (
    DEFAULT_ALIGNMENT,
    FIX,
    MAX_NAME,
    WINDOW,
    GgufKey,
    RawTensor,
    read_raw_header,
)
from ckptfix.io.source import ByteSource

# ggml type id -> dtype name (core.dtypes); ids missing here are unknown or removed.
GGML_TYPES: dict[int, str] = {
    0: "F32", 1: "F16", 2: "Q4_0", 3: "Q4_1", 6: "Q5_0", 7: "Q5_1", 8: "Q8_0", 9: "Q8_1",
    10: "Q2_K", 11: "Q3_K", 12: "Q4_K", 13: "Q5_K", 14: "Q6_K", 15: "Q8_K", 16: "IQ2_XXS",
    17: "IQ2_XS", 18: "IQ3_XXS", 19: "IQ1_S", 20: "IQ4_NL", 21: "IQ3_S", 22: "IQ2_S",
    23: "IQ4_XS", 24: "I8", 25: "I16", 26: "I32", 27: "I64", 28: "F64", 29: "IQ1_M",
    30: "BF16", 34: "TQ1_0", 35: "TQ2_0", 39: "MXFP4", 40: "NVFP4", 41: "Q1_0",
}  # fmt: skip
GGML_IDS = {name: type_id for type_id, name in GGML_TYPES.items()}
_REMOVED = {
    4: "Q4_2", 5: "Q4_3", 31: "Q4_0_4_4", 32: "Q4_0_4_8", 33: "Q4_0_8_8",
    36: "IQ4_NL_4_4", 37: "IQ4_NL_4_8", 38: "IQ4_NL_8_8",
}  # fmt: skip
SPLIT_KEYS = ("split.no", "split.count", "split.tensors.count")
# The one type llama.cpp reads each split key as: any other is refused ("key split.count has
# wrong type"), or aborts it (split.no in a later part, read by gguf_get_val_u16).
SPLIT_TYPES = {"split.no": "UINT16", "split.count": "UINT16", "split.tensors.count": "INT32"}
ALIGNMENT_KEY = "general.alignment"
ELEMENTS_LIMIT = 2**63  # ggml counts elements in int64
PROBE = 4096  # bytes of tensor data read from the end to see whether they are all zeros


@dataclass(frozen=True)
class SplitInfo:
    """The keys llama.cpp's split sets carry: this file's number (from 0), the number of
    files, the tensors of the whole set."""

    number: int
    count: int
    tensors: int


@dataclass(frozen=True)
class GgufFile(FileRead):
    """A GGUF file read: its tensors (in info order, which ggml requires to be file order),
    its metadata key/values (spans, and the values ckptfix uses), and what the layout
    checks found that is worth a warning."""

    version: int = 3
    alignment: int = DEFAULT_ALIGNMENT
    keys: tuple[GgufKey, ...] = ()
    keys_end: int = 0  # where the tensor infos start
    data_start: int = 0
    split: SplitInfo | None = None
    zero_tail: int = 0  # bytes at the end of the tensor data found all zero (0: not so)

    def key(self, name: str) -> GgufKey | None:
        return next((key for key in self.keys if key.key == name), None)

    @property
    def architecture(self) -> str | None:
        found = self.key("general.architecture")
        return found.value if found is not None and isinstance(found.value, str) else None


def _integer(key: GgufKey, label: str) -> int:
    if not isinstance(key.value, int) or key.value < 0:  # its type is checked already
        raise CorruptFileError(
            label,
            "gguf-bad-value",
            f"metadata key {key.key!r} is {key.type} {key.value!r}, not a non-negative integer",
            FIX,
        )
    return key.value


def _alignment(keys: dict[str, GgufKey], label: str) -> int:
    key = keys.get(ALIGNMENT_KEY)
    if key is None:
        return DEFAULT_ALIGNMENT
    value = key.value
    if key.type != "UINT32" or not isinstance(value, int) or value <= 0 or value & (value - 1):
        raise CorruptFileError(
            label,
            "gguf-alignment",
            f"general.alignment is {key.type} {value!r}; ggml needs a UINT32 power of two",
            FIX,
        )
    return value


def _split(keys: dict[str, GgufKey], label: str) -> SplitInfo | None:
    present = [keys[name] for name in SPLIT_KEYS if name in keys]
    if not present:
        return None
    for key in present:
        if key.type != SPLIT_TYPES[key.key]:
            raise CorruptFileError(
                label,
                "gguf-bad-value",
                f"metadata key {key.key!r} is {key.type} {key.value!r}; llama.cpp reads it "
                f"only as {SPLIT_TYPES[key.key]} and refuses the file",
                FIX,
            )
    values = {key.key: _integer(key, label) for key in present}
    count = values.get("split.count", 0)
    if count == 0:  # what `gguf-split --merge` leaves in a merged file: not a split set
        return None
    return SplitInfo(values.get("split.no", 0), count, values.get("split.tensors.count", -1))


def _bad(label: str, rule: str, name: str, what: str) -> CorruptFileError:
    return CorruptFileError(label, rule, f"tensor {name!r} {what}", FIX)


def _tensor(raw: RawTensor, data_start: int, alignment: int, label: str) -> TensorInfo:
    """One tensor info checked the way ggml checks it, as a descriptor."""
    name, dims = raw.name, raw.dims
    if len(name.encode("utf-8")) > MAX_NAME:
        raise _bad(label, "gguf-name-too-long", name, f"has a name over {MAX_NAME} bytes")
    dtype = GGML_TYPES.get(raw.type_id)
    if dtype is None:
        removed = _REMOVED.get(raw.type_id)
        what = f" ({removed}, removed from ggml)" if removed else ""
        raise _bad(label, "gguf-unknown-type", name, f"has unknown ggml type {raw.type_id}{what}")
    if 0 in dims:
        raise _bad(label, "gguf-zero-dim", name, f"has a zero dimension (ggml dims {list(dims)})")
    numel = 1
    for dim in dims:
        numel *= dim
    if numel >= ELEMENTS_LIMIT:
        raise _bad(label, "gguf-shape-overflow", name, f"has {numel} elements, over 2^63")
    row = dims[0] if dims else 1
    nbytes = byte_size(DTYPES[dtype], numel) if row % DTYPES[dtype].block == 0 else None
    if nbytes is None:
        block = DTYPES[dtype].block
        raise _bad(
            label,
            "gguf-partial-block",
            name,
            f"({dtype}) has rows of {row} elements, not a multiple of its {block}-element block",
        )
    if raw.offset % alignment:
        raise _bad(
            label,
            "gguf-misaligned",
            name,
            f"starts at data offset {raw.offset}, not a multiple of the alignment ({alignment})",
        )
    begin = data_start + raw.offset
    return TensorInfo(name, dtype, tuple(reversed(dims)), nbytes, label, (begin, begin + nbytes))


def _check_names(tensors: list[TensorInfo], label: str) -> None:
    seen: set[str] = set()
    for tensor in tensors:
        if tensor.name in seen:
            raise _bad(label, "gguf-duplicate-name", tensor.name, "is stored twice")
        seen.add(tensor.name)


def _check_layout(tensors: list[TensorInfo], data_start: int, alignment: int, label: str) -> int:
    """No two tensors overlap, and they are packed in order as ggml expects; returns the
    padded end of the data section."""
    ordered = sorted(tensors, key=lambda tensor: tensor.byte_range)
    for first, second in itertools.pairwise(ordered):
        if second.byte_range[0] < first.byte_range[1]:
            raise _bad(
                label,
                "gguf-overlap",
                second.name,
                f"starts at data offset {second.byte_range[0] - data_start}, inside "
                f"{first.name!r} (data bytes {first.byte_range[0] - data_start}-"
                f"{first.byte_range[1] - data_start})",
            )
    expected = data_start
    for tensor in tensors:
        if tensor.byte_range[0] != expected:
            raise _bad(
                label,
                "gguf-layout",
                tensor.name,
                f"is at data offset {tensor.byte_range[0] - data_start}, but ggml expects "
                f"{expected - data_start}: tensors are packed in order, each padded to "
                f"{alignment} bytes",
            )
        expected += padded(tensor.nbytes, alignment)
    return expected


def _check_size(tensors: list[TensorInfo], padded_end: int, file_size: int, label: str) -> None:
    needed = max((tensor.byte_range[1] for tensor in tensors), default=0)
    if needed > file_size:
        past = [tensor.name for tensor in tensors if tensor.byte_range[1] > file_size]
        raise CorruptFileError(
            label,
            "truncated",
            f"file is truncated: its tensors need {needed} bytes but the file has {file_size} "
            f"({len(past)} tensor(s) such as {past[0]!r} lie past its end)",
            "re-download the file",
        )
    if file_size > padded_end:
        raise CorruptFileError(
            label,
            "trailing-bytes",
            f"file has {file_size - padded_end} bytes after the last tensor "
            f"(expected {padded_end} bytes, found {file_size})",
            FIX,
        )


def _zero_tail(source: ByteSource, data_start: int, end: int) -> int:
    """How many bytes at the end of the tensor data were read and found all zero (0 when
    they are not, or when there is too little data to tell). The probe stays inside one
    WINDOW-aligned block (a remote file fetches that block, and no other)."""
    if end - data_start < PROBE:
        return 0
    floor = (end - 1) // WINDOW * WINDOW
    start = max(end - PROBE, floor)
    if end - start < PROBE // 16:  # too few bytes before the block edge: the block before
        end, start = floor, max(floor - PROBE, data_start)
        if end - start < PROBE // 16:
            return 0
    data = source.read_at(start, end - start)
    return len(data) if not data.strip(b"\0") else 0


def read_gguf(source: ByteSource) -> GgufFile:
    """Read and check a GGUF file's header and layout; raises CorruptFileError naming the
    `gguf-*` rule (or `truncated`, `trailing-bytes`) a file breaks."""
    label = source.label
    raw = read_raw_header(source)
    keys = {key.key: key for key in raw.keys}
    alignment = _alignment(keys, label)
    split = _split(keys, label)
    data_start = padded(raw.header_end, alignment)
    tensors = [_tensor(item, data_start, alignment, label) for item in raw.tensors]
    _check_names(tensors, label)
    padded_end = _check_layout(tensors, data_start, alignment, label)
    _check_size(tensors, padded_end, source.size, label)
    end = max((tensor.byte_range[1] for tensor in tensors), default=data_start)
    return GgufFile(
        label,
        "gguf",
        source.size,
        tuple(tensors),
        None,
        raw.version,
        alignment,
        raw.keys,
        raw.keys_end,
        data_start,
        split,
        _zero_tail(source, data_start, end),
    )
