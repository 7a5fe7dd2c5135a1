"""Folders worked in by the names of their entries, never through a link.

`FdFolder` (POSIX) holds the folder's descriptor and does everything relative to it (the
`*at` calls: O_NOFOLLOW, dir_fd): a folder swapped for a link after it was opened is never
walked into, whatever happens to its path. `PathFolder` (everywhere else, and the portable
mode) joins names to the folder's path: the folder must be a real one when opened, and the
same folder (device and inode) before each use; entries are looked at (lstat) before they
are opened and must be the same file once open. A swap between that check and the call
that follows is what it cannot exclude; on Windows the folder is also held open without
FILE_SHARE_DELETE (`Platform.pin_folder`), so it cannot be renamed or removed meanwhile.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from typing import TYPE_CHECKING, Protocol

from ckptfix.platform.common import (
    NotARegularFile,
    closed,
    identity,
    not_followed,
    replaced_meanwhile,
)

if TYPE_CHECKING:
    from ckptfix.platform.portable import Platform
    from ckptfix.platform.posix import Posix

_OWNER_ALL = stat.S_IRWXU


class FolderHandle(Protocol):
    """An open folder. Every name is an entry of it (no separators); nothing follows a link
    at that entry, and a link among them is removed itself, never what it points to."""

    path: str

    def open_file(self, name: str) -> int:
        """A read-only descriptor of the regular file `name`: ELOOP for a link,
        NotARegularFile for anything else (never opened for reading, never waited on)."""
        ...

    def create(self, name: str, mode: int) -> int:
        """A new file `name` for writing (FileExistsError if anything has that name)."""
        ...

    def child(self, name: str) -> FolderHandle:
        """The folder `name`: ELOOP for a link, ENOTDIR for anything else."""
        ...

    def child_to_remove(self, name: str) -> FolderHandle:
        """The folder `name` (as `child`), made readable, writable and searchable by its
        owner first if it was not, so that its entries can be removed."""
        ...

    def mkdir(self, name: str) -> None: ...

    def lstat(self, name: str) -> os.stat_result: ...

    def unlink(self, name: str) -> None:
        """Remove a non-folder entry (a link itself); IsADirectoryError for a folder."""
        ...

    def rmdir(self, name: str) -> None: ...

    def names(self) -> list[str]: ...

    def readlink(self, name: str) -> str: ...

    def link(self, name: str, target: str) -> None:
        """Hard-link the entry `name` (never what it points to) as the path `target`."""
        ...

    def replace(self, source: str, target: str) -> None:
        """Rename entry `source` over entry `target`."""
        ...

    def close(self) -> None: ...

    def __enter__(self) -> FolderHandle: ...

    def __exit__(self, *exc: object) -> None: ...


class _Closing:
    def close(self) -> None:
        raise NotImplementedError

    def __enter__(self) -> FolderHandle:
        return self  # type: ignore[return-value]  # each subclass is a FolderHandle

    def __exit__(self, *exc: object) -> None:
        self.close()


class FdFolder(_Closing):
    """A folder held by its descriptor (POSIX): every call relative to it."""

    def __init__(self, host: Posix, fd: int, path: str) -> None:
        self.host, self.fd, self.path = host, fd, path

    @classmethod
    def open(cls, host: Posix, path: str, *, follow: bool) -> FdFolder:
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
        return cls(host, os.open(path, flags), path)

    def open_file(self, name: str) -> int:
        # O_NONBLOCK: a FIFO is refused below, never waited on; it means nothing for a file
        flags = os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC
        fd = os.open(name, flags, dir_fd=self.fd)
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            os.close(fd)
            raise NotARegularFile(os.path.join(self.path, name))
        return fd

    def create(self, name: str, mode: int) -> int:
        flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
        return os.open(name, flags, mode, dir_fd=self.fd)

    def child(self, name: str) -> FdFolder:
        flags = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
        return FdFolder(self.host, os.open(name, flags, dir_fd=self.fd), self.joined(name))

    def child_to_remove(self, name: str) -> FdFolder:
        try:
            child = self.child(name)
        except PermissionError:  # not even readable: opened up without following a link
            self.host.add_owner_access_at(self.fd, name)
            child = self.child(name)
        mode = stat.S_IMODE(os.fstat(child.fd).st_mode)
        if mode & _OWNER_ALL != _OWNER_ALL:
            os.fchmod(child.fd, mode | _OWNER_ALL)
        return child

    def mkdir(self, name: str) -> None:
        os.mkdir(name, dir_fd=self.fd)

    def lstat(self, name: str) -> os.stat_result:
        return os.stat(name, dir_fd=self.fd, follow_symlinks=False)

    def unlink(self, name: str) -> None:
        try:
            os.unlink(name, dir_fd=self.fd)
        except PermissionError:  # macOS and BSDs refuse a folder so (Linux: EISDIR)
            if stat.S_ISDIR(self.lstat(name).st_mode):
                raise IsADirectoryError(errno.EISDIR, "is a folder", self.joined(name)) from None
            raise

    def rmdir(self, name: str) -> None:
        os.rmdir(name, dir_fd=self.fd)

    def names(self) -> list[str]:
        return os.listdir(self.fd)

    def readlink(self, name: str) -> str:
        return os.readlink(name, dir_fd=self.fd)

    def link(self, name: str, target: str) -> None:
        os.link(name, target, src_dir_fd=self.fd, follow_symlinks=False)

    def replace(self, source: str, target: str) -> None:
        os.replace(source, target, src_dir_fd=self.fd, dst_dir_fd=self.fd)

    def joined(self, name: str) -> str:
        return os.path.join(self.path, name)

    def close(self) -> None:
        self.fd = closed(self.fd)


class PathFolder(_Closing):
    """A folder known by its path and identity (see the module's docstring)."""

    def __init__(self, host: Platform, path: str, *, follow: bool = True) -> None:
        self.host, self.path = host, path
        native = host.native(path)
        info = os.stat(native) if follow else os.lstat(native)
        if not follow and host.is_link(info):
            raise not_followed(path)
        if not stat.S_ISDIR(info.st_mode):
            raise NotADirectoryError(errno.ENOTDIR, "not a folder", path)
        self._identity = identity(info)
        self._pin = host.pin_folder(native, follow=follow)
        try:
            self._check()  # the one pinned is the one looked at
        except BaseException:
            self.close()
            raise

    def _check(self) -> None:
        if identity(os.stat(self.host.native(self.path))) != self._identity:
            raise replaced_meanwhile(self.path)

    def at(self, name: str) -> str:
        """The native path of entry `name`, once the folder is checked to be the one opened."""
        self._check()
        return self.host.native(os.path.join(self.path, name))

    def open_file(self, name: str) -> int:
        return self.host.open_regular(self.at(name), follow=False)

    def create(self, name: str, mode: int) -> int:
        return self.host.create(self.at(name), mode)

    def child(self, name: str) -> PathFolder:
        self._check()
        return PathFolder(self.host, os.path.join(self.path, name), follow=False)

    def child_to_remove(self, name: str) -> PathFolder:
        path = self.at(name)
        info = os.lstat(path)
        if self.host.is_link(info):
            raise not_followed(path)
        if stat.S_ISDIR(info.st_mode) and info.st_mode & _OWNER_ALL != _OWNER_ALL:
            os.chmod(path, stat.S_IMODE(info.st_mode) | _OWNER_ALL)
        return self.child(name)

    def mkdir(self, name: str) -> None:
        os.mkdir(self.at(name))

    def lstat(self, name: str) -> os.stat_result:
        return os.lstat(self.at(name))

    def unlink(self, name: str) -> None:
        path = self.at(name)
        info = os.lstat(path)
        if stat.S_ISDIR(info.st_mode) and not self.host.is_link(info):
            raise IsADirectoryError(errno.EISDIR, "is a folder", path)
        self.host.remove_file(path)  # a link (Windows: a junction too) is removed itself

    def rmdir(self, name: str) -> None:
        os.rmdir(self.at(name))

    def names(self) -> list[str]:
        return os.listdir(self.at(""))

    def readlink(self, name: str) -> str:
        return os.readlink(self.at(name))

    def link(self, name: str, target: str) -> None:
        """A link made by path may follow a link swapped in meanwhile: the new entry must be
        the one looked at, else it is removed and this fails."""
        path = self.at(name)
        before = os.lstat(path)
        if self.host.is_link(before):
            raise not_followed(path)
        os.link(path, self.host.native(target))
        after = os.lstat(self.host.native(target))
        # the type too: a number freed by a removed file may be the link's that replaced it
        if (identity(after), stat.S_IFMT(after.st_mode)) != (
            identity(before),
            stat.S_IFMT(before.st_mode),
        ):
            os.unlink(self.host.native(target))
            raise replaced_meanwhile(path)

    def replace(self, source: str, target: str) -> None:
        os.replace(self.at(source), self.at(target))

    def close(self) -> None:
        pin, self._pin = getattr(self, "_pin", None), None
        if pin is not None:
            with contextlib.suppress(OSError):
                self.host.unpin_folder(pin)
