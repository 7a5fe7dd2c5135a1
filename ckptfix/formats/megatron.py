"""Megatron-Core `dist_checkpointing` folders: `metadata.json` (which backends wrote the
folder), the classes Megatron's writer adds to DCP's `.metadata` (its save plans), and
`common.pt` (what is not sharded: Megatron-LM's training arguments, the iteration, ...).

Only `torch_dist` (version 1) sharded data and `torch` (version 1) common data are read;
other backends are refused with the reason (see BACKEND_REFUSALS). Every pickle is read by
the restricted unpickler: the save plans and Megatron's own classes (its enums in the
training arguments) become inert stubs, nothing named in a file is imported or called.
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any

from ckptfix.core.errors import CorruptFileError, UnsupportedFormatError
from ckptfix.core.findings import Finding
from ckptfix.formats.base import FORMATS, FileRead, ReadOptions
from ckptfix.formats.benign import PLAIN_ALLOWLIST
from ckptfix.formats.dcp import METADATA_ALLOWLIST
from ckptfix.formats.strict_json import strict_json
from ckptfix.formats.torch_zip import read_zip
from ckptfix.formats.training_pickles import stubs
from ckptfix.formats.unpickler import Allowlist, DtypeMark, Stub, brief, stub_class
from ckptfix.io.source import ByteSource

CONFIG_FILE = "metadata.json"
COMMON_FILE = "common.pt"
MAX_CONFIG_BYTES = 64 * 1024
FORMAT = "megatron"
SUPPORTED = {"sharded_backend": ("torch_dist", 1), "common_backend": ("torch", 1)}
# Backends megatron-core wrote at some time that ckptfix does not read, and why.
BACKEND_REFUSALS = {
    "zarr": "megatron-core's first backend, a folder of zarr chunk files per tensor, which "
    "megatron-core no longer writes or reads",
}
_FIX = "save it again with megatron-core's default `torch_dist` backend"

# Megatron's writer keeps each rank's save plan in `.metadata` (`all_local_plans`).
_PLANNER = "torch.distributed.checkpoint.planner"
MEGATRON_METADATA_ALLOWLIST: Allowlist = {
    **METADATA_ALLOWLIST,
    **stubs(_PLANNER, ("SavePlan", "WriteItem", "WriteItemType", "TensorWriteData")),
    **stubs(_PLANNER, ("BytesIOWriteData",)),
}

# A class of Megatron's own (`megatron.core.transformer.enums.AttnBackend`): a dotted module
# under `megatron` and a capitalised name, as its classes are spelled.
_MEGATRON_CLASS = re.compile(r"megatron(\.[A-Za-z_][A-Za-z0-9_]*)+")
_CLASS_NAME = re.compile(r"[A-Z][A-Za-z0-9_]*")


class _CommonAllowlist(Mapping[tuple[str, str], object]):
    """The plain torch allowlist, plus an inert stub for each class of Megatron's own a
    pickle names (Megatron-LM pickles its training arguments' enum values). A stub records
    its arguments and nothing else; the class is never imported."""

    def __init__(self, base: Allowlist) -> None:
        self._base = base
        self._stubs: dict[tuple[str, str], type[Stub]] = {}

    def __getitem__(self, key: tuple[str, str]) -> object:
        if key in self._base:
            return self._base[key]
        module, name = key
        if not (_MEGATRON_CLASS.fullmatch(module) and _CLASS_NAME.fullmatch(name)):
            raise KeyError(key)
        if key not in self._stubs:
            self._stubs[key] = stub_class(f"{module}.{name}")
        return self._stubs[key]

    def __iter__(self) -> Iterator[tuple[str, str]]:
        return iter(self._base)

    def __len__(self) -> int:
        return len(self._base)


@dataclass(frozen=True)
class BackendConfig:
    sharded_backend: str
    common_backend: str


def read_backend_config(source: ByteSource) -> BackendConfig:
    """`metadata.json`; a backend other than torch_dist / torch (version 1) is refused."""
    path = source.label
    if source.size > MAX_CONFIG_BYTES:
        raise CorruptFileError(
            path, "megatron-config", f"file is {source.size:,} bytes, not a backend record", _FIX
        )
    try:
        document = strict_json(source.read_at(0, source.size), path)
    except CorruptFileError as exc:
        what = exc.what.replace("header", "the backend record", 1)
        raise CorruptFileError(path, "megatron-config", what, _FIX) from exc
    found = {}
    for key, (wanted, version) in SUPPORTED.items():
        name, number = document.get(key), document.get(f"{key}_version", 1)
        if type(name) is not str or type(number) is not int:
            raise CorruptFileError(
                path, "megatron-config", f"{key} is {brief(name)} version {brief(number)}", _FIX
            )
        if (name, number) != (wanted, version):
            why = BACKEND_REFUSALS.get(name, "a backend ckptfix does not know")
            kind = key.replace("_", " ")
            raise UnsupportedFormatError(
                path,
                f"the {kind} is {name!r} version {number} ({why}); ckptfix reads "
                f"{wanted!r} version {version}",
                _FIX,
                rule="megatron-backend",
            )
        found[key] = name
    return BackendConfig(**found)


@dataclass(frozen=True)
class CommonState:
    """What common.pt holds that a reader of the weights can use: the iteration, and the
    training arguments' plain values (numbers, strings, booleans, dtypes by name)."""

    keys: tuple[str, ...] = ()
    iteration: int | None = None
    checkpoint_version: float | None = None
    args: dict[str, object] = field(default_factory=dict)


COMMON_ALLOWLIST = _CommonAllowlist(PLAIN_ALLOWLIST)


def _plain(value: object) -> object:
    """A training argument as plain data: numbers, strings, booleans and None as they are,
    a dtype by its name, an enum by its value, lists of those; anything else is None."""
    if value is None or type(value) in (bool, int, float, str):
        return value
    if isinstance(value, DtypeMark):
        return value.dtype
    if isinstance(value, Stub) and len(value.args) == 1:
        return _plain(value.args[0])
    if type(value) in (list, tuple) and len(value) <= 1024:  # type: ignore[arg-type]
        return [_plain(item) for item in value]  # type: ignore[attr-defined]
    return None


def _args(value: object, path: str) -> dict[str, object]:
    if value is None:
        return {}
    fields = value.state if isinstance(value, Stub) else value
    if not isinstance(fields, dict) or not all(type(k) is str for k in fields):
        raise CorruptFileError(
            path, "megatron-common", f"the training arguments are {brief(value)}", _FIX
        )
    return {key: _plain(item) for key, item in fields.items()}


def read_common(source: ByteSource) -> CommonState:
    """`common.pt` through the restricted unpickler (see _CommonAllowlist)."""
    path = source.label
    obj: Any = read_zip(source, COMMON_ALLOWLIST).obj
    if not isinstance(obj, dict):
        raise CorruptFileError(
            path, "megatron-common", f"the common state is {brief(obj)}, not a dict", _FIX
        )
    iteration, version = obj.get("iteration"), obj.get("checkpoint_version")
    return CommonState(
        keys=tuple(sorted(str(key) for key in obj)),
        iteration=iteration if type(iteration) is int else None,
        checkpoint_version=float(version) if type(version) in (int, float) else None,  # type: ignore[arg-type]
        args=_args(obj.get("args"), path),
    )


class MegatronFormat:
    """The files of a Megatron-Core folder. Never sniffed: they are read as part of their
    folder (`layouts.megatron`); registered so that checks and reports know the name."""

    name = FORMAT
    description = "a Megatron-Core checkpoint file"

    def sniff(self, head: bytes) -> bool:
        return False

    def read(self, source: ByteSource, options: ReadOptions) -> FileRead:
        raise CorruptFileError(
            source.label,
            "megatron-part",
            "file is one part of a Megatron-Core checkpoint folder",
            "pass the folder that holds metadata.json",
        )

    def checks(self, file: FileRead) -> list[Finding]:
        return []


MEGATRON = FORMATS.register(MegatronFormat())
