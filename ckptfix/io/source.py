"""The one interface every reader and writer uses to get bytes.

A ByteSource is a file's bytes: its size, `read_at(offset, size)`, and a change token that
tells whether it is still the file that was read. Local files also lend a descriptor
(`descriptor`), so the writer can use kernel copies and clones. Remote sources
(fsspec) implement the same interface with ranged requests; nothing else in ckptfix needs to
know the difference.
"""

from __future__ import annotations

import io
import os
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any, BinaryIO, Protocol, runtime_checkable

from ckptfix.core.errors import CorruptFileError, SourceChangedError
from ckptfix.io.descriptors import OUT_OF_DESCRIPTORS, POOL, out_of_descriptors, with_room
from ckptfix.platform import system


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

    def identity(self) -> tuple[object, ...]:
        """What tells this version of the file from another wherever it is read (a split
        run's plan digest: write.parts): not its path, which another process may spell
        otherwise, and not what only one machine sees (a device or inode number)."""


def past_end(label: str, needed: int, size: int) -> CorruptFileError:
    """A read that the file's own structure asked for, past its end."""
    return CorruptFileError(
        label,
        "truncated",
        f"the file's structure points to byte {needed} but the file has {size} bytes",
        "re-download the file",
    )


@contextmanager
def _reading(label: str | None) -> Iterator[None]:
    """A read of the file `label` names that the OS fails (an I/O error, a network file
    system's stale handle) is that file's one-line error, as a refused open is; without a
    label (the writers reading their own output back) the OSError is the caller's."""
    try:
        yield
    except OSError as exc:
        if label is None:
            raise
        raise unreadable_file(label, exc) from exc


def pread_exact(fd: int, offset: int, size: int, label: str | None = None) -> bytes:
    """Reads at an offset in a loop (one call returns at most about 2 GiB on Linux, 1 GiB
    asked here); a file that ends early changed under us or was truncated."""
    parts = []
    with _reading(label):
        while size:
            part = system().pread(fd, min(size, 1 << 30), offset)
            if not part:
                raise SourceChangedError(label)
            parts.append(part)
            offset += len(part)
            size -= len(part)
    return b"".join(parts)


def preadv_exact(fd: int, offset: int, buffers: Sequence[Any], label: str | None = None) -> None:
    """Fill `buffers` (writable views, in order) from `offset` on, `vector_limit` of them per system
    call; a file that ends early changed under us."""
    limit = system().vector_limit
    with _reading(label):
        for first in range(0, len(buffers), limit):
            batch = buffers[first : first + limit]
            want = sum(map(len, batch))
            got = system().read_vector(fd, batch, offset)
            if got < want:  # short (never from the page cache but at the end of the file)
                _read_rest(fd, offset + got, _after(batch, got), label)
            offset += want


def _after(buffers: Sequence[Any], done: int) -> list[Any]:
    """What of `buffers` is left once their first `done` bytes are filled."""
    rest = []
    for buffer in buffers:
        view = memoryview(buffer).cast("B")
        if done >= len(view):
            done -= len(view)
            continue
        rest.append(view[done:])
        done = 0
    return rest


def _read_rest(fd: int, offset: int, buffers: Sequence[Any], label: str | None) -> None:
    for view in buffers:
        while len(view):
            data = system().pread(fd, min(len(view), 1 << 30), offset)
            if not data:
                raise SourceChangedError(label)
            view[: len(data)] = data
            view, offset = view[len(data) :], offset + len(data)


def read_into(source: ByteSource, offset: int, buffer: memoryview) -> None:
    """`len(buffer)` bytes of `source` from `offset` into `buffer` (a writable view): read
    straight into it for a local file, with the range checked as `read_at` checks it."""
    if isinstance(source, LocalFile):
        source.read_into(offset, [buffer])
    else:
        buffer[:] = source.read_at(offset, len(buffer))


def unreadable_file(label: str, exc: OSError) -> CorruptFileError:
    """A file that cannot be opened for reading (no permission, another user's) or whose
    read failed (an I/O error): one line."""
    refused = isinstance(exc, PermissionError)
    fix = "check its permissions" if refused else "check the disk or file system it is on"
    return CorruptFileError(label, "unreadable", f"cannot read the file: {exc.strerror}", fix)


