"""Findings about how a folder's files fit together: indexes against their shards (both
directions), duplicate names, shard numbering, mixed families, no weights at all."""

from __future__ import annotations

import itertools
import os
from collections import Counter, defaultdict
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, replace
from operator import attrgetter

from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.findings import Finding, finding, name_list
from ckptfix.core.sizes import format_size
from ckptfix.formats.base import FileRead
from ckptfix.formats.index import ShardIndex
from ckptfix.layouts.diffusers import no_weights_message
from ckptfix.layouts.huggingface import family_key
from ckptfix.layouts.names import Family, parse_weight_name

_NAME, _NBYTES, _STORAGE = attrgetter("name"), attrgetter("nbytes"), attrgetter("storage")


def tensor_names(files: Iterable[FileRead]) -> list[str]:
    """The names of every tensor of `files`, in order (duplicates kept)."""
    return list(map(_NAME, itertools.chain.from_iterable(item.tensors for item in files)))


def repeated(names: Sequence[str]) -> set[str]:
    """The names that occur more than once (no counting at all when none does)."""
    if len(set(names)) == len(names):
        return set()
    return {name for name, count in Counter(names).items() if count > 1}


def duplicate_name_findings(files: Iterable[FileRead]) -> list[Finding]:
    """The same tensor name stored in two files of one checkpoint."""
    files = list(files)
    twice = repeated(tensor_names(files))
    if not twice:
        return []
    holders: dict[str, list[str]] = defaultdict(list)
    for weight_file in files:
        for tensor in weight_file.tensors:
            if tensor.name in twice:
                holders[tensor.name].append(weight_file.label)
    by_files: dict[tuple[str, ...], list[str]] = defaultdict(list)
    for name, paths in holders.items():
        if len(paths) > 1:
            by_files[tuple(paths)].append(name)
    return [
        finding(
            "duplicate-name",
            f"{len(names)} tensor name(s) such as {name_list(names, 2)} are stored in "
            f"{len(paths)} files ({', '.join(paths)}); a loader keeps whichever it reads last "
            "(remove the stale copy)",
            file=paths[0],
            tensors=names,
        )
        for paths, names in by_files.items()
    ]


@dataclass(frozen=True)
class IndexDiff:
    """How an index and its shards disagree, as data (what `fix` repairs from)."""

    missing_files: dict[str, list[str]]  # shard the index names but is absent -> tensors
    missing_tensors: dict[str, list[str]]  # shard -> tensors the index maps to it, not in it
    unlisted: dict[
        str, list[str]
    ]  # shard label -> tensors it holds that the index does not map to it
    orphans: list[str]  # files of the family that the index does not reference
    declared_total: object  # metadata.total_size as written (None when absent)
    actual_total: int | None  # bytes of the indexed tensors (None while a shard is unreadable)
    # The same, storage shared by tied tensors of a .bin counted once, as huggingface_hub
    # and transformers count it when they write a .bin index.
    shared_total: int | None = None
    present_total: int = 0  # bytes of the indexed tensors found (a lower bound)


def index_diff(
    family: Family, index: ShardIndex, read: Mapping[str, FileRead], exists: Mapping[str, bool]
) -> IndexDiff:
    """Cross-check an index with its shards in both directions. `read` maps shard names to
    the files read; `exists` says whether each referenced shard is on disk."""
    by_shard: dict[str, list[str]] = defaultdict(list)
    for name, shard in index.weight_map.items():
        by_shard[shard].append(name)
    missing_files = {shard: names for shard, names in by_shard.items() if not exists[shard]}
    missing_tensors: dict[str, list[str]] = {}
    for shard, names in by_shard.items():
        if shard in read:  # an unreadable shard: its own finding already says why
            held = set(map(_NAME, read[shard].tensors))
            if not held.issuperset(names):  # (the usual answer, found in C)
                missing_tensors[shard] = [name for name in names if name not in held]
    twice = repeated(tensor_names(read.values()))
    unlisted = {}
    for shard, weight_file in read.items():
        mapped = list(map(index.weight_map.get, map(_NAME, weight_file.tensors)))
        if mapped.count(shard) == len(mapped):
            continue  # every tensor mapped to its shard (the usual answer, found in C)
        names = [
            tensor.name
            for tensor in weight_file.tensors
            if index.weight_map.get(tensor.name) != shard and tensor.name not in twice
        ]
        if names:
            unlisted[weight_file.label] = names
    present, shared = _indexed_bytes(by_shard, read)
    complete = all(shard in read for shard in by_shard)
    orphans = [name for name in family.files if name not in by_shard]
    declared = index.metadata.get("total_size")
    return IndexDiff(
        missing_files,
        missing_tensors,
        unlisted,
        orphans,
        declared,
        present if complete else None,
        shared if complete else None,
        present,
    )


