"""The one interface every reader and writer uses to get bytes.

A ByteSource is a file's bytes: its size, `read_at(offset, size)`, and a change token that
tells whether it is still the file that was read. Local files also expose a descriptor, so
the writer can use `copy_file_range` and reflinks. Remote sources (fsspec) implement the
same interface with ranged requests; nothing else in ckptfix needs to know the difference.
"""

from __future__ import annotations

import errno
import io
import os
import stat
import threading
from typing import Any, BinaryIO, Protocol, runtime_checkable

from ckptfix.core.errors import CorruptFileError, SourceChangedError


@runtime_checkable
class ByteSource(Protocol):
    """Random access to one file's bytes."""

    @property
    def label(self) -> str:
        """The name shown to the user (a path or a URL)."""

    @property
    def size(self) -> int: ...

    def read_at(self, offset: int, size: int) -> bytes:
        """Exactly `size` bytes from `offset`: a range past the end is a CorruptFileError
        (rule truncated), a file that shrinks during the read a SourceChangedError."""

    def change_token(self) -> tuple[object, ...]:
        """Equal before and after a run only if the file did not change in between."""

    def fileno(self) -> int | None:
        """A descriptor for kernel copies, or None for sources that have none."""


def past_end(label: str, needed: int, size: int) -> CorruptFileError:
    """A read that the file's own structure asked for, past its end."""
    return CorruptFileError(
        label,
        "truncated",
        f"the file's structure points to byte {needed} but the file has {size} bytes",
        "re-download the file",
    )


def pread_exact(fd: int, offset: int, size: int, label: str | None = None) -> bytes:
    """pread in a loop (one call returns at most about 2 GiB on Linux); a file that ends
    early changed under us or was truncated."""
    parts = []
    while size:
        part = os.pread(fd, min(size, 1 << 30), offset)
        if not part:
            raise SourceChangedError(label)
        parts.append(part)
        offset += len(part)
        size -= len(part)
    return b"".join(parts)


def _open_regular(path: str) -> int:
    """A read-only descriptor of a regular file. O_NONBLOCK: a FIFO put in the file's place
    after it was checked must be refused, not waited on for ever (it means nothing for
    reading a regular file)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | getattr(os, "O_CLOEXEC", 0))
    if not stat.S_ISREG(os.fstat(fd).st_mode):
        os.close(fd)
        raise OSError(errno.EINVAL, "not a regular file")
    return fd


class LocalFile:
    """A local file, opened read-only on first use and kept open (one descriptor)."""

    def __init__(self, path: str, label: str | None = None) -> None:
        self.path = path
        self._label = label if label is not None else path
        self._fd: int | None = None
        self._size: int | None = None
        self._lock = threading.Lock()

    @property
    def label(self) -> str:
        return self._label

    @property
    def size(self) -> int:
        """The size when the file was first opened: reads are checked against it, and a
        file that shrinks later has changed under us."""
        if self._size is None:
            self._size = os.fstat(self.fd()).st_size
        return self._size

    def fd(self) -> int:
        with self._lock:
            if self._fd is None:
                try:
                    self._fd = _open_regular(self.path)
                except OSError as exc:
                    raise CorruptFileError(
                        self._label,
                        "unreadable",
                        f"cannot read the file: {exc.strerror}",
                        "check its permissions",
                    ) from exc
            return self._fd

    def fileno(self) -> int | None:
        return self.fd()

    def read_at(self, offset: int, size: int) -> bytes:
        if offset + size > self.size:
            raise past_end(self._label, offset + size, self.size)
        return pread_exact(self.fd(), offset, size, self._label)

    def change_token(self) -> tuple[object, ...]:
        stat = os.fstat(self.fd())
        return (stat.st_dev, stat.st_ino, stat.st_size, stat.st_mtime_ns)

    def close(self) -> None:
        with self._lock:
            if self._fd is not None:
                os.close(self._fd)
                self._fd = None

    def __del__(self) -> None:  # a safety net: owners close their sources explicitly
        # Forgotten once closed: an owner's close() that runs later (a reference cycle
        # collected at exit) must not close the number again, by then maybe another file's.
        fd, self._fd = self._fd, None
        if fd is not None:
            os.close(fd)

    def __enter__(self) -> LocalFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _SourceReader(io.RawIOBase):
    """A read-only, seekable file object over a ByteSource (for zipfile)."""

    def __init__(self, source: ByteSource) -> None:
        super().__init__()
        self._source = source
        self._size = source.size
        self._position = 0

    def readable(self) -> bool:
        return True

    def seekable(self) -> bool:
        return True

    def tell(self) -> int:
        return self._position

    def seek(self, offset: int, whence: int = io.SEEK_SET) -> int:
        base = {io.SEEK_SET: 0, io.SEEK_CUR: self._position, io.SEEK_END: self._size}[whence]
        self._position = max(base + offset, 0)
        return self._position

    def readinto(self, buffer: Any) -> int:
        size = max(min(len(buffer), self._size - self._position), 0)
        if size:
            data = self._source.read_at(self._position, size)
            buffer[:size] = data
            self._position += size
        return size


def open_stream(source: ByteSource) -> BinaryIO:
    """A file object reading `source`: the file itself when it is local."""
    if isinstance(source, LocalFile):
        return os.fdopen(os.dup(source.fd()), "rb")
    return io.BufferedReader(_SourceReader(source), buffer_size=2**16)
