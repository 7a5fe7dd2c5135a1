"""Megatron-Core `torch_dist` folders: `metadata.json`, `common.pt`, `.metadata` and the
`__{rank}_{n}.distcp` rank files of torch.distributed.checkpoint (read by layouts.dcp).

Megatron saves the layers of a homogeneous model stacked on a leading axis (`decoder.layers.
self_attention.linear_qkv.weight` of shape (L, ...), one chunk per layer) and the experts of a
MoE layer on a second one ((L, E, ...)). Each is split here into one tensor per layer and
expert under Megatron's own names with the indices written in (`decoder.layers.3.
self_attention.linear_qkv.weight`, `decoder.layers.3.mlp.experts.experts.5.linear_fc1.weight`,
the names non-homogeneous checkpoints are saved under), each made of pieces of the chunks: no
byte is read or copied. Optimizer state and non-tensor items (`_extra_state`, RNG states) are
left out and counted. A Megatron-LM run folder (`latest_checkpointed_iteration.txt` beside
`iter_NNNNNNN/`) is read as its latest iteration.
"""

from __future__ import annotations

import itertools
import os
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import TypeVar

from ckptfix.core.checkpoint import Checkpoint, FileRecord
from ckptfix.core.dtypes import numel_of
from ckptfix.core.errors import CkptfixError, CorruptFileError, DuplicateNameError, UsageError
from ckptfix.core.tensor import TensorInfo
from ckptfix.core.training import RANK_SUFFIX, TrainingLayout
from ckptfix.formats.base import FileRead, ReadOptions
from ckptfix.formats.dcp import METADATA, DcpMetadata, TensorEntry, read_metadata
from ckptfix.formats.dcp_chunks import chunk_nbytes
from ckptfix.formats.megatron import (
    COMMON_FILE,
    CONFIG_FILE,
    FORMAT,
    MEGATRON_METADATA_ALLOWLIST,
    BackendConfig,
    CommonState,
    read_backend_config,
    read_common,
)
from ckptfix.io.folder import LOCAL, Folder
from ckptfix.io.source import ByteSource
from ckptfix.layouts.dcp import _no_metadata, read_tensors, step_of
from ckptfix.layouts.slices import Parts, tensor_of

TRACKER = "latest_checkpointed_iteration.txt"
# Stacked axes, found by name: `layers.` not followed by a layer index (the layer axis), and
# in a MoE layer `experts.experts.` not followed by an expert index (the expert axis).
STACKED_AXES = (
    re.compile(r"(?:^|\.)layers\.(?=[^\d.])"),
    re.compile(r"\.experts\.experts\.(?=[^\d.])"),
)
_TRAINING_STATE = re.compile(r"^(?:optimizer|chained_\d+)\.")
_HALVES = re.compile(r"(.*\.linear_fc1\.(?:weight|bias))_w")
# The training arguments inspect shows (and `--to-hf MODEL_TYPE` builds a config from).
ARCHITECTURE = (
    "num_layers", "hidden_size", "ffn_hidden_size", "num_attention_heads",
    "group_query_attention", "num_query_groups", "kv_channels", "normalization",
    "norm_epsilon", "swiglu", "add_bias_linear", "add_qkv_bias", "qk_layernorm",
    "untie_embeddings_and_output_weights", "position_embedding_type", "rotary_base",
    "rotary_percent", "max_position_embeddings", "vocab_size", "padded_vocab_size",
    "num_experts", "moe_router_topk", "moe_ffn_hidden_size", "moe_router_pre_softmax",
    "moe_layer_freq", "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "expert_model_parallel_size", "params_dtype",
)  # fmt: skip


@dataclass(frozen=True)
class MegatronLayout:
    """What a Megatron checkpoint is beyond its tensors (`Checkpoint.layout`)."""

    backends: BackendConfig | None
    common: CommonState | None
    stacked: dict[str, str] = field(default_factory=dict)  # split name -> the saved key

    @property
    def args(self) -> dict[str, object]:
        return self.common.args if self.common is not None else {}


def is_megatron_folder(root: str, names: list[str]) -> bool:
    """metadata.json beside what a dist_checkpointing save writes, or a run's tracker."""
    if TRACKER in names:
        return True
    saved = METADATA in names or COMMON_FILE in names
    return CONFIG_FILE in names and (saved or any(n.endswith(RANK_SUFFIX) for n in names))


def _stacked(name: str) -> list[re.Pattern[str]]:
    """The stacked axes a saved key's name gives, outermost first."""
    return [pattern for pattern in STACKED_AXES if pattern.search(name)]


def stacked_axes(name: str, entry: TensorEntry) -> int:
    """How many leading axes of a saved tensor are Megatron's stacking: those its name gives,
    when every chunk is one index of each and every index has a chunk (as megatron-core
    writes them); else none."""
    axes = len(_stacked(name))
    if len(entry.size) < axes or any(chunk.sizes[:axes] != (1,) * axes for chunk in entry.chunks):
        return 0
    # One chunk at least per layer (and expert): the parts are bounded by what .metadata holds.
    return axes if len(entry.chunks) >= numel_of(entry.size[:axes]) else 0


