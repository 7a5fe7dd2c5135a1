"""Restricted unpickling: the only objects a checkpoint's pickle can reach are inert.

A pickle is first walked by `pickle_scan` (bounds, where it ends, every global it names);
any global outside the allowlist refuses the file before anything is built. Only then does
CPython's unpickler run, with a `find_class` that maps exact (module, name) pairs to the
allowlist's entries and refuses everything else, and a `persistent_load` that turns storage
references into descriptors. Nothing named in a file is ever imported or called.

The allowlist is data: a mapping from (module, name) to the object the pickle gets, which
is a small builder, a marker, a container type, or an inert stub. Every object we hand out
refuses `__setstate__`, so the BUILD opcode cannot rewrite a descriptor after it was built;
views are validated once, at the end, on the final objects (see `tensor_dict.check_views`).
"""

from __future__ import annotations

import collections
import io
import pickle
import reprlib
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from ckptfix.core.dtypes import TORCH_DTYPES, TORCH_STORAGES
from ckptfix.core.errors import (
    CkptfixError,
    CorruptFileError,
    UnsafePickleError,
    UnsupportedFormatError,
)
from ckptfix.core.memory import paused_gc
from ckptfix.formats.pickle_scan import PickleRejected, ScanResult, scan

REFUSED_FIX = "only load it if you trust its origin; ckptfix never executes pickles"
MODEL_FIX = (
    "in a trusted environment, load it and save model.state_dict() instead; ckptfix never "
    "executes pickles"
)
# Classes that appear when a whole nn.Module is pickled rather than its state dict.
_MODEL_MODULES = ("torch.nn.", "__main__.", "torch.fx.", "transformers.", "diffusers.")
REEXPORT = "re-export the checkpoint"

_brief = reprlib.Repr()
_brief.maxlevel, _brief.maxstring, _brief.maxother = 3, 40, 40


def brief(value: object) -> str:
    """A short repr that cannot recurse deeply or print megabytes (hostile values)."""
    try:
        return _brief.repr(value)
    except Exception:  # a hostile value's repr can fail in any way; its type cannot
        return f"<{type(value).__name__}>"


class Inert:
    """Base of every object a pickle can get from us: it refuses BUILD (`__setstate__`)."""

    def __setstate__(self, state: object) -> None:
        raise PickleRejected(
            "mutated-object",
            f"pickle tries to rewrite a {type(self).__name__.lstrip('_')} after building it",
        )


class Stub(Inert):
    """An instance of a benign class a pickle may build (by REDUCE, NEWOBJ or NEWOBJ_EX, then
    at most one BUILD): nothing of the real class is imported or run; the arguments and the
    state are kept as plain data for the format that asked for the stub to read."""

    qualname = "stub"
    args: tuple[object, ...]
    kwargs: dict[str, object]
    state: object
    _built: bool

    def __new__(cls, *args: object, **kwargs: object) -> Stub:
        instance = super().__new__(cls)
        instance.args = args
        instance.kwargs = kwargs
        instance.state = None
        instance._built = False
        return instance

    def __init__(self, *args: object, **kwargs: object) -> None:
        pass  # __new__ kept the arguments

    def __setstate__(self, state: object) -> None:
        if self._built:
            raise PickleRejected("mutated-object", f"pickle builds a {self.qualname} twice")
        if not isinstance(state, dict | tuple) and state is not None:
            raise PickleRejected(
                "bad-pickle", f"pickle gives a {self.qualname} the state {brief(state)}"
            )
        self.state = state
        self._built = True

    def field(self, name: str, default: object = None) -> object:
        """A field of the BUILD state (a dict, or a dict in a (dict, slots) pair)."""
        state = self.state
        if isinstance(state, tuple) and len(state) == 2:
            state = state[0] if isinstance(state[0], dict) else state[1]
        return state.get(name, default) if isinstance(state, dict) else default

    def __repr__(self) -> str:
        return f"<{self.qualname} stub>"


def stub_class(qualname: str) -> type[Stub]:
    """A fresh Stub subclass standing for `module.Class`, for an allowlist entry."""
    return type(qualname.rsplit(".", 1)[-1], (Stub,), {"qualname": qualname})


@dataclass(frozen=True)
class StorageRef(Inert):
    """A storage as the pickle names it: key, dtype (None: untyped, counted in bytes), size."""

    key: str
    dtype: str | None
    nbytes: int


