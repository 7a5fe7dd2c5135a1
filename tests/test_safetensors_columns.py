"""The column reader of safetensors headers (formats/safetensors_columns.py): a header as the
writers write it is read a column at a time; anything else is left to the general reader,
and either way the result (or the error) is the general reader's."""

from __future__ import annotations

import math
import os
import struct
from contextlib import nullcontext
from dataclasses import replace
from pathlib import Path
from unittest import mock

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfix.core.errors import CorruptFileError
from ckptfix.core.tensor import TensorInfo
from ckptfix.formats import safetensors
from ckptfix.formats.safetensors import Fields, SafetensorsHeader, encode_fields, parse_header
from ckptfix.formats.safetensors_columns import read_columns

EXAMPLES = max(int(os.environ.get("CKPTFIX_FUZZ_EXAMPLES", "300")), 100)
# Names needing no escape, and names needing one (which the column reader leaves alone).
NAMES = st.one_of(
    st.text(alphabet="ab.0_", max_size=6),
    st.text(max_size=4),
    st.sampled_from(["__metadata__", '"', "\\", "\n", "\x7f", "é", "😀", '},"', ""]),
)
DTYPES = ["F32", "BF16", "U8", "F4", "F6_E2M3", "BOOL", "X9", "f32"]
BITS = {"F32": 32, "BF16": 16, "U8": 8, "F4": 4, "F6_E2M3": 6, "BOOL": 8, "X9": 8, "f32": 32}
DIMS = st.one_of(st.integers(0, 4), st.sampled_from([2**64 - 1, 2**64, 2**63]))
METADATA = st.one_of(
    st.none(),
    st.just({}),
    st.dictionaries(st.text(alphabet='ab"\\\n_', max_size=3), st.text(max_size=3), max_size=3),
    st.just({"dtype": "U8", "shape": "1", "data_offsets": "x"}),
)
# One byte added, removed or changed somewhere: whitespace, a leading zero, a quote, an escape,
# a brace, a control character, a byte that is no UTF-8.
BYTES = [b" ", b"\n", b"0", b"1", b",", b'"', b"\\", b"}", b"{", b"[", b"\x01", b"\xff", b":"]


@st.composite
def headers(draw: st.DrawFn) -> tuple[bytes, int]:
    """A header body (what follows the 8-byte length) and the size of the data after it."""
    entries: list[Fields] = []
    offset = 0
    for name in draw(st.lists(NAMES, max_size=8)):
        dtype = draw(st.sampled_from(DTYPES))
        shape = tuple(draw(st.lists(DIMS, max_size=3)))
        numel = 1
        for dim in shape:
            numel *= dim
        size = numel * BITS[dtype] // 8
        if size > 2**20 or draw(st.integers(0, 9)) == 0:
            size = draw(st.integers(0, 9))  # a size the shape does not need
        entries.append((name, dtype, shape, offset, offset + size))
        offset += size
    body = encode_fields(entries, draw(METADATA))[8:]
    mutation = draw(st.sampled_from(["none", "insert", "delete", "replace"]))
    if mutation != "none" and body:
        at = draw(st.integers(0, len(body) - 1))
        byte = draw(st.sampled_from(BYTES))
        keep = at + (mutation != "insert")
        body = body[:at] + (b"" if mutation == "delete" else byte) + body[keep:]
    return body, offset + draw(st.sampled_from([0, 0, 0, -1, 1]))


