"""Finding the model's tensors inside an unpickled checkpoint, and validating every view.

The unpickled object is hostile data: it may nest a million levels deep, share one list
a million times (a DAG that a naive walk visits 2^N times), or use keys that are not
names. Every walk here is iterative, visits each object once and is bounded.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Any

from ckptfix.core.dtypes import DTYPES
from ckptfix.core.errors import (
    CorruptFileError,
    DuplicateNameError,
    UnsupportedFormatError,
    UsageError,
)
from ckptfix.formats.unpickler import REEXPORT, TensorRef, brief

# An expanded (stride-0) tensor may claim far more elements than it stores; refuse ones
# whose logical size is both huge and out of all proportion to their storage. Writing
# one streams it in bounded chunks, so this bounds output size and time, not memory.
EXPANSION_CAP_BYTES = 1 << 34
EXPANSION_CAP_RATIO = 1 << 10
MAX_DIMS = 64  # torch's own limit on dimensions
MAX_NAME_DIGITS = 100  # an integer key longer than this is not a tensor name
_NAME_INT_LIMIT = 10**MAX_NAME_DIGITS
SEARCH_DEPTH = 3  # how deep `--key auto` looks for the tensor dictionary

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
class Storage:
    """A storage located in its file: the byte range its data occupies."""

    key: str
    dtype: str | None
    nbytes: int
    begin: int

    @property
    def byte_range(self) -> tuple[int, int]:
        return self.begin, self.begin + self.nbytes


@dataclass(frozen=True)
class View:
    """A validated tensor: dtype, shape, strides, and the bytes of its storage it reads."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    offset: int  # in elements, from the start of the storage
    storage: Storage
    span: tuple[int, int]  # bytes of the storage it reads, relative to the storage
    parameter: bool

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
        if self.numel == 0:
            return True
        expected = 1
        for dim, step in zip(reversed(self.shape), reversed(self.stride), strict=True):
            if dim != 1 and step != expected:
                return False
            expected *= dim
        return True


def key_name(key: object, display: str) -> str:
    """The tensor name of a dict key: strings as they are, integers in decimal."""
    if type(key) is str:
        return key
    if type(key) is int and abs(key) < _NAME_INT_LIMIT:
        return str(key)
    raise CorruptFileError(
        display, "bad-tensor-name", f"a tensor's key is {brief(key)}, not a name", REEXPORT
    )


def _bad_view(display: str, name: str, what: str) -> CorruptFileError:
    return CorruptFileError(display, "bad-tensor", f"tensor {name!r}: {what}", REEXPORT)


def element_range(shape: tuple[int, ...], stride: tuple[int, ...], offset: int) -> tuple[int, int]:
    """The lowest and one past the highest element index a view touches (shape non-empty
    in every dimension); negative strides are accounted for, not assumed away."""
    low = high = offset
    for dim, step in zip(shape, stride, strict=True):
        reach = (dim - 1) * step
        if reach < 0:
            low += reach
        else:
            high += reach
    return low, high + 1


def check_view(display: str, name: str, ref: TensorRef, storages: Mapping[str, Storage]) -> View:
    """Validate one view against its located storage: the single place views are checked."""
    storage = storages.get(ref.storage.key)
    if storage is None:
        raise CorruptFileError(
            display,
            "missing-storage",
            f"storage {ref.storage.key!r} is used but not stored",
            REEXPORT,
        )
    if ref.dtype not in DTYPES or DTYPES[ref.dtype].bits % 8:
        raise _bad_view(display, name, f"dtype {ref.dtype!r} is not a whole-byte dtype")
    if len(ref.shape) != len(ref.stride) or len(ref.shape) > MAX_DIMS:
        raise _bad_view(
            display, name, f"shape {brief(ref.shape)} and strides {brief(ref.stride)} do not match"
        )
    if any(dim < 0 for dim in ref.shape) or ref.offset < 0:
        raise _bad_view(
            display, name, f"shape {brief(ref.shape)} or offset {ref.offset} is negative"
        )
    if any(step < 0 for step in ref.stride):
        raise _bad_view(
            display, name, f"negative strides {brief(ref.stride)}, which torch cannot build"
        )
    itemsize = DTYPES[ref.dtype].bits // 8
    numel = 1
    for dim in ref.shape:
        numel *= dim
    if numel == 0:
        span = (ref.offset * itemsize, ref.offset * itemsize)
    else:
        low, high = element_range(ref.shape, ref.stride, ref.offset)
        span = (low * itemsize, high * itemsize)
        if high * itemsize > storage.nbytes:
            raise CorruptFileError(
                display,
                "view-out-of-bounds",
                f"tensor {name!r} reads bytes {span[0]}-{span[1]} of a {storage.nbytes}-byte storage",
                REEXPORT,
            )
    logical = numel * itemsize
    stored = span[1] - span[0]
    if logical > EXPANSION_CAP_BYTES and logical > EXPANSION_CAP_RATIO * max(stored, 1):
        raise CorruptFileError(
            display,
            "expansion-bomb",
            f"tensor {name!r} claims {logical} bytes from {stored} stored bytes",
            REEXPORT,
        )
    return View(name, ref.dtype, ref.shape, ref.stride, ref.offset, storage, span, ref.parameter)


def _children(value: Any) -> Iterator[tuple[object, Any]]:
    if isinstance(value, dict):
        yield from value.items()
    elif isinstance(value, list | tuple):
        yield from enumerate(value)


