"""Files that safetensors itself writes inspect clean, and we agree with safe_open exactly."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import ckptfix
from ckptfix.formats.safetensors import read_header
from tests.builders import SAFETENSORS_TORCH_DTYPES, every_dtype_state, random_tensor
from tests.helpers import torch_bytes

# Every test here runs safetensors' own writer and reader against ours.
pytestmark = pytest.mark.slow


def _safe_open_view(path: Path) -> tuple[dict[str, tuple[str, list[int]]], dict[str, str] | None]:
    with safe_open(str(path), "pt") as handle:
        found = {}
        keys = handle.keys()  # a safe_open handle, not a dict: it cannot be iterated
        for key in keys:
            piece = handle.get_slice(key)
            found[key] = (piece.get_dtype(), list(piece.get_shape()))
        return found, handle.metadata()


def test_every_dtype_written_by_safetensors_is_clean(tmp_path: Path) -> None:
    from safetensors.torch import save_file

    tensors = every_dtype_state((3, 5), scalar_seed=100, empty=(0, 4))
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
    from safetensors.torch import save_file

    tensors = {
        f"t{i}": random_tensor(dtype, (i + 1, 3), i, any_bool_bytes=True)
        for i, dtype in enumerate(SAFETENSORS_TORCH_DTYPES)
    }
    path = tmp_path / "ranges.safetensors"
    save_file(tensors, str(path))
    data = path.read_bytes()
    for info in read_header(path).tensors:
        begin, end = info.byte_range
        assert data[begin:end] == torch_bytes(tensors[info.name])


def test_no_metadata_file_only_warns_about_format(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

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
    st.tuples(st.sampled_from(sorted(SAFETENSORS_TORCH_DTYPES)), shapes),
    max_size=8,
)


@settings(max_examples=60, deadline=None)
@given(state_dicts, st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3))
def test_reader_agrees_with_safe_open(
    tmp_path_factory: pytest.TempPathFactory,
    spec: dict[str, tuple[str, tuple[int, ...]]],
    metadata: dict[str, str],
) -> None:
    from safetensors.torch import save_file

    tensors = {
        name: random_tensor(dtype, shape, i, any_bool_bytes=True)
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
        assert data[begin:end] == torch_bytes(tensors[info.name])


def test_header_json_as_written_by_safetensors(tmp_path: Path) -> None:
    """Pin the layout we parse: the reference writer's padding is accepted as-is."""
    import torch
    from safetensors.torch import save_file

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
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "meta.safetensors"
    save_file({"__metadata__": torch.zeros(2), "w": torch.ones(2)}, str(path))
    report = ckptfix.inspect(path)
    assert [item.code for item in report.findings] == ["corrupt-file"]
    assert "(rule metadata-as-tensor;" in report.findings[0].message