class LocalFile:
    """A local file, opened read-only on first use. Its descriptor belongs to the shared
    pool (io.descriptors), which may close it while nobody reads; it is then reopened when
    its bytes are needed, and must still be the file first opened: the same device, inode,
    size and modification time (the change token), else the read is a SourceChangedError."""

    def __init__(self, path: str, label: str | None = None) -> None:
        self.path = path
        self._label = label if label is not None else path
        self._fd: int | None = None
        self._pins = 0  # readers holding the descriptor
        self._doomed = False  # closed by its owner while read: closed when the reads end
        self._identity: tuple[int, int, int, int] | None = None  # at first open

    @property
    def label(self) -> str:
        return self._label

    @property
    def size(self) -> int:
        """The size when the file was first opened: reads are checked against it, and a
        file that shrinks later has changed under us."""
        if self._identity is None:
            with self.held():
                pass
        assert self._identity is not None
        return self._identity[2]

    @contextmanager
    def held(self) -> Iterator[int]:
        """The descriptor, open (reopened if the pool closed it) for the `with` block."""
        with POOL.lock:
            if self._fd is None:
                POOL.admit(self)
                try:
                    self._fd = self._open()
                except BaseException:
                    POOL.forget(self)
                    raise
            else:
                POOL.touch(self)
            self._pins += 1
            fd = self._fd
        try:
            yield fd
        finally:
            with POOL.lock:
                self._pins -= 1
                if self._doomed and not self._pins:
                    self.shut()
                    POOL.forget(self)

    def _open(self) -> int:
        """Open the file; a reopened one must be the file first opened."""
        try:
            fd = _open_with_room(self.path)
        except OSError as exc:
            if exc.errno in OUT_OF_DESCRIPTORS:  # the run's fault, not the file's
                raise out_of_descriptors(self._label) from exc
            if self._identity is not None:
                raise SourceChangedError(
                    self._label, f"file cannot be opened again ({exc.strerror}): it changed"
                ) from exc
            raise unreadable_file(self._label, exc) from exc
        info = os.fstat(fd)
        identity = (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)
        if self._identity is not None and identity != self._identity:
            os.close(fd)
            raise SourceChangedError(
                self._label, "file was replaced or modified since it was first read"
            )
        self._identity = identity
        self._doomed = False
        return fd

    def idle(self) -> bool:
        return self._fd is not None and not self._pins

    def shut(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def read_at(self, offset: int, size: int) -> bytes:
        if offset + size > self.size:
            raise past_end(self._label, offset + size, self.size)
        with self.held() as fd:
            return pread_exact(fd, offset, size, self._label)

    def read_into(self, offset: int, buffers: Sequence[Any], size: int | None = None) -> None:
        """`read_at` straight into `buffers` (writable views of `size` bytes in all, filled in
        order): the bytes are not copied again, and many short runs take one system call."""
        if size is None:
            size = sum(map(len, buffers))
        if offset + size > self.size:
            raise past_end(self._label, offset + size, self.size)
        with self.held() as fd:
            preadv_exact(fd, offset, buffers, self._label)

    def change_token(self) -> tuple[object, ...]:
        with self.held() as fd:
            info = os.fstat(fd)
        return (info.st_dev, info.st_ino, info.st_size, info.st_mtime_ns)

    def identity(self) -> tuple[object, ...]:
        """The size and modification time the file was first opened with."""
        if self._identity is None:
            with self.held():
                pass
        assert self._identity is not None
        return self._identity[2:]

    def close(self) -> None:
        """Close the descriptor now, or when the reads in progress end."""
        with POOL.lock:
            if self._pins:
                self._doomed = True
                return
            self.shut()
            POOL.forget(self)

    def __enter__(self) -> LocalFile:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _open_with_room(path: str) -> int:
    """A read-only descriptor of the regular file at `path` (a FIFO put in its place after it
    was checked is refused, not waited on for ever); when the process is out of descriptors,
    the pool's idle ones are closed (lock held) and the open tried once more."""
    try:
        return system().open_regular(path)
    except OSError as exc:
        if exc.errno not in OUT_OF_DESCRIPTORS or not POOL.shed(len(POOL)):
            raise
    return system().open_regular(path)


@contextmanager
def descriptor(source: ByteSource) -> Iterator[int | None]:
    """A descriptor of `source` for kernel copies, held open for the `with` block; None
    for sources that have none (remote files, windows into a file, cast tensors)."""
    if isinstance(source, LocalFile):
        with source.held() as fd:
            yield fd
    else:
        yield None


def is_local(source: ByteSource) -> bool:
    """Whether `source` is a local file (read at offsets, not over the network)."""
    return isinstance(source, LocalFile)


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
    """A file object reading `source`: the file itself when it is local and the system's
    reads at an offset leave the file's offset alone (a stream of its own moves it), else
    reads at offsets through a buffer."""
    if isinstance(source, LocalFile):
        with source.held() as fd:
            try:
                stream = with_room(lambda: system().stream(fd))
            except OSError as exc:
                if exc.errno not in OUT_OF_DESCRIPTORS:
                    raise
                raise out_of_descriptors(source.label) from exc
            if stream is not None:
                return stream
    return io.BufferedReader(_SourceReader(source), buffer_size=2**16)
