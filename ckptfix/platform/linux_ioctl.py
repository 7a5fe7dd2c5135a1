"""Linux's ioctls for sharing blocks between files (FICLONE, FICLONERANGE) and for asking
where a file's blocks lie (FIEMAP).

Clones: the destination shares the source's blocks instead of copying them; a file system
without reflinks answers with one of FALLBACK, nothing is changed, and the caller copies.
Extent maps: only plain extents count; one the file system marks as not yet allocated
(delalloc), unknown, unwritten, inline, encoded (compressed) or encrypted has no physical
address that can be compared, and the range is then compared byte for byte by the caller.
"""

from __future__ import annotations

import errno
import os
import struct

# struct file_clone_range {s64 src_fd; u64 src_offset; u64 src_length; u64 dest_offset;}
_CLONE_RANGE = struct.Struct("=qQQQ")
# Errors that mean "no clone here" (another filesystem, no reflink support, offsets the
# filesystem will not share, a file it will not clone): the bytes are copied instead.
FALLBACK = frozenset(
    {
        errno.EXDEV,
        errno.EOPNOTSUPP,
        errno.ENOTSUP,
        errno.EINVAL,
        errno.ENOTTY,
        errno.ENOSYS,
        errno.EPERM,
        errno.ETXTBSY,
        errno.EISDIR,
        errno.EBADF,
    }
)


def _ficlonerange() -> int | None:
    """The ioctl number, _IOW(0x94, 13, struct file_clone_range), on architectures that use
    the generic ioctl encoding; None elsewhere (no cloning)."""
    if os.uname().machine.startswith(("ppc", "mips", "sparc", "alpha")):
        return None  # another encoding of the direction bits: not worth guessing
    write, size_shift, type_shift = 1, 16, 8
    return (write << 30) | (_CLONE_RANGE.size << size_shift) | (0x94 << type_shift) | 13


FICLONERANGE = _ficlonerange()
# _IOW(0x94, 9, int): the whole file; the same encoding as FICLONERANGE's, with an int.
FICLONE = None if FICLONERANGE is None else (1 << 30) | (4 << 16) | (0x94 << 8) | 9


def _clone(request: int | None, dst_fd: int, argument: int | bytes) -> bool:
    """One clone ioctl on `dst_fd`; False where the filesystem refuses it (FALLBACK: nothing
    was changed then, and the caller copies)."""
    if request is None:
        return False
    import fcntl

    try:
        fcntl.ioctl(dst_fd, request, argument)
    except OSError as exc:
        if exc.errno in FALLBACK:
            return False
        raise
    return True


def clone_range(src_fd: int, src_offset: int, length: int, dst_fd: int, dst_offset: int) -> bool:
    """FICLONERANGE: share `length` bytes of `src_fd` at `src_offset` into `dst_fd` at
    `dst_offset`; False where this filesystem or these offsets do not allow it."""
    request = _CLONE_RANGE.pack(src_fd, src_offset, length, dst_offset)
    return _clone(FICLONERANGE, dst_fd, request)


def clone_file(src_fd: int, dst_fd: int) -> bool:
    """FICLONE: make the empty file `dst_fd` share all of `src_fd`'s blocks (its size too)."""
    return _clone(FICLONE, dst_fd, src_fd)


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
