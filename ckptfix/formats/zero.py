"""DeepSpeed ZeRO checkpoint files, read without deepspeed or torch: model states
(`*_model_states.pt`: shapes, buffers, frozen parameters, tied-weight aliases) and
optimizer states (`*_optim_states.pt`: the fp32 master partitions). Both are torch zips
whose pickles name a few DeepSpeed classes, which get inert stubs; every tensor stays a
descriptor (a validated view of a storage located in the file), no tensor byte is read.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ckptfix.core.errors import CorruptFileError
from ckptfix.core.findings import Finding
from ckptfix.formats.base import FORMATS, FileRead, ReadOptions
from ckptfix.formats.benign import reader_allowlist
from ckptfix.formats.tensor_dict import View, check_view, check_views
from ckptfix.formats.torch_zip import read_zip
from ckptfix.formats.unpickler import Allowlist, Stub, TensorRef, brief
from ckptfix.io.source import ByteSource

# DeepSpeed's own classes (loss scaler, stage enum, fragment address, ZeRO-3's tensor
# wrapper) are in the benign table, since its files may also be read alone as `.pt` files.
ZERO_ALLOWLIST: Allowlist = reader_allowlist("deepspeed")
_FIX = "save the checkpoint again (or copy this file again from the training run)"
FORMAT = "deepspeed"
LIGHTNING_KEY = "pytorch-lightning_version"  # what Lightning's DeepSpeedStrategy adds


def _not_states(path: str, what: str) -> CorruptFileError:
    return CorruptFileError(path, "zero-states", what, _FIX)


Shape = tuple[int, ...]


@dataclass(frozen=True)
class ModelStates:
    """`*_model_states.pt`: the module's tensors (full weights in stages 0-2, empty
    placeholders and full buffers in stage 3) and what reconstruction needs."""

    label: str
    module: dict[str, View]
    param_shapes: tuple[dict[str, Shape], ...]  # per group, in flattening order
    buffer_names: tuple[str, ...]
    shared_params: dict[str, str]  # alias -> source
    frozen_shapes: dict[str, Shape]
    frozen_fragments: dict[str, View]
    global_steps: int | None
    stage: int | None  # from ds_config, when it says
    dp_world_size: int | None
    lightning: bool = False  # Lightning's client state beside the engine's
    # What a client (Megatron-DeepSpeed) records for ds_to_universal: the vocabulary's size
    # before padding, the rows a universal checkpoint's vocabulary weights keep.
    original_vocab_size: int | None = None


@dataclass(frozen=True)
class OptimStates:
    """`*_optim_states.pt`: this rank's fp32 partition of each parameter group."""

    label: str
    stage: int
    partition_count: int
    groups: tuple[View, ...]
    alignment_paddings: tuple[tuple[int, ...], ...] | None
    other_bytes: int  # storage bytes of everything else (optimizer moments, ...)
    other_tensors: int


def _dict(value: object, path: str, what: str) -> dict[Any, Any]:
    if not isinstance(value, dict):
        raise _not_states(path, f"{what} is {brief(value)}, not a dictionary")
    return value


def _names(value: object, path: str, what: str) -> tuple[str, ...]:
    if type(value) not in (list, tuple) or not all(type(v) is str for v in value):  # type: ignore[attr-defined]
        raise _not_states(path, f"{what} is {brief(value)}, not a list of names")
    return tuple(value)  # type: ignore[arg-type]


def _shapes(value: object, path: str, what: str) -> dict[str, Shape]:
    shapes = {}
    for name, shape in _dict(value, path, what).items():
        if type(name) is not str or type(shape) is not tuple:
            raise _not_states(path, f"{what} maps {brief(name)} to {brief(shape)}")
        if not all(type(d) is int and d >= 0 for d in shape):
            raise _not_states(path, f"{what} gives {name!r} the shape {brief(shape)}")
        shapes[name] = shape
    return shapes


def _views(value: object, path: str, what: str, storages: Mapping[str, Any]) -> dict[str, View]:
    refs = {}
    for name, ref in _dict(value, path, what).items():
        if type(name) is not str or not isinstance(ref, TensorRef):
            raise _not_states(path, f"{what} maps {brief(name)} to {brief(ref)}, not a tensor")
        refs[name] = ref
    return dict(zip(refs, check_views(path, refs, storages), strict=True))


def _int(value: object) -> int | None:
    if isinstance(value, Stub) and value.args and type(value.args[0]) is int:
        return value.args[0]  # ZeroStageEnum(2)
    return value if type(value) is int else None


def _config_stage(config: object) -> int | None:
    if isinstance(config, dict) and isinstance(config.get("zero_optimization"), dict):
        return _int(config["zero_optimization"].get("stage"))
    return None


