"""Repairing one weight family of a model folder, taking the shard headers as the truth.

The family's files are every file named as its own plus the existing shards its index
lists. Every tensor they hold stays in the repaired checkpoint; a name held twice keeps the
copy the index maps it to. A file left holding nothing is taken out; a file that held stale
copies is rewritten without them (its original taken out); a header without `"format"` gets
it. Shards are renumbered when their N-of-M names are inconsistent, and the index is written
from the headers. What the headers cannot answer is refused: an unreadable file, an index
naming tensors no file holds, a name held twice with no index to choose, and numbered shards
with parts missing and no index to say what those held.
"""

from __future__ import annotations

import itertools
import json
import os
from collections import defaultdict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass

from ckptfix.core.checkpoint import Checkpoint, FileRecord
from ckptfix.core.findings import name_list
from ckptfix.core.tensor import TensorInfo
from ckptfix.formats.base import FileRead
from ckptfix.formats.index import ShardIndex
from ckptfix.layouts.choice import single_name
from ckptfix.layouts.huggingface import family_key
from ckptfix.layouts.names import Family, parse_weight_name
from ckptfix.plan.repair import FamilyPlan, IndexPlan, KeptFile, Move, Refusal, read_refusal
from ckptfix.plan.shards import OutputName

_AGAIN = "then run `ckptfix fix` again"


@dataclass(frozen=True)
class FamilyOutcome:
    """What planning one family gives: its plan (None when refused), what it takes out,
    and what it cannot repair."""

    plan: FamilyPlan | None
    moves: tuple[Move, ...] = ()
    refusals: tuple[Refusal, ...] = ()


@dataclass(frozen=True)
class _Member:
    """A file of the family: what it keeps and what it held twice (kept elsewhere)."""

    name: str
    read: FileRead
    kept: tuple[TensorInfo, ...]
    dropped: tuple[str, ...]


def index_of(checkpoint: Checkpoint, family: Family) -> ShardIndex | None:
    """The family's index as read (None when it has none, or it cannot be read)."""
    if family.index is None:
        return None
    label = os.path.join(checkpoint.path, family.index)
    record = next((item for item in checkpoint.indexes if item.label == label), None)
    return record.index if record is not None else None


def members(checkpoint: Checkpoint, family: Family, index: ShardIndex | None) -> list[str]:
    """The family's files: named as its own, or listed by its index and present; numbered
    shards first, by part number."""
    names = list(family.files)
    if index is not None:
        root = checkpoint.path
        names += [
            shard
            for shard in index.shard_names
            if shard not in names and checkpoint.exists.get(os.path.join(root, shard), False)
        ]
    return sorted(names, key=_order)


def _order(name: str) -> tuple[int, int, int, str]:
    parsed = parse_weight_name(name)
    if parsed is None or parsed.total is None:
        return (1, 0, 0, name)
    return (0, parsed.part or 0, parsed.total, name)


def _reads(
    root: str, names: Sequence[str], records: Mapping[str, FileRecord]
) -> tuple[dict[str, FileRead], list[Refusal]]:
    reads: dict[str, FileRead] = {}
    refusals = []
    for name in names:
        label = os.path.join(root, name)
        record = records.get(label)
        if record is not None and record.read is not None:
            reads[name] = record.read
            continue
        refusals.append(read_refusal(label, record.error if record is not None else None))
    return reads, refusals


def _chosen_copies(
    names: Sequence[str], reads: Mapping[str, FileRead], index: ShardIndex | None
) -> tuple[dict[str, str], dict[str, list[str]]]:
    """Which file keeps each tensor name, and the names held twice that nothing decides
    (with their files). A copy the index maps the name to wins. A name the index does not
    map at all keeps its one copy in a shard the index lists when every other copy is in a
    stale file: one outside the index whose every tensor a listed shard holds too (a stale
    single-file export or orphan beside the current shards)."""
    weight_map = index.weight_map if index is not None else {}
    listed = set(index.shard_names) if index is not None else set()
    holders: dict[str, list[str]] = defaultdict(list)
    for name in names:
        for tensor in reads[name].tensors:
            holders[tensor.name].append(name)
    stale = {
        name
        for name in names
        if name not in listed and all(set(holders[t.name]) & listed for t in reads[name].tensors)
    }
    kept_in: dict[str, str] = {}
    undecided: dict[str, list[str]] = {}
    for held, files in holders.items():
        current = [file for file in files if file in listed]
        if len(files) == 1:
            kept_in[held] = files[0]
        elif weight_map.get(held) in files:
            kept_in[held] = weight_map[held]
        elif held not in weight_map and len(current) == 1 and set(files) - listed <= stale:
            kept_in[held] = current[0]
        else:
            undecided[held] = files
    return kept_in, undecided


