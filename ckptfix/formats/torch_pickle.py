"""PyTorch checkpoints (zip and legacy) read without executing anything and without torch.

The pickle is first scanned opcode by opcode (pickletools, nothing is built) for the
globals it names; any outside the allowlist refuses the file with `unsafe-pickle`. Only
then is it unpickled, by an Unpickler whose find_class maps exact (module, name) pairs to
small local builders and refuses everything else. Storages become byte ranges in the file;
tensors become descriptors (dtype, shape, strides, storage offset). No tensor data is read.
"""

from __future__ import annotations

import collections
import io
import os
import pickle
import pickletools
import struct
import zipfile
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ckptfix.dtypes import DTYPES
from ckptfix.errors import CorruptFileError, UnsafePickleError, UnsupportedFormatError

MAX_PICKLE_SIZE = 1 << 30
LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
# An expanded (stride-0) tensor may claim far more elements than it stores; refuse ones
# whose logical size is both huge and out of all proportion to their storage.
EXPANSION_CAP_BYTES = 1 << 34
EXPANSION_CAP_RATIO = 1 << 10
_FIX = "re-export the checkpoint"

# torch dtype attribute -> safetensors dtype
TORCH_DTYPES = {
    "float32": "F32",
    "float": "F32",
    "float16": "F16",
    "half": "F16",
    "bfloat16": "BF16",
    "float64": "F64",
    "double": "F64",
    "int8": "I8",
    "uint8": "U8",
    "int16": "I16",
    "short": "I16",
    "uint16": "U16",
    "int32": "I32",
    "int": "I32",
    "uint32": "U32",
    "int64": "I64",
    "long": "I64",
    "uint64": "U64",
    "bool": "BOOL",
    "complex64": "C64",
    "cfloat": "C64",
    "float8_e4m3fn": "F8_E4M3",
    "float8_e5m2": "F8_E5M2",
    "float8_e4m3fnuz": "F8_E4M3FNUZ",
    "float8_e5m2fnuz": "F8_E5M2FNUZ",
    "float8_e8m0fnu": "F8_E8M0",
}
# legacy typed storage classes -> safetensors dtype
STORAGE_TYPES = {
    "FloatStorage": "F32",
    "HalfStorage": "F16",
    "BFloat16Storage": "BF16",
    "DoubleStorage": "F64",
    "CharStorage": "I8",
    "ByteStorage": "U8",
    "ShortStorage": "I16",
    "IntStorage": "I32",
    "LongStorage": "I64",
    "BoolStorage": "BOOL",
    "ComplexFloatStorage": "C64",
}


@dataclass(frozen=True)
class _DtypeMark:
    dtype: str


@dataclass(frozen=True)
class _StorageType:
    dtype: str | None  # None: untyped storage, counted in bytes


@dataclass(frozen=True)
class Storage:
    """A storage: its key and the byte range its data occupies in the file."""

    key: str
    dtype: str | None
    nbytes: int
    begin: int = -1  # filled in once the container is understood

    @property
    def byte_range(self) -> tuple[int, int]:
        return self.begin, self.begin + self.nbytes


@dataclass(frozen=True)
class TensorRef:
    """A tensor as the pickle describes it: a strided view of a storage."""

    storage: Storage
    dtype: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    parameter: bool = False

    @property
    def itemsize(self) -> int:
        return DTYPES[self.dtype].bits // 8

    @property
    def numel(self) -> int:
        count = 1
        for dim in self.shape:
            count *= dim
        return count

    @property
    def contiguous(self) -> bool:
        expected = 1
        for dim, step in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if dim != 1 and step != expected:
                return False
            expected *= dim
        return True

    @property
    def span(self) -> tuple[int, int]:
        """Byte range within the storage that holds elements of this view."""
        start = self.offset * self.itemsize
        if self.numel == 0:
            return start, start
        extent = sum((dim - 1) * step for dim, step in zip(self.shape, self.stride, strict=True))
        return start, start + (extent + 1) * self.itemsize


@dataclass(frozen=True)
class PickleCheckpoint:
    """What a torch file holds: the unpickled object (tensors as TensorRef) and storages."""

    obj: Any
    storages: dict[str, Storage]
    format: str  # "torch-zip" or "torch-legacy"


class _Refused(Exception):
    pass


def _ints(value: object, what: str, path: str) -> tuple[int, ...]:
    if not isinstance(value, tuple | list) or not all(type(v) is int for v in value):
        raise CorruptFileError(path, "bad-tensor", f"tensor {what} is {value!r:.60}", _FIX)
    return tuple(value)


