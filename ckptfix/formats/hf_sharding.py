"""torch's HuggingFaceStorageWriter headers: `DCP_SHARDING_INFO` in a safetensors file's
`__metadata__` (JSON: name -> `{"saved_offsets": [...]}`) places each tensor of the file in a
larger one. The writer adds it to every file it writes: offsets 0 for a rank-0 save of whole
tensors, a rank's offsets in a per-rank save (`shard-{rank}-model-{k}-of-{n}.safetensors`).
A file of a per-rank save read alone is only part of the model (`tensor-piece`); its folder
is read whole by layouts.hf_shards."""

from __future__ import annotations

import os
import re

from ckptfix.core.errors import CorruptFileError
from ckptfix.core.findings import Finding, finding
from ckptfix.formats.base import FileRead
from ckptfix.formats.strict_json import strict_json

SHARD_NAME = re.compile(r"^shard-(\d+)-model-(\d+)-of-(\d+)\.safetensors$")
SHARDING_KEY = "DCP_SHARDING_INFO"
_FIX = "save the checkpoint again, or copy this file again from the training run's output"


def sharding_info(read: FileRead) -> dict[str, tuple[int, ...]] | None:
    """Each tensor's offsets from the header's DCP_SHARDING_INFO (None when there is none);
    CorruptFileError (rule dcp-sharding-info) when it does not describe the file's tensors."""
    raw = (read.metadata or {}).get(SHARDING_KEY)
    if raw is None:
        return None
    try:
        parsed = strict_json(raw.encode("utf-8"), read.label)
    except CorruptFileError as exc:
        raise bad_info(read.label, f"is not valid JSON ({exc.what})") from exc
    if type(parsed) is not dict:
        raise bad_info(read.label, "is not a JSON object")
    shapes = {tensor.name: tensor.shape for tensor in read.tensors}
    if set(parsed) != set(shapes):
        odd = sorted(set(parsed) ^ set(shapes))[:3]
        raise bad_info(read.label, f"names other tensors than the file holds ({odd})")
    offsets = {}
    for name, entry in parsed.items():
        saved = entry.get("saved_offsets") if type(entry) is dict else None
        if type(saved) is not list or not all(type(o) is int and o >= 0 for o in saved):
            raise bad_info(read.label, f"gives {name!r} no list of offsets ({str(entry)[:60]})")
        if len(saved) != len(shapes[name]):
            raise bad_info(
                read.label,
                f"gives {name!r} {len(saved)} offset(s) for a piece of {len(shapes[name])} dimension(s)",
            )
        offsets[name] = tuple(saved)
    return offsets


def bad_info(path: str, what: str) -> CorruptFileError:
    return CorruptFileError(path, "dcp-sharding-info", f"header {SHARDING_KEY} {what}", _FIX)


def piece_findings(read: FileRead) -> list[Finding]:
    """A file of a per-rank save read alone: it holds pieces of larger tensors, never the
    model (the folder of every rank's files does)."""
    try:
        offsets = sharding_info(read)
    except CorruptFileError as exc:
        return [finding("corrupt-file", exc.detail(), file=read.label)]
    if offsets is None:
        return []
    placed = {name: at for name, at in offsets.items() if any(at)}
    per_rank = SHARD_NAME.match(os.path.basename(read.label)) is not None
    if not placed and not per_rank:
        return []  # a rank-0 save of whole tensors (the writer's default) says offsets 0
    shapes = {tensor.name: tensor.shape for tensor in read.tensors}
    name = next(iter(placed or offsets), "")
    where = (
        f"e.g. {name!r} {list(shapes[name])} sits at {list(offsets[name])} of a larger tensor"
        if placed
        else f"the tensors here, e.g. {name!r} {list(shapes.get(name, ()))}, may be only this rank's pieces"
    )
    return [
        finding(
            "tensor-piece",
            f"file is one rank's part of a torch.distributed.checkpoint HuggingFaceStorageWriter "
            f"save ({SHARDING_KEY} in its header): {where} (pass the folder that holds every "
            "shard-*-model-*.safetensors file; it is read as one checkpoint)",
            file=read.label,
            tensors=sorted(placed)[:50],
        )
    ]