def indexed_name(name: str, indices: tuple[int, ...]) -> str:
    """The saved key with its stacked axes' indices written in."""
    for pattern, index in zip(_stacked(name), indices, strict=True):
        match = pattern.search(name)
        assert match is not None
        name = f"{name[: match.end()]}{index}.{name[match.end() :]}"
    return name


def split_stacked(
    tensors: tuple[TensorInfo, ...], meta: DcpMetadata
) -> tuple[list[TensorInfo], dict[str, str]]:
    """Each stacked tensor as one tensor per layer (and expert), the others as they are, in
    the order of a state dict (what comes before the layers, the layers by index, the rest),
    and the split names (-> the saved key)."""
    before: list[TensorInfo] = []
    after: list[TensorInfo] = []
    layers: dict[tuple[int, ...], list[TensorInfo]] = {}
    stacked: dict[str, str] = {}
    for tensor in tensors:
        axes = stacked_axes(tensor.name, meta.tensors[tensor.name])
        if not axes:
            (after if layers else before).append(tensor)
            continue
        shape = tensor.shape[axes:]
        parts = Parts(tensor, tensor.nbytes // (numel_of(tensor.shape[:axes]) or 1))
        indices = itertools.product(*(range(n) for n in tensor.shape[:axes]))
        for flat, index in enumerate(indices):
            name = indexed_name(tensor.name, index)
            layers.setdefault(index, []).append(parts.part(flat, name, shape))
            stacked[name] = tensor.name
    in_layers = [tensor for index in sorted(layers) for tensor in layers[index]]
    return before + in_layers + after, stacked


def joined_halves(tensors: list[TensorInfo]) -> list[TensorInfo]:
    """A SwiGLU `linear_fc1` saved as its two halves (`…linear_fc1.weight_w`, the gate rows,
    and `_v`, the up rows: megatron-core's `singleton_local_shards` saves) as the one tensor
    [gate; up] other saves hold, made of both halves' pieces; anything else as it is."""
    by_name = {tensor.name: tensor for tensor in tensors}
    out, joined = [], set()
    for tensor in tensors:
        match = _HALVES.fullmatch(tensor.name)
        other = by_name.get(f"{match.group(1)}_v") if match else None
        if match is None or other is None or match.group(1) in by_name or not _fit(tensor, other):
            if tensor.name not in joined:
                out.append(tensor)
            continue
        pieces = [*tensor.pieces, *(replace(p, at=p.at + tensor.nbytes) for p in other.pieces)]
        shape = (tensor.shape[0] + other.shape[0], *tensor.shape[1:])
        out.append(tensor_of(match.group(1), tensor.dtype, shape, pieces, tensor.file))
        joined.add(other.name)
    return [tensor for tensor in out if tensor.name not in joined]


def _fit(gate: TensorInfo, up: TensorInfo) -> bool:
    same = gate.dtype == up.dtype and gate.shape[1:] == up.shape[1:] and gate.shape
    return bool(same) and gate.contiguous and up.contiguous


def _refuse_duplicates(tensors: list[TensorInfo], path: str) -> None:
    seen: set[str] = set()
    for tensor in tensors:
        if tensor.name in seen:
            raise DuplicateNameError(
                path,
                "duplicate-name",
                f"{tensor.name!r} is saved both stacked and on its own; one would be lost",
                "save the checkpoint again",
            )
        seen.add(tensor.name)


def _left_out(meta: DcpMetadata, model: dict[str, str]) -> dict[str, object]:
    """Optimizer state and non-tensor items (`_extra_state`, RNG and rerun states)."""
    others = [entry for fqn, entry in meta.tensors.items() if fqn not in model]
    return {
        "left_out_tensors": len(others),
        "left_out_bytes": sum(chunk_nbytes(e, c) for e in others for c in e.chunks),
        "left_out_parts": tuple(sorted({e.fqn.split(".", 1)[0] for e in others})),
        "other_items": len(meta.byte_items),
        "other_bytes": sum(
            item.length for (_, offsets), item in meta.storage.items() if offsets is None
        ),
    }


T = TypeVar("T")


def _read_side(
    root: str, name: str, folder: Folder, reader: Callable[[ByteSource], T]
) -> tuple[FileRecord, ByteSource, T | None]:
    """metadata.json, common.pt or .metadata: its record (with the error that stopped it,
    when one did), its source, and what was read."""
    path = os.path.join(root, name)
    source = folder.open(path)
    size = source.size
    try:
        value = reader(source)
    except CkptfixError as exc:
        if exc.code is None:
            raise
        return FileRecord(path, FORMAT, size, error=exc), source, None
    return FileRecord(path, FORMAT, size, read=FileRead(path, FORMAT, size, ())), source, value


def _read_metadata(source: ByteSource) -> DcpMetadata:
    return read_metadata(source, MEGATRON_METADATA_ALLOWLIST)


def _extra(layout: MegatronLayout) -> dict[str, object]:
    """The report's Megatron facts: backends, iteration, the architecture from the args."""
    extra: dict[str, object] = {}
    if layout.backends is not None:
        extra.update(vars(layout.backends))
    extra["stacked_tensors"] = len(set(layout.stacked.values()))
    if layout.common is not None:
        extra["iteration"] = layout.common.iteration
        extra["checkpoint_version"] = layout.common.checkpoint_version
        args = layout.common.args
        extra["architecture"] = {key: args[key] for key in ARCHITECTURE if key in args}
    return extra


def load_megatron(
    root: str, names: list[str], options: ReadOptions, folder: Folder = LOCAL
) -> Checkpoint:
    """Every model tensor of a Megatron-Core folder, stacked ones split by layer and expert."""
    if CONFIG_FILE not in names:  # a run folder: its latest iteration
        return _load_latest(root, folder, options)
    if options.key != "auto":
        raise UsageError(
            "--key", f"{root} is a Megatron-Core checkpoint: it holds one model", "drop --key"
        )
    if METADATA not in names:
        raise _no_metadata(root, names)
    read_common_file = COMMON_FILE in names
    config, config_source, backends = _read_side(root, CONFIG_FILE, folder, read_backend_config)
    meta_record, meta_source, meta = _read_side(root, METADATA, folder, _read_metadata)
    sides = [(config, config_source), (meta_record, meta_source)]
    common = None
    if read_common_file:
        common_record, common_source, common = _read_side(root, COMMON_FILE, folder, read_common)
        sides.append((common_record, common_source))
    layout = MegatronLayout(backends, common)
    sources = {record.label: source for record, source in sides}
    records = [record for record, _ in sides]
    step = (
        common.iteration if common is not None and common.iteration is not None else step_of(root)
    )
    if backends is None or meta is None:  # nothing more is read from a refused folder
        training = TrainingLayout("megatron", step=step, extra=_extra(layout))
        return Checkpoint(
            root, FORMAT, tuple(records), sources=sources, training=training, layout=layout
        )
    return _with_tensors(root, meta, layout, (records, sources), step, folder)


def _with_tensors(
    root: str,
    meta: DcpMetadata,
    layout: MegatronLayout,
    side: tuple[list[FileRecord], dict[str, ByteSource]],
    step: int | None,
    folder: Folder,
) -> Checkpoint:
    meta_path = os.path.join(root, METADATA)
    model = {fqn: fqn for fqn in meta.tensors if not _TRAINING_STATE.match(fqn)}
    read = read_tensors(root, meta, model, folder)
    tensors, stacked = split_stacked(read.tensors, meta)
    tensors = joined_halves(tensors)
    _refuse_duplicates(tensors, meta_path)
    layout = replace(layout, stacked=stacked)
    training = TrainingLayout(
        "megatron",
        world_size=read.world_size,
        serialization=read.serialization,
        step=step,
        findings=read.findings,
        extra=_extra(layout),
        **_left_out(meta, model),  # type: ignore[arg-type]
    )
    records, sources = side
    records = [
        replace(r, read=FileRead(meta_path, FORMAT, r.size, tuple(tensors)))
        if r.label == meta_path
        else r
        for r in records
    ]
    return Checkpoint(
        path=root,
        kind=FORMAT,
        files=tuple(records + read.records),
        sources={**sources, **read.sources},
        training=training,
        layout=layout,
    )


def _load_latest(root: str, folder: Folder, options: ReadOptions) -> Checkpoint:
    """A Megatron-LM run folder: the iteration its tracker file names."""
    path = os.path.join(root, TRACKER)
    text = folder.read_small(path, path, 64, "tracker").decode("utf-8", "replace").strip()
    if text.isdigit():
        name = f"iter_{int(text):07d}"
    elif text == "release":
        name = "release"
    else:
        raise CorruptFileError(
            path,
            "megatron-tracker",
            f"names iteration {text[:20]!r}, not a number",
            "pass an iteration folder",
        )
    target = os.path.join(root, name)
    if not folder.is_dir(target):
        raise CorruptFileError(
            path,
            "megatron-tracker",
            f"names iteration {text}, but the folder has no {name}/",
            "pass one of its iteration folders",
        )
    names = folder.listdir(target)
    if CONFIG_FILE not in names:
        raise CorruptFileError(
            os.path.join(target, ""),
            "megatron-tracker",
            f"is not a dist_checkpointing folder (no {CONFIG_FILE})",
            "pass a folder saved with --ckpt-format torch_dist",
        )
    return load_megatron(target, names, options, folder)
