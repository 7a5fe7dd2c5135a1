"""GGUF headers, read strictly and in bounded memory: the magic, the version, the metadata
key/values and the tensor infos, as llama.cpp's ggml reads them (`gguf_init_from_file`).

The header is read front to back through a window of at most WINDOW bytes over the
ByteSource (a remote file fetches one 64 KiB block per window), never mapped. Every count
and length is checked against what the file can still hold before anything is allocated
or read, so a header claiming 2^60 tensors or a 2^50-byte string fails at once. Metadata
values are decoded only where ckptfix needs them (scalars, short strings); arrays are
walked over, and a key/value's byte span is kept, so a writer can copy it as it is.
"""

from __future__ import annotations

import struct
import sys
from dataclasses import dataclass
from typing import Any

from ckptfix.core.errors import CorruptFileError, UnsupportedFormatError
from ckptfix.formats.sniff import GGUF_MAGIC as MAGIC
from ckptfix.io.source import ByteSource

VERSIONS = (2, 3)
PREFIX = 24  # magic, version, tensor count, key/value count
DEFAULT_ALIGNMENT = 32
WINDOW = 64 * 2**10
MAX_HEADER = 256 * 2**20  # metadata and tensor infos together
MAX_TENSORS = 1_000_000
MAX_KEYS = 1_000_000
MAX_KEY = 65_535  # bytes of a key
MAX_NAME = 63  # bytes of a tensor name: ggml's GGML_MAX_NAME is 64 with the NUL
MAX_DIMS = 4  # ggml's GGML_MAX_DIMS
SHORT_STRING = 4096  # string values longer than this are walked over, not decoded

FIX = "re-download the file, or convert the model to GGUF again"

# type id -> (name, struct format, size); STRING and ARRAY have no fixed size.
VALUE_TYPES: dict[int, tuple[str, str, int]] = {
    0: ("UINT8", "<B", 1),
    1: ("INT8", "<b", 1),
    2: ("UINT16", "<H", 2),
    3: ("INT16", "<h", 2),
    4: ("UINT32", "<I", 4),
    5: ("INT32", "<i", 4),
    6: ("FLOAT32", "<f", 4),
    7: ("BOOL", "<B", 1),
    8: ("STRING", "", 0),
    9: ("ARRAY", "", 0),
    10: ("UINT64", "<Q", 8),
    11: ("INT64", "<q", 8),
    12: ("FLOAT64", "<d", 8),
}
VALUE_IDS = {name: type_id for type_id, (name, _, _) in VALUE_TYPES.items()}
BOOL, STRING, ARRAY = 7, 8, 9
_U64 = struct.Struct("<Q").unpack_from
_LITTLE_ENDIAN = sys.byteorder == "little"


@dataclass(frozen=True)
class GgufKey:
    """One metadata key/value: its type, the byte span of the whole record in the file (key
    included), and its value where decoded (scalars and short strings; None otherwise)."""

    key: str
    type: str  # "UINT32", "STRING", "ARRAY", ...
    span: tuple[int, int]
    value: object = None
    item_type: str | None = None  # an array's element type
    count: int = 1  # an array's length


@dataclass(frozen=True)
class RawTensor:
    """A tensor info as stored: ggml's dims (ne[0] first, the fastest axis), type id, offset."""

    name: str
    dims: tuple[int, ...]
    type_id: int
    offset: int


@dataclass(frozen=True)
class RawHeader:
    """A GGUF header as stored: its version, key/values and tensor infos, and where they end."""

    version: int
    keys: tuple[GgufKey, ...]
    tensors: tuple[RawTensor, ...]
    keys_end: int  # where the tensor infos start
    header_end: int  # where they end (the data section starts at the next aligned offset)