class _Builders:
    """The only callables a pickle can reach. Each validates its arguments."""

    def __init__(self, path: str, storages: dict[str, Storage]) -> None:
        self.path = path
        self.storages = storages

    def tensor(
        self,
        storage: object,
        offset: object,
        size: object,
        stride: object,
        dtype: str | None = None,
        parameter: bool = False,
    ) -> TensorRef:
        if not isinstance(storage, Storage):
            raise CorruptFileError(
                self.path, "bad-tensor", "tensor is not built on a storage", _FIX
            )
        dtype = dtype or storage.dtype
        if dtype is None:
            raise CorruptFileError(self.path, "bad-tensor", "untyped storage without a dtype", _FIX)
        if type(offset) is not int or offset < 0:
            raise CorruptFileError(self.path, "bad-tensor", f"storage offset {offset!r:.40}", _FIX)
        shape, strides = _ints(size, "shape", self.path), _ints(stride, "stride", self.path)
        if len(shape) != len(strides) or any(d < 0 for d in shape) or any(s < 0 for s in strides):
            raise CorruptFileError(
                self.path,
                "bad-tensor",
                f"tensor shape {list(shape)} and strides {list(strides)} are not a valid view",
                _FIX,
            )
        return TensorRef(storage, dtype, offset, shape, strides)

    def rebuild_v2(
        self,
        storage: object,
        offset: object,
        size: object,
        stride: object,
        requires_grad: object = False,
        hooks: object = None,
        metadata: object = None,
    ) -> TensorRef:
        return self.tensor(storage, offset, size, stride)

    def rebuild_v3(
        self,
        storage: object,
        offset: object,
        size: object,
        stride: object,
        requires_grad: object,
        hooks: object,
        dtype: object,
        metadata: object = None,
    ) -> TensorRef:
        if not isinstance(dtype, _DtypeMark):
            raise CorruptFileError(
                self.path, "bad-tensor", "tensor dtype is not a torch dtype", _FIX
            )
        return self.tensor(storage, offset, size, stride, dtype.dtype)

    def parameter(
        self,
        data: object,
        requires_grad: object = False,
        hooks: object = None,
        state: object = None,
    ) -> TensorRef:
        if not isinstance(data, TensorRef):
            raise CorruptFileError(self.path, "bad-tensor", "parameter without a tensor", _FIX)
        return TensorRef(data.storage, data.dtype, data.offset, data.shape, data.stride, True)


def _allowlist(builders: _Builders) -> dict[tuple[str, str], object]:
    allowed: dict[tuple[str, str], object] = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2"): builders.rebuild_v2,
        ("torch._utils", "_rebuild_tensor_v3"): builders.rebuild_v3,
        ("torch._utils", "_rebuild_parameter"): builders.parameter,
        ("torch._utils", "_rebuild_parameter_with_state"): builders.parameter,
        ("torch.storage", "UntypedStorage"): _StorageType(None),
        ("torch", "UntypedStorage"): _StorageType(None),
    }
    for name, dtype in TORCH_DTYPES.items():
        allowed[("torch", name)] = _DtypeMark(dtype)
    for name, dtype in STORAGE_TYPES.items():
        allowed[("torch", name)] = _StorageType(dtype)
    return allowed


ALLOWED_GLOBALS = frozenset(_allowlist(_Builders("", {})))

_STRING_OPS = {
    "SHORT_BINUNICODE",
    "BINUNICODE",
    "BINUNICODE8",
    "UNICODE",
    "STRING",
    "BINSTRING",
    "SHORT_BINSTRING",
}


def scan_globals(data: bytes, path: str) -> Counter[str]:
    """Every global a pickle names, counted, without building anything.

    STACK_GLOBAL takes its names from the stack; they are tracked through the memo the
    way pickles usually push them. This scan is for reporting; find_class is the gate.
    """
    found: Counter[str] = Counter()
    recent: list[str] = []
    memo: dict[int, str] = {}
    next_memo = 0
    try:
        for opcode, arg, _ in pickletools.genops(data):
            name = opcode.name
            if name in ("GLOBAL", "INST"):
                module, _, attr = str(arg).partition(" ")
                found[f"{module}.{attr}"] += 1
            elif name == "STACK_GLOBAL":
                if len(recent) >= 2:
                    found[f"{recent[-2]}.{recent[-1]}"] += 1
                else:
                    found["<unknown>"] += 1
            elif name in _STRING_OPS:
                recent.append(str(arg))
            elif name in ("BINPUT", "LONG_BINPUT", "PUT"):
                if recent:
                    memo[int(str(arg))] = recent[-1]
            elif name == "MEMOIZE":
                if recent:
                    memo[next_memo] = recent[-1]
                next_memo += 1
            elif name in ("BINGET", "LONG_BINGET", "GET") and int(str(arg)) in memo:
                recent.append(memo[int(str(arg))])
            if name == "STOP":
                break
    except (ValueError, KeyError, IndexError, struct.error, MemoryError) as exc:
        raise CorruptFileError(path, "bad-pickle", f"pickle is malformed: {exc}", _FIX) from exc
    return found


