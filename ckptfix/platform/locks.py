"""The lock a write holds on an existing output folder for the whole run, so that a second
ckptfix writing to it fails at once (the record of the folder still catches other programs).

POSIX locks the folder itself (`FolderFlock`: flock on its descriptor). Where a folder cannot
be locked (Windows) the lock is on a file beside it (`LockFile`): `.ckptfix-lock-<digest of
the folder's name>`, created exclusively holding a fixed first line, locked without waiting,
and removed by its holder at the end. The operating system drops the lock of a process that
dies, so a file a killed run left behind is taken over by the next run, and removed by it. A
file of that name without the fixed line is not ckptfix's and is never locked or removed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import TYPE_CHECKING, Protocol

from ckptfix.platform.common import closed, identity

if TYPE_CHECKING:
    from ckptfix.platform.portable import Platform

MAGIC = b"ckptfix lock file; removed by the run that holds it\n"
PREFIX = ".ckptfix-lock-"
_ATTEMPTS = 8


class FolderLock(Protocol):
    def release(self) -> None:
        """Drop the lock (once; later calls do nothing)."""
        ...


class NotOurLockFile(FileExistsError):
    """The lock file's name is taken by a file ckptfix did not write: it is left alone."""


class Unlocked:
    """A file system without locks: the record of the folder still catches other writers."""

    def release(self) -> None:
        pass


class FolderFlock:
    """flock(2) on the folder's own descriptor (POSIX)."""

    def __init__(self, fd: int) -> None:
        self.fd = fd

    @classmethod
    def take(cls, path: str) -> FolderLock:
        import fcntl

        fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(fd)
            if isinstance(exc, BlockingIOError):
                raise
            if exc.errno not in (errno.ENOLCK, errno.EOPNOTSUPP, errno.ENOSYS, errno.EINVAL):
                raise
            return Unlocked()
        return cls(fd)

    def release(self) -> None:
        self.fd = closed(self.fd)


def lock_file_path(folder: str) -> str:
    """Where the lock of `folder` is kept: beside it, under a name of bounded length."""
    import hashlib

    parent, name = os.path.split(os.path.normpath(folder))
    digest = hashlib.blake2b(os.fsencode(name), digest_size=8).hexdigest()
    return os.path.join(parent, PREFIX + digest)


# The lock files this process holds: a process that must exit at once (the console
# script's answer to a signal outside a write) removes them first (`release_held`).
_HELD: dict[int, LockFile] = {}


def release_held() -> None:
    """Release every lock file this process holds."""
    for lock in list(_HELD.values()):
        lock.release()


class LockFile:
    """A lock file beside the folder (see the module's docstring)."""

    def __init__(self, host: Platform, fd: int, path: str) -> None:
        self.host, self.fd, self.path = host, fd, path
        _HELD[id(self)] = self

    @classmethod
    def take(cls, host: Platform, folder: str) -> FolderLock:
        path = lock_file_path(folder)
        for _ in range(_ATTEMPTS):
            try:
                fd = _open_or_create(host, path)
            except PermissionError:  # a parent we may not write to: the write fails there
                return Unlocked()  # anyway, with its own error; the record catches others
            if fd is None:
                continue  # removed between the two looks: again
            try:
                host.byte_lock(fd)
                if _still_named(host, fd, path):
                    _check_ours(host, fd, path)
                    return cls(host, fd, path)
            except BaseException:
                os.close(fd)
                raise
            os.close(fd)  # removed by its holder while we waited to lock it: again
        raise BlockingIOError(errno.EAGAIN, "the lock file keeps changing", path)

    def release(self) -> None:
        if self.fd < 0:
            return
        fd, self.fd = self.fd, -1
        _HELD.pop(id(self), None)
        self.host.drop_lock_file(fd, self.path)


def _open_or_create(host: Platform, path: str) -> int | None:
    """The lock file, created with its first line, or the existing one opened (a link is
    not followed); None if it vanished in between."""
    try:
        fd = host.create_rw(path, 0o644)
    except FileExistsError:
        pass
    else:
        try:
            host.write_all(fd, MAGIC, 0)
        except BaseException:
            os.close(fd)
            raise
        return fd
    try:
        return host.open_lock_file(path)
    except FileNotFoundError:
        return None


def _still_named(host: Platform, fd: int, path: str) -> bool:
    try:
        info = os.lstat(host.native(path))
    except FileNotFoundError:
        return False
    return identity(info) == identity(os.fstat(fd))


def _check_ours(host: Platform, fd: int, path: str) -> None:
    info = os.fstat(fd)
    if not stat.S_ISREG(info.st_mode) or host.pread(fd, len(MAGIC), 0) != MAGIC:
        raise NotOurLockFile(errno.EEXIST, "is not a lock file of ckptfix", path)


def remove_locked(host: Platform, fd: int, path: str) -> None:
    """POSIX: unlink the lock file while still holding it, then close (a process that opened
    it meanwhile finds it no longer named so once it has the lock, and starts again)."""
    try:
        if _still_named(host, fd, path):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(host.native(path))
    finally:
        os.close(fd)
