"""The layout of a PyTorch zip archive as `torch.save` (2.13, through miniz) writes it, computed
from the record sizes alone: every offset and header is known before any tensor byte is
written, so a writer can stream each storage into place and fill in CRCs at the end.

What torch writes, checked against `torch.save` output byte by byte:

- records in this order: `data.pkl`, `.format_version` ("1"), `.storage_alignment` ("64"),
  `byteorder` ("little"), `data/<key>` for each storage in key order, `version` ("3\\n"),
  `.data/serialization_id` (40 digits), all inside one folder (`archive` when torch.save is
  given a file object), all stored (method 0), no timestamps;
- each local header says "sizes and CRC in a data descriptor" (flags 0x0808, or 0x0800 and no
  descriptor for an empty record) and pads its extra field (`FB`, a length, then `Z`s) so
  that the record's data starts at a multiple of 64 (what `torch.load(mmap=True)` maps);
- a ZIP64 extra field in the local header and the central directory, and a ZIP64 data
  descriptor, for a record of 0xFFFFFFFF bytes or more or one starting past that offset;
- a ZIP64 end of central directory record and locator always, then the classic one.

The serialization id is two 20-digit numbers: torch's first is a C++ `std::hash` of the
record names (implementation-defined), ours a BLAKE2b of them; the second is, as torch
computes it, `c10::hash_combine` over the CRC-32 of each record with a data descriptor.
torch only logs the id.
"""

from __future__ import annotations

import hashlib
import struct
from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from ckptfix.core.sizes import padded

ARCHIVE = "archive"
ALIGNMENT = 64
FORMAT_VERSION = b"1"
VERSION = b"3\n"
BYTEORDER = b"little"
SERIALIZATION_ID = ".data/serialization_id"
SERIALIZATION_ID_SIZE = 40
FIRST_STORAGE = 4  # the records before data/0: data.pkl, .format_version, ...

_LIMIT32 = 0xFFFFFFFF
_LOCAL = struct.Struct("<IHHHHHIIIHH")
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")
_ZIP64_END = struct.Struct("<IQHHIIQQQQ")
_LOCATOR = struct.Struct("<IIQI")
_END = struct.Struct("<IHHHHIIH")
_WITH_DESCRIPTOR = 0x0808  # bit 3: sizes and CRC follow the data; bit 11: UTF-8 name
_WITHOUT_DESCRIPTOR = 0x0800
_MADE_BY = 0x031E  # what miniz puts in the ZIP64 end record (Unix, 3.0)
_NEEDED = 45  # ZIP64


def _zip64_local(size: int, header_offset: int) -> bytes:
    """The local header's ZIP64 field (miniz leaves its compressed size 0), where needed."""
    fields = (struct.pack("<QQ", size, 0) if size >= _LIMIT32 else b"") + (
        struct.pack("<Q", header_offset) if header_offset >= _LIMIT32 else b""
    )
    return struct.pack("<HH", 1, len(fields)) + fields if fields else b""


@dataclass(frozen=True, slots=True)
class ZipEntry:
    """One record placed in the archive."""

    name: str  # the full name, folder included
    size: int
    header_offset: int
    data_offset: int  # the local header's end: the first multiple of 64 it can reach

    @classmethod
    def at(cls, name: str, size: int, header_offset: int) -> ZipEntry:
        """The record `name` of `size` bytes whose local header starts at `header_offset`."""
        unpadded = header_offset + _LOCAL.size + len(name.encode()) + 4  # + "FB", length
        unpadded += len(_zip64_local(size, header_offset))
        return cls(name, size, header_offset, padded(unpadded, ALIGNMENT))

    @property
    def zip64(self) -> bool:
        return self.size >= _LIMIT32 or self.header_offset >= _LIMIT32

    @property
    def flags(self) -> int:
        return _WITH_DESCRIPTOR if self.size else _WITHOUT_DESCRIPTOR

    @property
    def data_range(self) -> tuple[int, int]:
        start = self.data_offset
        return start, start + self.size

    @property
    def descriptor_size(self) -> int:
        return 0 if not self.size else 24 if self.zip64 else 16

    @property
    def end(self) -> int:
        return self.data_offset + self.size + self.descriptor_size

    def local_header(self) -> bytes:
        """Everything from the header's signature to the first data byte."""
        name = self.name.encode()
        zip64 = _zip64_local(self.size, self.header_offset)
        start = self.header_offset + _LOCAL.size + len(name) + len(zip64) + 4
        padding = self.data_offset - start
        extra = zip64 + b"FB" + struct.pack("<H", padding) + b"Z" * padding
        fixed = _LOCAL.pack(0x04034B50, 0, self.flags, 0, 0, 0, 0, 0, 0, len(name), len(extra))
        return fixed + name + extra

    def descriptor(self, crc: int) -> bytes:
        if not self.size:
            return b""
        if self.zip64:
            return struct.pack("<IIQQ", 0x08074B50, crc, self.size, self.size)
        return struct.pack("<IIII", 0x08074B50, crc, self.size, self.size)

    def central_record(self, crc: int) -> bytes:
        name = self.name.encode()
        large, far = self.size >= _LIMIT32, self.header_offset >= _LIMIT32
        fields = (struct.pack("<QQ", self.size, self.size) if large else b"") + (
            struct.pack("<Q", self.header_offset) if far else b""
        )
        extra = struct.pack("<HH", 1, len(fields)) + fields if fields else b""
        size = _LIMIT32 if large else self.size
        offset = _LIMIT32 if far else self.header_offset
        fixed = _CENTRAL.pack(
            0x02014B50, 0, 0, self.flags, 0, 0, 0, crc, size, size, len(name), len(extra), 0, 0,
            0, 0, offset,
        )  # fmt: skip
        return fixed + name + extra


