"""What the implementations share: the errors their opens give, and file identity."""

from __future__ import annotations

import errno
import os

BINARY = getattr(os, "O_BINARY", 0)  # Windows: no newline translation, ever


class NotARegularFile(OSError):
    """An entry that was to be read as a regular file is something else (a FIFO, a folder,
    a device): refused before it was read, or opened (a FIFO would wait for a writer)."""

    def __init__(self, path: str) -> None:
        super().__init__(errno.EINVAL, "not a regular file", path)


def identity(info: os.stat_result) -> tuple[int, int]:
    """The file itself, whatever its name: device and inode (Windows: volume and file index)."""
    return info.st_dev, info.st_ino


def not_followed(path: str) -> OSError:
    """The error an open that never follows links gives for a link (as O_NOFOLLOW's)."""
    return OSError(errno.ELOOP, "is a link, which is not followed here", path)


def replaced_meanwhile(path: str) -> OSError:
    """Between the look at an entry and its open, another program put another in its place."""
    return OSError(errno.EBUSY, "was replaced while it was being opened", path)


def closed(fd: int) -> int:
    """Close `fd` unless it is closed already (-1); -1, to keep as what is left of it."""
    if fd >= 0:
        os.close(fd)
    return -1
