"""The safetensors header encoder: what json.dumps writes (compact, UTF-8), written by orjson
a batch of entries at a time, and its size counted without writing it."""

from __future__ import annotations

import json
import struct
from bisect import bisect_left
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from itertools import islice
from operator import itemgetter, le
from typing import Any

import orjson

METADATA_KEY = "__metadata__"


@dataclass(frozen=True)
class HeaderEntry:
    """What the encoder needs of a tensor: offsets are relative to the data section."""

    name: str
    dtype: str
    shape: Sequence[int]
    begin: int
    end: int


def encode_header(entries: Iterable[HeaderEntry], metadata: Mapping[str, str] | None) -> bytes:
    """The 8-byte length plus the JSON header, space-padded so data starts 8-byte aligned."""
    fields = [(entry.name, entry.dtype, entry.shape, entry.begin, entry.end) for entry in entries]
    return encode_fields(fields, metadata)


# A header entry as a plain tuple (name, dtype, shape, begin, end), which the writer makes by
# the million: a HeaderEntry costs several times as much to build.
Fields = tuple[str, str, Sequence[int], int, int]
_BATCH = 4096  # entries encoded at a time
# An entry's bytes besides its name's quotes and content, dtype, dims and the two offsets'
# digits: `:{"dtype":"","shape":[],"data_offsets":[,]}` and the comma before the next.
_ENTRY_FRAME = len(b':{"dtype":"","shape":[],"data_offsets":[,]},')


def encode_fields(entries: Sequence[Fields], metadata: Mapping[str, str] | None) -> bytes:
    """`encode_header` of tuples. The JSON is the compact form json.dumps writes with
    ensure_ascii=False (orjson writes the same bytes, faster), made a batch of entries at a
    time, so that a header of 1,000,000 tensors is never a dict of 1,000,000 dicts."""
    head = {METADATA_KEY: dict(metadata)} if metadata else {}
    names = [*head, *map(itemgetter(0), entries)]
    if len(set(names)) < len(names):  # a name twice: one dict, where the last value wins
        whole = head | {name: _entry(dtype, shape, b, e) for name, dtype, shape, b, e in entries}
        return _framed(_json(whole))
    parts = [_json(head)[1:-1]] if head else []
    for start in range(0, len(entries), _BATCH):
        batch = entries[start : start + _BATCH]
        parts.append(
            _json({name: _entry(dtype, shape, b, e) for name, dtype, shape, b, e in batch})[1:-1]
        )
    return _framed(b"{" + b",".join(parts) + b"}")


def header_size(
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    offsets: Sequence[int],
    metadata: Mapping[str, str] | None,
) -> int:
    """`len(encode_fields(...))` without encoding: the entries as columns (tensor i spans
    offsets[i] to offsets[i + 1]), counted a column at a time. What a plan checks against
    the format's limit before anything is written, for 1,000,000 tensors in a second."""
    if len(set(names)) < len(names) or (metadata and METADATA_KEY in names):
        fields = zip(names, dtypes, shapes, offsets, offsets[1:], strict=False)
        return len(encode_fields(list(fields), metadata))  # a name twice: as encoded
    items = [len(_json({METADATA_KEY: dict(metadata)})) - 2] if metadata else []
    if names:
        items.append(_entries_size(names, dtypes, shapes, offsets))
    body = 2 + sum(items) + max(len(items) - 1, 0)  # braces, and a comma between
    return 8 + body + (-body % 8)


def _entries_size(
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[tuple[int, ...]],
    offsets: Sequence[int],
) -> int:
    """The bytes of the entries, joined by commas (see header_size)."""
    joined = "".join(names)
    if joined.isascii() and joined.isprintable() and '"' not in joined and "\\" not in joined:
        quoted = len(joined) + 2 * len(names)  # nothing to escape: each name in quotes
    else:
        quoted = sum(len(_json_text(name)) for name in names)
    dims = {shape: len(",".join(map(str, shape))) for shape in set(shapes)}
    return (
        quoted
        + sum(map(len, dtypes))
        + sum(map(dims.__getitem__, shapes))
        + 2 * _digits(offsets)  # every offset ends one entry and begins the next
        - len(str(offsets[0]))
        - len(str(offsets[-1]))
        + _ENTRY_FRAME * len(names)
        - 1
    )


def _digits(numbers: Sequence[int]) -> int:
    """The decimal digits of `numbers` together. Offsets only grow: each power of ten then
    adds a digit to the numbers from the first one that reaches it, found by bisection
    (twenty steps for 1,000,000 numbers, not a string for each)."""
    rising = numbers[0] >= 0 and all(map(le, numbers, islice(numbers, 1, None)))
    if not rising:
        return sum(map(len, map(str, numbers)))
    total, power = len(numbers), 10
    while numbers[-1] >= power:
        total += len(numbers) - bisect_left(numbers, power)
        power *= 10
    return total


def _json_text(value: str) -> bytes:
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:
        return json.dumps(value, ensure_ascii=False).encode("utf-8")


def _entry(dtype: str, shape: Sequence[int], begin: int, end: int) -> dict[str, Any]:
    return {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}


def _json(value: dict[str, Any]) -> bytes:
    try:
        return orjson.dumps(value)
    except orjson.JSONEncodeError:  # a lone surrogate, an integer past 64 bits: json decides
        return json.dumps(value, separators=(",", ":"), ensure_ascii=False).encode("utf-8")


def _framed(body: bytes) -> bytes:
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body
