"""Folder trees a write makes or replaces, handled through folder descriptors, never through
a link.

A staging folder holds links recreated from the source (`write.extras`): a path that ran
through one of them would reach outside the output, where a removal or a write would
change the user's files (a model folder's `sub -> /elsewhere` once lost its shards that
way). So the folders files are placed in are created and checked one component at a time
(`make_folders`), and trees are removed by `unlinkat` relative to a folder opened with
O_NOFOLLOW (`remove_tree`), which removes a link itself and never what it points to. A
read-only folder in a tree being removed is made writable first, and an output that could
not be removed once replaced (a folder another user owns) is refused before anything is
written (`blocked_folder`).

Also here: the record of an existing output folder (`record`), which tells at the swap
whether another program changed it.
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
from collections.abc import Iterator
from dataclasses import dataclass

from ckptfix.core.errors import WriteError
from ckptfix.io.folder import unlistable

_FOLDER = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_PATH_ONLY = os.O_PATH | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_OWNER_ALL = stat.S_IRWXU

# (relative path, inode, type and mode, size, mtime in ns) of one entry under OUT
Entry = tuple[str, int, int, int, int]


@dataclass(frozen=True)
class OutputState:
    """What an existing OUT held when the run began: its identity and every entry under it
    (links not followed), to tell at the swap whether anyone else changed it meanwhile."""

    identity: tuple[int, int]
    entries: tuple[Entry, ...]

    @property
    def top_level(self) -> tuple[str, ...]:
        return tuple(entry[0] for entry in self.entries if "/" not in entry[0])


def record(folder: str) -> OutputState:
    info = os.stat(folder)
    entries: list[Entry] = []
    pending = [("", folder)]
    while pending:
        prefix, current = pending.pop()
        try:
            listing = os.scandir(current)
        except PermissionError as exc:  # a folder we may not list: name it
            raise unlistable(current, exc) from exc
        with listing:
            for item in listing:
                found = item.stat(follow_symlinks=False)
                path = prefix + item.name
                entries.append(
                    (path, found.st_ino, found.st_mode, found.st_size, found.st_mtime_ns)
                )
                if stat.S_ISDIR(found.st_mode):
                    pending.append((path + "/", item.path))
    return OutputState((info.st_dev, info.st_ino), tuple(sorted(entries)))


def differences(before: OutputState, after: OutputState) -> list[str]:
    """Entries added, removed or changed; a folder is named only when none of its entries is
    (adding a file changes its folder too)."""
    old = {entry[0]: entry for entry in before.entries}
    new = {entry[0]: entry for entry in after.entries}
    changed = sorted(path for path in old.keys() | new.keys() if old.get(path) != new.get(path))
    parents = {path[:index] for path in changed for index, char in enumerate(path) if char == "/"}
    return [path for path in changed if path not in parents]


def first_link(root: str, relative: str) -> str | None:
    """The first component of the folder path `relative` (under `root`) that exists and is
    not a real folder (a link, or a file), as a path relative to root; None when every
    existing one is a folder. Components are looked at in order, links never followed."""
    current = ""
    for part in [part for part in relative.split(os.sep) if part]:
        current = os.path.join(current, part)
        try:
            info = os.lstat(os.path.join(root, current))
        except FileNotFoundError:
            return None
        if not stat.S_ISDIR(info.st_mode):
            return current
    return None


def make_folders(root: str, relative: str, shown: str) -> None:
    """Create the missing folders of `relative` under `root` (a folder of ours), checking
    each one is a real folder, never a link: what is then created by path below them stays
    inside root. `shown` is the output path the messages name."""
    fd = os.open(root, _FOLDER)
    try:
        done = ""
        for part in [part for part in relative.split(os.sep) if part]:
            done = os.path.join(done, part)
            with contextlib.suppress(FileExistsError):
                os.mkdir(part, dir_fd=fd)
            try:
                child = os.open(part, _FOLDER, dir_fd=fd)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
                    raise
                raise WriteError(
                    os.path.join(shown, done),
                    "is no longer a folder: the source changed during the run",
                    "run again",
                ) from exc
            os.close(fd)
            fd = child
    finally:
        os.close(fd)


def _open_to_remove(parent: int, name: str) -> int:
    """A folder being removed, opened (O_NOFOLLOW) and made writable by its owner if it was
    not: only ever a folder of a staging tree or of an output being replaced."""
    try:
        fd = os.open(name, _FOLDER, dir_fd=parent)
    except PermissionError:  # not even readable: open it up through an O_PATH descriptor
        handle = os.open(name, _PATH_ONLY, dir_fd=parent)
        try:
            mode = stat.S_IMODE(os.fstat(handle).st_mode)
            os.chmod(f"/proc/self/fd/{handle}", mode | _OWNER_ALL)  # that very folder
        finally:
            os.close(handle)
        fd = os.open(name, _FOLDER, dir_fd=parent)
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    if mode & _OWNER_ALL != _OWNER_ALL:
        os.fchmod(fd, mode | _OWNER_ALL)
    return fd


def _unlinked(parent: int, name: str) -> bool:
    """Remove a non-folder entry (a link itself, never its target); False for a folder."""
    try:
        os.unlink(name, dir_fd=parent)
    except IsADirectoryError:
        return False
    except FileNotFoundError:
        pass
    return True


def remove_tree(path: str) -> None:
    """Remove `path` and everything under it, through folder descriptors; raises OSError
    for what could not be removed."""
    top = os.open(os.path.dirname(path) or ".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    # (parent descriptor, name, own descriptor, names still to remove)
    stack: list[tuple[int, str, int, Iterator[str]]] = []
    try:
        name = os.path.basename(path)
        if _unlinked(top, name):
            return
        fd = _open_to_remove(top, name)
        stack.append((top, name, fd, iter(os.listdir(fd))))
        while stack:
            parent, name, fd, pending = stack[-1]
            child = next(pending, None)
            if child is None:
                stack.pop()
                os.close(fd)
                os.rmdir(name, dir_fd=parent)
            elif not _unlinked(fd, child):
                inner = _open_to_remove(fd, child)
                stack.append((fd, child, inner, iter(os.listdir(inner))))
    finally:
        for _, _, fd, _ in stack:
            os.close(fd)
        os.close(top)


def blocked_folder(folder: str) -> tuple[str, str, str] | None:
    """The first entry of the tree at `folder` (itself included) that could not be removed
    once it is replaced, with why and what to do; None when there is none. A folder is
    clearable if it is ours (made writable if need be) or open to us for listing and
    writing; in a sticky folder (mode +t, like /tmp) that is not ours, only our own entries
    are. Links are not followed; a folder that cannot be listed is a one-line error."""
    wanted = os.R_OK | os.W_OK | os.X_OK
    me = os.geteuid()
    pending = [folder]
    while pending:
        current = pending.pop()
        info = os.lstat(current)
        if info.st_uid != me and not os.access(
            current, wanted, effective_ids=True, follow_symlinks=False
        ):
            return (current, *_NOT_WRITABLE)
        sticky = info.st_uid != me and info.st_mode & stat.S_ISVTX and not _may_own_anything()
        try:
            listing = os.scandir(current)
        except PermissionError as exc:
            raise unlistable(current, exc) from exc
        with listing:
            for entry in listing:
                found = entry.stat(follow_symlinks=False)
                if sticky and found.st_uid != me:
                    return (entry.path, *_STICKY)
                if stat.S_ISDIR(found.st_mode):
                    pending.append(entry.path)
    return None


_NOT_WRITABLE = (
    "folder is not writable and not ours to make writable, so its old entries could not be "
    "removed once the new folder is in place",
    "make it writable, or run as its owner",
)
_STICKY = (
    "is another user's, in a sticky folder (mode +t) that is not ours either, so it could not "
    "be removed once the new folder is in place",
    "have its owner move it out, or run as the folder's owner",
)
_CAP_FOWNER = 3  # linux/capability.h: bypasses the sticky bit's ownership check


def _may_own_anything() -> bool:
    """Whether this process has CAP_FOWNER (root usually has; root without it does not)."""
    try:
        with open("/proc/self/status", encoding="ascii") as status:
            for line in status:
                if line.startswith("CapEff:"):
                    return bool(int(line.split()[1], 16) >> _CAP_FOWNER & 1)
    except (OSError, ValueError):
        pass
    return os.geteuid() == 0