def _indexed_bytes(
    by_shard: Mapping[str, list[str]], read: Mapping[str, FileRead]
) -> tuple[int, int]:
    """(bytes of the indexed tensors found, the same with each storage of a .bin counted
    once at its full size, as huggingface_hub and transformers count a .bin index)."""
    present = shared = 0
    for shard, names in by_shard.items():
        if shard not in read:
            continue
        wanted, seen = set(names), set()
        sizes = getattr(read[shard], "storages", {})
        tensors = read[shard].tensors
        storages = list(map(_STORAGE, tensors))
        if storages.count(None) == len(tensors) and wanted.issuperset(map(_NAME, tensors)):
            total = sum(map(_NBYTES, tensors))  # each counted as the loop below counts it
            present, shared = present + total, shared + total
            continue
        for tensor in tensors:
            if tensor.name not in wanted:
                continue
            present += tensor.nbytes
            if tensor.storage is None:
                shared += tensor.nbytes
            elif tensor.storage not in seen:
                seen.add(tensor.storage)
                shared += sizes.get(tensor.storage, tensor.nbytes)
    return present, shared


def index_findings(
    family: Family, index: ShardIndex, diff: IndexDiff, display: Mapping[str, str]
) -> list[Finding]:
    """The findings an IndexDiff means; `display` maps names to the paths shown."""
    found = [
        finding(
            "index-missing-file",
            f"index maps {len(names)} tensor(s) to {shard!r}, which does not exist "
            "(download the missing shard, or regenerate the index)",
            file=index.path,
            tensors=names,
        )
        for shard, names in diff.missing_files.items()
    ]
    found += [
        finding(
            "index-missing-tensor",
            f"index maps {len(names)} tensor(s) such as {name_list(names, 2)} to "
            f"{shard!r}, which does not hold them (regenerate the index from the shards)",
            file=index.path,
            tensors=names,
        )
        for shard, names in diff.missing_tensors.items()
    ]
    found += [
        finding(
            "index-unlisted-tensor",
            f"shard holds {len(names)} tensor(s) such as {name_list(names, 2)} that the "
            "index does not map to it, so loaders never read them (regenerate the index)",
            file=label,
            tensors=names,
        )
        for label, names in diff.unlisted.items()
    ]
    found += [
        finding(
            "orphan-file",
            f"weight file is not referenced by {display[index.path]}; loaders ignore it "
            "(delete it if stale, or regenerate the index if it belongs)",
            file=display[name],
        )
        for name in diff.orphans
    ]
    return found + _total_size_findings(index, diff)


def _total_size_findings(index: ShardIndex, diff: IndexDiff) -> list[Finding]:
    declared = diff.declared_total
    if declared is None:
        return []
    if type(declared) is not int:
        return [
            finding(
                "index-total-size",
                f"metadata.total_size is {declared!r}, not an integer byte count "
                "(regenerate the index)",
                file=index.path,
            )
        ]
    actual = diff.actual_total
    if actual is None:  # a shard is missing or unreadable: what is present is a lower bound
        if declared >= diff.present_total:
            return []
        return [
            finding(
                "index-total-size",
                f"metadata.total_size is {declared} but the indexed tensors present already take "
                f"{diff.present_total} bytes, and a shard is missing; the index is stale "
                "(regenerate it)",
                file=index.path,
            )
        ]
    if declared in (actual, diff.shared_total):
        return []
    return [
        finding(
            "index-total-size",
            f"metadata.total_size is {declared} but the indexed tensors take {actual} bytes "
            f"({format_size(actual)}); the index is stale (regenerate it)",
            file=index.path,
        )
    ]


def shard_numbering_findings(family: Family, names: Sequence[str], where: str) -> list[Finding]:
    """N-of-M names must agree on M and cover 1..M; numbered shards need an index."""
    numbered = [(name, parse_weight_name(name)) for name in names]
    parts = [(name, parsed) for name, parsed in numbered if parsed and parsed.total is not None]
    if not parts:
        return []
    found: list[Finding] = []
    if family.index is None:
        found.append(
            finding(
                "shard-numbering",
                f"{len(parts)} file(s) are named as shards ({family.label}) but there is no index, so "
                "loaders cannot find the tensors (restore the index, or rewrite with `ckptfix reshard`)",
                file=where,
            )
        )
    totals = sorted({parsed.total for _, parsed in parts if parsed.total is not None})
    if len(totals) > 1:
        found.append(
            finding(
                "shard-numbering",
                f"shard names disagree on the shard count ({', '.join(f'of-{t:05d}' for t in totals)}); "
                "files from different exports are mixed (keep one export)",
                file=where,
            )
        )
        return found
    total = totals[0]
    seen = {parsed.part for _, parsed in parts if parsed.part is not None}
    # `total` comes from a file name and may be 9999999999: never build a list that long.
    absent = total - len({part for part in seen if 1 <= part <= total})
    missing = list(itertools.islice((p for p in range(1, total + 1) if p not in seen), 5))
    bad = sorted(part for part in seen if not 1 <= part <= total)
    if absent or bad:
        detail = []
        if absent:
            more = f" and {absent - len(missing)} more" if absent > len(missing) else ""
            detail.append(f"part(s) {', '.join(map(str, missing))}{more} of {total} absent")
        if bad:
            detail.append(f"part number(s) {', '.join(map(str, bad[:5]))} outside 1..{total}")
        found.append(
            finding(
                "shard-numbering",
                f"shard names are not a complete 1..{total} set: {'; '.join(detail)} "
                "(a shard is missing or misnamed; re-download or re-export)",
                file=where,
            )
        )
    return found


