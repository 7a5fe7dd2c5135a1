"""The passes in C that keep 1,000,000-tensor plans and reports fast give what the plain
loops give: packing, totals, the name coverage of a plan, the digits of header offsets."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfix.core.dtypes import DTYPES
from ckptfix.core.tensor import TensorInfo, bytes_by_dtype, parameter_count
from ckptfix.formats.safetensors_encode import _digits
from ckptfix.plan import coverage, shards
from ckptfix.plan.coverage import missing_name
from ckptfix.plan.select import OutTensor, Selection
from ckptfix.plan.shards import PlannedShard, pack, plan_shards

EXAMPLES = max(int(os.environ.get("CKPTFIX_FUZZ_EXAMPLES", "300")) // 3, 50)


@pytest.mark.slow
@settings(max_examples=EXAMPLES * 3, deadline=None)
@given(
    st.lists(st.sampled_from([0, 0, 1, 2, 3, 5, 8, 10, 11, 40]), max_size=30), st.integers(0, 12)
)
def test_packing_a_shard_at_a_time_is_packing_one_by_one(sizes: list[int], max_shard: int) -> None:
    """Shards found by bisection in the running totals (zero-byte tensors, tensors just at
    the limit, tensors over it, no tensors) are the shards of adding tensors while they fit."""
    named = [(f"t{index}", size) for index, size in enumerate(sizes)]
    assert pack(named, max_shard) == shards._pack_one_by_one(named, max_shard)


# Whole-byte, sub-byte and block-quantized dtypes, sizes each a whole number of elements.
_KINDS = ["F32", "BF16", "U8", "BOOL", "F4", "F6_E2M3", "I64", "Q4_0", "Q8_0"]


@st.composite
def tensor_lists(draw: st.DrawFn) -> list[TensorInfo]:
    tensors = []
    for index in range(draw(st.integers(0, 12))):
        dtype = DTYPES[draw(st.sampled_from(_KINDS))]
        units = draw(st.integers(0, 40))
        if dtype.block_bytes:
            nbytes, shape = units * dtype.block_bytes, (units * dtype.block,)
        else:  # a multiple of 8 elements fills whole bytes at any width
            nbytes, shape = units * dtype.bits, (units * 8,)
        tensors.append(TensorInfo(f"t{index}", dtype.name, shape, nbytes, "f", (0, nbytes)))
    return tensors


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None)
@given(tensor_lists())
def test_totals_in_columns_are_the_totals_tensor_by_tensor(tensors: list[TensorInfo]) -> None:
    """Bytes by dtype (in order of first appearance) and the parameter count, over mixed
    dtypes, sub-byte and block-quantized ones included, are the sums tensor by tensor."""
    by_dtype: dict[str, int] = {}
    for tensor in tensors:
        by_dtype[tensor.dtype] = by_dtype.get(tensor.dtype, 0) + tensor.nbytes
    if tensors:
        assert list(bytes_by_dtype(tensors).items()) == list(by_dtype.items())
    assert parameter_count(tensors) == sum(tensor.numel for tensor in tensors)


@pytest.mark.slow
@settings(max_examples=EXAMPLES * 3, deadline=None)
@given(st.lists(st.integers(0, 10**25), min_size=1, max_size=20), st.booleans())
def test_digits_counted_by_bisection_are_the_digits(numbers: list[int], ordered: bool) -> None:
    """The decimal digits of growing offsets (and, unordered, counted one by one)."""
    numbers = sorted(numbers) if ordered else numbers
    assert _digits(numbers) == sum(len(str(number)) for number in numbers)


def _tensor(name: str, offset: int) -> TensorInfo:
    return TensorInfo(name, "U8", (1,), 1, "f", (offset, offset + 1))


def _cases() -> dict[str, tuple[list[TensorInfo], Selection, list[tuple[str, ...]]]]:
    """(declared, selection, the names each shard lists) for plans the shortcut takes and
    plans it must leave to the check by name."""
    declared = [_tensor(name, offset) for offset, name in enumerate("abcdef")]
    same = Selection(OutTensor.unchanged(declared))
    twice = [*declared, _tensor("a", 9)]
    other = list(same.tensors)
    other[2] = OutTensor("c", _tensor("c", 7), "U8")
    names = tuple("abcdef")
    return {
        "each itself": (declared, same, [names[:4], names[4:]]),
        "one shard": (declared, same, [names]),
        "a name in no shard": (declared, same, [names[:3], names[4:]]),
        "a name in two shards": (declared, same, [names[:4], names[3:]]),
        "shards out of order": (declared, same, [names[4:], names[:4]]),
        "a name declared twice": (twice, Selection(OutTensor.unchanged(twice)), [names]),
        "another tensor": (declared, Selection(tuple(other)), [names]),
        "one left out": (declared, Selection(same.tensors[1:]), [names[1:]]),
        "renamed": (
            declared,
            replace(same, renamed={"a": "z"}),
            [("z", *names[1:])],
        ),
    }


@pytest.mark.parametrize("case", list(_cases()))
def test_a_plan_writing_each_tensor_itself_is_checked_alike(
    case: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """missing_name's shortcut (a plan writing each declared tensor itself, under its own
    name, in order) answers as the check by name does, for plans it takes and plans it
    leaves: a name missing or in two shards, shards out of order, a name declared twice,
    another tensor under a name, a tensor left out, a rename."""
    declared, selection, listed = _cases()[case]
    plan = plan_shards([(name, 1) for name in "abcdef"], 10)
    planned = tuple(PlannedShard(f"s{i}", names, len(names)) for i, names in enumerate(listed))
    plan = replace(plan, shards=planned, renamed=dict(selection.renamed))
    taken = coverage._each_itself(declared, selection, plan)
    fast = missing_name(declared, selection, plan)
    monkeypatch.setattr(coverage, "_each_itself", lambda *_: False)
    assert fast == missing_name(declared, selection, plan)
    kept = ("each itself", "one shard", "shards out of order", "a name in two shards")
    assert (fast is None) == (case in kept)
    assert taken == (case in kept)
