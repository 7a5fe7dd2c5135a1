"""A safetensors header exactly as its writers write it, read a column at a time in C.

The reference writer (and ckptfix's) writes compact JSON: `__metadata__` first, then each
tensor as `"name":{"dtype":"F32","shape":[2,3],"data_offsets":[b,e]}`, in the order of its
bytes, each beginning where the one before ends. For such a header a regular expression
finds every entry's fields as strings, and every rule is checked over whole columns (names
once each, dtypes known, shapes and offsets within 64 bits, sizes equal to shape × dtype, the
data covered exactly): 1,000,000 tensors in about a second, where a parse into a dict per
entry and a check in Python per entry take three times as long.

Anything else (whitespace, escapes, a field out of place, a gap, a name twice) is left to the
general reader (`read_columns` returns None), which decides and names the rule. Nothing is
accepted here that the general reader refuses, and what is accepted is read as it reads it:
the entries tile the header's object exactly (their lengths add up to it), so the text is
nothing but those entries, which strict JSON parses to just those values.
"""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from itertools import pairwise, repeat
from operator import add, attrgetter, sub

from ckptfix.core.dtypes import SAFETENSORS_DTYPES
from ckptfix.core.tensor import TensorInfo

METADATA_KEY = "__metadata__"
_U64_MAX = 2**64 - 1
_TENSOR_FIELDS = {"dtype", "shape", "data_offsets"}
# A JSON string needing no escape (no quote, backslash or control character), and a JSON
# integer of at most 20 digits (no leading zero: JSON has none).
_TEXT = r'"([^"\\\x00-\x1f]*)"'
_UINT = r"(?:0|[1-9][0-9]{0,19})"
# An entry's fields as strings; its integers are checked apart (a regular expression
# that checks them takes half as long again).
_ENTRY = re.compile(
    _TEXT
    + r':\{"dtype":"([A-Z0-9_]+)","shape":\[([0-9,]*)\],"data_offsets":\[([0-9]+),([0-9]+)\]\}(,?)'
)
_SHAPE = re.compile(r"(?:" + _UINT + r"(?:," + _UINT + r")*)?")
# The bytes of an entry besides its five fields and its comma.
_FRAME = len('"":{"dtype":"","shape":[],"data_offsets":[,]}')
_PAIR = r'"[^"\\\x00-\x1f]*":"[^"\\\x00-\x1f]*"'
_METADATA = re.compile(r'\{"__metadata__":(\{(?:' + _PAIR + r"(?:," + _PAIR + r")*)?\})(,?)")
_CHUNK = 2**20  # the entries are read about this many characters at a time
# Each dtype's name as one shared string (not one per tensor).
_SHARED = {name: name for name in SAFETENSORS_DTYPES}
_NAME = attrgetter("name")

Read = tuple[dict[str, str] | None, int, list[TensorInfo]]  # metadata, empty names, tensors


class _Unusual(Exception):
    """Not a header as the writers write it: the general reader decides."""