def mixed_format_findings(families: Sequence[Family]) -> list[Finding]:
    kinds: dict[str, list[Family]] = defaultdict(list)
    for family in families:
        if family.files:
            kinds[family.kind].append(family)
    if len(kinds) < 2:
        return []
    parts = []
    for kind, members in kinds.items():
        count = sum(len(member.files) for member in members)
        indexes = [member.index for member in members if member.index]
        covered = f", indexed by {', '.join(indexes)}" if indexes else ""
        parts.append(f"{kind} ({count} file(s){covered})")
    return [
        finding(
            "mixed-formats",
            f"{len(kinds)} weight families in one folder: {'; '.join(parts)}; loaders pick one by "
            "their own rules (keep one family, move the others out)",
            tensors=(),
        )
    ]


def folder_findings(checkpoint: Checkpoint) -> list[Finding]:
    """Indexes against their shards, names, numbering and families of a model folder."""
    layout, root = checkpoint.layout, checkpoint.path
    found: list[Finding] = []
    indexes = {record.family: record for record in checkpoint.indexes}
    for family in layout.families:
        record = indexes.get(family_key(family))
        if record is not None and record.index is not None:
            found += _index_family(checkpoint, family, record.index)
        elif family.index is None and family.stem != "loose":
            found += shard_numbering_findings(
                family, family.files, os.path.join(root, family.files[0])
            )
            found += duplicate_name_findings(
                _read(checkpoint, [os.path.join(root, name) for name in family.files]).values()
            )
    found += mixed_format_findings(layout.families)
    found += _choice_findings(checkpoint)
    if not checkpoint.files and not checkpoint.indexes:
        found.append(finding("no-weights", no_weights_message(root), file=root))
    return found


def _choice_findings(checkpoint: Checkpoint) -> list[Finding]:
    """Several separate checkpoints side by side; a single file that hides its family's
    shards from the loader."""
    choice = checkpoint.choice
    if choice is None:
        return []
    if len(choice.separate) > 1:
        return [
            finding(
                "several-checkpoints",
                f"folder holds {len(choice.separate)} separate checkpoints "
                f"({name_list(list(choice.separate))}), not one model in several files; "
                "nothing merges them (inspect or convert one file at a time)",
                file=checkpoint.path,
            )
        ]
    family = choice.family
    if family is None or family.index is None or choice.index is not None:
        return []
    return [
        finding(
            "shadowed-shards",
            f"{choice.files[0]} and {family.index} both exist: {choice.loader} loads "
            f"{choice.files[0]} and never reads the index or its shards (delete the stale one)",
            file=os.path.join(checkpoint.path, family.index),
        )
    ]


def _read(checkpoint: Checkpoint, labels: Iterable[str]) -> dict[str, FileRead]:
    """The files among `labels` that were read, by label."""
    read = {}
    for label in labels:
        record = checkpoint.record(label)
        if record is not None and record.read is not None:
            read[label] = record.read
    return read


def _index_family(checkpoint: Checkpoint, family: Family, index: ShardIndex) -> list[Finding]:
    root = checkpoint.path
    display = {name: os.path.join(root, name) for name in family.files}
    display[index.path] = family.index or index.path
    exists: dict[str, bool] = {}
    read: dict[str, FileRead] = {}
    for shard in index.shard_names:
        label = os.path.join(root, shard)
        display[shard] = label
        exists[shard] = checkpoint.exists.get(label, False)
        record = checkpoint.record(label)
        if record is not None and record.read is not None:
            read[shard] = record.read
    diff = index_diff(family, index, read, exists)
    chosen = checkpoint.choice.files if checkpoint.choice is not None else ()
    if chosen and checkpoint.choice.index is None:  # the single file a loader reads instead
        diff = replace(diff, orphans=[name for name in diff.orphans if name not in chosen])
    found = index_findings(family, index, diff, display)
    found += duplicate_name_findings(read.values())
    found += shard_numbering_findings(family, index.shard_names, index.path)
    return found
