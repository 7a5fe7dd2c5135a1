"""A mapping table applied to a Megatron checkpoint's tensors (Megatron names, one tensor per
layer and expert, see layouts.megatron): the Hugging Face tensors, each made of pieces of the
same rank files, so a conversion streams them at bounded memory and nothing is read here.

Every tensor is accounted for on both sides: a Megatron tensor no row takes, a target no
source provides, or a size that disagrees with the config is an error naming both sides,
never a smaller model.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass, replace

from ckptfix.core.errors import MappingError
from ckptfix.core.findings import name_list
from ckptfix.core.tensor import TensorInfo
from ckptfix.layouts.slices import gather_rows
from ckptfix.mappings.hf_config import Dims, Target
from ckptfix.mappings.table import Row

WRAPPERS = ("module.", "model.")
_ORDER = ("megatron-unmapped", "hf-unsourced", "megatron-shape")
_FIX = "check that --to-hf names the model this checkpoint was trained as (`ckptfix inspect` lists its tensors)"


@dataclass(frozen=True)
class Mapped:
    """The Hugging Face tensors, in the table's order (model rows, then layer by layer)."""

    tensors: tuple[TensorInfo, ...]


@dataclass(frozen=True)
class _Instance:
    """A row for one layer (and expert): its names filled in."""

    row: Row
    sources: tuple[str, ...]
    targets: tuple[str, ...]


def _instances(rows: Sequence[Row], dims: Dims) -> Iterator[_Instance]:
    """Model rows first, then each layer's rows in table order (experts in index order)."""
    for row in rows:
        if not _per_layer(row):
            yield _Instance(row, row.megatron, row.hf)
    for layer in range(dims.layers):
        for row in rows:
            if not _per_layer(row):
                continue
            experts = range(dims.sizes["E"]) if "{expert}" in row.hf[0] else range(1)
            for expert in experts:
                yield _Instance(
                    row, _filled(row.megatron, layer, expert), _filled(row.hf, layer, expert)
                )


def _filled(names: tuple[str, ...], layer: int, expert: int) -> tuple[str, ...]:
    return tuple(name.format(layer=layer, expert=expert) for name in names)


def _per_layer(row: Row) -> bool:
    return "{layer}" in row.hf[0]


class _Problems:
    def __init__(self) -> None:
        self.found: list[tuple[str, str]] = []  # (rule, what)

    def problem(self, rule: str, what: str) -> None:
        self.found.append((rule, what))

    def raise_any(self, path: str) -> None:
        if not self.found:
            return
        # What does not correspond at all says more than a size that disagrees.
        rule, what = min(self.found, key=lambda item: _ORDER.index(item[0]))
        more = len(self.found) - 1
        tail = f"; and {more} more problem(s) of this mapping" if more else ""
        raise MappingError(path, what + tail, _FIX, rule=rule)


def map_tensors(target: Target, tensors: Sequence[TensorInfo], path: str) -> Mapped:
    """Apply `target`'s table to the Megatron-named `tensors` of the checkpoint at `path`."""
    _check_counts(target, len(tensors), path)
    prefix = _wrapper(tensors)
    by_name = {tensor.name[len(prefix) :]: tensor for tensor in tensors}
    problems = _Problems()
    used: set[str] = set()
    inactive: dict[str, str] = {}  # a source name -> the flag that turned its row off
    out: list[TensorInfo] = []
    for instance in _instances(target.table.rows, target.dims):
        row = instance.row
        if row.when is not None and not target.dims.flags[row.when]:
            inactive.update(dict.fromkeys(instance.sources, row.when))
            continue
        present = [name for name in instance.sources if name in by_name]
        if not present:
            what = f"{name_list(instance.targets)} of a {target.table.model_type} model has no source: Megatron {prefix + instance.sources[0]!r} is not in the checkpoint"
            problems.problem("hf-unsourced", what)
            continue
        used.update(present)
        out += _split(row, by_name[present[0]], instance.targets, target.dims, problems)
    for name, tensor in by_name.items():
        if name not in used:
            problems.problem(
                "megatron-unmapped", _no_destination(tensor.name, name, target, inactive)
            )
    problems.raise_any(path)
    return Mapped(tuple(out))


