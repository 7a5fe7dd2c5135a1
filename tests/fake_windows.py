"""kernel32 and msvcrt as ckptfix.platform.windows_api calls them, on Linux: each Win32 call
done with the POSIX call it stands for on real files (a handle is a descriptor), and
recorded with the arguments it was given, so that tests see the offsets, flags and
structures the Windows implementation passes and what it makes of each answer."""

from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import stat
from dataclasses import dataclass, field
from typing import Any

from ckptfix.platform import windows_api as api

IO_REPARSE_TAG_SYMLINK = 0xA000000C
IO_REPARSE_TAG_CLOUD = 0x9000001A  # a cloud placeholder: a reparse point, not a name
FILE_TYPE_PIPE = 3
ERROR_INVALID_FUNCTION = 1


def _value(argument: Any) -> Any:
    """What a ctypes argument stands for: a handle's number, byref's object, bytes as is."""
    if isinstance(argument, ctypes.c_void_p):
        return argument.value
    return getattr(argument, "_obj", argument)


@dataclass
class FakeKernel32:
    """The calls ckptfix makes. `tags` gives a path's reparse tag (as Windows would report
    for it opened with FILE_FLAG_OPEN_REPARSE_POINT); `cluster` makes it ReFS."""

    tags: dict[str, int] = field(default_factory=dict)
    cluster: int | None = None
    error: int = 0
    calls: list[tuple[str, tuple[Any, ...]]] = field(default_factory=list)
    paths: dict[int, str] = field(default_factory=dict)

    def _fail(self, code: int) -> int:
        self.error = code
        return 0

    def CreateFileW(self, path: str, access: int, share: int, *rest: Any) -> int:
        self.calls.append(("CreateFileW", (path, access, share, *rest)))
        link = os.path.islink(path) and rest[2] & api.FILE_FLAG_OPEN_REPARSE_POINT
        flags = os.O_PATH | os.O_NOFOLLOW if link else os.O_NONBLOCK
        if not link and not os.path.isdir(path):
            flags |= os.O_RDWR if access & api.GENERIC_WRITE else os.O_RDONLY
        try:
            handle = os.open(path, flags)
        except FileNotFoundError:
            return self._fail(2) or api.INVALID_HANDLE_VALUE
        self.paths[handle] = path
        return handle

    def CloseHandle(self, handle: Any) -> int:
        self.calls.append(("CloseHandle", (_value(handle),)))
        os.close(_value(handle))
        return 1

    def GetFileInformationByHandleEx(self, handle: Any, kind: int, info: Any, size: int) -> int:
        assert kind == api.FILE_ATTRIBUTE_TAG_INFO and size == 8
        mode = os.fstat(_value(handle)).st_mode
        target = _value(info)
        target.FileAttributes = api.FILE_ATTRIBUTE_DIRECTORY if stat.S_ISDIR(mode) else 0x80
        tag = self.tags.get(self.paths.get(_value(handle), ""))
        if stat.S_ISLNK(mode):
            tag = IO_REPARSE_TAG_SYMLINK
        if tag is not None:
            target.FileAttributes |= api.FILE_ATTRIBUTE_REPARSE_POINT
            target.ReparseTag = tag
        return 1

    def GetFileType(self, handle: Any) -> int:
        mode = os.fstat(_value(handle)).st_mode
        return FILE_TYPE_PIPE if stat.S_ISFIFO(mode) else api.FILE_TYPE_DISK

    def ReadFile(self, handle: Any, buffer: Any, size: int, done: Any, where: Any) -> int:
        offset = _value(where).Offset | _value(where).OffsetHigh << 32
        self.calls.append(("ReadFile", (_value(handle), size, offset)))
        data = os.pread(_value(handle), size, offset)
        if size and not data:
            return self._fail(api.ERROR_HANDLE_EOF)
        ctypes.memmove(buffer, data, len(data))
        _value(done).value = len(data)
        return 1

    def WriteFile(self, handle: Any, buffer: Any, size: int, done: Any, where: Any) -> int:
        offset = _value(where).Offset | _value(where).OffsetHigh << 32
        self.calls.append(("WriteFile", (_value(handle), size, offset)))
        _value(done).value = os.pwrite(_value(handle), ctypes.string_at(buffer, size), offset)
        return 1

    def LockFileEx(
        self, handle: Any, flags: int, reserved: int, low: int, high: int, where: Any
    ) -> int:
        self.calls.append(("LockFileEx", (_value(handle), flags, low, high)))
        try:
            fcntl.flock(_value(handle), fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            return self._fail(api.ERROR_LOCK_VIOLATION)
        return 1

    def UnlockFileEx(self, handle: Any, *rest: Any) -> int:
        fcntl.flock(_value(handle), fcntl.LOCK_UN)
        return 1

    def DeviceIoControl(
        self, handle: Any, code: int, request: Any, request_size: int, *rest: Any
    ) -> int:
        answer = _value(rest[0])
        self.calls.append(("DeviceIoControl", (_value(handle), code, request_size)))
        if self.cluster is None:
            return self._fail(ERROR_INVALID_FUNCTION)
        if code == api.FSCTL_GET_INTEGRITY_INFORMATION:
            answer.ClusterSizeInBytes = self.cluster
            return 1
        extent = _value(request)
        self.calls.append(("duplicate", (extent.FileHandle, *self._range(extent))))
        source, target, count = self._range(extent)
        data = os.pread(extent.FileHandle, count, source)
        os.pwrite(_value(handle), data, target)
        return 1

    @staticmethod
    def _range(extent: api.DuplicateExtents) -> tuple[int, int, int]:
        return extent.SourceFileOffset, extent.TargetFileOffset, extent.ByteCount


class FakeMsvcrt:
    """A C runtime descriptor is its handle here."""

    @staticmethod
    def get_osfhandle(fd: int) -> int:
        os.fstat(fd)  # EBADF for a closed one, as the C runtime
        return fd

    @staticmethod
    def open_osfhandle(handle: int, flags: int) -> int:
        return handle


def fake_api(kernel32: FakeKernel32) -> api.WindowsApi:
    return api.WindowsApi(kernel32, FakeMsvcrt(), lambda: kernel32.error)


def errno_of(code: int) -> int:
    return api.ERRNO.get(code, errno.EIO)