def read_model_states(source: ByteSource) -> ModelStates:
    path = source.label
    saved = read_zip(source, ZERO_ALLOWLIST)
    top = _dict(saved.obj, path, "the file")
    if "buffer_names" not in top or "module" not in top:
        raise _not_states(path, "file has no buffer_names or module: not DeepSpeed model states")
    groups = top.get("param_shapes") or []
    if type(groups) not in (list, tuple):
        groups = [groups]
    frozen_shapes = top.get("frozen_param_shapes") or {}
    states = ModelStates(
        label=path,
        module=_views(top["module"], path, "module", saved.storages),
        param_shapes=tuple(_shapes(g, path, "param_shapes") for g in groups),
        buffer_names=_names(top["buffer_names"], path, "buffer_names"),
        shared_params=_str_map(top.get("shared_params") or {}, path),
        frozen_shapes=_shapes(frozen_shapes, path, "frozen_param_shapes"),
        frozen_fragments=_views(
            top.get("frozen_param_fragments") or {}, path, "frozen_param_fragments", saved.storages
        ),
        global_steps=_int(top.get("global_steps")),
        stage=_config_stage(top.get("ds_config")),
        dp_world_size=_int(top.get("dp_world_size")),
        lightning=LIGHTNING_KEY in top,
        original_vocab_size=_vocab_size(top.get("universal_checkpoint_info")),
    )
    _check_aliases(states)
    return states


def _vocab_size(info: object) -> int | None:
    size = info.get("original_vocab_size") if isinstance(info, dict) else None
    return size if type(size) is int and size >= 0 else None


def _check_aliases(states: ModelStates) -> None:
    """DeepSpeed records each tied parameter's other names as `alias -> the first name`:
    an alias is never stored itself, and what it names is a tensor the file records (never
    another alias, so no chain or cycle decides which names survive)."""
    stored = {name for group in states.param_shapes for name in group}
    stored |= set(states.frozen_shapes) | set(states.buffer_names)
    for alias, source in states.shared_params.items():
        if alias in stored:
            what = f"makes {alias!r} an alias of {source!r}, but {alias!r} is stored itself"
        elif source in states.shared_params:
            what = f"makes {alias!r} an alias of {source!r}, itself an alias (a chain)"
        elif source not in stored and source not in states.module:
            what = f"makes {alias!r} an alias of {source!r}, which the file does not hold"
        else:
            continue
        raise _not_states(states.label, f"shared_params {what}")


def _str_map(value: object, path: str) -> dict[str, str]:
    pairs = _dict(value, path, "shared_params")
    if not all(type(k) is str and type(v) is str for k, v in pairs.items()):
        raise _not_states(path, f"shared_params is {brief(pairs)}")
    return dict(pairs)


def _paddings(value: object, path: str) -> tuple[tuple[int, ...], ...] | None:
    if value is None:
        return None
    if type(value) is not list or not all(
        type(group) is list and all(type(p) is int and p >= 0 for p in group) for group in value
    ):
        raise _not_states(path, f"param_alignment_paddings is {brief(value)}")
    return tuple(tuple(group) for group in value)


def read_optim_states(source: ByteSource) -> OptimStates:
    path = source.label
    saved = read_zip(source, ZERO_ALLOWLIST)
    state = _dict(
        _dict(saved.obj, path, "the file").get("optimizer_state_dict"), path, "optimizer_state_dict"
    )
    stage = _int(state.get("zero_stage"))
    if stage not in (1, 2, 3):
        raise _not_states(path, f"zero_stage is {brief(state.get('zero_stage'))}, not 1, 2 or 3")
    key = "fp32_flat_groups" if stage == 3 else "single_partition_of_fp32_groups"
    count = state.get("partition_count")
    counts = count if type(count) is list else [count]
    if not counts or not all(type(c) is int and c > 0 for c in counts):
        raise _not_states(path, f"partition_count is {brief(count)}")
    refs = state.get(key)
    if type(refs) is not list or not all(isinstance(ref, TensorRef) for ref in refs):
        raise _not_states(path, f"{key} is {brief(refs)}, not a list of tensors")
    groups = tuple(
        check_view(path, f"{key}[{i}]", ref, saved.storages) for i, ref in enumerate(refs)
    )
    for view in groups:
        if len(view.shape) != 1 or not view.contiguous:
            raise _not_states(
                path, f"a flat group has shape {list(view.shape)}; flat groups are 1-D"
            )
    used = {view.storage.key for view in groups}
    return OptimStates(
        label=path,
        stage=stage,
        partition_count=max(counts),
        groups=groups,
        alignment_paddings=_paddings(state.get("param_alignment_paddings"), path),
        other_bytes=sum(s.nbytes for k, s in saved.storages.items() if k not in used),
        other_tensors=len(saved.storages) - len(used),
    )


class DeepSpeedFormat:
    """The `.pt` files of a DeepSpeed checkpoint. Never sniffed (they are torch zips, and
    `torch-zip` reads one alone); read as part of their folder by `layouts.deepspeed`."""

    name = FORMAT
    description = "a DeepSpeed checkpoint file"

    def sniff(self, head: bytes) -> bool:
        return False

    def read(self, source: ByteSource, options: ReadOptions) -> FileRead:
        raise CorruptFileError(
            source.label,
            "deepspeed-part",
            "file is one part of a DeepSpeed checkpoint",
            "pass the folder that holds `latest`, or its tag folder",
        )

    def checks(self, file: FileRead) -> list[Finding]:
        return []


DEEPSPEED = FORMATS.register(DeepSpeedFormat())
