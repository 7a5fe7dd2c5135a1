"""Files that safetensors itself writes inspect clean, and we agree with safe_open exactly."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open
from safetensors.torch import save_file

import ckptfix
from ckptfix.formats.safetensors import read_header

TORCH_DTYPES = {
    "BOOL": torch.bool,
    "U8": torch.uint8,
    "I8": torch.int8,
    "I16": torch.int16,
    "U16": torch.uint16,
    "I32": torch.int32,
    "U32": torch.uint32,
    "I64": torch.int64,
    "U64": torch.uint64,
    "F16": torch.float16,
    "BF16": torch.bfloat16,
    "F32": torch.float32,
    "F64": torch.float64,
    "C64": torch.complex64,
    "F8_E5M2": torch.float8_e5m2,
    "F8_E4M3": torch.float8_e4m3fn,
    "F8_E4M3FNUZ": torch.float8_e4m3fnuz,
    "F8_E5M2FNUZ": torch.float8_e5m2fnuz,
    "F8_E8M0": torch.float8_e8m0fnu,
}


def _make(dtype: torch.dtype, shape: tuple[int, ...], seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    count = int(np.prod(shape, dtype=np.int64)) if shape else 1
    raw = torch.randint(
        0,
        256,
        (count * torch.empty((), dtype=dtype).element_size(),),
        generator=generator,
        dtype=torch.uint8,
    )
    return raw.view(dtype).reshape(shape)


def _safe_open_view(path: Path) -> tuple[dict[str, tuple[str, list[int]]], dict[str, str] | None]:
    with safe_open(str(path), "pt") as handle:
        found = {}
        keys = handle.keys()  # a safe_open handle, not a dict: it cannot be iterated
        for key in keys:
            piece = handle.get_slice(key)
            found[key] = (piece.get_dtype(), list(piece.get_shape()))
        return found, handle.metadata()


def test_every_dtype_written_by_safetensors_is_clean(tmp_path: Path) -> None:
    tensors = {}
    for index, (name, dtype) in enumerate(sorted(TORCH_DTYPES.items())):
        tensors[f"{name}.matrix"] = _make(dtype, (3, 5), index)
        tensors[f"{name}.scalar"] = _make(dtype, (), index + 100)
        tensors[f"{name}.empty"] = torch.empty((0, 4), dtype=dtype)
    path = tmp_path / "all.safetensors"
    save_file(tensors, str(path), metadata={"format": "pt"})
    report = ckptfix.inspect(path)
    # Several float dtypes in one file is worth an info note; nothing else may be reported.
    assert [item.code for item in report.findings] == ["dtype-mix"]
    expected, metadata = _safe_open_view(path)
    ours = {tensor.name: (tensor.dtype, list(tensor.shape)) for tensor in report.tensors}
    assert ours == expected
    assert read_header(path).metadata == metadata
    assert report.tensor_count == len(tensors)
    assert report.parameter_count == sum(tensor.numel() for tensor in tensors.values())
    assert report.total_bytes == sum(t.numel() * t.element_size() for t in tensors.values())


def test_byte_ranges_hold_the_tensor_bytes(tmp_path: Path) -> None:
    tensors = {
        f"t{i}": _make(dtype, (i + 1, 3), i) for i, dtype in enumerate(TORCH_DTYPES.values())
    }
    path = tmp_path / "ranges.safetensors"
    save_file(tensors, str(path))
    data = path.read_bytes()
    for info in read_header(path).tensors:
        begin, end = info.byte_range
        expected = tensors[info.name].contiguous().view(torch.uint8).reshape(-1).numpy().tobytes()
        assert data[begin:end] == expected


def test_no_metadata_file_only_warns_about_format(tmp_path: Path) -> None:
    path = tmp_path / "plain.safetensors"
    save_file({"w": torch.ones(2, 2)}, str(path))
    report = ckptfix.inspect(path)
    assert [item.code for item in report.findings] == ["missing-format-metadata"]
    assert report.exit_code() == 0


shapes = st.lists(st.integers(0, 5), min_size=0, max_size=3).map(tuple)
# "__metadata__" as a tensor name is refused on purpose (see test_tensor_named_metadata).
names = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), min_size=1, max_size=12)
state_dicts = st.dictionaries(
    names.filter(lambda name: name != "__metadata__"),
    st.tuples(st.sampled_from(sorted(TORCH_DTYPES)), shapes),
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(state_dicts, st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
def test_reader_agrees_with_safe_open(
    tmp_path_factory: pytest.TempPathFactory,
    spec: dict[str, tuple[str, tuple[int, ...]]],
    metadata: dict[str, str],
) -> None:
    tensors = {
        name: _make(TORCH_DTYPES[dtype], shape, i)
        for i, (name, (dtype, shape)) in enumerate(spec.items())
    }
    path = tmp_path_factory.mktemp("prop") / "x.safetensors"
    save_file(tensors, str(path), metadata=metadata or None)
    header = read_header(path)
    expected, expected_meta = _safe_open_view(path)
    assert {t.name: (t.dtype, list(t.shape)) for t in header.tensors} == expected
    assert header.metadata == expected_meta
    data = path.read_bytes()
    for info in header.tensors:
        begin, end = info.byte_range
        raw = tensors[info.name].contiguous().reshape(-1).view(torch.uint8).numpy().tobytes()
        assert data[begin:end] == raw


def test_header_json_as_written_by_safetensors(tmp_path: Path) -> None:
    """Pin the layout we parse: the reference writer's padding is accepted as-is."""
    path = tmp_path / "pad.safetensors"
    save_file({"a": torch.zeros(3, dtype=torch.uint8)}, str(path), metadata={"format": "pt"})
    raw = path.read_bytes()
    length = int.from_bytes(raw[:8], "little")
    assert (8 + length) % 8 == 0
    assert json.loads(raw[8 : 8 + length]) == {
        "__metadata__": {"format": "pt"},
        "a": {"dtype": "U8", "shape": [3], "data_offsets": [0, 3]},
    }
    assert read_header(path).tensors[0].byte_range == (8 + length, 8 + length + 3)


def test_tensor_named_metadata_is_refused(tmp_path: Path) -> None:
    """safetensors writes it, and its own reader then takes the tensor for the metadata."""
    path = tmp_path / "meta.safetensors"
    save_file({"__metadata__": torch.zeros(2), "w": torch.ones(2)}, str(path))
    report = ckptfix.inspect(path)
    assert [item.code for item in report.findings] == ["corrupt-file"]
    assert "(rule metadata-as-tensor;" in report.findings[0].message