def _refuse_unsafe(data: bytes, path: str) -> None:
    names = scan_globals(data, path)
    refused = {
        name: count
        for name, count in names.items()
        if tuple(name.rsplit(".", 1)) not in ALLOWED_GLOBALS
    }
    if refused:
        listed = ", ".join(f"{name} ×{count}" for name, count in sorted(refused.items()))
        raise UnsafePickleError(
            path,
            f"pickle references globals outside the allowlist: {listed}; it was not loaded",
            "only load it if you trust its origin; ckptfix never executes pickles",
        )


class _Unpickler(pickle.Unpickler):
    def __init__(
        self,
        stream: io.BytesIO,
        path: str,
        storages: dict[str, Storage],
        resolve: Callable[[str, str | None, int], Storage],
    ) -> None:
        super().__init__(stream)
        self.path = path
        self.allowed = _allowlist(_Builders(path, storages))
        self.resolve = resolve

    def find_class(self, module: str, name: str) -> Any:
        # Never the default find_class: nothing named in the file is ever imported.
        try:
            return self.allowed[(module, name)]
        except KeyError:
            raise UnsafePickleError(
                self.path,
                f"pickle references {module}.{name}, outside the allowlist",
                "only load it if you trust its origin; ckptfix never executes pickles",
            ) from None

    def persistent_load(self, pid: Any) -> Storage:
        if (
            not isinstance(pid, tuple)
            or len(pid) not in (5, 6)
            or pid[0] != "storage"
            or not isinstance(pid[1], _StorageType)
            or not isinstance(pid[2], str)
            or type(pid[4]) is not int
            or pid[4] < 0
            or (len(pid) == 6 and pid[5] is not None)
        ):
            raise CorruptFileError(
                self.path, "bad-storage-ref", f"unexpected persistent id {pid!r:.80}", _FIX
            )
        storage_type: _StorageType = pid[1]
        return self.resolve(pid[2], storage_type.dtype, pid[4])


def _unpickle(
    data: bytes,
    path: str,
    resolve: Callable[[str, str | None, int], Storage],
    storages: dict[str, Storage],
) -> Any:
    _refuse_unsafe(data, path)
    stream = io.BytesIO(data)
    try:
        result = _Unpickler(stream, path, storages, resolve).load()
    except (CorruptFileError, UnsafePickleError):
        raise
    except (
        pickle.UnpicklingError,
        EOFError,
        ValueError,
        TypeError,
        AttributeError,
        IndexError,
        KeyError,
        RecursionError,
        MemoryError,
        struct.error,
    ) as exc:
        raise CorruptFileError(
            path, "bad-pickle", f"pickle cannot be read: {exc!s:.80}", _FIX
        ) from exc
    return result


def _storage_nbytes(dtype: str | None, numel: int) -> int:
    return numel if dtype is None else numel * DTYPES[dtype].bits // 8


