"""Checks that turn descriptors into findings. Pure functions: no I/O, no terminal."""

from __future__ import annotations

import itertools
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping, Sequence
from typing import Any

from ckptfix.catalog import TensorInfo
from ckptfix.dtypes import DTYPES
from ckptfix.findings import Finding, finding, name_list
from ckptfix.folder import Family, parse_weight_name
from ckptfix.formats.index import ShardIndex
from ckptfix.readers import WeightFile
from ckptfix.sizes import format_size

HUGE = 2**31


def tensor_findings(tensors: Sequence[TensorInfo], max_shard: int) -> list[Finding]:
    """Size and dtype findings, one per file and code so large models stay readable."""
    huge: dict[str, list[TensorInfo]] = defaultdict(list)
    oversized: dict[str, list[TensorInfo]] = defaultdict(list)
    for tensor in tensors:
        # numel >= 2^31 needs nbytes >= 2^30 even at 4 bits per element: skip small ones fast.
        if tensor.nbytes >= HUGE // 2 and (tensor.numel >= HUGE or tensor.nbytes >= HUGE):
            huge[tensor.file].append(tensor)
        if tensor.nbytes > max_shard:
            oversized[tensor.file].append(tensor)
    found: list[Finding] = []
    for file, group in huge.items():
        biggest = max(group, key=lambda tensor: tensor.numel)
        found.append(
            finding(
                "huge-numel",
                f"{len(group)} tensor(s) reach 2^31 elements or bytes, e.g. {biggest.name!r} with "
                f"{biggest.numel} elements ({biggest.nbytes} bytes); readers that size arrays in "
                "32-bit integers overflow on them (make sure consumers use 64-bit sizes, or split them)",
                file=file,
                tensors=[tensor.name for tensor in group],
            )
        )
    for file, group in oversized.items():
        biggest = max(group, key=lambda tensor: tensor.nbytes)
        found.append(
            finding(
                "oversized-tensor",
                f"{len(group)} tensor(s) exceed the shard limit of {max_shard} bytes, e.g. "
                f"{biggest.name!r} at {biggest.nbytes} bytes; each will need a shard of its own "
                "(raise --max-shard if a hard limit applies)",
                file=file,
                tensors=[tensor.name for tensor in group],
            )
        )
    floating = sorted({tensor.dtype for tensor in tensors if DTYPES[tensor.dtype].is_floating})
    if len(floating) > 1:
        found.append(
            finding(
                "dtype-mix",
                f"floating tensors come in {len(floating)} dtypes ({', '.join(floating)}); check this "
                "is intended (`ckptfix convert --dtype` casts them to one)",
                tensors=(),
            )
        )
    return found


def file_findings(weight_file: WeightFile) -> list[Finding]:
    found: list[Finding] = []
    metadata = weight_file.metadata or {}
    if "format" not in metadata:
        found.append(
            finding(
                "missing-format-metadata",
                'header __metadata__ has no "format" entry, which some loaders require '
                '(rewrite with `ckptfix reshard`, which adds "format": "pt")',
                file=weight_file.path,
            )
        )
    if weight_file.empty_names:
        found.append(
            finding(
                "empty-name",
                f"{weight_file.empty_names} tensor(s) have an empty name, which loaders cannot address "
                "(rename them at export)",
                file=weight_file.path,
                tensors=[""],
            )
        )
    return found


def duplicate_name_findings(files: Iterable[WeightFile]) -> list[Finding]:
    """The same tensor name stored in two files of one checkpoint."""
    files = list(files)
    counts = Counter(tensor.name for weight_file in files for tensor in weight_file.tensors)
    if not counts or max(counts.values()) == 1:
        return []
    holders: dict[str, list[str]] = defaultdict(list)
    for weight_file in files:
        for tensor in weight_file.tensors:
            if counts[tensor.name] > 1:
                holders[tensor.name].append(weight_file.path)
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


def index_findings(
    family: Family,
    index: ShardIndex,
    read: Mapping[str, WeightFile],
    exists: Mapping[str, bool],
    display: Mapping[str, str],
) -> list[Finding]:
    """Cross-check an index with its shards in both directions.

    `read` maps shard names to files that were read; `exists` says whether each referenced
    shard is on disk; `display` maps shard names to the paths shown to the user.
    """
    found: list[Finding] = []
    by_shard: dict[str, list[str]] = defaultdict(list)
    for name, shard in index.weight_map.items():
        by_shard[shard].append(name)
    for shard, names in by_shard.items():
        if not exists[shard]:
            found.append(
                finding(
                    "index-missing-file",
                    f"index maps {len(names)} tensor(s) to {shard!r}, which does not exist "
                    "(download the missing shard, or regenerate the index)",
                    file=index.path,
                    tensors=names,
                )
            )
            continue
        if shard not in read:
            continue  # unreadable: its own finding already says why
        held = {tensor.name for tensor in read[shard].tensors}
        missing = [name for name in names if name not in held]
        if missing:
            found.append(
                finding(
                    "index-missing-tensor",
                    f"index maps {len(missing)} tensor(s) such as {name_list(missing, 2)} to "
                    f"{shard!r}, which does not hold them (regenerate the index from the shards)",
                    file=index.path,
                    tensors=missing,
                )
            )
    stored_in = Counter(tensor.name for weight in read.values() for tensor in weight.tensors)
    for shard, weight_file in read.items():
        unlisted = [
            tensor.name
            for tensor in weight_file.tensors
            if index.weight_map.get(tensor.name) != shard and stored_in[tensor.name] == 1
        ]
        if unlisted:
            found.append(
                finding(
                    "index-unlisted-tensor",
                    f"shard holds {len(unlisted)} tensor(s) such as {name_list(unlisted, 2)} that the "
                    "index does not map to it, so loaders never read them (regenerate the index)",
                    file=weight_file.path,
                    tensors=unlisted,
                )
            )
    referenced = set(by_shard)
    for name in family.files:
        if name not in referenced:
            found.append(
                finding(
                    "orphan-file",
                    f"weight file is not referenced by {display[index.path]}; loaders ignore it "
                    "(delete it if stale, or regenerate the index if it belongs)",
                    file=display[name],
                )
            )
    found.extend(_total_size_findings(index, read, by_shard))
    return found