def _parsed(body: bytes, data_size: int, *, columns: bool) -> SafetensorsHeader | str:
    """parse_header's header, or its error; with the column reader or without it."""
    unused = mock.patch.object(safetensors, "read_columns", return_value=None)
    with nullcontext() if columns else unused:
        try:
            return parse_header(
                body, header_size=len(body), file_size=8 + len(body) + data_size, path="x"
            )
        except CorruptFileError as exc:
            return str(exc)


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None)
@given(headers())
def test_the_column_reader_reads_what_the_general_reader_reads(header: tuple[bytes, int]) -> None:
    """Whatever the header holds (names needing escapes, unknown dtypes, sizes that are not
    shape × dtype, dimensions past 64 bits, metadata of every kind, a byte added, removed or
    changed anywhere, data too short or too long), the header read, or the error, is the
    general reader's; and the column reader takes no header the general reader refuses."""
    body, data_size = header
    general = _parsed(body, data_size, columns=False)
    assert _parsed(body, data_size, columns=True) == general
    if isinstance(general, str):
        assert read_columns(body, 8 + len(body), data_size, "x") is None


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None)
@given(
    st.lists(st.text(alphabet="ab.0_é😀 ", max_size=5), unique=True, min_size=1, max_size=30),
    st.lists(st.sampled_from([(), (0,), (3,), (2, 5), (4, 1, 2)]), min_size=30, max_size=30),
    st.lists(st.sampled_from(["F32", "BF16", "U8", "BOOL", "F8_E4M3"]), min_size=30, max_size=30),
    st.one_of(st.none(), st.dictionaries(*[st.text(alphabet="ab é😀", max_size=3)] * 2)),
)
def test_a_header_as_the_writers_write_it_is_read_in_columns(
    names: list[str], shapes: list[tuple[int, ...]], dtypes: list[str], metadata: dict[str, str]
) -> None:
    """Every header the encoder writes for names needing no escape (any others, empty and
    non-ASCII included), known dtypes and right sizes is read by the column reader, exactly
    as the general reader reads it."""
    entries: list[Fields] = []
    offset = 0
    for name, shape, dtype in zip(names, shapes, dtypes, strict=False):
        size = math.prod(shape) * _WIDTH[dtype]
        entries.append((name, dtype, shape, offset, offset + size))
        offset += size
    body = encode_fields(entries, metadata)[8:]
    read = read_columns(body, 8 + len(body), offset, "x")
    assert read is not None
    metadata_read, empty, tensors = read
    header = SafetensorsHeader("x", len(body), 8 + len(body) + offset, metadata_read, (), empty)
    assert replace(header, tensors=tuple(tensors)) == _parsed(body, offset, columns=False)
    assert [tensor.name for tensor in read[2]] == names  # in the order of their bytes


_WIDTH = {"F32": 4, "BF16": 2, "U8": 1, "BOOL": 1, "F8_E4M3": 1}  # bytes per element


def test_a_file_saved_by_safetensors_is_read_in_columns(tmp_path: Path) -> None:
    """safetensors' own writer (torch): dtypes of every width, scalars, empty tensors."""
    import torch
    from safetensors.torch import save_file

    tensors = {
        "model.embed.weight": torch.ones(5, 3, dtype=torch.bfloat16),
        "model.scale": torch.tensor(2.0, dtype=torch.float64),
        "model.empty": torch.zeros(0, 4),
        "model.mask": torch.ones(3, dtype=torch.bool),
        "model.layers.0.w": torch.arange(6, dtype=torch.int32).reshape(2, 3),
    }
    path = tmp_path / "saved.safetensors"
    save_file(tensors, path, metadata={"format": "pt", "note": "a b"})
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    body = raw[8 : 8 + size]
    read = read_columns(body, 8 + size, len(raw) - 8 - size, "x")
    assert read is not None
    metadata, empty, found = read
    assert (metadata, empty) == ({"format": "pt", "note": "a b"}, 0)
    assert sorted(tensor.name for tensor in found) == sorted(tensors)
    assert all(isinstance(tensor, TensorInfo) for tensor in found)
    general = _parsed(body, len(raw) - 8 - size, columns=False)
    assert isinstance(general, SafetensorsHeader)
    assert tuple(found) == general.tensors


@pytest.mark.parametrize(
    ("header", "why"),
    [
        (
            b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"a":{"dtype":"U8","shape":[1],'
            b'"data_offsets":[1,2]}}',
            "a name twice",
        ),
        (b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[00,1]}}', "a leading zero"),
        (b'{"a":{"dtype":"U8","shape":[01],"data_offsets":[0,1]}}', "a leading zero"),
        (
            b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]} ,"b":{"dtype":"U8","shape":[1],'
            b'"data_offsets":[1,2]}}',
            "a space",
        ),
        (
            b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]}"b":{"dtype":"U8","shape":[1],'
            b'"data_offsets":[1,2]}}',
            "no comma",
        ),
        (
            b'{"b":{"dtype":"U8","shape":[1],"data_offsets":[1,2]},"a":{"dtype":"U8","shape":[1],'
            b'"data_offsets":[0,1]}}',
            "out of order",
        ),
        (
            b'{"a":{"dtype":"U8","shape":[1],"data_offsets":[0,1]},"__metadata__":{"format":"pt"}}',
            "metadata last",
        ),
    ],
)
def test_what_the_column_reader_leaves_to_the_general_reader(header: bytes, why: str) -> None:
    """Headers the writers do not write are left to the general reader, which refuses them
    or reads them (the last two, as it always has)."""
    assert read_columns(header, 8 + len(header), 2, "x") is None, why
    assert _parsed(header, 2, columns=True) == _parsed(header, 2, columns=False)
