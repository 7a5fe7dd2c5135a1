"""The files around the weights (config, tokenizer, sub-folders, whatever else a model folder
holds), carried into the output entry by entry.

Nothing here walks into a link or opens anything but a regular file:
- a folder is recreated and its entries carried by the same rules;
- a link is recreated with the same target text, except (for -o) a link to a regular file
  outside the source folder, such as the files of a Hugging Face cache snapshot (relative
  links into `../../blobs/`): that file is copied, since it is what a loader would read;
- a regular file is copied (and fsynced), or for --in-place hard-linked; on a filesystem
  with reflinks the copy shares the source's blocks (FICLONE) instead of duplicating them;
- a FIFO, socket or device is never opened: -o leaves it out (the plan lists it, see
  `special_files`), --in-place keeps it by a hard link.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Sequence

from ckptfix.core.errors import WriteError
from ckptfix.write.reflink import clone_file
from ckptfix.write.results import WrittenFile

_NO_LINK = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP)
_CHUNK = 2**30


def _walk(root: str, names: Sequence[str]) -> list[tuple[str, os.stat_result]]:
    """(relative path, lstat) of each named entry and everything under the real folders
    among them, parents before children; links are not followed."""
    found = []
    pending = [name for name in reversed(names)]
    while pending:
        relative = pending.pop()
        info = os.lstat(os.path.join(root, relative))
        found.append((relative, info))
        if stat.S_ISDIR(info.st_mode):
            with os.scandir(os.path.join(root, relative)) as listing:
                children = sorted(entry.name for entry in listing)
            pending.extend(os.path.join(relative, child) for child in reversed(children))
    return found


def _special(mode: int) -> bool:
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode))


def special_files(root: str, names: Sequence[str]) -> list[str]:
    """FIFOs, sockets and devices among the named entries of `root` and in their folders."""
    return [relative for relative, info in _walk(root, names) if _special(info.st_mode)]


def _inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def _copy_data(source: int, target: int) -> int:
    if clone_file(source, target):  # the whole file, sharing its blocks: no bytes moved
        return os.fstat(target).st_size
    copied = 0
    try:
        while sent := os.sendfile(target, source, copied, _CHUNK):
            copied += sent
        return copied
    except OSError as exc:
        if exc.errno not in (errno.EINVAL, errno.ENOSYS) or copied:
            raise
    while chunk := os.pread(source, 2**20, copied):
        view = memoryview(chunk)
        while view:
            view = view[os.write(target, view) :]
        copied += len(chunk)
    return copied


def _copy_file(source: str, target: str) -> int:
    """Copy a regular file with its permission bits and times; fsync it."""
    reader = os.open(source, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK)
    try:
        info = os.fstat(reader)
        if not stat.S_ISREG(info.st_mode):  # swapped for something else since it was listed
            raise WriteError(
                source, "is no longer a regular file: it changed during the run", "run again"
            )
        writer = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            copied = _copy_data(reader, writer)
            os.fchmod(writer, stat.S_IMODE(info.st_mode))
            os.utime(writer, ns=(info.st_atime_ns, info.st_mtime_ns))
            os.fsync(writer)
        finally:
            os.close(writer)
        return copied
    finally:
        os.close(reader)


def _carry_link(source: str, target: str, root: str, link: bool) -> int | None:
    """Recreate a link, or copy the regular file outside the folder it points to (-o only).
    Returns the bytes copied, None for a link."""
    if not link:
        try:
            pointed = os.stat(source)
        except OSError:  # dangling, or a loop
            pointed = None
        resolved = os.path.realpath(source)
        if pointed is not None and stat.S_ISREG(pointed.st_mode) and not _inside(resolved, root):
            return _copy_file(resolved, target)
    os.symlink(os.readlink(source), target)
    return None


def _hard_link(source: str, target: str, regular: bool) -> None:
    try:
        os.link(source, target, follow_symlinks=False)
    except OSError as exc:
        if exc.errno not in _NO_LINK:
            raise
        if not regular:
            raise WriteError(
                source,
                "cannot keep a FIFO, socket or device across file systems",
                "move it out of the folder, then run again",
            ) from exc
        _copy_file(source, target)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def copy_extra(
    source_root: str, names: Sequence[str], staging: str, *, link: bool = False
) -> list[WrittenFile]:
    """Carry the named entries of `source_root` into `staging` by the rules above (`link`:
    hard-link, for --in-place); returns the regular files written, with their sizes."""
    root = os.path.realpath(source_root)
    written = []
    folders = []
    for relative, info in _walk(source_root, names):
        source, target = os.path.join(source_root, relative), os.path.join(staging, relative)
        mode = info.st_mode
        if stat.S_ISDIR(mode):
            os.mkdir(target)
            folders.append((target, mode))
        elif stat.S_ISLNK(mode):
            copied = _carry_link(source, target, root, link)
            if copied is not None:
                written.append(WrittenFile(relative, copied))
        elif stat.S_ISREG(mode):
            if link:
                _hard_link(source, target, regular=True)
                size = info.st_size
            else:
                size = _copy_file(source, target)
            written.append(WrittenFile(relative, size))
        elif link:
            _hard_link(source, target, regular=False)
    for target, mode in reversed(folders):  # innermost first: permissions may forbid writing
        _fsync_dir(target)
        os.chmod(target, stat.S_IMODE(mode))
    return written
