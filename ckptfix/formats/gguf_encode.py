"""What the GGUF writer writes, as bytes: a part's header (prefix, metadata key/values,
tensor infos) in llama.cpp's split layout; and the metadata decoded in full, as the JSON a
conversion to safetensors keeps.

Metadata is carried as it is stored: each key/value record of the source is copied byte for
byte (its span), except the keys a split set's layout owns (`split.*`), which are written
anew, and `ckptfix.padding`, the string key ckptfix adds only to move a part's data to where
it can share the source's blocks (write.gguf), never carried over.
"""

from __future__ import annotations

import json
import math
import struct
from collections.abc import Sequence
from dataclasses import dataclass

from ckptfix.core.errors import PlanError
from ckptfix.formats.gguf_file import ALIGNMENT_KEY, GGML_IDS, SPLIT_KEYS, GgufFile
from ckptfix.formats.gguf_header import (
    ARRAY,
    BOOL,
    STRING,
    VALUE_IDS,
    VALUE_TYPES,
    Cursor,
    GgufKey,
)
from ckptfix.formats.sniff import GGUF_MAGIC as MAGIC
from ckptfix.io.source import ByteSource

PADDING_KEY = "ckptfix.padding"
NOT_CARRIED = (*SPLIT_KEYS, PADDING_KEY)


def encode_string(text: str) -> bytes:
    raw = text.encode("utf-8")
    return struct.pack("<Q", len(raw)) + raw


def encode_key(key: str, value_type: str, value: int | str) -> bytes:
    """One scalar key/value record (the split keys, the alignment, the padding)."""
    type_id = VALUE_IDS[value_type]
    head = encode_string(key) + struct.pack("<I", type_id)
    if type_id == STRING:
        return head + encode_string(str(value))
    return head + struct.pack(VALUE_TYPES[type_id][1], value)


def padding_key(size: int) -> bytes:
    """A `ckptfix.padding` record of exactly `size` bytes (at least padding_overhead())."""
    spaces = size - padding_overhead()
    assert spaces >= 0
    return encode_key(PADDING_KEY, "STRING", " " * spaces)


def padding_overhead() -> int:
    return len(encode_key(PADDING_KEY, "STRING", ""))


def split_keys(number: int, count: int, tensors: int) -> list[bytes]:
    """llama.cpp's split keys, with the types `gguf-split` writes (u16, u16, i32)."""
    return [
        encode_key("split.no", "UINT16", number),
        encode_key("split.count", "UINT16", count),
        encode_key("split.tensors.count", "INT32", tensors),
    ]


def tensor_info(name: str, shape: Sequence[int], dtype: str, offset: int) -> bytes:
    """A tensor info: ggml's dims are the row-major shape reversed."""
    dims = tuple(reversed(tuple(shape)))
    return (
        encode_string(name)
        + struct.pack(f"<I{len(dims)}Q", len(dims), *dims)
        + struct.pack("<IQ", GGML_IDS[dtype], offset)
    )


@dataclass(frozen=True)
class PartHeader:
    """The bytes of a part's header, up to the end of its tensor infos."""

    version: int
    keys: Sequence[bytes]  # every key/value record, in order
    infos: Sequence[bytes]

    def pieces(self) -> list[bytes]:
        """The header as the pieces it is made of, in order (never joined: the metadata
        of a large vocabulary is megabytes)."""
        prefix = MAGIC + struct.pack("<IQQ", self.version, len(self.infos), len(self.keys))
        return [prefix, *self.keys, *self.infos]

    def encode(self) -> bytes:
        return b"".join(self.pieces())

    @property
    def size(self) -> int:
        return 24 + sum(map(len, self.keys)) + sum(map(len, self.infos))


def carried_spans(head: GgufFile) -> list[tuple[int, int]]:
    """The spans of the source's key/value records a rewrite carries."""
    return [key.span for key in head.keys if key.key not in NOT_CARRIED]


def carried_keys(head: GgufFile, source: ByteSource) -> list[bytes]:
    """The source's key/value records a rewrite carries, read as stored."""
    return [source.read_at(begin, end - begin) for begin, end in carried_spans(head)]


def alignment_key(alignment: int) -> bytes:
    return encode_key(ALIGNMENT_KEY, "UINT32", alignment)


# --- the metadata as JSON (convert to safetensors) ---------------------------------------

# The shortest JSON of one array item with its comma: `0,`, `0.0,`, `true,`, and for a
# string its two quotes, escaped again in the safetensors header (`\"\",`).
_SHORTEST = {"FLOAT32": 4, "FLOAT64": 4, "BOOL": 5, "STRING": 5}
_CHUNK = 4096  # array items decoded and encoded at a time


