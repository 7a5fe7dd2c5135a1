"""`ckptfix.save`: a mapping of tensors in memory to Hugging Face-style shards and index,
written one tensor at a time without copying the model, verified, swapped in as OUT."""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from typing import Any

from ckptfix.api.arrays import MemoryTensor, as_memory
from ckptfix.api.output import (
    SaveResult,
    checked_metadata,
    checked_name,
    config_of,
    open_sink,
    writing,
)
from ckptfix.api.types import ConfigLike, Shared, Size, choice
from ckptfix.checks.config import tie_decision
from ckptfix.core.errors import UsageError
from ckptfix.core.sizes import shard_size
from ckptfix.plan.alias_record import DROPPED_KEY
from ckptfix.plan.memory import Item, choose_names, plan_memory
from ckptfix.plan.shards import ShardPlan
from ckptfix.write.sink import write_plan

HEADER_ROOM = 1024  # a generous guess of one tensor's header entry, for the free-space check


def save(
    tensors: Mapping[str, Any],
    out: str | os.PathLike[str],
    *,
    max_shard: Size = "5GB",
    metadata: Mapping[str, str] | None = None,
    shared: Shared = "dedupe",
    config: ConfigLike | None = None,
) -> SaveResult:
    """Write `tensors` (name -> torch tensor or numpy array) to the folder `out` as
    huggingface_hub's `save_torch_state_dict` names and splits them: `model.safetensors`,
    or `model-0000i-of-0000N.safetensors` and `model.safetensors.index.json`.

    Each tensor is written from its own memory (in bounded chunks where it is not
    contiguous), read back and compared, and the folder appears at `out` only when all of it
    is verified. Tensors that are the same elements under several names are written once
    and the other names recorded (`shared="dedupe"`, the `ckptfix.dropped` record the CLI
    writes), or each written whole (`"clone"`). `config` (a dict, or a config.json path) is
    written as config.json; a head it ties to the embedding is the name dropped, as
    transformers expects. `out` must not exist, or be an empty folder: nothing is ever
    overwritten.
    """
    limit = shard_size(max_shard)
    dedupe = choice(shared, ("dedupe", "clone"), "shared") == "dedupe"
    header_metadata = checked_metadata(metadata)
    config_dict, config_bytes = config_of(config)
    if not isinstance(tensors, Mapping):
        raise UsageError("tensors", f"is a {type(tensors).__name__}", "pass a dict of tensors")
    memory = _in_memory(tensors)
    tie: dict[str, str] = {}
    separate: frozenset[str] = frozenset()
    if config_dict is not None:
        tie, separate = tie_decision(config_dict, list(memory))
    names = choose_names(_items(memory.values()), dedupe=dedupe, tie=tie, separate=separate)
    plan = plan_memory(names.written, limit, names.dropped)
    shard_metadata, index_metadata = _metadata(header_metadata, plan)
    parts = {m.name: (m.dtype, m.shape, m) for m in memory.values()}
    needed = plan.total_size + HEADER_ROOM * len(memory) + len(config_bytes or b"")
    single = plan.index_file is None
    with writing(open_sink(out, needed=needed, single_file=single)) as sink:
        written = write_plan(plan, parts, shard_metadata, index_metadata, sink)
        if config_bytes is not None:
            written.append(sink.write_file("config.json", config_bytes))
        sink.commit()
    files = {item.path: item.bytes for item in written}
    return SaveResult(os.fspath(out), files, dict(plan.dropped), plan.index_file)


def _in_memory(tensors: Mapping[str, Any]) -> dict[str, MemoryTensor]:
    memory: dict[str, MemoryTensor] = {}
    for name, value in tensors.items():
        tensor = as_memory(name, value)
        checked_name(tensor.name, memory)
        memory[tensor.name] = tensor
    return memory


def _items(tensors: Sequence[MemoryTensor] | Any) -> list[Item]:
    """Each tensor as the plan sees it: a contiguous one belongs to its storage's block (as
    huggingface_hub groups them); any other is made contiguous there, a block of its own."""
    items = []
    for tensor in tensors:
        storage = tensor.storage
        shared = tensor.direct and storage is not None
        block = (storage.address, storage.nbytes) if shared and storage else ("own", tensor.name)
        items.append(Item(tensor.name, tensor.nbytes, block, tensor.alias_key))
    return items


def _metadata(
    metadata: dict[str, str], plan: ShardPlan
) -> tuple[list[dict[str, str]], dict[str, Any]]:
    """huggingface_hub's placement: one file holds `format` and the caller's metadata; shards
    hold `format`, and the index the caller's metadata. The alias record goes with them."""
    if plan.index_file is None:
        single = {"format": "pt", **metadata}
        if plan.dropped:
            single[DROPPED_KEY] = json.dumps(plan.dropped, sort_keys=True)
        return [single], {}
    index: dict[str, Any] = dict(metadata)
    if plan.dropped:
        index[DROPPED_KEY] = dict(sorted(plan.dropped.items()))
    return [{"format": "pt"}] * len(plan.shards), index
