"""The Win32 calls the Windows implementation makes, through ctypes: each one a small typed
method of `WindowsApi`, its failure an OSError with the POSIX errno the rest of ckptfix
knows. Tests replace kernel32 and msvcrt (`WindowsApi(kernel32, msvcrt, last_error)`) and so
exercise everything above these calls on Linux: the offsets, structures and flags passed,
and what each answer becomes. Also here: long paths (`long_path`, pure string work)."""

from __future__ import annotations

import ctypes
import errno
import ntpath
import os
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

GENERIC_READ = 0x80000000
GENERIC_WRITE = 0x40000000
FILE_READ_ATTRIBUTES = 0x80
FILE_SHARE_READ, FILE_SHARE_WRITE, FILE_SHARE_DELETE = 0x1, 0x2, 0x4
SHARE_ALL = FILE_SHARE_READ | FILE_SHARE_WRITE | FILE_SHARE_DELETE
OPEN_EXISTING = 3
FILE_FLAG_BACKUP_SEMANTICS = 0x02000000  # needed to open a folder
FILE_FLAG_OPEN_REPARSE_POINT = 0x00200000  # the link itself, never what it points to
FILE_ATTRIBUTE_DIRECTORY = 0x10
FILE_ATTRIBUTE_REPARSE_POINT = 0x400
NAME_SURROGATE = 0x20000000  # a reparse tag that names another file (symlinks, junctions)
FILE_TYPE_DISK = 1
FILE_ATTRIBUTE_TAG_INFO = 9  # FILE_INFO_BY_HANDLE_CLASS FileAttributeTagInfo
LOCKFILE_FAIL_IMMEDIATELY, LOCKFILE_EXCLUSIVE_LOCK = 0x1, 0x2
FSCTL_DUPLICATE_EXTENTS_TO_FILE = 0x00098344
FSCTL_GET_INTEGRITY_INFORMATION = 0x0009027C
INVALID_HANDLE_VALUE = -1
MAX_CALL = 2**30  # bytes per ReadFile/WriteFile (their counts are 32-bit)
# Paths this long or longer need the \\?\ form (MAX_PATH, less room for an 8.3 name).
LONG_PATH = 248

# Win32 error codes and the errno each stands for.
ERROR_HANDLE_EOF = 38
ERROR_LOCK_VIOLATION = 33
ERRNO = {
    1: errno.EINVAL,  # ERROR_INVALID_FUNCTION (a file system without the request)
    2: errno.ENOENT,  # ERROR_FILE_NOT_FOUND
    3: errno.ENOENT,  # ERROR_PATH_NOT_FOUND
    5: errno.EACCES,  # ERROR_ACCESS_DENIED
    6: errno.EBADF,  # ERROR_INVALID_HANDLE
    17: errno.EXDEV,  # ERROR_NOT_SAME_DEVICE
    19: errno.EROFS,  # ERROR_WRITE_PROTECT
    32: errno.EACCES,  # ERROR_SHARING_VIOLATION
    33: errno.EAGAIN,  # ERROR_LOCK_VIOLATION
    50: errno.EOPNOTSUPP,  # ERROR_NOT_SUPPORTED
    80: errno.EEXIST,  # ERROR_FILE_EXISTS
    87: errno.EINVAL,  # ERROR_INVALID_PARAMETER
    112: errno.ENOSPC,  # ERROR_DISK_FULL
    145: errno.ENOTEMPTY,  # ERROR_DIR_NOT_EMPTY
    183: errno.EEXIST,  # ERROR_ALREADY_EXISTS
    206: errno.ENAMETOOLONG,  # ERROR_FILENAME_EXCED_RANGE
    1921: errno.ELOOP,  # ERROR_CANT_RESOLVE_FILENAME
}


def os_error(code: int, path: str | None = None) -> OSError:
    """The OSError for Win32 error `code`, with the errno it stands for."""
    number = ERRNO.get(code, errno.EIO)
    return OSError(number, f"{os.strerror(number)} (Windows error {code})", path)


def long_path(path: str) -> str:
    """`path` in the \\\\?\\ form Windows needs past MAX_PATH (absolute, normalised: that
    form is taken as it is, `.` and `..` included), UNC paths as \\\\?\\UNC\\server\\share;
    a shorter path, or one already in that form, unchanged."""
    if path.startswith(("\\\\?\\", "\\\\.\\")):
        return path
    full = ntpath.abspath(path)
    if len(full) < LONG_PATH:
        return path
    if full.startswith("\\\\"):
        return "\\\\?\\UNC\\" + full[2:]
    return "\\\\?\\" + full


