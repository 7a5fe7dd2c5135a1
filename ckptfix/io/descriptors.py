"""A bound on the descriptors ckptfix keeps open for reading.

A folder of 1,100 shards, or a training run's 1,100 rank files, must not need 1,100
descriptors at once: the common soft limit is 1,024, and a process past it fails everywhere,
even importing a module. Every `io.source.LocalFile` belongs to one `DescriptorPool`: a file
is opened on first use and stays open while the pool has room; when the pool is full, the
least recently used file that nobody is reading is closed, to be reopened when its bytes
are needed again (and checked then to be the same file: see `LocalFile`). A reader holds a
descriptor for the length of each read (`LocalFile.held`), so the pool never closes one in
use.

The pool takes a quarter of the soft limit, between MIN_OPEN and MAX_OPEN descriptors; the
rest is left to Python's own imports, output files, sockets and the caller. At first use (and
when the CLI starts) the soft limit is raised to the hard limit where the system allows it.
"""

from __future__ import annotations

import errno
import threading
from collections import OrderedDict
from collections.abc import Callable
from typing import Protocol, TypeVar

from ckptfix.core.errors import OpenFilesError
from ckptfix.platform import system

MIN_OPEN = 16
MAX_OPEN = 4096


class Member(Protocol):
    """A file with a descriptor the pool may close while nobody holds it."""

    def idle(self) -> bool:
        """Whether the descriptor is open and nobody is reading through it."""
        ...

    def shut(self) -> None:
        """Close the descriptor (called with the pool's lock held)."""
        ...


def raise_open_files_limit() -> int | None:
    """Raise the soft limit on descriptors to the hard limit where the system allows it
    (once per process); the limit in force, None where there is none."""
    return system().raise_open_files_limit()


class DescriptorPool:
    """The open members, least recently used first; at most `capacity` of them open, but
    for those being read when all are (never closed under a reader)."""

    def __init__(self, capacity: int | None = None) -> None:
        self.lock = threading.Lock()  # guards every member's descriptor as well
        self._open: OrderedDict[int, Member] = OrderedDict()
        self._capacity = capacity

    @property
    def capacity(self) -> int:
        if self._capacity is None:
            limit = raise_open_files_limit() or 4 * MAX_OPEN
            self._capacity = max(MIN_OPEN, min(MAX_OPEN, limit // 4))
        return self._capacity

    def __len__(self) -> int:
        return len(self._open)

    def touch(self, member: Member) -> None:
        """`member` was just used (lock held)."""
        self._open.move_to_end(id(member))

    def admit(self, member: Member) -> None:
        """`member` is about to open its descriptor: make room for it (lock held)."""
        self.shed(len(self._open) + 1 - self.capacity)
        self._open[id(member)] = member

    def forget(self, member: Member) -> None:
        """`member` closed its descriptor (lock held)."""
        self._open.pop(id(member), None)

    def shed(self, count: int) -> int:
        """Close up to `count` idle members, least recently used first (lock held); how
        many were closed."""
        victims: list[int] = []
        for key, member in self._open.items():  # the oldest is nearly always idle: one step
            if len(victims) >= count:
                break
            if member.idle():
                victims.append(key)
        for key in victims:
            self._open.pop(key).shut()
        return len(victims)


POOL = DescriptorPool()


_T = TypeVar("_T")
OUT_OF_DESCRIPTORS = (errno.EMFILE, errno.ENFILE)


def with_room(call: Callable[[], _T]) -> _T:
    """`call()`, something that opens descriptors (an output file, a folder to remove);
    when the process is out of them, the pool's idle ones are closed and it is tried once
    more. Not called with the pool's lock held."""
    try:
        return call()
    except OSError as exc:
        if exc.errno not in OUT_OF_DESCRIPTORS:
            raise
        with POOL.lock:
            if not POOL.shed(len(POOL)):
                raise
    return call()


def open_files_limit() -> int | None:
    """The soft limit on descriptors in force (None where there is none): for messages."""
    return system().open_files_limit()


def out_of_descriptors(path: str | None) -> OpenFilesError:
    """The one-line error for a run that ran out of descriptors at `path`."""
    limit = open_files_limit()
    return OpenFilesError(
        path,
        f"too many open files: the process may open {limit or 'only a few'}, fewer than this "
        "run needs at once; nothing was written",
        "raise the limit (e.g. `ulimit -n 1024`), then run again",
    )