def _dumps(value: object) -> str:
    return json.dumps(value, ensure_ascii=False, separators=(",", ":"))


def _json_value(value: object) -> object:
    """A float that JSON cannot hold (NaN, ±Infinity) as the string Python writes for it."""
    if isinstance(value, float) and not math.isfinite(value):
        return str(value)
    return value


def _decode_value(cursor: Cursor, type_id: int) -> object:
    if type_id == STRING:
        length = cursor.length(cursor.remaining())
        return cursor.take(length).decode("utf-8", "backslashreplace")
    _, fmt, size = VALUE_TYPES[type_id]
    value = cursor.unpack(fmt, size)
    return bool(value) if type_id == BOOL else _json_value(value)


def _floor(key: GgufKey) -> int:
    """The fewest bytes a key/value's JSON takes in a safetensors header, from its span and
    type alone (nothing read): every string byte at least one, every item its shortest."""
    payload = key.span[1] - key.span[0] - 8 - len(key.key.encode("utf-8")) - 4
    if key.type == "STRING":
        return payload - 8 + _SHORTEST["STRING"] - 1
    if key.type != "ARRAY" or key.item_type is None or not key.count:
        return 1
    items = _SHORTEST.get(key.item_type, 2) * key.count - 1  # the last without its comma
    if key.item_type == "STRING":  # and the strings' bytes
        return payload - 12 - 8 * key.count + items
    return items


class JsonBudget:
    """The JSON document, piece by piece, refused (PlanError) as soon as it would take more
    than `limit` bytes as the string a safetensors header holds it in (where each `"` and
    `\\` of it is escaped once more)."""

    def __init__(self, label: str, limit: int) -> None:
        self.label, self.limit = label, limit
        self.pieces: list[str] = []
        self.size = 0

    def check(self, size: int) -> None:
        if size > self.limit:
            raise PlanError(
                self.label,
                f"its metadata would take at least {size:,} bytes as the JSON a safetensors "
                f"header keeps, over that format's {self.limit:,}-byte header limit",
                "keep the model as GGUF, or re-download it: no model's metadata is this large",
                rule="header-too-large",
            )

    def add(self, text: str) -> None:
        self.pieces.append(text)
        self.size += len(text.encode("utf-8")) + text.count('"') + text.count("\\")
        self.check(self.size)


def metadata_json(head: GgufFile, source: ByteSource, limit: int) -> str:
    """Every carried key/value of a GGUF file decoded in full, as one JSON document:
    `{"version": 3, "metadata": {key: {"type", "value"} or {"type": "ARRAY", "items",
    "value"}}}` (non-finite floats as strings, strings that are not UTF-8 with backslash
    escapes). Refused before anything is read when the spans alone say it cannot fit in
    `limit` bytes of a safetensors header, else as soon as it grows past them; arrays are
    decoded a chunk at a time, so no key's values are ever all held as objects."""
    carried = [key for key in head.keys if key.key not in NOT_CARRIED]
    budget = JsonBudget(head.label, limit)
    budget.check(sum(map(_floor, carried)))
    budget.add(f'{{"version":{head.version},"metadata":{{')
    for number, key in enumerate(carried):
        budget.add(("," if number else "") + _dumps(key.key) + ":")
        cursor = Cursor(source, key.span[0])
        cursor.skip(8 + len(key.key.encode("utf-8")))
        _value_json(cursor, key, budget)
    budget.add("}}")
    return "".join(budget.pieces)


def _value_json(cursor: Cursor, key: GgufKey, budget: JsonBudget) -> None:
    type_id = cursor.u32()
    if type_id != ARRAY:
        budget.add(_dumps({"type": key.type, "value": _decode_value(cursor, type_id)}))
        return
    item, count = cursor.u32(), cursor.u64()
    budget.add(f'{{"type":"ARRAY","items":{_dumps(VALUE_TYPES[item][0])},"value":[')
    separator = ""
    while count:
        values = _items(cursor, item, min(count, _CHUNK))
        count -= len(values)
        budget.add(separator + _dumps(values)[1:-1])
        separator = ","
    budget.add("]}")


def _items(cursor: Cursor, item: int, most: int) -> list[object]:
    """At least one and at most `most` items of an array, decoded."""
    if item == STRING:
        return list(cursor.strings(most))
    _, fmt, size = VALUE_TYPES[item]
    values = list(struct.unpack(f"<{most}{fmt[1]}", cursor.take(most * size)))
    if item == BOOL:
        return [bool(value) for value in values]
    return [_json_value(value) for value in values] if fmt[1] in "fd" else values
