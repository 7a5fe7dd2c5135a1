"""macOS: renamex_np (RENAME_SWAP for the atomic exchange, RENAME_EXCL for a rename that
replaces nothing), APFS clones of whole files (fclonefileat), kernel copies of whole files
(fcopyfile), F_FULLFSYNC (fsync alone leaves the data in the drive's cache), and folders
opened up with fchmodat(AT_SYMLINK_NOFOLLOW).

macOS has no kernel copy of a byte range (no copy_file_range) and no clone of one: ranges are
copied through a buffer, and only files carried whole are cloned. The C library is reached
through ctypes; tests replace it (`Darwin(libc=...)`) at exactly these calls.
"""

from __future__ import annotations

import ctypes
import errno
import os
import stat
from collections.abc import Callable
from typing import Any

from ckptfix.platform.posix import Posix

RENAME_SWAP = 0x2
RENAME_EXCL = 0x4
COPYFILE_DATA = 1 << 3
CLONE_NOFOLLOW = 0x1
AT_FDCWD = -2  # macOS's value (Linux's is -100)
F_FULLFSYNC = 51
# The call cannot do this here (another file system, not APFS, an old macOS): fall back.
UNSUPPORTED = frozenset(
    {errno.ENOTSUP, errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS, errno.EXDEV, errno.EPERM}
)
_OWNER_ALL = stat.S_IRWXU


class Darwin(Posix):
    name = "darwin"

    def __init__(self, libc: Any = None, errno_of: Callable[[], int] | None = None) -> None:
        super().__init__()
        self._libc = libc
        self._errno_of = errno_of or ctypes.get_errno

    @property
    def libc(self) -> Any:
        if self._libc is None:
            self._libc = ctypes.CDLL(None, use_errno=True)
        return self._libc

    def _call(self, name: str, *args: object) -> int:
        """0, or the errno of a failed call; AttributeError-free: a C library without the
        function answers ENOSYS."""
        function = getattr(self.libc, name, None)
        if function is None:
            return errno.ENOSYS
        return 0 if function(*args) == 0 else self._errno_of()

    def _rename(self, first: str, second: str, flags: int) -> bool:
        code = self._call("renamex_np", os.fsencode(first), os.fsencode(second), flags)
        if code in UNSUPPORTED:
            return False
        if code:
            raise OSError(code, os.strerror(code), second)
        return True

    def exchange(self, first: str, second: str) -> bool:
        return self._rename(first, second, RENAME_SWAP)

    def rename_new(self, first: str, second: str) -> None:
        if not self._rename(first, second, RENAME_EXCL):
            super().rename_new(first, second)

    def copy_to_new(self, reader: int, target: str) -> tuple[int, int]:
        """APFS: the new file shares the source's blocks (fclonefileat never replaces and
        never follows a link at `target`); elsewhere created and copied."""
        code = self._call("fclonefileat", reader, AT_FDCWD, os.fsencode(target), CLONE_NOFOLLOW)
        if code == 0:
            writer = os.open(target, os.O_WRONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            return writer, os.fstat(writer).st_size
        if code not in UNSUPPORTED:
            raise OSError(code, os.strerror(code), target)
        return super().copy_to_new(reader, target)

    def copy_whole(self, reader: int, writer: int) -> int:
        """fcopyfile of the data (from the start of both files), else through a buffer."""
        os.lseek(reader, 0, os.SEEK_SET)
        os.lseek(writer, 0, os.SEEK_SET)
        code = self._call("fcopyfile", reader, writer, None, COPYFILE_DATA)
        if code == 0:
            return os.fstat(writer).st_size
        if code not in UNSUPPORTED or os.fstat(writer).st_size:
            raise OSError(code, os.strerror(code))
        return super().copy_whole(reader, writer)

    def sync(self, fd: int) -> None:
        """F_FULLFSYNC asks the drive to write its cache too; file systems that do not know
        it (some network ones) get a plain fsync."""
        import fcntl

        try:
            fcntl.fcntl(fd, F_FULLFSYNC)
        except OSError:
            os.fsync(fd)

    def add_owner_access_at(self, folder: int, name: str) -> None:
        info = os.stat(name, dir_fd=folder, follow_symlinks=False)
        if not stat.S_ISDIR(info.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", name)
        mode = stat.S_IMODE(info.st_mode) | _OWNER_ALL
        os.chmod(name, mode, dir_fd=folder, follow_symlinks=False)