@dataclass(frozen=True)
class TensorRef(Inert):
    """A tensor as the pickle describes it: a strided view of a storage. Not yet validated."""

    storage: StorageRef
    dtype: str
    offset: int
    shape: tuple[int, ...]
    stride: tuple[int, ...]
    parameter: bool = False


@dataclass(frozen=True)
class DtypeMark(Inert):
    """What `torch.float16` and friends unpickle to."""

    dtype: str


@dataclass(frozen=True)
class StorageType(Inert):
    """What `torch.FloatStorage`, `torch.UntypedStorage`, ... unpickle to."""

    dtype: str | None


def _ints(value: object, what: str) -> tuple[int, ...]:
    if type(value) not in (tuple, list) or not all(type(v) is int for v in value):  # type: ignore[attr-defined]
        raise PickleRejected("bad-tensor", f"tensor {what} is {brief(value)}, not integers")
    return tuple(value)  # type: ignore[arg-type]


def _tensor(
    storage: object, offset: object, size: object, stride: object, dtype: object
) -> TensorRef:
    if not isinstance(storage, StorageRef):
        raise PickleRejected("bad-tensor", "tensor is not built on a storage")
    if isinstance(dtype, Unsupported):
        raise PickleUnsupported(f"a tensor of {dtype.name}")
    if dtype is None:
        dtype = storage.dtype
    elif isinstance(dtype, DtypeMark):
        dtype = dtype.dtype
    else:
        raise PickleRejected("bad-tensor", f"tensor dtype {brief(dtype)} is not a torch dtype")
    if dtype is None:
        raise PickleRejected("bad-tensor", "tensor on an untyped storage has no dtype")
    if type(offset) is not int:
        raise PickleRejected("bad-tensor", f"tensor storage offset is {brief(offset)}")
    return TensorRef(storage, str(dtype), offset, _ints(size, "shape"), _ints(stride, "stride"))


class PickleUnsupported(PickleRejected):
    """A tensor of a dtype or layout ckptfix does not read (complex128, sparse, quantized):
    not a hostile file, and reported as unsupported, not as unsafe."""

    def __init__(self, what: str) -> None:
        super().__init__("unsupported-tensor", what)


@dataclass(frozen=True)
class Unsupported(Inert):
    """What an unsupported torch dtype or storage class unpickles to."""

    name: str


class Builder(Inert):
    """A callable the pickle may REDUCE; wraps one of the functions below."""

    def __init__(self, name: str, function: Callable[..., object]) -> None:
        self._name = name
        self._function = function

    def __call__(self, *args: object) -> object:
        try:
            return self._function(*args)
        except TypeError:  # wrong arity: a malformed or hostile pickle
            raise PickleRejected(
                "bad-tensor", f"{self._name} called with {len(args)} argument(s)"
            ) from None


def _rebuild_v2(
    storage: object, offset: object, size: object, stride: object, *_: object
) -> TensorRef:
    return _tensor(storage, offset, size, stride, None)


def _rebuild_v3(*args: object) -> TensorRef:
    """torch._utils._rebuild_tensor_v3(storage, offset, size, stride, requires_grad,
    backward_hooks, dtype, metadata=None): the dtype is explicit (untyped storages)."""
    if len(args) < 7:
        raise TypeError("too few arguments")
    storage, offset, size, stride, _, _, dtype = args[:7]
    return _tensor(storage, offset, size, stride, dtype)


def _parameter(data: object, *_: object) -> TensorRef:
    if not isinstance(data, TensorRef):
        raise PickleRejected("bad-tensor", "parameter is not built on a tensor")
    return TensorRef(data.storage, data.dtype, data.offset, data.shape, data.stride, True)


Allowlist = Mapping[tuple[str, str], object]


def _torch_allowlist() -> dict[tuple[str, str], object]:
    allowed: dict[tuple[str, str], object] = {
        ("collections", "OrderedDict"): collections.OrderedDict,
        ("torch._utils", "_rebuild_tensor_v2"): Builder("_rebuild_tensor_v2", _rebuild_v2),
        ("torch._utils", "_rebuild_tensor_v3"): Builder("_rebuild_tensor_v3", _rebuild_v3),
        ("torch._utils", "_rebuild_parameter"): Builder("_rebuild_parameter", _parameter),
        ("torch._utils", "_rebuild_parameter_with_state"): Builder(
            "_rebuild_parameter_with_state", _parameter
        ),
        ("torch.storage", "UntypedStorage"): StorageType(None),
        ("torch", "UntypedStorage"): StorageType(None),
    }
    for name, dtype in TORCH_DTYPES.items():
        allowed[("torch", name)] = DtypeMark(dtype)
    for name, dtype in TORCH_STORAGES.items():
        allowed[("torch", name)] = StorageType(dtype)
    return allowed