def _check_counts(target: Target, count: int, path: str) -> None:
    """Each layer (and expert) of the config needs a tensor of its own: a config asking for
    more than the checkpoint holds is refused before its rows are expanded."""
    layers, experts = target.dims.layers, target.dims.sizes.get("E", 1)
    if layers * experts > count:
        what = f"the {target.table.model_type} model of {target.origin} has {layers:,} layers"
        what += f" of {experts:,} experts" if "E" in target.dims.sizes else ""
        raise MappingError(
            path, f"{what}, but the checkpoint holds {count:,} tensors", _FIX, rule="hf-unsourced"
        )


def _wrapper(tensors: Sequence[TensorInfo]) -> str:
    """A prefix every name carries (NeMo 2 saves the model under `module.`), or ""."""
    for prefix in WRAPPERS:
        if tensors and all(tensor.name.startswith(prefix) for tensor in tensors):
            return prefix
    return ""


def _no_destination(shown: str, name: str, target: Target, inactive: dict[str, str]) -> str:
    why = ""
    if name in inactive:
        flag = inactive[name]
        why = (
            " (its config ties the embeddings)"
            if flag == "untied"
            else f" (its config has {flag} false)"
        )
    return f"Megatron tensor {shown!r} has no destination in the {target.table.model_type} model of {target.origin}{why}"


def _split(
    row: Row, source: TensorInfo, targets: tuple[str, ...], dims: Dims, problems: _Problems
) -> list[TensorInfo]:
    """The targets of one row instance, or [] (and a problem) when the sizes disagree."""
    want = dims.shape(row.shape)
    expected = _expected(row.split, want, dims, source)
    if expected is None or source.shape != expected:
        shown = (
            list(expected)
            if expected is not None
            else f"at least {want[0]} rows of {list(want[1:])}"
        )
        problems.problem(
            "megatron-shape",
            f"Megatron {source.name!r} has shape {list(source.shape)}, but {name_list(targets)} "
            f"of the config need {shown}",
        )
        return []
    if row.split == "same":
        return [replace(source, name=targets[0])]
    return [
        gather_rows(source, name, spans, (sum(b - a for a, b in spans), *source.shape[1:]))
        for name, spans in zip(targets, _ranges(row.split, want, dims), strict=True)
    ]


def _expected(
    split: str, want: tuple[int, ...], dims: Dims, source: TensorInfo
) -> tuple[int, ...] | None:
    """The source shape a split needs (None: a vocabulary smaller than the config's)."""
    if split == "same":
        return want
    if split == "vocab":
        rows = source.shape[0] if source.shape and source.shape[0] >= want[0] else None
        return None if rows is None else (rows, *want[1:])
    if split == "swiglu":
        return (2 * want[0], *want[1:])
    return (dims.sizes["Q"] + 2 * dims.sizes["KV"], *want)


def _ranges(split: str, want: tuple[int, ...], dims: Dims) -> list[list[tuple[int, int]]]:
    """The source rows of each target, once the source's shape is known to be right (so a
    config's group count is bounded by the rows the checkpoint holds)."""
    if split == "vocab":
        return [[(0, want[0])]]
    if split == "swiglu":
        return [[(0, want[0])], [(want[0], 2 * want[0])]]
    head_dim, groups = dims.sizes["D"], dims.groups
    per_group = dims.sizes["Q"] // dims.sizes["KV"]  # query heads per key-value group
    block = (per_group + 2) * head_dim
    ranges: list[list[tuple[int, int]]] = [[], [], []]
    for group in range(groups):
        start = group * block
        ranges[0].append((start, start + per_group * head_dim))
        ranges[1].append((start + per_group * head_dim, start + (per_group + 1) * head_dim))
        ranges[2].append((start + (per_group + 1) * head_dim, start + block))
    return ranges
