"""Checkpoints of very many tensors (a mixture of experts: hundreds of experts × layers ×
matrices): the shortcuts that keep them fast give exactly what the plain code gives."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from typing import Any

from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfix.formats.safetensors import Fields, encode_fields, header_size

EXAMPLES = max(int(os.environ.get("CKPTFIX_FUZZ_EXAMPLES", "300")) // 3, 30)
# Names that need every kind of escape, and none: quotes, backslashes, control characters,
# DEL, non-ASCII, astral characters, the metadata key itself.
NAMES = st.one_of(
    st.text(alphabet="abc._0123", max_size=8),
    st.text(max_size=6),  # any character but a lone surrogate (hypothesis's default)
    st.sampled_from(["__metadata__", '"', "\\", "\n", "\x7f", "é", "😀"]),
)
SHAPES = st.lists(st.integers(0, 2**64 - 1), max_size=3).map(tuple)
METADATA = st.one_of(
    st.none(),
    st.just({}),
    st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
)


def _reference(entries: Sequence[Fields], metadata: Mapping[str, str] | None) -> bytes:
    """The encoder as it was written first: one dict, json.dumps."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    for name, dtype, shape, begin, end in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


@st.composite
def headers(draw: st.DrawFn) -> tuple[list[Fields], Mapping[str, str] | None]:
    names = draw(st.lists(NAMES, max_size=12))
    entries: list[Fields] = []
    offset = 0
    for name in names:
        size = draw(st.integers(0, 2**40))
        dtype = draw(st.sampled_from(["F32", "BF16", "U8", "F8_E4M3"]))
        entries.append((name, dtype, draw(SHAPES), offset, offset + size))
        offset += size
    return entries, draw(METADATA)


@settings(max_examples=EXAMPLES, deadline=None)
@given(headers())
def test_header_encoding_and_size_are_the_plain_encoders(
    header: tuple[list[Fields], Mapping[str, str] | None],
) -> None:
    """encode_fields (batched, orjson) writes the bytes json.dumps writes, and header_size
    counts them without encoding, whatever the names hold (repeated ones included)."""
    entries, metadata = header
    expected = _reference(entries, metadata)
    assert encode_fields(entries, metadata) == expected
    names = [entry[0] for entry in entries]
    offsets = [0, *(entry[4] for entry in entries)] if entries else [0]
    shapes = [tuple(entry[2]) for entry in entries]
    dtypes = [entry[1] for entry in entries]
    assert header_size(names, dtypes, shapes, offsets, metadata) == len(expected)


def test_a_header_of_many_batches_is_one_document() -> None:
    """More entries than one batch (and a repeat across batches, where the last value wins
    at the first place, as in one dict)."""
    entries: list[Fields] = [(f"t.{i}", "U8", (1,), i, i + 1) for i in range(10_000)]
    entries.append(("t.3", "F32", (2,), 7, 9))
    for subset in (entries[:-1], entries):
        assert encode_fields(subset, {"format": "pt"}) == _reference(subset, {"format": "pt"})
