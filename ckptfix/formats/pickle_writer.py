"""The one pickle ckptfix writes: a state dict as `torch.save` (2.13) pickles it, opcode for
opcode, without torch and without `pickle.Pickler` (which would import the classes it names).

torch pickles an `OrderedDict` of name -> tensor with protocol 2. Each tensor is a call of
`torch._utils._rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict())`
whose storage is a persistent id `('storage', torch.<Dtype>Storage, key, 'cpu', numel)`;
dtypes without a legacy storage class (uint16, float8, ...) use `_rebuild_tensor_v3` on a
`torch.storage.UntypedStorage` counted in bytes, with the dtype as a seventh argument.
The memo is used as CPython's pickler uses it for the objects torch passes: every string,
global and non-empty tuple is memoized; the globals, the 'storage' and 'cpu' strings and a
storage's key are the same object each time they recur, so they recur as memo gets. With
tensors as distinct objects (what `state_dict()` returns), the bytes are torch's own.
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ckptfix.core.dtypes import DTYPES, TORCH_NAMES

_BATCH = 1000  # pickle's _BATCHSIZE: SETITEMS takes at most this many pairs


@dataclass(frozen=True, slots=True)
class TensorEntry:
    """One name of the state dict: a view of a storage (shared by name when keys repeat)."""

    name: str
    storage_key: str
    dtype: str  # the safetensors name of the dtype
    storage_nbytes: int
    shape: tuple[int, ...]
    offset: int = 0  # in elements
    stride: tuple[int, ...] | None = None  # None: contiguous

    @property
    def strides(self) -> tuple[int, ...]:
        return contiguous_strides(self.shape) if self.stride is None else self.stride


def contiguous_strides(shape: Sequence[int]) -> tuple[int, ...]:
    """Row-major strides as torch computes them (a size-0 dimension counts as 1)."""
    strides, step = [], 1
    for dim in reversed(shape):
        strides.append(step)
        step *= max(dim, 1)
    return tuple(reversed(strides))


def torch_can_store(dtype: str) -> bool:
    return dtype in TORCH_NAMES


class _Emitter:
    """Protocol-2 opcodes with CPython's memo numbering."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")  # PROTO 2
        self.memo: dict[object, int] = {}
        self.count = 0

    def remember(self, key: object = None) -> None:
        """Memoize the object just written (`key`: how a later occurrence is recognised)."""
        index = self.count
        self.count += 1
        if key is not None:
            self.memo[key] = index
        self.out += b"q" + bytes([index]) if index < 256 else b"r" + struct.pack("<I", index)

    def recall(self, key: object) -> bool:
        """Write a memo get for `key` if it was seen; say whether it was."""
        index = self.memo.get(key)
        if index is None:
            return False
        self.out += b"h" + bytes([index]) if index < 256 else b"j" + struct.pack("<I", index)
        return True

    def glob(self, module: str, name: str) -> None:
        if not self.recall(("global", module, name)):
            self.out += b"c" + f"{module}\n{name}\n".encode()
            self.remember(("global", module, name))

    def string(self, text: str, key: object = None) -> None:
        if key is not None and self.recall(key):
            return
        data = text.encode("utf-8", "surrogatepass")
        self.out += b"X" + struct.pack("<I", len(data)) + data
        self.remember(key)

    def integer(self, value: int) -> None:
        if 0 <= value <= 0xFF:
            self.out += b"K" + bytes([value])
        elif 0 <= value <= 0xFFFF:
            self.out += b"M" + struct.pack("<H", value)
        elif -(2**31) <= value < 2**31:
            self.out += b"J" + struct.pack("<i", value)
        else:
            data = value.to_bytes((value.bit_length() >> 3) + 1, "little", signed=True)
            self.out += b"\x8a" + bytes([len(data)]) + data  # LONG1

    def int_tuple(self, values: Sequence[int]) -> None:
        if not values:
            self.out += b")"  # EMPTY_TUPLE, never memoized
            return
        if len(values) > 3:
            self.out += b"("  # MARK
        for value in values:
            self.integer(value)
        self.out += b"t" if len(values) > 3 else b"\x85\x86\x87"[len(values) - 1 : len(values)]
        self.remember()

    def call_empty(self, module: str, name: str) -> None:
        """`module.name()`: the class, an empty argument tuple, REDUCE."""
        self.glob(module, name)
        self.out += b")R"
        self.remember()


def _tensor(emit: _Emitter, entry: TensorEntry) -> None:
    storage_class = DTYPES[entry.dtype].storage
    itemsize = DTYPES[entry.dtype].bits // 8
    emit.glob("torch._utils", "_rebuild_tensor_v2" if storage_class else "_rebuild_tensor_v3")
    emit.out += b"(("  # MARK of the arguments, MARK of the persistent id
    emit.string("storage", ("literal", "storage"))
    if storage_class:
        emit.glob("torch", storage_class)
    else:
        emit.glob("torch.storage", "UntypedStorage")
    emit.string(entry.storage_key, ("storage key", entry.storage_key))
    emit.string("cpu", ("literal", "cpu"))
    emit.integer(entry.storage_nbytes // itemsize if storage_class else entry.storage_nbytes)
    emit.out += b"t"
    emit.remember()
    emit.out += b"Q"  # BINPERSID
    emit.integer(entry.offset)
    emit.int_tuple(entry.shape)
    emit.int_tuple(entry.strides)
    emit.out += b"\x89"  # requires_grad=False
    emit.call_empty("collections", "OrderedDict")  # backward hooks
    if not storage_class:
        emit.glob("torch", TORCH_NAMES[entry.dtype])
    emit.out += b"t"
    emit.remember()
    emit.out += b"R"
    emit.remember()


def state_dict_pickle(entries: Iterable[TensorEntry]) -> bytes:
    """data.pkl of a torch zip holding these tensors, in this order."""
    emit = _Emitter()
    emit.call_empty("collections", "OrderedDict")
    items = list(entries)
    for start in range(0, max(len(items), 1), _BATCH):
        batch = items[start : start + _BATCH]
        if len(batch) > 1:
            emit.out += b"("
        for entry in batch:
            emit.string(entry.name)
            _tensor(emit, entry)
        if batch:
            emit.out += b"u" if len(batch) > 1 else b"s"  # SETITEMS or SETITEM
    emit.out += b"."
    return bytes(emit.out)