def _total_size_findings(
    index: ShardIndex, read: Mapping[str, WeightFile], by_shard: Mapping[str, list[str]]
) -> list[Finding]:
    if "total_size" not in index.metadata:
        return []
    declared: Any = index.metadata["total_size"]
    if type(declared) is not int:
        return [
            finding(
                "index-total-size",
                f"metadata.total_size is {declared!r}, not an integer byte count "
                "(regenerate the index)",
                file=index.path,
            )
        ]
    if any(shard not in read for shard in by_shard):
        return []  # cannot know the true total while a shard is missing or unreadable
    actual = 0
    for shard, names in by_shard.items():
        sizes = {tensor.name: tensor.nbytes for tensor in read[shard].tensors}
        actual += sum(sizes.get(name, 0) for name in names)
    if declared == actual:
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


_EMBEDDING_SUFFIXES = (
    "embed_tokens.weight",
    "wte.weight",
    "word_embeddings.weight",
    "embed_in.weight",
    "tok_embeddings.weight",
    "shared.weight",
)
_HEAD_NAMES = ("lm_head.weight", "embed_out.weight")


def _tie_setting(config: Mapping[str, Any]) -> tuple[bool, bool]:
    """(tie, explicit): transformers ties by default when the key is absent."""
    for scope in (config, config.get("text_config")):
        if isinstance(scope, Mapping) and "tie_word_embeddings" in scope:
            return bool(scope["tie_word_embeddings"]), True
    return True, False


def tied_config_findings(
    config: Mapping[str, Any],
    config_path: str,
    tensors: Sequence[TensorInfo],
    same_bytes: Callable[[str, str], bool | None],
) -> list[Finding]:
    """Compare `tie_word_embeddings` with the stored names.

    `same_bytes(a, b)` says whether two tensors hold equal bytes, or None when not compared.
    """
    embedding = min((t.name for t in tensors if t.name.endswith(_EMBEDDING_SUFFIXES)), default=None)
    head = min((t.name for t in tensors if t.name.endswith(_HEAD_NAMES)), default=None)
    if embedding is None:
        return []
    tie, explicit = _tie_setting(config)
    said = (
        "sets tie_word_embeddings=" + ("true" if tie else "false")
        if explicit
        else "leaves tie_word_embeddings unset (transformers defaults to true)"
    )
    if not tie and head is None:
        return [
            finding(
                "tied-config-mismatch",
                f"config.json sets tie_word_embeddings=false but no output head (lm_head.weight) is "
                f"stored, only {embedding!r}; the head would be randomly initialised (set it to true, "
                "or store the head)",
                file=config_path,
                tensors=[embedding],
            )
        ]
    if tie and head is not None:
        compared = same_bytes(embedding, head)
        if compared is True:
            return []
        differs = (
            "holds different bytes"
            if compared is False
            else "may differ (run with --hash to compare)"
        )
        return [
            finding(
                "tied-config-mismatch",
                f"config.json {said}, but {head!r} is stored separately from {embedding!r} and "
                f"{differs}; transformers will overwrite it with the embedding (set "
                "tie_word_embeddings=false to keep it)",
                file=config_path,
                tensors=[embedding, head],
            )
        ]
    return []


WRAPPER_PREFIXES = {
    "module.": "DistributedDataParallel / DataParallel",
    "_orig_mod.": "torch.compile",
    "_forward_module.": "Lightning",
    "model.": "Lightning",
}


def common_wrapper_prefixes(names: Sequence[str], *, training_checkpoint: bool) -> list[str]:
    """Wrapper prefixes that every name carries, outermost first (e.g. module._orig_mod.).

    `model.` counts only inside a training checkpoint (Lightning's LightningModule.model):
    in a Hugging Face shard it is the ordinary name of the base model.
    """
    candidates = [p for p in WRAPPER_PREFIXES if training_checkpoint or p != "model."]
    found: list[str] = []
    current = list(names)
    while current:
        prefix = next((p for p in candidates if all(n.startswith(p) for n in current)), None)
        if prefix is None or any(len(n) == len(prefix) for n in current):
            break
        found.append(prefix)
        current = [n[len(prefix) :] for n in current]
    return found