def read_zip(path: str, display: str) -> PickleCheckpoint:
    try:
        archive = zipfile.ZipFile(path)
    except (zipfile.BadZipFile, OSError, ValueError) as exc:
        raise CorruptFileError(
            display, "bad-zip", f"zip archive cannot be read: {exc}", _FIX
        ) from exc
    with archive:
        infos = archive.infolist()
        names = [info.filename for info in infos]
        if len(set(names)) != len(names):
            duplicated = sorted({name for name in names if names.count(name) > 1})
            raise CorruptFileError(
                display,
                "zip-duplicate-entry",
                f"zip holds duplicate entries: {', '.join(duplicated[:3])}",
                _FIX,
            )
        roots = {name.split("/", 1)[0] for name in names}
        if len(roots) != 1 or any("/" not in name for name in names):
            raise CorruptFileError(
                display, "zip-layout", "zip does not have exactly one top-level folder", _FIX
            )
        root = roots.pop()
        if any(name.startswith((f"{root}/code/", f"{root}/constants.pkl")) for name in names):
            raise UnsupportedFormatError(
                display,
                "file is a TorchScript archive, not a checkpoint",
                "export its state_dict() with torch.save instead",
            )
        pickles = [n for n in names if n.endswith(".pkl")]
        if pickles != [f"{root}/data.pkl"]:
            raise CorruptFileError(
                display, "zip-layout", f"expected one {root}/data.pkl, found {pickles[:3]}", _FIX
            )
        info = archive.getinfo(f"{root}/data.pkl")
        if info.file_size > MAX_PICKLE_SIZE:
            raise CorruptFileError(display, "pickle-too-large", "data.pkl is over 1 GiB", _FIX)
        try:
            data = archive.read(info)
        except (zipfile.BadZipFile, OSError, ValueError) as exc:
            raise CorruptFileError(
                display, "bad-zip", f"data.pkl cannot be read: {exc}", _FIX
            ) from exc
        entries = {info.filename: info for info in infos}
        file_size = os.path.getsize(path)
        storages: dict[str, Storage] = {}

        def resolve(key: str, dtype: str | None, numel: int) -> Storage:
            if key in storages:
                known = storages[key]
                if _storage_nbytes(dtype, numel) != known.nbytes:
                    raise CorruptFileError(
                        display,
                        "storage-mismatch",
                        f"storage {key!r} is referenced with two sizes",
                        _FIX,
                    )
                return known
            entry = entries.get(f"{root}/data/{key}")
            if entry is None:
                raise CorruptFileError(
                    display, "missing-storage", f"storage {key!r} has no data/{key} entry", _FIX
                )
            if entry.compress_type != zipfile.ZIP_STORED:
                raise CorruptFileError(
                    display,
                    "compressed-storage",
                    f"storage {key!r} is compressed; torch writes storages stored",
                    _FIX,
                )
            nbytes = _storage_nbytes(dtype, numel)
            if entry.file_size != nbytes or entry.compress_size != nbytes:
                raise CorruptFileError(
                    display,
                    "storage-size",
                    f"storage {key!r} should hold {nbytes} bytes but its entry has {entry.file_size}",
                    _FIX,
                )
            begin = _data_offset(path, entry, display)
            if begin + nbytes > file_size:
                raise CorruptFileError(
                    display,
                    "truncated",
                    f"storage {key!r} runs past the end of the file",
                    "re-download the file",
                )
            storages[key] = Storage(key, dtype, nbytes, begin)
            return storages[key]

        obj = _unpickle(data, display, resolve, storages)
    return PickleCheckpoint(obj, storages, "torch-zip")


def _data_offset(path: str, entry: zipfile.ZipInfo, display: str) -> int:
    """Where an entry's bytes start: after its local header, whose extra field may differ
    from the central directory's."""
    with open(path, "rb") as handle:
        handle.seek(entry.header_offset)
        header = handle.read(30)
    if len(header) != 30 or header[:4] != b"PK\x03\x04":
        raise CorruptFileError(display, "bad-zip", f"bad local header for {entry.filename}", _FIX)
    name_length, extra_length = struct.unpack("<HH", header[26:30])
    start: int = entry.header_offset + 30 + name_length + extra_length
    return start