class _Overlapped(ctypes.Structure):
    """OVERLAPPED: only the offset is used (synchronous handles; no event)."""

    _fields_ = (
        ("Internal", ctypes.c_size_t),
        ("InternalHigh", ctypes.c_size_t),
        ("Offset", ctypes.c_uint32),
        ("OffsetHigh", ctypes.c_uint32),
        ("hEvent", ctypes.c_void_p),
    )


def overlapped(offset: int) -> _Overlapped:
    """An OVERLAPPED naming the 64-bit file offset `offset` (low and high halves)."""
    return _Overlapped(0, 0, offset & 0xFFFFFFFF, offset >> 32, None)


class _AttributeTag(ctypes.Structure):
    _fields_ = (("FileAttributes", ctypes.c_uint32), ("ReparseTag", ctypes.c_uint32))


class DuplicateExtents(ctypes.Structure):
    """DUPLICATE_EXTENTS_DATA: the source handle and the ranges (ReFS block cloning)."""

    _fields_ = (
        ("FileHandle", ctypes.c_void_p),
        ("SourceFileOffset", ctypes.c_int64),
        ("TargetFileOffset", ctypes.c_int64),
        ("ByteCount", ctypes.c_int64),
    )


class _Integrity(ctypes.Structure):
    """FSCTL_GET_INTEGRITY_INFORMATION_BUFFER (ReFS): its cluster size is what clones."""

    _fields_ = (
        ("ChecksumAlgorithm", ctypes.c_uint16),
        ("Reserved", ctypes.c_uint16),
        ("Flags", ctypes.c_uint32),
        ("ChecksumChunkSizeInBytes", ctypes.c_uint32),
        ("ClusterSizeInBytes", ctypes.c_uint32),
    )


@dataclass(frozen=True)
class FileTag:
    """What a handle is: its attributes and reparse tag."""

    attributes: int
    tag: int

    @property
    def folder(self) -> bool:
        return bool(self.attributes & FILE_ATTRIBUTE_DIRECTORY)

    @property
    def names_another(self) -> bool:
        """A symlink or a junction (a reparse point that is a name of another file); other
        reparse points (cloud placeholders, deduplicated files) are files in their own right."""
        return bool(self.attributes & FILE_ATTRIBUTE_REPARSE_POINT and self.tag & NAME_SURROGATE)

    @property
    def reparse(self) -> bool:
        return bool(self.attributes & FILE_ATTRIBUTE_REPARSE_POINT)


def _h(handle: int) -> ctypes.c_void_p:
    return ctypes.c_void_p(handle)


def _load() -> tuple[Any, Any, Callable[[], int]]:
    import msvcrt

    kernel32 = ctypes.WinDLL("kernel32", use_last_error=True)  # type: ignore[attr-defined]
    kernel32.CreateFileW.restype = ctypes.c_void_p
    kernel32.CreateFileW.argtypes = (
        ctypes.c_wchar_p,
        *(ctypes.c_uint32,) * 2,
        ctypes.c_void_p,
        *(ctypes.c_uint32,) * 2,
        ctypes.c_void_p,
    )
    for name in ("ReadFile", "WriteFile", "CloseHandle", "GetFileType", "LockFileEx"):
        getattr(kernel32, name).restype = ctypes.c_int
    for name in ("UnlockFileEx", "DeviceIoControl", "GetFileInformationByHandleEx"):
        getattr(kernel32, name).restype = ctypes.c_int
    return kernel32, msvcrt, ctypes.get_last_error  # type: ignore[attr-defined]


