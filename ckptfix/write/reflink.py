"""Cloning byte ranges between files (FICLONERANGE): the destination shares the source's
blocks instead of copying them. Linux only; anything else, or a filesystem without reflinks,
answers "cannot", and the caller copies as it always did."""

from __future__ import annotations

import errno
import os
import platform
import struct
import sys

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
# One ioctl at most this long, so that progress and Ctrl-C are seen between them.
CLONE_CHUNK = 2**30


def _ficlonerange() -> int | None:
    """The ioctl number, _IOW(0x94, 13, struct file_clone_range), on Linux architectures that
    use the generic ioctl encoding; None elsewhere (no cloning)."""
    if not sys.platform.startswith("linux"):
        return None
    if platform.machine().startswith(("ppc", "mips", "sparc", "alpha")):
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
    """Share `length` bytes of `src_fd` at `src_offset` into `dst_fd` at `dst_offset`; False
    where this filesystem or these offsets do not allow it (nothing was changed then)."""
    request = _CLONE_RANGE.pack(src_fd, src_offset, length, dst_offset)
    return _clone(FICLONERANGE, dst_fd, request)


def clone_file(src_fd: int, dst_fd: int) -> bool:
    """Make the empty file `dst_fd` share all of `src_fd`'s blocks (its size too); False where
    the filesystem does not allow it (nothing was changed then, and the caller copies)."""
    return _clone(FICLONE, dst_fd, src_fd)


def clone_block(src_fd: int, folder: str) -> int | None:
    """The block size at which `src_fd` clones into new files in `folder`, or None where it
    does not (no reflinks, another filesystem, a source smaller than one block).

    The block is the larger of the folder's filesystem block and the source's preferred I/O
    size (ZFS clones whole records). It is tried for real: the source's first block is
    cloned into an unnamed temporary file in `folder` (O_TMPFILE), which vanishes on close.
    """
    if FICLONERANGE is None or not hasattr(os, "O_TMPFILE"):
        return None
    block = max(os.statvfs(folder).f_bsize, os.fstat(src_fd).st_blksize, 512)
    if os.fstat(src_fd).st_size < block:
        return None
    try:
        probe = os.open(folder, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600)
    except OSError:
        return None
    try:
        return block if clone_range(src_fd, 0, block, probe, 0) else None
    except OSError:  # only a probe: a full disk or a failing device shows up when writing
        return None
    finally:
        os.close(probe)