def read_legacy(path: str, display: str) -> PickleCheckpoint:
    """The pre-1.6 format: magic, protocol, sys-info, the object, the storage keys, then
    each storage as an int64 element count and its raw bytes."""
    size = os.path.getsize(path)
    pending: dict[str, tuple[str | None, int]] = {}
    storages: dict[str, Storage] = {}

    def resolve(key: str, dtype: str | None, numel: int) -> Storage:
        if key in pending and pending[key] != (dtype, numel):
            raise CorruptFileError(
                display, "storage-mismatch", f"storage {key!r} is referenced with two sizes", _FIX
            )
        pending[key] = (dtype, numel)
        return Storage(key, dtype, _storage_nbytes(dtype, numel))

    with open(path, "rb") as handle:

        def next_pickle(what: str) -> Any:
            # Find where this pickle ends by walking its opcodes (nothing is built), then
            # read exactly those bytes: the storages after the pickles are never loaded.
            start = handle.tell()
            end = _pickle_end(handle, display, what)
            if end - start > MAX_PICKLE_SIZE:
                raise CorruptFileError(display, "pickle-too-large", f"{what} is over 1 GiB", _FIX)
            handle.seek(start)
            data = handle.read(end - start)
            return _unpickle(data, display, resolve, storages)

        magic = next_pickle("magic number")
        if magic != LEGACY_MAGIC:
            raise CorruptFileError(display, "bad-magic", "pickle is not a PyTorch checkpoint", _FIX)
        if next_pickle("protocol version") != LEGACY_PROTOCOL:
            raise CorruptFileError(display, "bad-protocol", "unknown legacy protocol version", _FIX)
        info = next_pickle("system info")
        if not isinstance(info, dict) or info.get("little_endian") is not True:
            raise CorruptFileError(
                display, "big-endian", "only little-endian checkpoints are read", _FIX
            )
        obj = next_pickle("checkpoint")
        keys = next_pickle("storage list")
        if not isinstance(keys, list) or not all(isinstance(k, str) for k in keys):
            raise CorruptFileError(
                display, "bad-storage-list", "storage key list is malformed", _FIX
            )
        position = handle.tell()
        for key in keys:
            handle.seek(position)
            raw = handle.read(8)
            if len(raw) != 8:
                raise CorruptFileError(
                    display,
                    "truncated",
                    f"file ends before storage {key!r}",
                    "re-download the file",
                )
            (numel,) = struct.unpack("<q", raw)
            dtype, expected = pending.get(key, (None, -1))
            if key not in pending or numel != expected:
                raise CorruptFileError(
                    display,
                    "storage-size",
                    f"storage {key!r} has {numel} elements, expected {expected}",
                    _FIX,
                )
            nbytes = _storage_nbytes(dtype, numel)
            storages[key] = Storage(key, dtype, nbytes, position + 8)
            position += 8 + nbytes
    if position > size:
        raise CorruptFileError(
            display,
            "truncated",
            f"storages need {position} bytes but the file has {size}",
            "re-download the file",
        )
    if position < size:
        raise CorruptFileError(
            display,
            "trailing-bytes",
            f"file has {size - position} bytes after the last storage",
            _FIX,
        )
    missing = sorted(set(pending) - set(storages))
    if missing:
        raise CorruptFileError(
            display, "missing-storage", f"storage {missing[0]!r} is used but not stored", _FIX
        )
    return PickleCheckpoint(_rebind(obj, storages), storages, "torch-legacy")


class _Bounded:
    """A read-only view of a file that never reads past `end`: a pickle opcode claiming a
    huge length gets a short read (and pickletools a clean error), not a huge allocation."""

    def __init__(self, handle: Any, end: int) -> None:
        self.handle = handle
        self.end = end

    def read(self, size: int = -1) -> bytes:
        left = max(self.end - self.handle.tell(), 0)
        data: bytes = self.handle.read(left if size < 0 else min(size, left))
        return data

    def readline(self) -> bytes:
        line: bytes = self.handle.readline(max(self.end - self.handle.tell(), 0))
        return line

    def tell(self) -> int:
        position: int = self.handle.tell()
        return position


def _pickle_end(handle: Any, display: str, what: str) -> int:
    """Walk one pickle's opcodes from the current position; return the offset after STOP."""
    start = handle.tell()
    size = os.fstat(handle.fileno()).st_size
    bounded = _Bounded(handle, min(size, start + MAX_PICKLE_SIZE))
    try:
        for opcode, _, _ in pickletools.genops(bounded):  # type: ignore[arg-type]
            if opcode.name == "STOP":
                end: int = handle.tell()
                return end
    except (ValueError, KeyError, IndexError, struct.error, MemoryError) as exc:
        raise CorruptFileError(
            display, "bad-pickle", f"{what} pickle is malformed: {exc}", _FIX
        ) from exc
    raise CorruptFileError(display, "bad-pickle", f"{what} pickle has no end", _FIX)


def _rebind(obj: Any, storages: dict[str, Storage]) -> Any:
    """Point tensors at the storages located after the pickle was read (legacy files)."""
    if isinstance(obj, TensorRef):
        return TensorRef(
            storages[obj.storage.key], obj.dtype, obj.offset, obj.shape, obj.stride, obj.parameter
        )
    if isinstance(obj, dict):
        rebound = {key: _rebind(value, storages) for key, value in obj.items()}
        return (
            collections.OrderedDict(rebound)
            if isinstance(obj, collections.OrderedDict)
            else rebound
        )
    if isinstance(obj, list):
        return [_rebind(item, storages) for item in obj]
    if isinstance(obj, tuple):
        return tuple(_rebind(item, storages) for item in obj)
    return obj


