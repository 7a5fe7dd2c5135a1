"""What torch zip and legacy files share once unpickled: the tensor dictionary as
descriptors, and the findings only a pickle can have (shared storage, strided views,
wasted storage, a training checkpoint around the model)."""

from __future__ import annotations

import itertools
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass, field

from ckptfix.core.findings import Finding, finding
from ckptfix.core.sizes import format_size
from ckptfix.core.tensor import TensorInfo
from ckptfix.formats.base import FileRead, ReadOptions, empty_names
from ckptfix.formats.tensor_dict import PickleCheckpoint, check_views, find_tensor_dict
from ckptfix.io.source import ByteSource


@dataclass(frozen=True)
class PickleFile(FileRead):
    """A torch file: where the tensor dict sat, what was left around it, storage sizes."""

    nested_key: str | None = None
    other_entries: tuple[str, ...] = ()
    other_bytes: int = 0
    storages: dict[str, int] = field(default_factory=dict)


def pickle_file(
    checkpoint: PickleCheckpoint, source: ByteSource, fmt: str, options: ReadOptions
) -> PickleFile:
    """Descriptors of the chosen tensor dictionary, every view validated."""
    found = find_tensor_dict(checkpoint.obj, options.key, source.label)
    views = check_views(source.label, found.tensors, checkpoint.storages)
    tensors = tuple(
        TensorInfo(
            name=view.name,
            dtype=view.dtype,
            shape=view.shape,
            nbytes=view.numel * view.itemsize,
            file=source.label,
            byte_range=(view.storage.begin + view.span[0], view.storage.begin + view.span[1]),
            contiguous=view.contiguous,
            storage=view.storage.key,
            strides=view.stride,
        )
        for view in views
    )
    return PickleFile(
        label=source.label,
        format=fmt,
        size=source.size,
        tensors=tensors,
        nested_key=found.key,
        other_entries=found.other_entries,
        other_bytes=found.other_bytes,
        storages={key: storage.nbytes for key, storage in checkpoint.storages.items()},
    )


def pickle_checks(file: FileRead) -> list[Finding]:
    if not isinstance(file, PickleFile):
        return []
    found = _shared_storage(file)
    found += _non_contiguous(file)
    found += _wasted_storage(file)
    found += _nested(file)
    found += _empty_names(file)
    return found


def _empty_names(file: PickleFile) -> list[Finding]:
    return empty_names(sum(1 for tensor in file.tensors if tensor.name == ""), file.label)


def _overlap(first: tuple[int, int], second: tuple[int, int]) -> bool:
    return first[0] < second[1] and second[0] < first[1]


def _sharing(group: Sequence[TensorInfo]) -> str:
    """`'a' = 'b' are aliases (tied weights); 3 disjoint views of one buffer`."""
    Layout = tuple[tuple[int, int], tuple[int, ...], tuple[int, ...] | None, str]
    layouts: dict[Layout, list[str]] = defaultdict(list)
    for tensor in group:
        layouts[(tensor.byte_range, tensor.shape, tensor.strides, tensor.dtype)].append(tensor.name)
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
    return "; ".join(parts)


def _shared_storage(file: PickleFile) -> list[Finding]:
    by_storage: dict[str, list[TensorInfo]] = defaultdict(list)
    for tensor in file.tensors:
        if tensor.storage is not None:
            by_storage[tensor.storage].append(tensor)
    return [
        finding(
            "shared-storage",
            f"{len(group)} tensors share one storage: {_sharing(group)}; safetensors cannot "
            "store shared memory (`ckptfix convert` writes each alias once and each view as "
            "its own tensor)",
            file=file.label,
            tensors=[tensor.name for tensor in group],
        )
        for group in by_storage.values()
        if len(group) > 1
    ]


def _non_contiguous(file: PickleFile) -> list[Finding]:
    strided = [tensor for tensor in file.tensors if not tensor.contiguous]
    if not strided:
        return []
    example = strided[0]
    return [
        finding(
            "non-contiguous",
            f"{len(strided)} tensor(s) are not contiguous (transposed, sliced or expanded), e.g. "
            f"{example.name!r} with shape {list(example.shape)} and strides "
            f"{list(example.strides or ())}; safetensors needs row-major bytes "
            "(`ckptfix convert` materialises them one at a time)",
            file=file.label,
            tensors=[tensor.name for tensor in strided],
        )
    ]


def _wasted_storage(file: PickleFile) -> list[Finding]:
    spans: dict[str, list[tuple[int, int]]] = defaultdict(list)
    for tensor in file.tensors:
        if tensor.storage is not None:
            spans[tensor.storage].append(tensor.byte_range)
    stored = sum(file.storages.get(key, 0) for key in spans)
    used = sum(_union_length(ranges) for ranges in spans.values())
    if stored <= used:
        return []
    return [
        finding(
            "wasted-storage",
            f"the file stores {format_size(stored)} of storage but its tensors use "
            f"{format_size(used)}: {format_size(stored - used)} belongs to no tensor (views "
            "saved with their whole buffer; `ckptfix convert` writes only the bytes used)",
            file=file.label,
        )
    ]


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


def _nested(file: PickleFile) -> list[Finding]:
    if file.nested_key is None and not file.other_entries:
        return []
    where = f"under {file.nested_key!r}" if file.nested_key else "at the top level"
    beside = ", ".join(file.other_entries[:6]) or "nothing else"
    extra = len(file.other_entries) - 6
    more = f" and {extra} more" if extra > 0 else ""
    return [
        finding(
            "nested-checkpoint",
            f"the model's tensors sit {where} of a training checkpoint beside {beside}{more}; "
            f"{format_size(file.other_bytes)} of other tensors (optimizer or EMA state) "
            "are not part of the model (`ckptfix convert --key auto` extracts it)",
            file=file.label,
        )
    ]