def _undecided_refusals(root: str, undecided: Mapping[str, list[str]]) -> list[Refusal]:
    if not undecided:
        return []
    names = list(undecided)
    files = sorted({file for holders in undecided.values() for file in holders})
    return [
        Refusal(
            "duplicate-name",
            os.path.join(root, undecided[names[0]][0]),
            f"{len(names)} tensor name(s) such as {name_list(names, 2)} are stored in "
            f"several files ({', '.join(files)}) and no index entry says which copy is current",
            f"move the stale file out of the folder, {_AGAIN}",
            tuple(names),
        )
    ]


def _unheld_refusals(
    checkpoint: Checkpoint, index: ShardIndex, kept_in: Mapping[str, str]
) -> list[Refusal]:
    """The index names tensors that no file of the family holds: only a download helps."""
    by_shard: dict[str, list[str]] = defaultdict(list)
    for tensor, shard in index.weight_map.items():
        if tensor not in kept_in:
            by_shard[shard].append(tensor)
    refusals = []
    for shard, tensors in by_shard.items():
        present = checkpoint.exists.get(os.path.join(checkpoint.path, shard), False)
        code = "index-missing-tensor" if present else "index-missing-file"
        where = "which does not hold them" if present else "which does not exist"
        refusals.append(
            Refusal(
                code,
                index.path,
                f"index maps {len(tensors)} tensor(s) such as {name_list(tensors, 2)} to "
                f"{shard!r}, {where}, and no other file of the family holds them",
                f"download {shard} again, {_AGAIN}",
                tuple(tensors),
            )
        )
    return refusals


def _numbering_refusals(where: str, names: Sequence[str]) -> list[Refusal]:
    """Without an index, numbered shards must be one complete 1..M set: a part missing held
    tensors that nothing else names. `where` is the file inspect names for it."""
    parts = [parsed for name in names if (parsed := parse_weight_name(name)) and parsed.total]
    if not parts:
        return []
    totals = sorted({parsed.total for parsed in parts if parsed.total is not None})
    if len(totals) > 1:
        counts = ", ".join(f"of-{total:05d}" for total in totals)
        what = f"shard names disagree on the shard count ({counts}) and there is no index to say which export is current"
        return [Refusal("shard-numbering", where, what, f"keep one export, {_AGAIN}")]
    total = totals[0]
    seen = {
        parsed.part for parsed in parts if parsed.part is not None and 1 <= parsed.part <= total
    }
    if len(seen) == total and len(parts) == total:
        return []
    absent = list(itertools.islice((p for p in range(1, total + 1) if p not in seen), 5))
    what = (
        f"shard names are not a complete 1..{total} set (part(s) {', '.join(map(str, absent))} "
        "absent or misnamed) and there is no index to say which tensors the missing part held"
    )
    return [Refusal("shard-numbering", where, what, f"download the missing shard(s), {_AGAIN}")]


def _split(
    names: Sequence[str], reads: Mapping[str, FileRead], kept_in: Mapping[str, str]
) -> list[_Member]:
    found = []
    for name in names:
        tensors = sorted(reads[name].tensors, key=lambda tensor: tensor.byte_range)
        kept = tuple(tensor for tensor in tensors if kept_in[tensor.name] == name)
        dropped = tuple(tensor.name for tensor in tensors if kept_in[tensor.name] != name)
        found.append(_Member(name, reads[name], kept, dropped))
    return found


def _targets(family: Family, names: Sequence[str]) -> list[str]:
    """The kept files' names in the result: as they are, unless their N-of-M numbering is
    not one complete set (or the single file's name would stand beside shards)."""
    count = len(names)
    single = single_name(family)
    if family.stem == "loose" or (count == 1 and names[0] == single):
        return list(names)
    parsed = [parse_weight_name(name) for name in names]
    numbered = [item for item in parsed if item is not None and item.total is not None]
    parts = sorted(item.part or 0 for item in numbered)
    complete = len(numbered) == count and parts == list(range(1, count + 1))
    if complete and {item.total for item in numbered} == {count}:
        return list(names)
    if not numbered and single not in names:
        return list(names)  # names of their own (the index says where): left as they are
    output = OutputName(family.stem, family.ext, family.variant)
    return [output.shard(number, count) for number in range(1, count + 1)]


