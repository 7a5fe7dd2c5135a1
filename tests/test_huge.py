"""Tensors past 2^31 elements, built as sparse files, are counted exactly."""

from __future__ import annotations

import pytest

import ckptfix
from tests.builders import Factory
from tests.helpers import cli

# Sparse files of 2 GiB and more: cheap on most file systems, not on all.
pytestmark = pytest.mark.slow


def test_more_than_2_31_elements_counted_exactly(factory: Factory) -> None:
    numel = 2**31 + 8
    path = factory.sparse_safetensors("huge.safetensors", "U8", (numel,))
    report = ckptfix.inspect(path)
    assert report.tensor_count == 1
    assert report.parameter_count == numel
    assert report.total_bytes == numel
    assert [item.code for item in report.findings] == ["huge-numel"]
    assert f"with {numel} elements ({numel} bytes)" in report.findings[0].message


def test_huge_bytes_but_fewer_elements(factory: Factory) -> None:
    shape = (2**15, 2**14 + 1)  # 2^29 + 2^15 elements of 4 bytes: over 2^31 bytes
    path = factory.sparse_safetensors("bytes.safetensors", "F32", shape)
    document = cli("inspect", path, "--json", "--max-shard", "1GB").json()
    assert document["parameter_count"] == shape[0] * shape[1]
    assert document["total_bytes"] == shape[0] * shape[1] * 4
    assert sorted(item["code"] for item in document["findings"]) == [
        "huge-numel",
        "oversized-tensor",
    ]


def test_just_below_the_limit_is_not_flagged(factory: Factory) -> None:
    path = factory.sparse_safetensors("below.safetensors", "U8", (2**31 - 1,))
    assert ckptfix.inspect(path).findings == ()


def test_sub_byte_dtype_sizes(factory: Factory) -> None:
    path = factory.sparse_safetensors("f4.safetensors", "F4", (2**32,))
    report = ckptfix.inspect(path)
    assert report.parameter_count == 2**32
    assert report.total_bytes == 2**31
