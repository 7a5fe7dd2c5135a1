"""Proving a cloned range equal to its source without reading it: both files map the range
to the same physical blocks (FIEMAP), on the same filesystem. Blocks are the bytes, so two
files that share every block of a range hold the same bytes there.

Only plain extents count: one the filesystem marks as not yet allocated (delalloc), unknown,
unwritten, inline, encoded (compressed) or encrypted has no physical address that can be
compared, and the range is then compared byte for byte by the caller instead.
"""

from __future__ import annotations

import os
import struct
import sys

# struct fiemap {u64 fm_start; u64 fm_length; u32 fm_flags; u32 fm_mapped_extents;
#                u32 fm_extent_count; u32 fm_reserved;}
_FIEMAP = struct.Struct("=QQIIII")
# struct fiemap_extent {u64 fe_logical; u64 fe_physical; u64 fe_length; u64 reserved[2];
#                       u32 fe_flags; u32 reserved[3];}
_EXTENT = struct.Struct("=QQQ16xI12x")
FS_IOC_FIEMAP = 0xC020660B  # _IOWR('f', 11, struct fiemap)
FIEMAP_FLAG_SYNC = 0x1  # write dirty pages back first, so the map is the data's
EXTENT_LAST = 0x1
# Flags that leave the physical address meaningful: the last extent, merged records, shared.
_PLAIN = 0x1 | 0x1000 | 0x2000
_BATCH = 256

# (offset from the start of the range, physical address, length), merged where contiguous.
Mapping = list[tuple[int, int, int]]


def _batch(fd: int, start: int, length: int) -> list[tuple[int, int, int, int]]:
    """One FIEMAP call: up to _BATCH extents (logical, physical, length, flags) from `start`."""
    import fcntl

    buffer = bytearray(_FIEMAP.size + _EXTENT.size * _BATCH)
    _FIEMAP.pack_into(buffer, 0, start, length, FIEMAP_FLAG_SYNC, 0, _BATCH, 0)
    fcntl.ioctl(fd, FS_IOC_FIEMAP, buffer)
    count = _FIEMAP.unpack_from(buffer, 0)[3]
    return [_EXTENT.unpack_from(buffer, _FIEMAP.size + i * _EXTENT.size) for i in range(count)]


def _add(mapping: Mapping, offset: int, physical: int, length: int) -> None:
    if mapping:
        last_offset, last_physical, last_length = mapping[-1]
        if last_offset + last_length == offset and last_physical + last_length == physical:
            mapping[-1] = (last_offset, last_physical, last_length + length)
            return
    mapping.append((offset, physical, length))


def extent_map(fd: int, start: int, length: int) -> Mapping | None:
    """Where the bytes [start, start + length) of a file lie on its device, relative to
    `start` (holes are absent); None when the filesystem cannot say or an extent is not a
    plain one (see the module's docstring)."""
    if not sys.platform.startswith("linux"):
        return None
    mapping: Mapping = []
    position, end = start, start + length
    while position < end:
        try:
            extents = _batch(fd, position, end - position)
        except OSError:
            return None  # no FIEMAP here (ZFS, tmpfs, ...)
        for logical, physical, size, flags in extents:
            if flags & ~_PLAIN:
                return None
            begin, stop = max(logical, start), min(logical + size, end)
            if begin < stop:
                _add(mapping, begin - start, physical + begin - logical, stop - begin)
        if not extents or extents[-1][3] & EXTENT_LAST:
            break
        position = max(position + 1, extents[-1][0] + extents[-1][2])
    return mapping


def same_blocks(src_fd: int, src_offset: int, dst_fd: int, dst_offset: int, length: int) -> bool:
    """True only if both ranges lie on the same physical blocks of one filesystem (then they
    hold the same bytes); False when that is not so or cannot be told."""
    if os.fstat(src_fd).st_dev != os.fstat(dst_fd).st_dev:
        return False  # physical addresses of two devices are not comparable
    source = extent_map(src_fd, src_offset, length)
    if not source:  # an unmapped (all-hole) range proves nothing here: compare its bytes
        return False
    return source == extent_map(dst_fd, dst_offset, length)
