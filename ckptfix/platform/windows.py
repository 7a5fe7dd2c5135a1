"""Windows: the portable implementation with the Win32 calls that do better.

- Reads and writes at an offset are ReadFile/WriteFile with the offset in an OVERLAPPED:
  each call carries its own offset, so threads never share a seek pointer.
- Sources are opened with CreateFileW sharing read, write and delete, so that a folder being
  read can still be renamed and removed (Windows refuses that while a file in it is open
  without FILE_SHARE_DELETE). An open that must not follow a link opens the entry itself
  (FILE_FLAG_OPEN_REPARSE_POINT) and refuses a symlink or junction; other reparse points
  (cloud placeholders) are files. Folders worked in are held open without FILE_SHARE_DELETE,
  so they cannot be renamed or removed meanwhile (folders.PathFolder).
- The staging lock is LockFileEx on a lock file beside the output (platform.locks).
- There is no atomic exchange of two folders: replacing an output moves the old one aside,
  checks it, and renames the new one in (what the staging folder does without an exchange);
  a rename never replaces anything (MoveFileExW without MOVEFILE_REPLACE_EXISTING), and a
  file rewritten in place is put there by os.replace (MoveFileExW with it).
- Folders' entries cannot be flushed to the disk (no call for it): NTFS's journal makes a
  rename atomic, not durable at once.
- Clones: ReFS block cloning (FSCTL_DUPLICATE_EXTENTS_TO_FILE) of whole clusters; elsewhere
  copies. No extent maps: cloned ranges are verified by comparing their bytes.
- Paths past MAX_PATH get the \\\\?\\ form in every call made here (windows_api.long_path).
- Ctrl-C is SIGINT and Ctrl-Break SIGBREAK; both stop a command as SIGTERM does.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import stat
import tempfile
from typing import Any

from ckptfix.platform.common import NotARegularFile, not_followed
from ckptfix.platform.portable import Platform
from ckptfix.platform.windows_api import (
    FILE_ATTRIBUTE_REPARSE_POINT,
    FILE_FLAG_BACKUP_SEMANTICS,
    FILE_FLAG_OPEN_REPARSE_POINT,
    FILE_READ_ATTRIBUTES,
    FILE_SHARE_READ,
    FILE_SHARE_WRITE,
    GENERIC_READ,
    GENERIC_WRITE,
    MAX_CALL,
    NAME_SURROGATE,
    SHARE_ALL,
    WindowsApi,
    long_path,
)

_UCRT_DESCRIPTORS = 8192  # the C runtime's own ceiling on descriptors
_READ_ONLY = 0x1  # FILE_ATTRIBUTE_READONLY
SIGBREAK = 21  # signal.SIGBREAK, which only Windows' signal module has: Ctrl-Break


def _c_buffer(data: bytes | bytearray | memoryview, size: int) -> Any:
    """The first `size` bytes of `data` as ctypes passes them: bytes as they are, a writable
    buffer in place, a read-only view copied."""
    if isinstance(data, bytes) and len(data) == size:
        return data
    view = memoryview(data).cast("B")[:size]
    if view.readonly:
        return bytes(view)
    return (ctypes.c_char * size).from_buffer(view)


class Windows(Platform):
    name = "windows"

    def __init__(self, api: WindowsApi | None = None) -> None:
        super().__init__()
        self._api = api

    @property
    def api(self) -> WindowsApi:
        if self._api is None:
            self._api = WindowsApi()
        return self._api

    def native(self, path: str) -> str:
        return long_path(path)

    def is_link(self, info: os.stat_result) -> bool:
        attributes = getattr(info, "st_file_attributes", 0)
        tag = getattr(info, "st_reparse_tag", 0)
        surrogate = attributes & FILE_ATTRIBUTE_REPARSE_POINT and tag & NAME_SURROGATE
        return stat.S_ISLNK(info.st_mode) or bool(surrogate)

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        data = bytearray(min(size, MAX_CALL))
        count = self.read_into(fd, memoryview(data), offset)
        del data[count:]
        return bytes(data)

    def read_into(self, fd: int, target: memoryview, offset: int) -> int:
        """Read into `target` at `offset`, straight from the kernel: the count read."""
        size = min(len(target), MAX_CALL)
        if not size:
            return 0
        buffer = (ctypes.c_char * size).from_buffer(target.cast("B"))
        return self.api.read_at(self.api.handle(fd), buffer, size, offset)

    def pwrite(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        size = min(memoryview(data).nbytes, MAX_CALL)
        if not size:
            return 0
        return self.api.write_at(self.api.handle(fd), _c_buffer(data, size), size, offset)

    def sync_folder(self, path: str) -> None:
        """Nothing: Windows has no call that writes a folder's entries out (see above)."""

    def _open_file(self, path: str, access: int, share: int, *, follow: bool) -> int:
        api = self.api
        flags = 0 if follow else FILE_FLAG_OPEN_REPARSE_POINT
        handle = api.open(self.native(path), access, share, flags)
        try:
            tag = api.tag(handle)
            if not follow and tag.names_another:
                raise not_followed(path)
            if tag.folder or not api.on_disk(handle):
                raise NotARegularFile(path)
        except BaseException:
            api.close(handle)
            raise
        return api.descriptor(handle, os.O_RDONLY if access == GENERIC_READ else os.O_RDWR)

    def open_regular(self, path: str, *, follow: bool = True) -> int:
        return self._open_file(path, GENERIC_READ, SHARE_ALL, follow=follow)

    def open_lock_file(self, path: str) -> int:
        # no FILE_SHARE_DELETE: nobody removes it while it is open here
        access, share = GENERIC_READ | GENERIC_WRITE, FILE_SHARE_READ | FILE_SHARE_WRITE
        return self._open_file(path, access, share, follow=False)

    def byte_lock(self, fd: int) -> None:
        self.api.lock(self.api.handle(fd))

    def drop_lock_file(self, fd: int, path: str) -> None:
        """Unlocked and closed first (a file open here cannot be removed); then removed,
        unless another run has opened it meanwhile (Windows refuses that removal)."""
        try:
            self.api.unlock(self.api.handle(fd))
        finally:
            os.close(fd)
        with contextlib.suppress(PermissionError, FileNotFoundError):
            os.unlink(self.native(path))

    def pin_folder(self, native: str, *, follow: bool = True) -> object | None:
        flags = FILE_FLAG_BACKUP_SEMANTICS | (0 if follow else FILE_FLAG_OPEN_REPARSE_POINT)
        share = FILE_SHARE_READ | FILE_SHARE_WRITE  # no FILE_SHARE_DELETE: no rename meanwhile
        handle = self.api.open(native, FILE_READ_ATTRIBUTES, share, flags)
        try:
            tag = self.api.tag(handle)
        except BaseException:
            self.api.close(handle)
            raise
        if not tag.folder or (not follow and tag.names_another):
            self.api.close(handle)
            raise not_followed(native)
        return handle

    def unpin_folder(self, pin: object) -> None:
        assert isinstance(pin, int)
        self.api.close(pin)

    def remove_file(self, native: str) -> None:
        """A read-only file (attribute) cannot be removed on Windows: cleared first. Only
        ever an entry of a tree ckptfix removes (a staging folder, a replaced output)."""
        try:
            os.unlink(native)
        except PermissionError:
            info = os.lstat(native)
            if not getattr(info, "st_file_attributes", 0) & _READ_ONLY:
                raise
            os.chmod(native, stat.S_IWRITE)
            os.unlink(native)

    def rename_new(self, first: str, second: str) -> None:
        os.rename(self.native(first), self.native(second))  # never replaces on Windows

    def copy_to_new(self, reader: int, target: str) -> tuple[int, int]:
        """ReFS: the whole clusters cloned, the rest copied; elsewhere all copied."""
        writer = self.create(target, 0o600)
        try:
            shared = self._clone_clusters(reader, writer)
            return writer, self.copy_from(reader, writer, shared)
        except BaseException:
            os.close(writer)
            raise

    def _clone_clusters(self, reader: int, writer: int) -> int:
        """Clone the whole clusters of `reader` into the empty `writer`: how many bytes."""
        cluster = self.api.cluster(self.api.handle(reader))
        shared = os.fstat(reader).st_size // cluster * cluster if cluster else 0
        if not shared:
            return 0
        os.ftruncate(writer, shared)  # a clone may not reach past the end of its target
        if self.clone_range(reader, 0, shared, writer, 0):
            return shared
        os.ftruncate(writer, 0)
        return 0

    def clone_range(
        self, src: int, src_offset: int, length: int, dst: int, dst_offset: int
    ) -> bool:
        handles = self.api.handle(src), self.api.handle(dst)
        return self.api.duplicate(*handles, (src_offset, dst_offset, length))

    def clone_block(self, src: int, folder: str) -> int | None:
        """ReFS's cluster size, tried for real on a probe file in `folder` (removed)."""
        cluster = self.api.cluster(self.api.handle(src))
        if cluster is None or os.fstat(src).st_size < cluster:
            return None
        probe, path = tempfile.mkstemp(prefix=".ckptfix-probe-", dir=self.native(folder))
        try:
            os.ftruncate(probe, cluster)
            return cluster if self.clone_range(src, 0, cluster, probe, 0) else None
        except OSError:  # only a probe: a full disk or a failing device shows up when writing
            return None
        finally:
            os.close(probe)
            with contextlib.suppress(OSError):
                os.unlink(path)

    def stop_signals(self) -> tuple[int, ...]:
        return (signal.SIGINT, signal.SIGTERM, SIGBREAK)

    def open_files_limit(self) -> int | None:
        return _UCRT_DESCRIPTORS

    def raise_open_files_limit(self) -> int | None:
        return _UCRT_DESCRIPTORS

    def effective_user(self) -> int | None:
        return None  # owners are security identifiers, and access is by ACLs