class WindowsApi:
    """kernel32 and msvcrt, as ckptfix uses them (see the module's docstring)."""

    def __init__(
        self, kernel32: Any = None, msvcrt: Any = None, last_error: Callable[[], int] | None = None
    ) -> None:
        if kernel32 is None:
            kernel32, msvcrt, last_error = _load()
        self.kernel32, self.msvcrt = kernel32, msvcrt
        self.last_error = last_error or (lambda: 0)

    def _fail(self, path: str | None = None) -> OSError:
        return os_error(self.last_error(), path)

    def handle(self, fd: int) -> int:
        return int(self.msvcrt.get_osfhandle(fd))

    def descriptor(self, handle: int, flags: int) -> int:
        """A C runtime descriptor owning `handle` (closing it closes the handle)."""
        try:
            return int(self.msvcrt.open_osfhandle(handle, flags))
        except BaseException:
            self.close(handle)
            raise

    def open(self, path: str, access: int, share: int, flags: int) -> int:
        """CreateFileW of an existing file or folder: its handle."""
        handle = self.kernel32.CreateFileW(path, access, share, None, OPEN_EXISTING, flags, None)
        if handle is None or handle == INVALID_HANDLE_VALUE or handle == 2**64 - 1:
            raise self._fail(path)
        return int(handle)

    def close(self, handle: int) -> None:
        self.kernel32.CloseHandle(_h(handle))

    def tag(self, handle: int) -> FileTag:
        info = _AttributeTag()
        size = ctypes.sizeof(info)
        call = self.kernel32.GetFileInformationByHandleEx
        if not call(_h(handle), FILE_ATTRIBUTE_TAG_INFO, ctypes.byref(info), size):
            raise self._fail()
        return FileTag(info.FileAttributes, info.ReparseTag)

    def on_disk(self, handle: int) -> bool:
        """Whether the handle is a file on a disk (not a pipe, a console, a device)."""
        return bool(self.kernel32.GetFileType(_h(handle)) == FILE_TYPE_DISK)

    def read_at(self, handle: int, target: Any, size: int, offset: int) -> int:
        """ReadFile of up to `size` bytes at `offset` into the ctypes buffer `target`: the
        count read, 0 at the end of the file. The offset is the call's own (OVERLAPPED):
        no seek that another thread could move between it and the read."""
        done = ctypes.c_uint32(0)
        where = overlapped(offset)
        read = self.kernel32.ReadFile
        if not read(_h(handle), target, size, ctypes.byref(done), ctypes.byref(where)):
            code = self.last_error()
            if code == ERROR_HANDLE_EOF:
                return 0
            raise os_error(code)
        return done.value

    def write_at(self, handle: int, source: Any, size: int, offset: int) -> int:
        """WriteFile of `size` bytes of the ctypes buffer `source` at `offset`: the count."""
        done = ctypes.c_uint32(0)
        where = overlapped(offset)
        write = self.kernel32.WriteFile
        if not write(_h(handle), source, size, ctypes.byref(done), ctypes.byref(where)):
            raise self._fail()
        return done.value

    def lock(self, handle: int) -> None:
        """LockFileEx of the first byte, exclusive, without waiting: BlockingIOError when
        another handle holds it."""
        flags = LOCKFILE_EXCLUSIVE_LOCK | LOCKFILE_FAIL_IMMEDIATELY
        where = overlapped(0)
        if not self.kernel32.LockFileEx(_h(handle), flags, 0, 1, 0, ctypes.byref(where)):
            code = self.last_error()
            if code == ERROR_LOCK_VIOLATION:
                raise BlockingIOError(errno.EAGAIN, "locked by another process")
            raise os_error(code)

    def unlock(self, handle: int) -> None:
        self.kernel32.UnlockFileEx(_h(handle), 0, 1, 0, ctypes.byref(overlapped(0)))

    def control(self, handle: int, code: int, request: Any, answer: Any) -> bool:
        """DeviceIoControl; False when the file system does not do `code` (not ReFS)."""
        returned = ctypes.c_uint32(0)
        request_size = ctypes.sizeof(request) if request is not None else 0
        answer_size = ctypes.sizeof(answer) if answer is not None else 0
        request_ref = ctypes.byref(request) if request is not None else None
        answer_ref = ctypes.byref(answer) if answer is not None else None
        call = self.kernel32.DeviceIoControl
        sizes = (request_size, answer_ref, answer_size, ctypes.byref(returned), None)
        if call(_h(handle), code, request_ref, *sizes):
            return True
        failure = os_error(self.last_error())
        if failure.errno in (errno.EINVAL, errno.EOPNOTSUPP, errno.EXDEV, errno.EACCES):
            return False
        raise failure

    def cluster(self, handle: int) -> int | None:
        """The cluster size of a file on ReFS (the unit block cloning shares); None for any
        other file system."""
        answer = _Integrity()
        if not self.control(handle, FSCTL_GET_INTEGRITY_INFORMATION, None, answer):
            return None
        return answer.ClusterSizeInBytes or None

    def duplicate(self, src: int, dst: int, extent: tuple[int, int, int]) -> bool:
        """FSCTL_DUPLICATE_EXTENTS_TO_FILE on `dst`: its range shares `src`'s clusters.
        `extent`: (source offset, target offset, byte count)."""
        request = DuplicateExtents(src, *extent)
        return self.control(dst, FSCTL_DUPLICATE_EXTENTS_TO_FILE, request, None)
