"""`diff`: what differs between two checkpoints, whatever their formats and sharding.

Names are compared first (after --strip-prefix), then dtype and shape, then bytes: each pair
of tensors is read chunk by chunk side by side (two pairs at a time), hashing one side while
the two agree and stopping at the first difference, so equal models cost one hash, not two,
and different ones little more than their headers. With `values`, differing tensors are read
to the end for element counts and maxima (ops.compare).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from contextlib import ExitStack
from dataclasses import dataclass, field, replace

from ckptfix.core.errors import UsageError
from ckptfix.core.memory import paused_gc
from ckptfix.core.tensor import TensorInfo
from ckptfix.ops.compare import PairResult, Stats, ValueDiff, compare_pair
from ckptfix.ops.digest import (
    ALGORITHM,
    WORKERS,
    LayoutKey,
    Meter,
    Progress,
    content_digests,
    layout_key,
    model_digest,
    run_parallel,
    small_range,
    tensor_digest,
)
from ckptfix.ops.tensorset import Digester, TensorSet, opened, stripped_names

SCHEMA_VERSION = 1
# --fail-on: which differences make `diff` exit 1.
FAIL_ON = ("any", "layout", "names", "never")


@dataclass(frozen=True)
class LayoutChange:
    """A name in both whose dtype or shape differs."""

    name: str
    a: tuple[str, tuple[int, ...]]
    b: tuple[str, tuple[int, ...]]

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "a": {"dtype": self.a[0], "shape": list(self.a[1])},
            "b": {"dtype": self.b[0], "shape": list(self.b[1])},
        }


@dataclass(frozen=True)
class BytesChange:
    """A name in both, of one dtype and shape, whose bytes differ (and how, with values)."""

    name: str
    values: ValueDiff | None = None

    def to_dict(self) -> dict[str, object]:
        return {"name": self.name, "values": self.values.to_dict() if self.values else None}


@dataclass(frozen=True)
class DiffResult:
    """Every difference, by compared name (after prefixes are stripped), sorted."""

    a: str
    b: str
    compared: int  # names in both
    compared_bytes: int  # their bytes (A's side)
    only_in_a: tuple[str, ...] = ()
    only_in_b: tuple[str, ...] = ()
    layout_changed: tuple[LayoutChange, ...] = ()
    bytes_changed: tuple[BytesChange, ...] = ()
    digest: str | None = None  # the model digest both share, when identical
    stripped: dict[str, list[str]] = field(default_factory=dict)  # side -> prefixes removed
    algorithm: str = ALGORITHM
    # Side -> which copy of a DeepSpeed folder's weights was read, when it holds two.
    weights_notes: dict[str, str] = field(default_factory=dict)

    @property
    def identical(self) -> bool:
        return not (self.only_in_a or self.only_in_b or self.layout_changed or self.bytes_changed)

    @property
    def difference_count(self) -> int:
        return (
            len(self.only_in_a)
            + len(self.only_in_b)
            + len(self.layout_changed)
            + len(self.bytes_changed)
        )

    def exit_code(self, fail_on: str = "any") -> int:
        """1 when a difference at or above `fail_on` was found, else 0."""
        if fail_on not in FAIL_ON:
            raise UsageError("--fail-on", f"unknown level {fail_on!r}", f"use {', '.join(FAIL_ON)}")
        names = bool(self.only_in_a or self.only_in_b)
        layout = names or bool(self.layout_changed)
        failing = {"any": not self.identical, "layout": layout, "names": names, "never": False}
        return 1 if failing[fail_on] else 0

    def to_dict(self) -> dict[str, object]:
        return {
            "schema_version": SCHEMA_VERSION,
            "a": self.a,
            "b": self.b,
            "identical": self.identical,
            "algorithm": self.algorithm,
            "digest": self.digest,
            "compared": self.compared,
            "compared_bytes": self.compared_bytes,
            "stripped": self.stripped,
            "only_in_a": list(self.only_in_a),
            "only_in_b": list(self.only_in_b),
            "layout_changed": [change.to_dict() for change in self.layout_changed],
            "bytes_changed": [change.to_dict() for change in self.bytes_changed],
            **({"weights_notes": dict(self.weights_notes)} if self.weights_notes else {}),
        }


@dataclass(frozen=True)
class DiffOptions:
    values: bool = False  # count differing elements and their largest differences
    strip_prefix: str | None = None  # None, "auto", or a prefix removed on both sides
    key: str = "auto"
    alias_record: bool = True
    workers: int = WORKERS
    progress: Progress | None = None
    to_hf: str | None = None  # map the Megatron side to this Hugging Face model (ops.to_hf)
    # Who reads and hashes the tensors: this process (None) or an executor's tasks, which
    # hash both sides whole; with values, differing pairs are then read here.
    digester: Digester | None = None


def diff(
    a: str | os.PathLike[str], b: str | os.PathLike[str], options: DiffOptions | None = None
) -> DiffResult:
    """Compare the checkpoints a loader would load from `a` and `b`."""
    options = options or DiffOptions()
    if options.strip_prefix == "":
        raise UsageError("--strip-prefix", "the prefix is empty", "pass auto or a prefix")
    with ExitStack() as stack:
        sides = [
            stack.enter_context(opened(path, key=options.key, alias_record=options.alias_record))
            for path in (a, b)
        ]
        if options.to_hf is not None:
            sides = _megatron_as_hf(sides, options.to_hf)
        return diff_tensor_sets(sides[0], sides[1], options)


def _megatron_as_hf(sides: list[TensorSet], spec: str) -> list[TensorSet]:
    """The one Megatron side mapped to the Hugging Face model `spec` names."""
    from ckptfix.layouts.megatron import MegatronLayout
    from ckptfix.ops.to_hf import hf_tensor_set, megatron_layout

    megatron = [
        isinstance(side.checkpoint.layout, MegatronLayout) if side.checkpoint else False
        for side in sides
    ]
    if megatron.count(True) != 1:
        megatron_layout(sides[0].checkpoint)  # type: ignore[arg-type]  # the usage error
        raise UsageError(
            "--to-hf",
            "both sides are Megatron-Core checkpoints",
            "compare them without --to-hf, or one with the Hugging Face model",
        )
    return [
        hf_tensor_set(side, spec) if is_megatron else side
        for side, is_megatron in zip(sides, megatron, strict=True)
    ]


@dataclass(frozen=True)
class _Side:
    tensors: TensorSet
    names: dict[str, str]  # compared name -> the set's name

    def tensor(self, compared: str) -> TensorInfo:
        return self.tensors.tensors[self.names[compared]]


def diff_tensor_sets(a: TensorSet, b: TensorSet, options: DiffOptions) -> DiffResult:
    with paused_gc():  # several small objects per tensor: 1,000,000 tensors for some headers
        return _diff(a, b, options)


def _diff(a: TensorSet, b: TensorSet, options: DiffOptions) -> DiffResult:
    sides, stripped = [], {}
    for label, tensors in (("a", a), ("b", b)):
        names, prefixes = stripped_names(
            list(tensors.tensors),
            options.strip_prefix,
            training_checkpoint=tensors.training_checkpoint,
            side=tensors.path,
        )
        sides.append(_Side(tensors, names))
        stripped[label] = prefixes
    left, right = sides
    common = sorted(left.names.keys() & right.names.keys())
    layout = [
        LayoutChange(name, _layout(left.tensor(name)), _layout(right.tensor(name)))
        for name in common
        if _layout(left.tensor(name)) != _layout(right.tensor(name))
    ]
    changed = {change.name for change in layout}
    outcomes = _compare([n for n in common if n not in changed], left, right, options)
    differ = tuple(
        BytesChange(name, outcome.values) for name, outcome in outcomes.items() if not outcome.equal
    )
    result = DiffResult(
        a.path,
        b.path,
        compared=len(common),
        compared_bytes=sum(left.tensor(name).nbytes for name in common),
        only_in_a=_sorted(left.names.keys() - right.names.keys()),
        only_in_b=_sorted(right.names.keys() - left.names.keys()),
        layout_changed=tuple(layout),
        bytes_changed=differ,
        stripped=stripped,
        weights_notes={
            label: side.tensors.weights_note
            for label, side in (("a", left), ("b", right))
            if side.tensors.weights_note is not None
        },
    )
    if result.identical:
        digests = {name: tensor_digest(name, outcomes[name].content) for name in common}
        result = replace(result, digest=model_digest(digests).hex())
    return result


def _layout(tensor: TensorInfo) -> tuple[str, tuple[int, ...]]:
    return tensor.dtype, tensor.shape


def _sorted(names: set[str]) -> tuple[str, ...]:
    return tuple(sorted(names))  # code point order, which is the order of the UTF-8 bytes


Pairs = dict[tuple[LayoutKey, LayoutKey], tuple[TensorInfo, TensorInfo]]


def _compare(
    names: Sequence[str], left: _Side, right: _Side, options: DiffOptions
) -> dict[str, PairResult]:
    """Compare each distinct pair of tensors once (aliases on both sides share a pair)."""
    pairs: Pairs = {}
    for name in names:
        tensor_a, tensor_b = left.tensor(name), right.tensor(name)
        pairs.setdefault((layout_key(tensor_a), layout_key(tensor_b)), (tensor_a, tensor_b))
    if options.digester is None:
        small = {
            key: pair
            for key, pair in pairs.items()
            if small_range(pair[0]) is not None and small_range(pair[1]) is not None
        }
        outcome = _compare_small(small, left, right, options)
    else:
        outcome = _compare_digested(names, pairs, (left, right), options)
    outcome.update(
        _compare_each({k: v for k, v in pairs.items() if k not in outcome}, left, right, options)
    )
    return {
        name: outcome[(layout_key(left.tensor(name)), layout_key(right.tensor(name)))]
        for name in names
    }


def _compare_small(
    pairs: Pairs, left: _Side, right: _Side, options: DiffOptions
) -> dict[tuple[LayoutKey, LayoutKey], PairResult]:
    """Small tensors by their content digests, each side hashed in batches (one read for
    many tensors, see ops.digest); with values, differing pairs are left to _compare_each."""
    if not pairs:
        return {}
    workers = options.workers
    digests_a = content_digests(
        [a for a, _ in pairs.values()], left.tensors.source, workers=workers
    )
    digests_b = content_digests(
        [b for _, b in pairs.values()], right.tensors.source, workers=workers
    )
    return _by_digest(pairs, digests_a, digests_b, options)


def _compare_digested(
    names: Sequence[str], pairs: Pairs, sides: tuple[_Side, _Side], options: DiffOptions
) -> dict[tuple[LayoutKey, LayoutKey], PairResult]:
    """Every pair by the content digests `options.digester` gives for each side; with
    values, differing pairs are left to _compare_each."""
    assert options.digester is not None
    totals = [sum(pair[side].nbytes for pair in pairs.values()) for side in (0, 1)]
    digests = []
    for index, side in enumerate(sides):
        wanted = list(dict.fromkeys(side.names[name] for name in names))
        digests.append(options.digester(side.tensors, wanted, _shifted(options, totals, index)))
    return _by_digest(pairs, digests[0], digests[1], options)


def _shifted(options: DiffOptions, totals: list[int], index: int) -> Progress | None:
    """Progress over both sides for the side at `index` (A's bytes come first)."""
    progress = options.progress
    if progress is None:
        return None
    before, total = sum(totals[:index]), sum(totals)
    return lambda done, _: progress(before + done, total)


def _by_digest(
    pairs: Pairs,
    digests_a: dict[LayoutKey, bytes],
    digests_b: dict[LayoutKey, bytes],
    options: DiffOptions,
) -> dict[tuple[LayoutKey, LayoutKey], PairResult]:
    outcome = {}
    for key, (tensor_a, tensor_b) in pairs.items():
        digest = digests_a[layout_key(tensor_a)]
        if digest == digests_b[layout_key(tensor_b)]:  # same dtype and shape: same bytes
            outcome[key] = PairResult(True, digest)
        elif not (options.values and Stats.supports(tensor_a.dtype)):
            outcome[key] = PairResult(False)
    return outcome


def _compare_each(
    pairs: Pairs, left: _Side, right: _Side, options: DiffOptions
) -> dict[tuple[LayoutKey, LayoutKey], PairResult]:
    """Pairs read side by side, two at a time (ops.compare)."""
    keys = list(pairs)
    found: list[PairResult] = [PairResult(False)] * len(keys)
    meter = Meter(sum(2 * a.nbytes for a, _ in pairs.values()), options.progress)

    def work(index: int, stop: threading.Event) -> None:
        tensor_a, tensor_b = pairs[keys[index]]
        found[index] = compare_pair(
            (left.tensors.source, tensor_a),
            (right.tensors.source, tensor_b),
            values=options.values,
            stop=stop,
            advance=meter.add,
        )

    run_parallel(len(keys), work, options.workers)
    return dict(zip(keys, found, strict=True))
