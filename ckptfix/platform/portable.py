"""The portable implementation: every primitive from what Python offers on each operating
system ckptfix supports, and the base the others refine.

It keeps the same promises with weaker tools, and says where they are weaker:
- positional reads and writes without pread/pwrite: a seek and a read (or write) under a lock
  of that descriptor, so two threads never move one offset between each other's seek and
  read; a descriptor is never shared with a stream that would move it (`stream` is None);
- opens that never follow a link without O_NOFOLLOW: the entry is looked at first (lstat),
  then opened, then the open file must be the one looked at (same device and inode), else it
  is closed unread; a FIFO is refused by that first look (it has no O_NONBLOCK to fall back
  on: one swapped in between the look and the open would be waited on, on Linux only, where
  this mode runs in the tests; Windows has no FIFOs among files);
- folders without descriptors (`folders.PathFolder`): names joined to the folder's path, the
  folder's identity checked again before each use;
- the staging lock: a lock file beside the output (`locks.LockFile`);
- swaps without an atomic exchange: `exchange` says it cannot, and the staging folder moves
  the old output aside, checks it, and renames the new one in; a rename that must replace
  nothing looks first (an empty folder that appears in between is replaced: it held nothing);
- copies through a bounded buffer; nothing cloned; no extent maps; holes read as zeros.

On Linux the tests run the fast suite a second time on this implementation (`make test`;
tests/conftest.py, `--platform portable`), which is how its logic is tested here.
"""

from __future__ import annotations

import errno
import os
import signal
import stat
import threading
from collections.abc import Iterator, Sequence
from typing import BinaryIO

from ckptfix.platform.common import (
    BINARY,
    NotARegularFile,
    identity,
    not_followed,
    replaced_meanwhile,
)
from ckptfix.platform.folders import FolderHandle, PathFolder
from ckptfix.platform.locks import FolderLock, LockFile, remove_locked

_STRIPES = 64
_NR_OPEN = 1 << 20  # Linux's default ceiling (fs.nr_open) for an unlimited hard limit
COPY_BUFFER = 2**20
# (offset from the start of the range, physical address, length) of a file's blocks
Extents = list[tuple[int, int, int]]


