"""--hash and --scan-values: reading tensor bytes, checked against torch as the oracle."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ckptfix
from ckptfix.checks.values import count_non_finite
from ckptfix.io.source import LocalFile
from tests.builders import Factory, Spec, torch_dtype

if TYPE_CHECKING:
    import torch

# The floating safetensors dtypes whose values torch can count NaN and Inf in.
FLOAT_DTYPES = ["F16", "BF16", "F32", "F64", "F8_E5M2", "F8_E4M3", "F8_E4M3FNUZ", "F8_E5M2FNUZ"]


def _oracle(tensor: torch.Tensor) -> tuple[int, int]:
    import torch

    wide = tensor.to(torch.float64) if tensor.dtype != torch.complex64 else tensor
    return int(torch.isnan(wide).sum()), int(torch.isinf(wide).sum())


@pytest.mark.parametrize("name", sorted(FLOAT_DTYPES))
def test_non_finite_counts_match_torch(factory: Factory, name: str) -> None:
    import torch
    from safetensors.torch import save_file

    dtype = torch_dtype(name)
    # Every bit pattern of the format (for 8 and 16 bits), so each NaN and Inf encoding is seen.
    width = torch.finfo(dtype).bits
    if width == 8:
        tensor = torch.arange(256, dtype=torch.int32).to(torch.uint8).view(dtype)
    elif width == 16:
        tensor = torch.arange(-(2**15), 2**15, dtype=torch.int32).to(torch.int16).view(dtype)
    else:
        tensor = torch.tensor(
            [1.0, float("nan"), float("inf"), -float("inf"), 0.0, -0.0, float("nan")], dtype=dtype
        )
    path = factory.path(f"{name}.safetensors")
    save_file({"t": tensor}, str(path))
    report = ckptfix.inspect(path)
    info = report.tensors[0]
    assert count_non_finite(LocalFile(str(path)), info) == _oracle(tensor)


def test_complex_non_finite(factory: Factory) -> None:
    import torch
    from safetensors.torch import save_file

    tensor = torch.tensor(
        [1 + 1j, complex(float("nan"), 0), complex(0, float("inf"))], dtype=torch.complex64
    )
    path = factory.path("c.safetensors")
    save_file({"c": tensor}, str(path))
    assert count_non_finite(LocalFile(str(path)), ckptfix.inspect(path).tensors[0]) == (1, 1)


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(
    st.lists(st.floats(allow_nan=True, allow_infinity=True, width=32), min_size=1, max_size=64),
    st.sampled_from(["F16", "BF16", "F32", "F8_E5M2", "F8_E4M3"]),
)
def test_non_finite_property(
    tmp_path_factory: pytest.TempPathFactory, floats: list[float], name: str
) -> None:
    import torch
    from safetensors.torch import save_file

    tensor = torch.tensor(floats, dtype=torch.float32).to(torch_dtype(name))
    path = tmp_path_factory.mktemp("nf") / "t.safetensors"
    save_file({"t": tensor}, str(path))
    assert count_non_finite(LocalFile(str(path)), ckptfix.inspect(path).tensors[0]) == _oracle(
        tensor
    )


def test_scan_values_finding(factory: Factory) -> None:
    import torch
    from safetensors.torch import save_file

    path = factory.path("m.safetensors")
    save_file(
        {"good": torch.ones(4), "bad": torch.tensor([1.0, float("nan"), float("inf")])},
        str(path),
        metadata={"format": "pt"},
    )
    assert ckptfix.inspect(path).findings == ()  # values are not read without the flag
    report = ckptfix.inspect(path, scan_values=True)
    assert [(item.code, item.tensors) for item in report.findings] == [("non-finite", ("bad",))]
    assert "holds 1 NaN and 1 Inf value(s) out of 3" in report.findings[0].message


def test_scan_values_large_tensor_spans_chunks(factory: Factory) -> None:
    import torch
    from safetensors.torch import save_file

    tensor = torch.zeros(5 * 2**20, dtype=torch.float32)  # 20 MiB: several read chunks
    tensor[0] = float("nan")
    tensor[-1] = float("-inf")
    tensor[3 * 2**20] = float("nan")
    path = factory.path("big.safetensors")
    save_file({"t": tensor}, str(path))
    assert count_non_finite(LocalFile(str(path)), ckptfix.inspect(path).tensors[0]) == (2, 1)


def test_hash_finds_duplicate_content(factory: Factory) -> None:
    same = bytes(range(24))
    path = factory.safetensors(
        "m.safetensors",
        [
            Spec("a", "F32", (2, 3), same),
            Spec("b", "F32", (2, 3), same),
            Spec("c", "F32", (2, 3)),  # same dtype/shape, other bytes
            Spec("d", "I32", (2, 3), same),  # same bytes, other dtype: not a duplicate
            Spec("e", "F32", (3, 2), same),  # same bytes, other shape: not a duplicate
            Spec("z1", "F32", (0,)),
            Spec("z2", "F32", (0,)),  # empty tensors are not duplicates
        ],
    )
    assert ckptfix.inspect(path).findings == ()
    report = ckptfix.inspect(path, hash_values=True)
    assert [(item.code, item.tensors) for item in report.findings] == [
        ("duplicate-content", ("a", "b"))
    ]
    assert "24 B stored more than once" in report.findings[0].message


def test_hash_across_shards(factory: Factory) -> None:
    same = bytes(range(16))
    folder = factory.sharded(
        "m", [[Spec("x", "BF16", (8,), same)], [Spec("y", "BF16", (8,), same)]]
    )
    report = ckptfix.inspect(folder, hash_values=True)
    assert [(item.code, item.tensors) for item in report.findings] == [
        ("duplicate-content", ("x", "y"))
    ]


def test_strided_views_are_hashed_and_scanned_by_content(tmp_path: Path) -> None:
    """A view's byte range is the storage span it reads; --hash and --scan-values must use
    its elements. Two views with equal spans but different strides are not duplicates."""
    import torch

    base = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    other = base.clone()
    other[0, 1] = float("nan")  # inside the span, outside the column view below
    path = tmp_path / "views.pt"
    torch.save({"col": base[:, 0], "other_col": other[:, 0]}, path)
    report = ckptfix.inspect(path, hash_values=True, scan_values=True)
    duplicates = [f.tensors for f in report.findings if f.code == "duplicate-content"]
    assert duplicates == [("col", "other_col")]  # equal elements, different spans
    assert not [f for f in report.findings if f.code == "non-finite"]