def check_views(display: str, tensors: list[tuple[str, TensorRef]]) -> None:
    """Every view must lie inside its storage; expansions must not be absurd."""
    for name, ref in tensors:
        begin, end = ref.span
        if ref.numel and end > ref.storage.nbytes:
            raise CorruptFileError(
                display,
                "view-out-of-bounds",
                f"tensor {name!r} reads bytes {begin}-{end} of a {ref.storage.nbytes}-byte storage",
                _FIX,
            )
        logical = ref.numel * ref.itemsize
        if logical > EXPANSION_CAP_BYTES and logical > EXPANSION_CAP_RATIO * max(end - begin, 1):
            raise CorruptFileError(
                display,
                "expansion-bomb",
                f"tensor {name!r} claims {logical} bytes from {end - begin} stored bytes",
                _FIX,
            )


# Where training checkpoints keep the model's tensors, most likely first.
STATE_DICT_KEYS = (
    "state_dict",
    "model_state_dict",
    "model",
    "module",
    "ema",
    "model_ema",
    "state_dict_ema",
    "ema_state_dict",
    "net",
    "params",
    "weights",
)


@dataclass(frozen=True)
class TensorDict:
    """The tensor dictionary found in a checkpoint, and what was left around it."""

    key: str | None  # "state_dict", "model/ema", or None for a plain state dict
    tensors: dict[str, TensorRef]
    other_entries: tuple[str, ...]  # non-tensor entries beside the tensors (epoch, optimizer...)
    other_bytes: int  # storage bytes of tensors elsewhere (optimizer state, EMA copies)


def _tensor_dicts(obj: Any, path: str, depth: int) -> list[tuple[str, dict[Any, Any]]]:
    found: list[tuple[str, dict[Any, Any]]] = []
    if isinstance(obj, dict):
        if any(isinstance(value, TensorRef) for value in obj.values()):
            found.append((path, obj))
        if depth < 3:
            for key, value in obj.items():
                if isinstance(value, dict | list | tuple):
                    found += _tensor_dicts(value, f"{path}/{key}" if path else str(key), depth + 1)
    elif isinstance(obj, list | tuple) and depth < 3:
        for index, value in enumerate(obj):
            found += _tensor_dicts(value, f"{path}/{index}" if path else str(index), depth + 1)
    return found


def _all_tensors(obj: Any, depth: int = 0) -> list[TensorRef]:
    if isinstance(obj, TensorRef):
        return [obj]
    if depth > 50:
        return []
    if isinstance(obj, dict):
        return [t for value in obj.values() for t in _all_tensors(value, depth + 1)]
    if isinstance(obj, list | tuple):
        return [t for value in obj for t in _all_tensors(value, depth + 1)]
    return []


def find_tensor_dict(obj: Any, key: str, display: str) -> TensorDict:
    """Locate the model's tensors: `key` is "auto" or a path such as "state_dict" or "a/b"."""
    candidates = dict(_tensor_dicts(obj, "", 0))
    if key != "auto":
        chosen_key = key
        if key not in candidates:
            raise UnsupportedFormatError(
                display,
                f"no tensor dictionary at key {key!r}",
                f"keys with tensors: {', '.join(sorted(k or '(top level)' for k in candidates))[:120]}",
            )
    elif "" in candidates:
        chosen_key = ""
    else:
        known = [k for k in STATE_DICT_KEYS if k in candidates]
        if known:
            chosen_key = known[0]
        elif candidates:
            chosen_key = max(
                candidates,
                key=lambda k: sum(
                    t.numel * t.itemsize for t in candidates[k].values() if isinstance(t, TensorRef)
                ),
            )
        else:
            raise UnsupportedFormatError(
                display,
                "checkpoint holds no tensor dictionary",
                "check that this is a model checkpoint",
            )
    chosen = candidates[chosen_key]
    tensors = {str(name): value for name, value in chosen.items() if isinstance(value, TensorRef)}
    used = {id(t.storage) for t in tensors.values()}
    seen: set[int] = set()
    other_bytes = 0
    for ref in _all_tensors(obj):
        if id(ref.storage) not in used and id(ref.storage) not in seen:
            seen.add(id(ref.storage))
            other_bytes += ref.storage.nbytes
    if chosen_key:
        other = tuple(str(k) for k in obj) if isinstance(obj, dict) else ()
        other = tuple(k for k in other if k != chosen_key.split("/")[0])
    else:
        other = tuple(str(k) for k, v in chosen.items() if not isinstance(v, TensorRef))
    return TensorDict(chosen_key or None, tensors, other, other_bytes)