def read_columns(raw: bytes, data_start: int, data_size: int, path: str) -> Read | None:
    """The metadata, the count of empty names and the tensors (in header order, which is
    their bytes' order) of a header as the writers write it, its tensors covering the
    `data_size` bytes of data exactly; None for any other header."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError:
        return None
    end = text.rfind("}")
    if end == -1 or text.count(" ", end + 1) != len(text) - end - 1:
        return None  # not an object followed by nothing but the padding
    entries = _Entries(data_start, path)
    try:
        metadata, start = _metadata(text, end)
        tensors = entries.read(text, start, end)
    except _Unusual:
        return None
    if not tensors or tensors[-1].byte_range[1] != data_start + data_size:
        return None  # data past the last tensor, or missing: the general reader says which
    return metadata, entries.empty, tensors


def _metadata(text: str, end: int) -> tuple[dict[str, str] | None, int]:
    """The metadata (when it comes first, as the writers put it) and where entries begin."""
    found = _METADATA.match(text, 0, end + 1)
    if found is None:
        if text.startswith('{"__metadata__"') or text[:1] != "{":
            raise _Unusual  # metadata of another kind: the general reader decides
        return None, 1
    pairs = found.group(1)
    metadata = json.loads(pairs)
    if len(metadata) != pairs.count('":"') or set(metadata) >= _TENSOR_FIELDS:
        raise _Unusual  # a key twice, or a tensor's fields in the metadata: refused there
    if not found.group(2) and found.end() != end:
        raise _Unusual
    return metadata, found.end()


class _Entries:
    """The entries of a header, read a chunk at a time (see read_columns)."""

    def __init__(self, data_start: int, path: str) -> None:
        self.data_start, self.path = data_start, path
        self.shapes: dict[str, tuple[int, ...]] = {"": ()}
        self.last = "0"  # where the data of the entries read so far ends, as written
        self.empty = 0  # names that are empty (one at most)

    def read(self, text: str, start: int, end: int) -> list[TensorInfo]:
        """The tensors of the entries from `start` to `end` (the object's closing brace)."""
        tensors: list[TensorInfo] = []
        position = start
        while position < end:
            cut = text.find('},"', position + _CHUNK, end)
            stop = end if cut == -1 else cut + 2  # just past the comma
            tensors += self._chunk(text, position, stop, final=stop == end)
            position = stop
        names = set(map(_NAME, tensors))
        if len(names) != len(tensors) or METADATA_KEY in names:
            raise _Unusual  # a name twice (refused there), or the metadata's
        self.empty = 1 if "" in names else 0
        return tensors

    def _chunk(self, text: str, start: int, stop: int, *, final: bool) -> list[TensorInfo]:
        found = _ENTRY.findall(text, start, stop)
        if not found:
            raise _Unusual
        names, dtypes, shapes, begins, ends, commas = zip(*found, strict=True)
        del found
        count = len(names)
        separators = count - 1 if final else count
        lengths = sum(len("".join(column)) for column in (names, dtypes, shapes, begins, ends))
        if (
            commas.count(",") != separators
            or (final and commas[-1])
            or lengths + separators + _FRAME * count != stop - start
        ):
            raise _Unusual  # something between or around the entries
        if (
            begins[0] != self.last
            or begins[1:] != ends[:-1]
            or sum(map(str.startswith, ends, repeat("0"))) != ends.count("0")
            or max(map(len, ends)) > 20
        ):
            raise _Unusual  # not each where the last ends, or a number JSON writes otherwise
        first, self.last = int(self.last), ends[-1]
        at = list(map(add, repeat(self.data_start), [first, *map(int, ends)]))
        sizes = list(map(sub, at[1:], at))
        if at[-1] - self.data_start > _U64_MAX or self._sizes(dtypes, shapes) != sizes:
            raise _Unusual  # a size that is not shape × dtype (or past 64 bits)
        return list(
            map(
                TensorInfo,
                names,
                map(_SHARED.__getitem__, dtypes),
                map(self.shapes.__getitem__, shapes),
                sizes,
                repeat(self.path),
                pairwise(at),
            )
        )

    def _sizes(self, dtypes: Sequence[str], shapes: Sequence[str]) -> list[int | None]:
        """The bytes each entry's dtype and shape need (looked up once per pair)."""
        if len(set(dtypes)) == 1:  # the usual model: one dtype
            sizes = {shape: self._size(dtypes[0], shape) for shape in set(shapes)}
            return list(map(sizes.__getitem__, shapes))
        kinds = list(zip(dtypes, shapes, strict=True))
        pairs = {kind: self._size(*kind) for kind in set(kinds)}
        return list(map(pairs.__getitem__, kinds))

    def _size(self, dtype: str, shape_text: str) -> int | None:
        """The bytes of a tensor of this dtype and shape; None (equal to no size) when its
        elements fill no whole number of bytes or it is past 64 bits."""
        if dtype not in _SHARED or not _SHAPE.fullmatch(shape_text):
            raise _Unusual  # an unknown dtype, or a shape JSON writes otherwise
        shape = self.shapes.get(shape_text)
        if shape is None:
            shape = self.shapes[shape_text] = tuple(map(int, shape_text.split(",")))
        numel = 1
        for dim in shape:
            numel *= dim
        bits = numel * SAFETENSORS_DTYPES[dtype].bits
        if max(shape, default=0) > _U64_MAX or bits % 8 or bits // 8 > _U64_MAX:
            return None
        return bits // 8