def place(records: Sequence[tuple[str, int]], folder: str = ARCHIVE) -> tuple[ZipEntry, ...]:
    """Each (name, size) record after the previous one, inside `folder`."""
    entries, offset = [], 0
    for name, size in records:
        entry = ZipEntry.at(f"{folder}/{name}", size, offset)
        entries.append(entry)
        offset = entry.end
    return tuple(entries)


def torch_records(pickle_size: int, storages: Sequence[tuple[str, int]]) -> list[tuple[str, int]]:
    """The records of a torch.save archive, in torch's order: (name, size)."""
    return [
        ("data.pkl", pickle_size),
        (".format_version", len(FORMAT_VERSION)),
        (".storage_alignment", len(str(ALIGNMENT))),
        ("byteorder", len(BYTEORDER)),
        *((f"data/{key}", size) for key, size in storages),
        ("version", len(VERSION)),
        (SERIALIZATION_ID, SERIALIZATION_ID_SIZE),
    ]


def small_records(pickle: bytes) -> dict[str, bytes]:
    """The contents of every record but the storages and the serialization id."""
    return {
        "data.pkl": pickle,
        ".format_version": FORMAT_VERSION,
        ".storage_alignment": str(ALIGNMENT).encode(),
        "byteorder": BYTEORDER,
        "version": VERSION,
    }


def _hash_combine(seed: int, value: int) -> int:
    """c10::hash_combine on 64-bit size_t."""
    mask = 2**64 - 1
    return (seed ^ ((value + 0x9E3779B9 + (seed << 6) + (seed >> 2)) & mask)) & mask


def serialization_id(entries: Sequence[ZipEntry], crcs: Sequence[int]) -> bytes:
    """The id of an archive whose records before the id are `entries` with these CRCs."""
    names = hashlib.blake2b(digest_size=8)
    combined = 0
    for entry, crc in zip(entries, crcs, strict=True):
        names.update(entry.name.encode() + b"\0")
        if entry.size:
            combined = _hash_combine(combined, crc)
    first = int.from_bytes(names.digest(), "little")
    return f"{first:020d}{combined:020d}".encode()


def central_directory(
    entries: Sequence[ZipEntry], crcs: Sequence[int], batch: int = 4096
) -> Iterator[bytes]:
    """The central directory and the end records, in pieces of `batch` entries (a
    directory of millions of records is not built in memory at once)."""
    start = entries[-1].end if entries else 0
    size = 0
    for first in range(0, len(entries), batch):
        piece = b"".join(
            entry.central_record(crc)
            for entry, crc in zip(
                entries[first : first + batch], crcs[first : first + batch], strict=True
            )
        )
        size += len(piece)
        yield piece
    count = len(entries)
    zip64_end = _ZIP64_END.pack(
        0x06064B50, _ZIP64_END.size - 12, _MADE_BY, _NEEDED, 0, 0, count, count, size, start
    )
    locator = _LOCATOR.pack(0x07064B50, 0, start + size, 1)
    end = _END.pack(
        0x06054B50, 0, 0, min(count, 0xFFFF), min(count, 0xFFFF), min(size, _LIMIT32),
        min(start, _LIMIT32), 0,
    )  # fmt: skip
    yield zip64_end + locator + end
