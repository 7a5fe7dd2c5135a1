"""POSIX systems (Linux, macOS, the BSDs): pread and pwrite, descriptors of folders (O_NOFOLLOW,
the `*at` calls), flock on the output folder itself, holes found with SEEK_DATA, statvfs."""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Iterator, Sequence
from typing import BinaryIO

from ckptfix.platform.common import NotARegularFile
from ckptfix.platform.folders import FdFolder, FolderHandle
from ckptfix.platform.locks import FolderFlock, FolderLock
from ckptfix.platform.portable import Platform

_OWNER_ALL = stat.S_IRWXU


class Posix(Platform):
    name = "posix"

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        return os.pread(fd, size, offset)

    def read_into(self, fd: int, target: memoryview, offset: int) -> int:
        return os.preadv(fd, [target], offset)  # straight into place, no bytes object

    vector_limit = min(os.sysconf("SC_IOV_MAX"), 1024)  # Linux: 1,024

    def read_vector(self, fd: int, targets: Sequence[memoryview], offset: int) -> int:
        return os.preadv(fd, targets, offset)

    def pwrite(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        return os.pwrite(fd, data, offset)

    def stream(self, fd: int) -> BinaryIO | None:
        # pread moves no offset: a duplicate of the descriptor may have its own reads
        return os.fdopen(os.dup(fd), "rb")

    def sync_data(self, fd: int) -> None:
        sync = getattr(os, "fdatasync", os.fsync)  # macOS has only fsync
        sync(fd)

    def data_segments(self, fd: int, begin: int, end: int) -> Iterator[tuple[int, int]]:
        """The parts of [begin, end) holding data: holes of a sparse file are skipped (they
        read as zeros). Without SEEK_DATA support the whole range is one segment."""
        seek_data, seek_hole = getattr(os, "SEEK_DATA", None), getattr(os, "SEEK_HOLE", None)
        if seek_data is None or seek_hole is None:
            yield begin, end
            return
        position = begin
        while position < end:
            try:
                data = os.lseek(fd, position, seek_data)
                hole = os.lseek(fd, data, seek_hole)
            except OSError as exc:
                if exc.errno == errno.ENXIO:  # nothing but hole up to the end of the file
                    return
                yield position, end
                return
            if data >= end:
                return
            yield data, min(hole, end)
            position = hole

    def open_regular(self, path: str, *, follow: bool = True) -> int:
        # O_NONBLOCK: a FIFO put in the file's place after it was checked is refused, not
        # waited on for ever (it means nothing for reading a regular file).
        flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
        fd = os.open(path, flags)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise NotARegularFile(path)
        return fd

    def open_lock_file(self, path: str) -> int:
        fd = os.open(path, os.O_RDWR | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise NotARegularFile(path)
        return fd

    def create(self, path: str, mode: int = 0o666) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(path, flags, mode)

    def create_rw(self, path: str, mode: int = 0o600) -> int:
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(path, flags, mode)

    def open_folder(self, path: str, *, follow: bool = True) -> FolderHandle:
        return FdFolder.open(self, path, follow=follow)

    def add_owner_access_at(self, folder: int, name: str) -> None:
        """Give the folder `name` of the folder open as `folder` its owner's read, write and
        search bits, without following a link there."""
        info = os.stat(name, dir_fd=folder, follow_symlinks=False)
        if not stat.S_ISDIR(info.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", name)
        os.chmod(name, stat.S_IMODE(info.st_mode) | _OWNER_ALL, dir_fd=folder)

    def lock_folder(self, path: str) -> FolderLock:
        return FolderFlock.take(path)

    def may_own_anything(self) -> bool:
        return os.geteuid() == 0

    def disk_space(self, folder: str) -> tuple[int, bool]:
        stats = os.statvfs(folder)
        return stats.f_bavail * stats.f_frsize, bool(stats.f_flag & os.ST_RDONLY)

    def set_mode(self, fd: int, path: str, mode: int) -> None:
        os.fchmod(fd, mode)

    def set_times(self, fd: int, path: str, times_ns: tuple[int, int]) -> None:
        os.utime(fd, ns=times_ns)