def _key_text(key: object) -> str:
    if type(key) is str:
        return key
    if type(key) is int and abs(key) < _NAME_INT_LIMIT:
        return str(key)
    return f"<{type(key).__name__}>"


def _tensor_dicts(obj: Any) -> dict[str, dict[Any, Any]]:
    """Dicts holding tensors, by their key path ("", "state_dict", "model/ema"), up to
    SEARCH_DEPTH levels down, each visited once."""
    found: dict[str, dict[Any, Any]] = {}
    seen: set[int] = set()
    pending: list[tuple[str, Any, int]] = [("", obj, 0)]
    while pending:
        path, value, depth = pending.pop()
        if id(value) in seen:
            continue
        seen.add(id(value))
        if isinstance(value, dict) and any(isinstance(v, TensorRef) for v in value.values()):
            found.setdefault(path, value)
        if depth < SEARCH_DEPTH:
            for key, child in _children(value):
                if isinstance(child, dict | list | tuple):
                    child_path = f"{path}/{_key_text(key)}" if path else _key_text(key)
                    pending.append((child_path, child, depth + 1))
    return found


def all_tensors(obj: Any) -> Iterator[TensorRef]:
    """Every tensor anywhere in the object, each container visited once (iterative)."""
    seen: set[int] = set()
    pending: list[Any] = [obj]
    while pending:
        value = pending.pop()
        if isinstance(value, TensorRef):
            yield value
        elif isinstance(value, dict | list | tuple) and id(value) not in seen:
            seen.add(id(value))
            pending.extend(child for _, child in _children(value))


@dataclass(frozen=True)
class PickleCheckpoint:
    """What a torch file holds: the unpickled object (tensors as TensorRef) and its
    storages located in the file, by key."""

    obj: Any
    storages: dict[str, Storage]
    format: str  # "torch-zip" or "torch-legacy"


@dataclass(frozen=True)
class TensorDict:
    """The tensor dictionary found in a checkpoint, and what was left around it."""

    key: str | None  # "state_dict", "model/ema", or None for a plain state dict
    tensors: dict[str, TensorRef]
    other_entries: tuple[str, ...]  # non-tensor entries beside the tensors (epoch, optimizer...)
    other_bytes: int  # storage bytes of tensors elsewhere (optimizer state, EMA copies)


def _choose(candidates: Mapping[str, dict[Any, Any]], key: str, display: str) -> str:
    if key != "auto":
        if key not in candidates:
            listed = ", ".join(sorted(k or "(top level)" for k in candidates))
            raise UsageError(
                "--key",
                f"{display} has no tensor dictionary at key {key!r}",
                f"keys with tensors: {listed[:120]}",
            )
        return key
    if "" in candidates:
        return ""
    known = [k for k in STATE_DICT_KEYS if k in candidates]
    if known:
        return known[0]
    if not candidates:
        raise UnsupportedFormatError(
            display,
            "checkpoint holds no tensor dictionary",
            "check that this is a model checkpoint",
        )

    def stored(path: str) -> int:
        return sum(t.storage.nbytes for t in candidates[path].values() if isinstance(t, TensorRef))

    return max(candidates, key=stored)


def _named_tensors(chosen: dict[Any, Any], display: str) -> dict[str, TensorRef]:
    """The dict's tensors by name; two keys with one name (1 and "1") lose nothing silently."""
    tensors: dict[str, TensorRef] = {}
    for key, value in chosen.items():
        if not isinstance(value, TensorRef):
            continue
        name = key_name(key, display)
        if name in tensors:
            raise DuplicateNameError(
                display,
                "duplicate-name",
                f"two keys of the tensor dictionary are both named {name!r} "
                f"({brief(key)} and another); one tensor would be lost",
                REEXPORT,
            )
        tensors[name] = value
    return tensors


def find_tensor_dict(obj: Any, key: str, display: str) -> TensorDict:
    """Locate the model's tensors: `key` is "auto" or a path such as "state_dict" or "a/b"."""
    candidates = _tensor_dicts(obj)
    chosen_key = _choose(candidates, key, display)
    chosen = candidates[chosen_key]
    tensors = _named_tensors(chosen, display)
    used = {t.storage.key for t in tensors.values()}
    other_storages = {
        ref.storage.key: ref.storage.nbytes
        for ref in all_tensors(obj)
        if ref.storage.key not in used
    }
    if chosen_key:
        top = [_key_text(k) for k in obj] if isinstance(obj, dict) else []
        other = tuple(k for k in top if k != chosen_key.split("/")[0])
    else:
        other = tuple(_key_text(k) for k, v in chosen.items() if not isinstance(v, TensorRef))
    return TensorDict(chosen_key or None, tensors, other, sum(other_storages.values()))


def check_views(
    display: str, tensors: Mapping[str, TensorRef], storages: Mapping[str, Storage]
) -> list[View]:
    """Validate every chosen tensor once, at the end, on the final objects; the expansion cap
    also holds for the file as a whole (many tensors, each just under the cap, expanding one
    small storage would claim terabytes from a few bytes)."""
    views = [check_view(display, name, ref, storages) for name, ref in tensors.items()]
    expanded = stored = 0
    for view in views:
        logical, span = view.numel * view.itemsize, view.span[1] - view.span[0]
        if logical > span:
            expanded += logical - span
            stored += span
    if expanded > EXPANSION_CAP_BYTES and expanded > EXPANSION_CAP_RATIO * max(stored, 1):
        raise CorruptFileError(
            display,
            "expansion-bomb",
            f"expanded tensors claim {expanded} bytes more than the {stored} bytes they store",
            REEXPORT,
        )
    return views
