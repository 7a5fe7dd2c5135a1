"""The pickle globals training checkpoints name beyond a plain `torch.save`, as inert stubs
and small builders (never the classes themselves): `torch.Size`, paths, DCP's metadata
dataclasses, DeepSpeed's loss scaler, stage enum and fragment addresses, and the
`_rebuild_from_type_v2` wrapper ZeRO-3 puts around its flat groups."""

from __future__ import annotations

from collections.abc import Iterable

from ckptfix.formats.pickle_scan import PickleRejected
from ckptfix.formats.unpickler import (
    Builder,
    Inert,
    Stub,
    TensorRef,
    brief,
    stub_class,
)


def _size(dims: object = ()) -> tuple[int, ...]:
    """torch.Size((5, 3)) as a tuple of non-negative ints."""
    if type(dims) not in (tuple, list) or not all(
        type(d) is int and d >= 0
        for d in dims  # type: ignore[attr-defined]
    ):
        raise PickleRejected("bad-pickle", f"torch.Size of {brief(dims)}")
    return tuple(dims)  # type: ignore[arg-type]


def _path(*parts: object) -> str:
    """pathlib.PosixPath('/', 'a', 'b') as the text '/a/b' (only ever shown, never opened)."""
    if not all(type(part) is str for part in parts):
        raise PickleRejected("bad-pickle", f"a path of {brief(parts)}")
    return "/".join(str(part) for part in parts).replace("//", "/")


def _layout(name: object) -> str:
    if type(name) is not str:
        raise PickleRejected("bad-pickle", f"a tensor layout of {brief(name)}")
    return name


class TensorClass(Inert):
    """What `torch.Tensor` unpickles to: a marker `_rebuild_from_type_v2` accepts."""


def _from_type_v2(function: object, new_type: object, args: object, state: object) -> TensorRef:
    """torch._tensor._rebuild_from_type_v2(func, type, args, state): a tensor rebuilt by
    `func(*args)`, then given plain attributes (ZeRO-3: `{"ds_id": ...}`), which we drop."""
    if not isinstance(function, Builder) or not isinstance(new_type, TensorClass):
        raise PickleRejected("bad-tensor", "a tensor rebuilt through an unexpected function")
    if type(args) is not tuple:
        raise PickleRejected("bad-tensor", f"tensor arguments {brief(args)}")
    built = function(*args)
    if not isinstance(built, TensorRef):
        raise PickleRejected("bad-tensor", "a rebuilt tensor is not a tensor")
    return built


def stubs(module: str, names: Iterable[str]) -> dict[tuple[str, str], type[Stub]]:
    return {(module, name): stub_class(f"{module}.{name}") for name in names}


SIZE = {("torch", "Size"): Builder("torch.Size", _size)}
PATHS = {
    ("pathlib", "PosixPath"): Builder("pathlib.PosixPath", _path),
    ("pathlib", "WindowsPath"): Builder("pathlib.WindowsPath", _path),
}
LAYOUT = {("torch.serialization", "_get_layout"): Builder("_get_layout", _layout)}
FROM_TYPE = {
    ("torch._tensor", "_rebuild_from_type_v2"): Builder("_rebuild_from_type_v2", _from_type_v2),
    ("torch", "Tensor"): TensorClass(),
}
