"""The shard planner, with plain integers."""

from __future__ import annotations

import itertools

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptfix.plan.shards import output_name, pack, plan_shards


def names(groups: list[list[tuple[str, int]]]) -> list[list[str]]:
    return [[name for name, _ in group] for group in groups]


def test_greedy_packing_keeps_order() -> None:
    sizes = [("a", 4), ("b", 4), ("c", 4), ("d", 1)]
    assert names(pack(sizes, 8)) == [["a", "b"], ["c", "d"]]


def test_oversized_tensor_gets_its_own_shard_in_place() -> None:
    sizes = [("a", 3), ("big", 20), ("b", 3), ("c", 3)]
    assert names(pack(sizes, 8)) == [["a"], ["big"], ["b", "c"]]


def test_oversized_first_and_last_never_make_empty_shards() -> None:
    assert names(pack([("big", 20), ("a", 1)], 8)) == [["big"], ["a"]]
    assert names(pack([("a", 1), ("big", 20)], 8)) == [["a"], ["big"]]
    assert names(pack([("x", 9), ("y", 9)], 8)) == [["x"], ["y"]]


def test_exact_fit_and_zero_size() -> None:
    assert names(pack([("a", 8), ("z", 0), ("b", 1)], 8)) == [["a", "z"], ["b"]]


def test_no_tensors_gives_one_empty_file() -> None:
    plan = plan_shards([], 10)
    assert [shard.file for shard in plan.shards] == ["model.safetensors"]
    assert plan.index_file is None


def test_names_and_index() -> None:
    plan = plan_shards([("a", 5), ("b", 5), ("c", 5)], 10)
    assert [shard.file for shard in plan.shards] == [
        "model-00001-of-00002.safetensors",
        "model-00002-of-00002.safetensors",
    ]
    assert plan.index_file == "model.safetensors.index.json"
    assert plan.weight_map == {
        "a": "model-00001-of-00002.safetensors",
        "b": "model-00001-of-00002.safetensors",
        "c": "model-00002-of-00002.safetensors",
    }
    assert plan.total_size == 15
    one = plan_shards([("a", 5)], 10, output_name("model", None, "bin"))
    assert [shard.file for shard in one.shards] == ["pytorch_model.bin"]


def test_family_names_are_kept() -> None:
    """The stem and variant of the input family, as transformers and diffusers name them."""
    two = [("a", 5), ("b", 5)]
    plan = plan_shards(two, 5, output_name("diffusion_pytorch_model", "fp16", "safetensors"))
    assert [shard.file for shard in plan.shards] == [
        "diffusion_pytorch_model.fp16-00001-of-00002.safetensors",
        "diffusion_pytorch_model.fp16-00002-of-00002.safetensors",
    ]
    assert plan.index_file == "diffusion_pytorch_model.safetensors.index.fp16.json"
    assert plan_shards(two, 10, output_name("model", "fp16", "bin")).shards[0].file == (
        "pytorch_model.fp16.bin"
    )
    assert plan_shards(two, 10, output_name("pytorch_model", None, "safetensors")).shards[
        0
    ].file == ("model.safetensors")
    adapter = plan_shards(two, 10, output_name("adapter_model", None, "bin"))
    assert adapter.shards[0].file == "adapter_model.bin"


@pytest.mark.slow
@given(st.lists(st.integers(0, 100), max_size=40), st.integers(1, 60))
def test_packing_properties(sizes: list[int], limit: int) -> None:
    named = [(f"t{i}", size) for i, size in enumerate(sizes)]
    groups = pack(named, limit)
    flat = [item for group in groups for item in group]
    assert flat == named  # order kept, nothing lost or duplicated
    assert all(group for group in groups) or groups == [[]]
    for group in groups:
        total = sum(size for _, size in group)
        assert total <= limit or len(group) == 1  # only a lone oversized tensor exceeds it
    for first, second in itertools.pairwise(groups):
        # Greedy: the next shard's first tensor did not fit in the previous shard.
        first_size = sum(size for _, size in first)
        assert first_size + second[0][1] > limit or first_size > limit or second[0][1] > limit