def wrapper_prefix_findings(
    tensors: Sequence[TensorInfo], *, training_checkpoint: bool
) -> list[Finding]:
    prefixes = common_wrapper_prefixes(
        [tensor.name for tensor in tensors], training_checkpoint=training_checkpoint
    )
    if not prefixes:
        return []
    chain = "".join(prefixes)
    sources = ", ".join(dict.fromkeys(WRAPPER_PREFIXES[p] for p in prefixes))
    return [
        finding(
            "wrapper-prefix",
            f"every tensor name starts with {chain!r} (left by {sources}); loaders expect the "
            "bare names (`ckptfix convert --strip-prefix auto` removes it)",
            tensors=(),
        )
    ]


def _overlap(first: tuple[int, int], second: tuple[int, int]) -> bool:
    return first[0] < second[1] and second[0] < first[1]


def pickle_findings(weight_file: WeightFile) -> list[Finding]:
    """Shared storage, non-contiguous views, wasted storage and nesting in a torch file."""
    found: list[Finding] = []
    by_storage: dict[str, list[TensorInfo]] = defaultdict(list)
    for tensor in weight_file.tensors:
        if tensor.storage is not None:
            by_storage[tensor.storage].append(tensor)
    for group in by_storage.values():
        if len(group) < 2:
            continue
        Layout = tuple[tuple[int, int], tuple[int, ...], tuple[int, ...] | None, str]
        layouts: dict[Layout, list[str]] = defaultdict(list)
        for tensor in group:
            layouts[(tensor.byte_range, tensor.shape, tensor.strides, tensor.dtype)].append(
                tensor.name
            )
        aliases = [names for names in layouts.values() if len(names) > 1]
        parts = [
            f"{' = '.join(repr(n) for n in names[:3])} are aliases (tied weights)"
            for names in aliases[:2]
        ]
        if len(layouts) > 1:
            ranges = sorted({layout[0] for layout in layouts})
            overlapping = any(_overlap(a, b) for a, b in itertools.pairwise(ranges))
            kind = "overlapping" if overlapping else "disjoint"
            parts.append(f"{len(layouts)} {kind} views of one buffer")
        found.append(
            finding(
                "shared-storage",
                f"{len(group)} tensors share one storage: {'; '.join(parts)}; safetensors cannot "
                "store shared memory (`ckptfix convert` writes each alias once and each view as "
                "its own tensor)",
                file=weight_file.path,
                tensors=[tensor.name for tensor in group],
            )
        )
    strided = [tensor for tensor in weight_file.tensors if not tensor.contiguous]
    if strided:
        example = strided[0]
        found.append(
            finding(
                "non-contiguous",
                f"{len(strided)} tensor(s) are not contiguous (transposed, sliced or expanded), e.g. "
                f"{example.name!r} with shape {list(example.shape)} and strides "
                f"{list(example.strides or ())}; safetensors needs row-major bytes "
                "(`ckptfix convert` materialises them one at a time)",
                file=weight_file.path,
                tensors=[tensor.name for tensor in strided],
            )
        )
    if weight_file.storages:
        stored = used = 0
        for key, spans in _spans_by_storage(weight_file.tensors).items():
            stored += weight_file.storages.get(key, 0)
            used += _union_length(spans)
        if stored > used:
            found.append(
                finding(
                    "wasted-storage",
                    f"the file stores {format_size(stored)} of storage but its tensors use "
                    f"{format_size(used)}: {format_size(stored - used)} belongs to no tensor (views "
                    "saved with their whole buffer; `ckptfix convert` writes only the bytes used)",
                    file=weight_file.path,
                )
            )
    if weight_file.nested_key is not None or weight_file.other_entries:
        where = (
            f"under {weight_file.nested_key!r}" if weight_file.nested_key else "at the top level"
        )
        beside = ", ".join(weight_file.other_entries[:6]) or "nothing else"
        more = (
            ""
            if len(weight_file.other_entries) <= 6
            else f" and {len(weight_file.other_entries) - 6} more"
        )
        found.append(
            finding(
                "nested-checkpoint",
                f"the model's tensors sit {where} of a training checkpoint beside {beside}{more}; "
                f"{format_size(weight_file.other_bytes)} of other tensors (optimizer or EMA state) "
                "are not part of the model (`ckptfix convert --key auto` extracts it)",
                file=weight_file.path,
            )
        )
    return found


def _spans_by_storage(tensors: Sequence[TensorInfo]) -> dict[str, list[tuple[int, int]]]:
    spans: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for tensor in tensors:
        if tensor.storage is not None:
            spans[tensor.storage].append(tensor.byte_range)
    return spans


def _union_length(spans: list[tuple[int, int]]) -> int:
    total, end = 0, None
    for begin, stop in sorted(spans):
        if end is None or begin >= end:
            total += stop - begin
            end = stop
        elif stop > end:
            total += stop - end
            end = stop
    return total
