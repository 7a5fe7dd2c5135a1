"""Where the layouts find files: a Folder answers the few questions a loader asks of a
folder (what it holds, what is a file, how big) and opens files as ByteSources.

Layouts work with paths (a folder's path joined with names, `os.path.join`, which also joins
URLs) and ask the Folder about them, so the same loader reads a local folder (`LocalFolder`,
plain `os` calls) and a remote one (`io.remote_folder.RemoteFolder`, listings and ranged
requests). Nothing outside `io/` needs to know which.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Iterable
from typing import Protocol, TypeVar

from ckptfix.core.errors import CorruptFileError
from ckptfix.io.source import ByteSource, LocalFile
from ckptfix.platform import system

T = TypeVar("T")
R = TypeVar("R")

_FIX = "regenerate the index, or fix the entry by hand"  # as formats.index has always said
_FIXES = {"config": "check that config.json is the model's own; save it again with the model"}


def inside(child: str, parent: str, sep: str = os.sep) -> bool:
    """Whether the path `child` is `parent` or below it (both spelt alike: absolute, real; a
    URL and its prefix with `sep="/"`)."""
    return child == parent or child.startswith(parent.rstrip(sep) + sep)


class Folder(Protocol):
    """The file system a checkpoint folder lives on, addressed by path (or URL)."""

    def listdir(self, path: str) -> list[str]:
        """The names in a folder (files and sub-folders), sorted; OSError when unreadable."""
        ...

    def file_names(self, path: str) -> list[str]:
        """The names of the regular files in a folder (links followed), sorted."""
        ...

    def is_file(self, path: str) -> bool: ...

    def is_dir(self, path: str) -> bool: ...

    def size(self, path: str) -> int:
        """A file's size in bytes; OSError when it cannot be had."""
        ...

    def open(self, path: str) -> ByteSource:
        """The file as a ByteSource (opened lazily: errors arrive with the first read)."""
        ...

    def read_small(self, path: str, display: str, limit: int, what: str) -> bytes:
        """The whole of a small side file (index, config), refusing one over `limit` bytes
        (rule `<what>-too-large`) or one that cannot be read (rule `unreadable`)."""
        ...

    def map(self, function: Callable[[T], R], items: Iterable[T]) -> list[R]:
        """`[function(item) for item in items]`, on several threads where that pays (a
        remote folder's requests); the first exception is raised."""
        ...

    def escapes(self, path: str) -> bool:
        """Whether `path` (the folder's path joined with names) leaves the folder once the
        store decodes it: a URL's percent-escapes, backslashes and `;` parameters may turn
        a name into `..`. A local path means what it says (its names are checked as
        written)."""
        ...


class LocalFolder:
    """The local file system: `os` calls, one after another."""

    def listdir(self, path: str) -> list[str]:
        return sorted(os.listdir(path))

    def file_names(self, path: str) -> list[str]:
        try:
            with os.scandir(path) as listing:
                return sorted(entry.name for entry in listing if _is_file(entry))
        except OSError as exc:
            raise unlistable(path, exc) from exc

    def is_file(self, path: str) -> bool:
        return os.path.isfile(path)

    def is_dir(self, path: str) -> bool:
        return os.path.isdir(path)

    def size(self, path: str) -> int:
        return os.path.getsize(path)

    def open(self, path: str) -> ByteSource:
        return LocalFile(path)

    def read_small(self, path: str, display: str, limit: int, what: str) -> bytes:
        try:
            # a FIFO put in the file's place after the listing is refused, never waited on
            with open(system().open_regular(path), "rb") as handle:
                info = os.fstat(handle.fileno())
                if info.st_size > limit:
                    raise too_large(display, what, info.st_size, limit)
                return handle.read(limit + 1)
        except OSError as exc:
            raise CorruptFileError(
                display,
                "unreadable",
                f"cannot read the {what}: {exc.strerror}",
                "check its permissions",
            ) from exc

    def map(self, function: Callable[[T], R], items: Iterable[T]) -> list[R]:
        return [function(item) for item in items]

    def escapes(self, path: str) -> bool:
        return False


def _is_file(entry: os.DirEntry[str]) -> bool:
    """A regular file, links followed; a link in a loop (ELOOP) or that cannot be followed
    is not one, as os.path.isfile says."""
    try:
        return entry.is_file()
    except OSError:
        return False


def unlistable(path: str, exc: OSError) -> CorruptFileError:
    """A folder that cannot be listed (no read permission, another user's): one line."""
    return CorruptFileError(
        path, "unreadable", f"cannot list the folder: {exc.strerror}", "check its permissions"
    )


def too_large(display: str, what: str, size: int, limit: int) -> CorruptFileError:
    return CorruptFileError(
        display,
        f"{what}-too-large",
        f"{what} is {size} bytes, over the {limit} limit",
        _FIXES.get(what, _FIX),
    )


LOCAL = LocalFolder()