class Platform:
    """The portable primitives (see the module's docstring); subclasses use better ones."""

    name = "portable"

    def __init__(self) -> None:
        self._offsets = [threading.Lock() for _ in range(_STRIPES)]
        self._raised = False

    # -- paths -----------------------------------------------------------------------------

    def native(self, path: str) -> str:
        """`path` as the operating system's calls take it (Windows: `\\\\?\\` when long)."""
        return path

    def is_link(self, info: os.stat_result) -> bool:
        """Whether an lstat result is a link of any kind (Windows: junctions too)."""
        return stat.S_ISLNK(info.st_mode)

    # -- reads and writes at an offset ----------------------------------------------------

    def pread(self, fd: int, size: int, offset: int) -> bytes:
        """Up to `size` bytes at `offset` (fewer only at the end of the file)."""
        with self._offsets[fd % _STRIPES]:
            os.lseek(fd, offset, os.SEEK_SET)
            return os.read(fd, size)

    def read_into(self, fd: int, target: memoryview, offset: int) -> int:
        """Read into `target` at `offset`: the count read (fewer only at the end of the file,
        or past what one call of the system reads)."""
        data = self.pread(fd, len(target), offset)
        target[: len(data)] = data
        return len(data)

    # The most views one `read_vector` call takes (one here: a view at a time).
    vector_limit = 1

    def read_vector(self, fd: int, targets: Sequence[memoryview], offset: int) -> int:
        """Read into `targets` in order from `offset`: the count read (fewer only at the end of
        the file, or past what the system reads in one call)."""
        done = 0
        for target in targets:
            count = self.read_into(fd, target, offset + done)
            done += count
            if count < len(target):
                break
        return done

    def pwrite(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> int:
        """Write at `offset`; how many bytes were written."""
        with self._offsets[fd % _STRIPES]:
            os.lseek(fd, offset, os.SEEK_SET)
            return os.write(fd, data)

    def write_all(self, fd: int, data: bytes | bytearray | memoryview, offset: int) -> None:
        """Write all of `data` at `offset` (a write may take only part of it)."""
        view = memoryview(data)
        while view:
            written = self.pwrite(fd, view, offset)
            view = view[written:]
            offset += written

    def stream(self, fd: int) -> BinaryIO | None:
        """A file object reading the file of `fd` from the start, with an offset of its own;
        None where one would share (and move) the offset `pread` relies on."""
        return None

    def sync(self, fd: int) -> None:
        """Write the file's data and metadata to the disk."""
        os.fsync(fd)

    def sync_data(self, fd: int) -> None:
        """Write the file's data to the disk (its times may wait)."""
        os.fsync(fd)

    def sync_folder(self, path: str) -> None:
        """Write a folder's entries to the disk, where the system can be asked to."""
        fd = self.open_read(path)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)

    def data_segments(self, fd: int, begin: int, end: int) -> Iterator[tuple[int, int]]:
        """The parts of [begin, end) that hold data; here all of it (holes read as zeros)."""
        yield begin, end

    # -- opening ---------------------------------------------------------------------------

    def open_regular(self, path: str, *, follow: bool = True) -> int:
        """A read-only descriptor of the regular file at `path`; anything else (a FIFO, a
        folder; with follow=False a link) is refused without being opened for reading."""
        return self._open_checked(path, os.O_RDONLY, follow=follow)

    def _open_checked(self, path: str, flags: int, *, follow: bool) -> int:
        """Look (stat, or lstat), refuse what is not a regular file, open, and make sure the
        file opened is the one looked at."""
        native = self.native(path)
        info = os.stat(native) if follow else os.lstat(native)
        if not follow and self.is_link(info):
            raise not_followed(path)
        if not stat.S_ISREG(info.st_mode):
            raise NotARegularFile(path)
        fd = os.open(native, flags | BINARY)
        if identity(os.fstat(fd)) != identity(info):
            os.close(fd)
            raise replaced_meanwhile(path)
        return fd

    def open_read(self, path: str) -> int:
        """A read-only descriptor of a file (or folder) of ckptfix's own."""
        return os.open(self.native(path), os.O_RDONLY | BINARY)

    def create(self, path: str, mode: int = 0o666) -> int:
        """A new file, created for writing (never through a link: it must not exist)."""
        return os.open(self.native(path), os.O_WRONLY | os.O_CREAT | os.O_EXCL | BINARY, mode)

    def create_rw(self, path: str, mode: int = 0o600) -> int:
        """A new file, created for reading and writing (never through a link)."""
        return os.open(self.native(path), os.O_RDWR | os.O_CREAT | os.O_EXCL | BINARY, mode)

    def open_folder(self, path: str, *, follow: bool = True) -> FolderHandle:
        """A folder to work in by names; with follow=False `path` itself must not be a link."""
        return PathFolder(self, path, follow=follow)

    # -- the staging lock, renames ------------------------------------------------------------

    def lock_folder(self, path: str) -> FolderLock:
        """An exclusive lock on the output folder at `path` for the run: BlockingIOError when
        another run holds it."""
        return LockFile.take(self, path)

    def byte_lock(self, fd: int) -> None:
        """Lock an open lock file for this descriptor alone, without waiting:
        BlockingIOError when another descriptor holds it, in this process or another.
        The portable mode runs on a POSIX host (the tests) and uses its flock here, which
        holds per open file as Windows' LockFileEx holds per handle."""
        import fcntl

        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)

    def open_lock_file(self, path: str) -> int:
        """An existing lock file, opened for reading and writing (a link is not followed)."""
        return self._open_checked(path, os.O_RDWR, follow=False)

    def drop_lock_file(self, fd: int, path: str) -> None:
        """Remove the lock file held as `fd` and let go of it."""
        remove_locked(self, fd, path)

    def remove_file(self, native: str) -> None:
        """Remove a non-folder entry of a tree ckptfix removes (a link itself)."""
        os.unlink(native)

    def pin_folder(self, native: str, *, follow: bool = True) -> object | None:
        """Hold the folder at `native` so that it cannot be renamed or removed while it is
        worked in, where the system can (Windows); None here."""
        return None

    def unpin_folder(self, pin: object) -> None:
        """Let go of a folder `pin_folder` held."""

    def exchange(self, first: str, second: str) -> bool:
        """Swap two paths atomically; False where the system cannot (nothing was done)."""
        return False

    def rename_new(self, first: str, second: str) -> None:
        """Rename `first` to `second`, which must not exist (FileExistsError)."""
        if os.path.lexists(self.native(second)):
            raise FileExistsError(errno.EEXIST, "exists", second)
        os.rename(self.native(first), self.native(second))

    def replace(self, source: str, target: str) -> None:
        """Rename the file `source` over the file `target` (the target, if any, is gone)."""
        os.replace(self.native(source), self.native(target))

    # -- copies and clones ----------------------------------------------------------------

    def copy_range(
        self, src: int, dst: int, size: int, src_offset: int, dst_offset: int
    ) -> int | None:
        """Copy up to `size` bytes in the kernel; how many, or None where these files cannot
        be copied so (the caller copies through a buffer)."""
        return None

    def copy_to_new(self, reader: int, target: str) -> tuple[int, int]:
        """A new file at `target` (created as `create` does, mode 0600) holding all of
        `reader`'s file, cloned where the file system shares blocks, else copied: (a
        descriptor writing it, the bytes it holds)."""
        writer = self.create(target, 0o600)
        try:
            return writer, self.copy_whole(reader, writer)
        except BaseException:
            os.close(writer)
            raise

    def copy_whole(self, reader: int, writer: int) -> int:
        """Copy `reader`'s file from its start into the empty file `writer`, through a
        bounded buffer; the bytes copied."""
        return self.copy_from(reader, writer, 0)

    def copy_from(self, reader: int, writer: int, start: int) -> int:
        """Copy `reader`'s file from `start` to its end into `writer` at the same offsets,
        through a bounded buffer; where it ended (the bytes the copy holds)."""
        copied = start
        while chunk := self.pread(reader, COPY_BUFFER, copied):
            self.write_all(writer, chunk, copied)
            copied += len(chunk)
        return copied

    def clone_range(
        self, src: int, src_offset: int, length: int, dst: int, dst_offset: int
    ) -> bool:
        """Share `length` bytes of `src` at `src_offset` into `dst` at `dst_offset`; False
        where the file system or these offsets do not allow it (nothing was changed)."""
        return False

    def clone_block(self, src: int, folder: str) -> int | None:
        """The block size at which `src` clones into new files in `folder`, or None."""
        return None

    def extent_map(self, fd: int, start: int, length: int) -> Extents | None:
        """Where the bytes [start, start + length) lie on the device, or None where the
        system cannot say (the caller compares bytes instead)."""
        return None

    # -- the process ---------------------------------------------------------------------------

    def stop_signals(self) -> tuple[int, ...]:
        """The signals that stop a command (and are held while an output is swapped in)."""
        return (signal.SIGINT, signal.SIGTERM)

    # Facts about the process (its descriptor limit, its user, the locks it holds) are the
    # host's own: the portable mode runs on a POSIX host, and Windows overrides them.

    def open_files_limit(self) -> int | None:
        """The soft limit on descriptors, None where there is none to respect."""
        try:
            import resource
        except ImportError:
            return None
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        return None if soft == resource.RLIM_INFINITY else soft

    def raise_open_files_limit(self) -> int | None:
        """Raise the soft limit to the hard one where allowed (once per process); the limit
        then in force."""
        try:
            import resource
        except ImportError:
            return None
        soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
        if not self._raised:
            self._raised = True
            target = hard if hard != resource.RLIM_INFINITY else max(soft, _NR_OPEN)
            if soft != resource.RLIM_INFINITY and soft < target:
                try:
                    resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
                    soft = target
                except (ValueError, OSError):
                    pass  # a container's ceiling below the hard limit: keep the soft one
        return soft if soft != resource.RLIM_INFINITY else _NR_OPEN

    def effective_user(self) -> int | None:
        """The user this process acts as, None where ownership is not a number (folders
        are then judged by whether they are writable alone)."""
        geteuid = getattr(os, "geteuid", None)
        return None if geteuid is None else int(geteuid())

    def may_own_anything(self) -> bool:
        """Whether this process may remove another user's entries of a sticky folder: here
        never assumed (a sticky folder holding one is refused, never half removed)."""
        return False

    def disk_space(self, folder: str) -> tuple[int, bool]:
        """(bytes available to this user, whether the file system is known to be read-only:
        here never, and a write there fails with its own error, EROFS, before anything is
        created)."""
        import shutil

        return shutil.disk_usage(self.native(folder)).free, False

    def set_mode(self, fd: int, path: str, mode: int) -> None:
        """Give the file open as `fd` at `path` these permission bits."""
        os.chmod(self.native(path), mode)

    def set_times(self, fd: int, path: str, times_ns: tuple[int, int]) -> None:
        """Give the file open as `fd` at `path` these access and modification times."""
        os.utime(self.native(path), ns=times_ns)