TORCH_ALLOWLIST: Allowlist = _torch_allowlist()


def extended(base: Allowlist, extra: Mapping[tuple[str, str], object]) -> Allowlist:
    """An allowlist with more entries, as a format that reads more classes needs (each an
    inert stub or a small builder; never the class itself)."""
    return {**base, **extra}


# Called by persistent_load with (key, dtype or None, element count); returns the storage.
Resolver = Callable[[str, str | None, int], StorageRef]


class _Unpickler(pickle.Unpickler):
    def __init__(self, data: bytes, allowed: Allowlist, resolve: Resolver) -> None:
        super().__init__(io.BytesIO(data))
        self.allowed = allowed
        self.resolve = resolve

    def find_class(self, module: str, name: str) -> Any:
        # Never the default find_class: nothing named in the file is ever imported.
        try:
            return self.allowed[(module, name)]
        except (KeyError, TypeError):
            raise _Unsafe(f"{module}.{name}") from None

    def persistent_load(self, pid: Any) -> StorageRef:
        if type(pid) is tuple and len(pid) > 1 and isinstance(pid[1], Unsupported):
            raise PickleUnsupported(f"a tensor of {pid[1].name}")
        if (
            type(pid) is not tuple
            or len(pid) not in (5, 6)
            or pid[0] != "storage"
            or not isinstance(pid[1], StorageType)
            or type(pid[2]) is not str
            or type(pid[4]) is not int
            or pid[4] < 0
            or (len(pid) == 6 and pid[5] is not None)
        ):
            raise PickleRejected("bad-storage-ref", f"unexpected persistent id {brief(pid)}")
        return self.resolve(pid[2], pid[1].dtype, pid[4])


class _Unsafe(Exception):
    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.name = name


def refuse_unsafe(names: collections.Counter[str], allowed: Allowlist, path: str) -> None:
    """Refuse a pickle naming any global outside the allowlist, listing them all."""
    refused = {
        name: count for name, count in names.items() if tuple(name.rsplit(".", 1)) not in allowed
    }
    if refused:
        listed = ", ".join(f"{name} ×{count}" for name, count in sorted(refused.items()))
        whole_model = any(name.startswith(_MODEL_MODULES) for name in refused)
        raise UnsafePickleError(
            path,
            f"pickle references globals outside the allowlist: {listed[:300]}; it was not loaded"
            + (
                "; it holds a whole model object (torch.save(model)), not a state dict"
                if whole_model
                else ""
            ),
            MODEL_FIX if whole_model else REFUSED_FIX,
        )


_UNPICKLE_ERRORS = (
    pickle.UnpicklingError,
    EOFError,
    ValueError,
    TypeError,
    AttributeError,
    IndexError,
    KeyError,
    RecursionError,
    MemoryError,
    OverflowError,
    UnicodeDecodeError,
    LookupError,
)


def unpickle(
    data: bytes,
    path: str,
    resolve: Resolver,
    allowed: Allowlist,
    *,
    walk: ScanResult | None = None,
) -> Any:
    """Walk (unless `walk` is the walk already made), gate and unpickle one pickle."""
    if walk is None:
        try:
            walk = scan(data)
        except PickleRejected as exc:
            raise CorruptFileError(path, exc.rule, exc.what, REEXPORT) from exc
    refuse_unsafe(walk.globals, allowed, path)
    try:
        with paused_gc():
            return _Unpickler(data[: walk.end], allowed, resolve).load()
    except PickleUnsupported as exc:
        raise UnsupportedFormatError(
            path,
            f"file holds {exc.what}, a dtype or layout ckptfix does not read",
            "ckptfix reads dense tensors of the safetensors dtypes; convert this one in a "
            "trusted environment (e.g. to a supported dtype, or .to_dense())",
        ) from None
    except _Unsafe as exc:
        raise UnsafePickleError(
            path,
            f"pickle references {exc.name}, outside the allowlist; it was not loaded",
            REFUSED_FIX,
        ) from None
    except PickleRejected as exc:
        raise CorruptFileError(path, exc.rule, exc.what, REEXPORT) from exc
    except CkptfixError:  # a storage's own error line (a ValueError too), as it is
        raise
    except _UNPICKLE_ERRORS as exc:
        raise CorruptFileError(
            path, "bad-pickle", f"pickle cannot be read: {brief(str(exc))}", REEXPORT
        ) from exc