class Cursor:
    """Reads a source front to back through a window of at most WINDOW bytes (more only
    for one value that is longer), refusing to go past the file or the header bound."""

    def __init__(self, source: ByteSource, position: int = 0) -> None:
        self.source = source
        self.label = source.label
        self.size = source.size
        self.limit = min(self.size, MAX_HEADER + PREFIX)
        self.position = position
        self.buffer = b""
        self.start = position  # file offset of buffer[0]
        self.what = "the header"  # what is being read, for errors

    def remaining(self) -> int:
        return self.limit - self.position

    def _fill(self, count: int) -> None:
        """Make buffer hold [position, position + count), reading up to the window's end."""
        end = self.position + count
        if end > self.limit:
            raise self.past(end)
        if self.start <= self.position and end <= self.start + len(self.buffer):
            return
        kept = self.buffer[self.position - self.start :]
        have = self.position + len(kept)
        stop = min(max(end, (have // WINDOW + 1) * WINDOW), self.limit)
        self.buffer = kept + self.source.read_at(have, stop - have)
        self.start = self.position

    def past(self, end: int) -> CorruptFileError:
        if end > self.size:
            return CorruptFileError(
                self.label,
                "gguf-past-end",
                f"{self.what} runs past the end of the file (it reaches byte {end}; the file "
                f"has {self.size})",
                FIX,
            )
        return CorruptFileError(
            self.label,
            "gguf-header-too-large",
            f"{self.what} reaches byte {end}: metadata and tensor infos over the "
            f"{MAX_HEADER}-byte limit",
            FIX,
        )

    def take(self, count: int) -> bytes:
        self._fill(count)
        at = self.position - self.start
        self.position += count
        return self.buffer[at : at + count]

    def unpack(self, fmt: str, size: int) -> Any:
        self._fill(size)
        (value,) = struct.unpack_from(fmt, self.buffer, self.position - self.start)
        self.position += size
        return value

    def u32(self) -> int:
        value: int = self.unpack("<I", 4)
        return value

    def u64(self) -> int:
        value: int = self.unpack("<Q", 8)
        return value

    def skip(self, count: int) -> None:
        if self.position + count > self.limit:
            raise self.past(self.position + count)
        self.position += count

    def length(self, most: int) -> int:
        """A string's u64 length, refused before anything is read if the file (or `most`)
        cannot hold it."""
        count = self.u64()
        if count > min(most, self.remaining()):
            if count > self.remaining():
                raise self.past(self.position + count)
            raise CorruptFileError(
                self.label,
                "gguf-bad-string",
                f"{self.what} is {count} bytes long, over the {most}-byte limit",
                FIX,
            )
        return count

    def text(self, most: int) -> str:
        """A string that must be UTF-8 (keys, tensor names)."""
        raw = self.take(self.length(most))
        try:
            return raw.decode("utf-8")
        except UnicodeDecodeError:
            raise CorruptFileError(
                self.label, "gguf-bad-string", f"{self.what} is not UTF-8 text: {raw[:40]!r}", FIX
            ) from None

    def skip_strings(self, count: int) -> None:
        """Walk over `count` strings (an array of them): a tight loop over each window, the
        hot path of a tokenizer's 100,000s of strings."""
        position = self.position
        while count:
            self.position = position
            self._fill(8)
            buffer, base = self.buffer, self.start
            at = position - base
            if _LITTLE_ENDIAN:  # each length read as one item of a u64 view
                at, done = _walk(_u64_views(buffer), at, count)
            else:
                done = 0
                try:  # a length not whole in the window ends the walk: no test per string
                    for done in range(count):  # noqa: B007  (`done` counts the strings walked)
                        at += 8 + _U64(buffer, at)[0]
                    done = count
                except struct.error:
                    pass
            position = base + at
            count -= done
            if position > self.limit:
                raise self.past(position)
        self.position = position

    def strings(self, most: int) -> list[str]:
        """At least one and at most `most` strings of an array, decoded (bytes that are not
        UTF-8 as backslash escapes): those whole in the window in one tight loop, as
        skip_strings walks them; a longer one alone."""
        self._fill(8)
        buffer, base, position = self.buffer, self.start, self.position
        found: list[str] = []
        while len(found) < most and position - base + 8 <= len(buffer):
            at = position - base + 8
            end = at + _U64(buffer, at - 8)[0]
            if end > len(buffer):
                break
            found.append(buffer[at:end].decode("utf-8", "backslashreplace"))
            position = base + end
        self.position = position
        if not found:
            found.append(
                self.take(self.length(self.remaining())).decode("utf-8", "backslashreplace")
            )
        return found


def _walk(views: list[memoryview], at: int, count: int) -> tuple[int, int]:
    """(the offset reached, the strings walked): up to `count` strings from offset `at` of
    the buffer `views` show (_u64_views), eight a turn while eight remain (a fifth faster
    than one a turn, measured). A length not whole in the buffer ends the walk (IndexError:
    no test per string) with `at` the offset of its string; in a turn of eight, that turn is
    walked again one string at a time to find which."""
    start, turn = at, 0
    try:
        for turn in range(count >> 3):  # noqa: B007  (`turn` counts the turns walked)
            start = at
            at += 8 + views[at & 7][at >> 3]
            at += 8 + views[at & 7][at >> 3]
            at += 8 + views[at & 7][at >> 3]
            at += 8 + views[at & 7][at >> 3]
            at += 8 + views[at & 7][at >> 3]
            at += 8 + views[at & 7][at >> 3]
            at += 8 + views[at & 7][at >> 3]
            at += 8 + views[at & 7][at >> 3]
        turn = count >> 3
    except IndexError:
        at = start
    done = turn << 3
    try:
        for done in range(done, count):  # noqa: B007, B020  (`done` counts the strings walked)
            at += 8 + views[at & 7][at >> 3]
        done = count
    except IndexError:
        pass
    return at, done


def _u64_views(buffer: bytes) -> list[memoryview]:
    """The buffer as native u64 items from each of the 8 byte offsets: the item at byte `at`
    is views[at & 7][at >> 3] (an IndexError once fewer than 8 bytes are left). A fifth
    faster than struct.unpack_from per string; native order, so little-endian hosts only."""
    whole = memoryview(buffer)
    return [whole[r : r + max(len(buffer) - r, 0) // 8 * 8].cast("Q") for r in range(8)]


def read_prefix(source: ByteSource) -> tuple[int, int, int, Cursor]:
    """(version, tensor count, key count) and a cursor after them; refuses the wrong magic,
    versions other than 2 and 3, a byte-swapped (big-endian) file and absurd counts."""
    label, size = source.label, source.size
    if size < PREFIX:
        raise CorruptFileError(
            label,
            "gguf-too-small",
            f"file has {size} bytes; a GGUF file needs at least {PREFIX}",
            FIX,
        )
    cursor = Cursor(source)
    if cursor.take(4) != MAGIC:
        raise CorruptFileError(label, "gguf-bad-magic", "file does not start with GGUF", FIX)
    version, tensors, keys = cursor.u32(), cursor.u64(), cursor.u64()
    if version and not version & 0xFFFF:
        raise UnsupportedFormatError(
            label,
            f"GGUF version field reads {version:#x}: a big-endian GGUF file, which ckptfix "
            "does not read",
            "use the little-endian file the model was published as",
            rule="gguf-big-endian",
        )
    if version not in VERSIONS:
        first = (
            " (llama.cpp's first format, which it no longer reads either)" if version == 1 else ""
        )
        raise CorruptFileError(
            label,
            "gguf-version",
            f"GGUF version {version}{first} is not supported; versions 2 and 3 are",
            FIX,
        )
    _check_counts(cursor, tensors, keys)
    return version, tensors, keys, cursor


def _check_counts(cursor: Cursor, tensors: int, keys: int) -> None:
    """Counts over the bounds are refused before anything is read; counts under them are
    walked, and a walk past the end of the file stops there (each record takes bytes)."""
    over = []
    if tensors > MAX_TENSORS:
        over.append(f"over the {MAX_TENSORS:,}-tensor limit")
    if keys > MAX_KEYS:
        over.append(f"over the {MAX_KEYS:,}-key limit")
    if over:
        raise CorruptFileError(
            cursor.label,
            "gguf-counts",
            f"header claims {tensors} tensor(s) and {keys} metadata key(s), {' and '.join(over)}",
            FIX,
        )


def read_raw_header(source: ByteSource) -> RawHeader:
    """The header as stored, every count and length checked on the way."""
    version, tensor_count, key_count, cursor = read_prefix(source)
    keys = _read_keys(cursor, key_count)
    keys_end = cursor.position
    tensors = _read_infos(cursor, tensor_count)
    return RawHeader(version, keys, tensors, keys_end, cursor.position)


def _read_keys(cursor: Cursor, count: int) -> tuple[GgufKey, ...]:
    keys: list[GgufKey] = []
    seen: set[str] = set()
    for index in range(count):
        start = cursor.position
        cursor.what = f"metadata key {index}"
        key = cursor.text(MAX_KEY)
        cursor.what = f"metadata key {key!r}"
        if key in seen:
            raise CorruptFileError(
                cursor.label,
                "gguf-duplicate-key",
                f"metadata key {key!r} is given twice (llama.cpp refuses the file)",
                FIX,
            )
        seen.add(key)
        keys.append(_read_value(cursor, key, start))
    return tuple(keys)


def _value_type(cursor: Cursor, key: str, *, item: bool = False) -> int:
    type_id = cursor.u32()
    if item and type_id == ARRAY:
        what = "arrays of arrays, which llama.cpp does not read"
    elif type_id not in VALUE_TYPES:
        what = f"{'elements of ' if item else ''}unknown value type {type_id}"
    else:
        return type_id
    raise CorruptFileError(
        cursor.label, "gguf-bad-value-type", f"metadata key {key!r} holds {what}", FIX
    )


def _read_value(cursor: Cursor, key: str, start: int) -> GgufKey:
    type_id = _value_type(cursor, key)
    name = VALUE_TYPES[type_id][0]
    if type_id == ARRAY:
        item = _value_type(cursor, key, item=True)
        count = cursor.u64()
        _skip_array(cursor, key, item, count)
        item_name = VALUE_TYPES[item][0]
        return GgufKey(key, name, (start, cursor.position), None, item_name, count)
    value = _scalar(cursor, key, type_id)
    return GgufKey(key, name, (start, cursor.position), value)


def _scalar(cursor: Cursor, key: str, type_id: int) -> object:
    if type_id == STRING:
        length = cursor.length(cursor.remaining())
        if length > SHORT_STRING:
            cursor.skip(length)
            return None
        return cursor.take(length).decode("utf-8", "replace")
    _, fmt, size = VALUE_TYPES[type_id]
    value = cursor.unpack(fmt, size)
    if type_id != BOOL:
        return value
    if value not in (0, 1):
        raise CorruptFileError(
            cursor.label,
            "gguf-bad-value",
            f"metadata key {key!r} is a bool stored as {value}, not 0 or 1",
            FIX,
        )
    return bool(value)


def _skip_array(cursor: Cursor, key: str, item: int, count: int) -> None:
    if item == STRING:
        if count * 8 > cursor.remaining():
            raise cursor.past(cursor.position + count * 8)
        cursor.skip_strings(count)
        return
    size = VALUE_TYPES[item][2]
    if item == BOOL:
        values = cursor.take(count) if count <= cursor.remaining() else b""
        if len(values) != count:
            raise cursor.past(cursor.position + count)
        if values.strip(b"\0\1"):
            raise CorruptFileError(
                cursor.label,
                "gguf-bad-value",
                f"metadata key {key!r} holds a bool that is not 0 or 1",
                FIX,
            )
        return
    cursor.skip(count * size)


def _read_infos(cursor: Cursor, count: int) -> tuple[RawTensor, ...]:
    tensors: list[RawTensor] = []
    for index in range(count):
        cursor.what = f"tensor info {index}"
        name = cursor.text(MAX_KEY)
        cursor.what = f"tensor info {name!r}"
        rank = cursor.u32()
        if rank > MAX_DIMS:
            raise CorruptFileError(
                cursor.label,
                "gguf-dims",
                f"tensor {name!r} has {rank} dimensions; ggml allows at most {MAX_DIMS}",
                FIX,
            )
        dims = struct.unpack(f"<{rank}Q", cursor.take(8 * rank))
        type_id, offset = cursor.u32(), cursor.u64()
        tensors.append(RawTensor(name, dims, type_id, offset))
    return tuple(tensors)