def _moved(member: _Member, kept_in: Mapping[str, str]) -> Move:
    holders = sorted({kept_in[name] for name in member.dropped})
    if not member.kept:
        why = (
            f"stale: each of its {len(member.dropped)} tensor(s) is kept in {', '.join(holders)}"
            if member.dropped
            else "holds no tensor"
        )
    else:
        why = (
            f"held stale copies of {len(member.dropped)} tensor(s) such as "
            f"{name_list(list(member.dropped), 2)}, kept in {', '.join(holders)}; "
            "rewritten without them"
        )
    return Move(member.name, member.name, why, member.dropped)


def _index_plan(
    family: Family, index: ShardIndex | None, kept: Sequence[KeptFile]
) -> tuple[IndexPlan | None, list[Move]]:
    """The index of the repaired family (none for one file named as the family's single
    file), and the old index taken out when it is replaced or no longer needed."""
    one_file = len(kept) == 1 and (family.stem == "loose" or kept[0].target == single_name(family))
    old = family.index
    if one_file:
        why = "the index of shards the checkpoint no longer has: it is one file now"
        return None, [Move(old, old, why)] if old is not None else []
    weight_map = {name: item.target for item in kept for name in item.tensors}
    metadata = dict(index.metadata) if index is not None else {}
    metadata["total_size"] = sum(item.nbytes for item in kept)
    file = old or OutputName(family.stem, family.ext, family.variant).index()
    same = index is not None and _same(index, weight_map, metadata)
    moves = []
    if old is not None and not same:
        why = "the old index, written anew from the shard headers"
        if index is None:
            why = "cannot be read; written anew from the shard headers"
        moves.append(Move(old, old, why))
    return IndexPlan(file, weight_map, metadata, write=not same), moves


def _same(index: ShardIndex, weight_map: Mapping[str, str], metadata: Mapping[str, object]) -> bool:
    """Exactly the same document (a total_size of 144.0 or "144" is not 144)."""
    return index.weight_map == weight_map and json.dumps(
        index.metadata, sort_keys=True
    ) == json.dumps(metadata, sort_keys=True)


def plan_family(
    checkpoint: Checkpoint, family: Family, records: Mapping[str, FileRecord]
) -> FamilyOutcome:
    """Repair one family of the folder from its files' headers (see the module docstring)."""
    root = checkpoint.path
    index = index_of(checkpoint, family)
    names = members(checkpoint, family, index)
    reads, refusals = _reads(root, names, records)
    if refusals:
        return FamilyOutcome(None, refusals=tuple(refusals))
    kept_in, undecided = _chosen_copies(names, reads, index)
    refusals = _undecided_refusals(root, undecided)
    refusals += _unheld_refusals(checkpoint, index, kept_in) if index else []
    first = family.files[0] if family.files else family.index or ""
    refusals += _numbering_refusals(os.path.join(root, first), names) if index is None else []
    if refusals:
        return FamilyOutcome(None, refusals=tuple(refusals))
    return _outcome(family, index, _split(names, reads, kept_in), kept_in)


def _outcome(
    family: Family, index: ShardIndex | None, split: Sequence[_Member], kept_in: Mapping[str, str]
) -> FamilyOutcome:
    keeping = [member for member in split if member.kept] or list(split[:1])
    moves = [_moved(member, kept_in) for member in split if member.dropped or member not in keeping]
    targets = _targets(family, [member.name for member in keeping])
    kept = [
        KeptFile(
            member.name,
            target,
            tuple(tensor.name for tensor in member.kept),
            sum(tensor.nbytes for tensor in member.kept),
            member.dropped if member.kept else (),
            "format" not in (member.read.metadata or {}),
        )
        for member, target in zip(keeping, targets, strict=True)
    ]
    index_plan, index_moves = _index_plan(family, index, kept)
    plan = FamilyPlan(family.label, family_key(family), tuple(kept), index_plan)
    return FamilyOutcome(plan, tuple(moves + index_moves))
