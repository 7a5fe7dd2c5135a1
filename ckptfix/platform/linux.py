"""Linux: renameat2 (RENAME_EXCHANGE, RENAME_NOREPLACE), copy_file_range and sendfile,
reflinks (FICLONE, FICLONERANGE, probed with an O_TMPFILE file) and extent maps (FIEMAP),
folders opened up through O_PATH, the capability that bypasses the sticky bit."""

from __future__ import annotations

import errno
import os
import stat

from ckptfix.platform import linux_ioctl
from ckptfix.platform.portable import Extents
from ckptfix.platform.posix import Posix

RENAME_NOREPLACE = 1
RENAME_EXCHANGE = 2
_AT_FDCWD = -100
_OWNER_ALL = stat.S_IRWXU
_CAP_FOWNER = 3  # linux/capability.h: bypasses the sticky bit's ownership check
_SENDFILE_CHUNK = 2**30
# copy_file_range between these files is not possible: copied through a buffer instead
_NO_KERNEL_COPY = (errno.EXDEV, errno.ENOSYS, errno.EINVAL, errno.EOPNOTSUPP)


def renameat2(first: str, second: str, flags: int) -> bool:
    """renameat2(2) with `flags`; False where the C library, kernel or file system lacks it."""
    import ctypes

    call = getattr(ctypes.CDLL(None, use_errno=True), "renameat2", None)
    if call is None:
        return False
    if call(_AT_FDCWD, os.fsencode(first), _AT_FDCWD, os.fsencode(second), flags) == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), second)


class Linux(Posix):
    name = "linux"

    def exchange(self, first: str, second: str) -> bool:
        return renameat2(first, second, RENAME_EXCHANGE)

    def rename_new(self, first: str, second: str) -> None:
        """Without RENAME_NOREPLACE (an old kernel, a file system without it), the portable
        look-then-rename."""
        if not renameat2(first, second, RENAME_NOREPLACE):
            super().rename_new(first, second)

    def copy_range(
        self, src: int, dst: int, size: int, src_offset: int, dst_offset: int
    ) -> int | None:
        try:
            return os.copy_file_range(src, dst, size, src_offset, dst_offset)
        except OSError as exc:
            if exc.errno not in _NO_KERNEL_COPY:
                raise
            return None

    def copy_to_new(self, reader: int, target: str) -> tuple[int, int]:
        writer = self.create(target, 0o600)
        try:
            if linux_ioctl.clone_file(reader, writer):  # sharing its blocks: no byte moved
                return writer, os.fstat(writer).st_size
            return writer, self.copy_whole(reader, writer)
        except BaseException:
            os.close(writer)
            raise

    def copy_whole(self, reader: int, writer: int) -> int:
        """sendfile (file to file since Linux 2.6.33), else through a buffer."""
        copied = 0
        try:
            while sent := os.sendfile(writer, reader, copied, _SENDFILE_CHUNK):
                copied += sent
            return copied
        except OSError as exc:
            if exc.errno not in (errno.EINVAL, errno.ENOSYS) or copied:
                raise
        return super().copy_whole(reader, writer)

    def clone_range(
        self, src: int, src_offset: int, length: int, dst: int, dst_offset: int
    ) -> bool:
        return linux_ioctl.clone_range(src, src_offset, length, dst, dst_offset)

    def clone_block(self, src: int, folder: str) -> int | None:
        """The larger of the folder's filesystem block and the source's preferred I/O size
        (ZFS clones whole records), tried for real: the source's first block is cloned into
        an unnamed temporary file in `folder` (O_TMPFILE), which vanishes on close."""
        if linux_ioctl.FICLONERANGE is None or not hasattr(os, "O_TMPFILE"):
            return None
        block = max(os.statvfs(folder).f_bsize, os.fstat(src).st_blksize, 512)
        if os.fstat(src).st_size < block:
            return None
        try:
            probe = os.open(folder, os.O_TMPFILE | os.O_WRONLY | os.O_CLOEXEC, 0o600)
        except OSError:
            return None
        try:
            return block if linux_ioctl.clone_range(src, 0, block, probe, 0) else None
        except OSError:  # only a probe: a full disk or a failing device shows up when writing
            return None
        finally:
            os.close(probe)

    def extent_map(self, fd: int, start: int, length: int) -> Extents | None:
        return linux_ioctl.extent_map(fd, start, length)

    def add_owner_access_at(self, folder: int, name: str) -> None:
        """fchmodat cannot refuse to follow a link on Linux: the folder is opened as O_PATH
        (never through a link) and changed through /proc/self/fd, which is that very folder."""
        handle = os.open(
            name, os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC, dir_fd=folder
        )
        try:
            mode = stat.S_IMODE(os.fstat(handle).st_mode)
            os.chmod(f"/proc/self/fd/{handle}", mode | _OWNER_ALL)
        finally:
            os.close(handle)

    def may_own_anything(self) -> bool:
        """Whether this process has CAP_FOWNER (root usually has; root without it does not)."""
        try:
            with open("/proc/self/status", encoding="ascii") as status:
                for line in status:
                    if line.startswith("CapEff:"):
                        return bool(int(line.split()[1], 16) >> _CAP_FOWNER & 1)
        except (OSError, ValueError):
            pass
        return super().may_own_anything()
