"""Folder trees a write makes or replaces, handled through folder descriptors, never through
a link.

A staging folder holds links recreated from the source (`write.extras`): a path that ran
through one of them would reach outside the output, where a removal or a write would
change the user's files (a model folder's `sub -> /elsewhere` once lost its shards that
way). So the folders files are placed in are created and checked one component at a time
(`make_folders`), and trees are removed entry by entry through folders opened without
following a link (`remove_tree`, on `Platform.open_folder`: `unlinkat` relative to folders
opened with O_NOFOLLOW on POSIX), which removes a link itself and never what it points to. A
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
from ckptfix.platform import system
from ckptfix.platform.folders import FolderHandle

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
    folder = system().open_folder(root, follow=False)
    try:
        done = ""
        for part in [part for part in relative.split(os.sep) if part]:
            done = os.path.join(done, part)
            with contextlib.suppress(FileExistsError):
                folder.mkdir(part)
            try:
                child = folder.child(part)
            except OSError as exc:
                if exc.errno not in (errno.ELOOP, errno.ENOTDIR, errno.EBUSY):
                    raise
                raise WriteError(
                    os.path.join(shown, done),
                    "is no longer a folder: the source changed during the run",
                    "run again",
                ) from exc
            folder.close()
            folder = child
    finally:
        folder.close()


def _unlinked(parent: FolderHandle, name: str) -> bool:
    """Remove a non-folder entry (a link itself, never its target); False for a folder."""
    try:
        parent.unlink(name)
    except IsADirectoryError:
        return False
    except FileNotFoundError:
        pass
    return True


def remove_tree(path: str) -> None:
    """Remove `path` and everything under it, through folders opened without following a
    link, each made writable by its owner first if it was not (only ever a folder of a
    staging tree or of an output being replaced); raises OSError for what could not be
    removed."""
    top = system().open_folder(os.path.dirname(path) or ".")
    # (parent, name, the folder itself, names still to remove)
    stack: list[tuple[FolderHandle, str, FolderHandle, Iterator[str]]] = []
    try:
        name = os.path.basename(path)
        if _unlinked(top, name):
            return
        folder = top.child_to_remove(name)
        stack.append((top, name, folder, iter(folder.names())))
        while stack:
            parent, name, folder, pending = stack[-1]
            child = next(pending, None)
            if child is None:
                stack.pop()
                folder.close()
                parent.rmdir(name)
            elif not _unlinked(folder, child):
                inner = folder.child_to_remove(child)
                stack.append((folder, child, inner, iter(inner.names())))
    finally:
        for _, _, folder, _ in stack:
            folder.close()
        top.close()


def blocked_folder(folder: str) -> tuple[str, str, str] | None:
    """The first entry of the tree at `folder` (itself included) that could not be removed
    once it is replaced, with why and what to do; None when there is none. A folder is
    clearable if it is ours (made writable if need be) or open to us for listing and
    writing; in a sticky folder (mode +t, like /tmp) that is not ours, only our own entries
    are. Links are not followed; a folder that cannot be listed is a one-line error."""
    me = system().effective_user()
    pending = [folder]
    while pending:
        current = pending.pop()
        info = os.lstat(current)
        if info.st_uid != me and not _open_to_us(current, me):
            return (current, *_NOT_WRITABLE)
        sticky = (
            me is not None
            and info.st_uid != me
            and info.st_mode & stat.S_ISVTX
            and not system().may_own_anything()
        )
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


def _open_to_us(folder: str, me: int | None) -> bool:
    """Whether this process may list and change `folder` (without ownership numbers, as
    on Windows: whether it is writable)."""
    if me is None:
        return os.access(folder, os.W_OK)
    wanted = os.R_OK | os.W_OK | os.X_OK
    return os.access(folder, wanted, effective_ids=True, follow_symlinks=False)
