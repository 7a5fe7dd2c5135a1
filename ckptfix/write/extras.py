"""The files around the weights (config, tokenizer, sub-folders, whatever else a model folder
holds), carried into the output entry by entry.

Nothing here walks into a link or opens anything but a regular file:
- a folder is recreated and its entries carried by the same rules;
- a link is recreated with the same target text, except (for -o) a link to a regular file
  inside the model folder, or in a Hugging Face cache snapshot (`.../snapshots/<revision>/`,
  or a folder in it) a link into the repository's `blobs/` folder: that file is copied,
  since it is what a loader would read, and OUT must not lean on the source (an absolute
  link would point back into it; a cast's config.json is edited on the copy). A link to
  any other file outside the folder is never followed (a downloaded folder may link to
  ~/.ssh/id_rsa);
- a regular file is copied (and fsynced), or for --in-place hard-linked; on a filesystem
  that clones files the copy shares the source's blocks instead of duplicating them
  (`Platform.copy_to_new`: FICLONE, APFS clones, ReFS block cloning);
- a FIFO, socket or device is never opened: -o leaves it out (the plan lists it, see
  `special_files`), --in-place keeps it by a hard link.
"""

from __future__ import annotations

import errno
import os
import stat
from collections.abc import Collection, Iterator, Mapping, Sequence
from dataclasses import dataclass

from ckptfix.core.errors import SourceChangedError, WriteError
from ckptfix.io.folder import inside, unlistable
from ckptfix.io.source import unreadable_file
from ckptfix.layouts.hub import blobs_of
from ckptfix.platform import system
from ckptfix.platform.common import NotARegularFile
from ckptfix.platform.folders import FolderHandle
from ckptfix.write.copy import write_all
from ckptfix.write.results import WrittenFile

_NO_LINK = (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP)


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
            children = _listed(os.path.join(root, relative))
            pending.extend(os.path.join(relative, child) for child in reversed(children))
    return found


def _listed(folder: str | FolderHandle, shown: str | None = None) -> list[str]:
    """A folder's names, sorted; one that cannot be listed is a one-line error."""
    try:
        if not isinstance(folder, str):
            return sorted(folder.names())
        with os.scandir(folder) as listing:
            return sorted(entry.name for entry in listing)
    except OSError as exc:
        raise unlistable(shown or str(folder), exc) from exc


def _special(mode: int) -> bool:
    return not (stat.S_ISREG(mode) or stat.S_ISDIR(mode) or stat.S_ISLNK(mode))


def special_files(root: str, names: Sequence[str]) -> list[str]:
    """FIFOs, sockets and devices among the named entries of `root` and in their folders."""
    return [relative for relative, info in _walk(root, names) if _special(info.st_mode)]


@dataclass(frozen=True)
class _Entry:
    """An entry being carried: its name in the open `folder`, its path from the source root,
    and the path shown in errors."""

    folder: FolderHandle
    name: str
    relative: str
    shown: str


def _copy_file(
    entry: _Entry | str, target: str, expected: Identity | None = None, label: str = ""
) -> int:
    """Copy a regular file with its permission bits and times; fsync it. An entry is opened
    relative to its folder's descriptor, never through a path a link could redirect; a file
    with an `expected` identity must still be that file. `label`: the name errors give."""
    shown = label or (entry.shown if isinstance(entry, _Entry) else entry)
    try:
        if isinstance(entry, _Entry):
            reader = entry.folder.open_file(entry.name)
        else:
            reader = system().open_regular(entry, follow=False)
    except PermissionError as exc:  # the source's fault, not the output's
        raise unreadable_file(shown, exc) from exc
    except FileNotFoundError as exc:
        raise _vanished(shown) from exc
    except NotARegularFile as exc:  # swapped for something else since it was listed
        raise WriteError(
            shown, "is no longer a regular file: it changed during the run", "run again"
        ) from exc
    try:
        info = os.fstat(reader)
        _check_identity(shown, info, expected)
        writer, copied = system().copy_to_new(reader, target)
        try:
            system().set_mode(writer, target, stat.S_IMODE(info.st_mode))
            system().set_times(writer, target, (info.st_atime_ns, info.st_mtime_ns))
            system().sync(writer)
        finally:
            os.close(writer)
        return copied
    finally:
        os.close(reader)


def _blob(root: str, relative: str) -> str | None:
    """The regular file a link of the folder points to, when it is one a loader of the folder
    reads and the folder owns: a file inside the model folder itself, or the cache blob of a
    Hugging Face cache snapshot (in the repository's blobs/). None: every other link is never
    followed."""
    source = os.path.join(root, relative)
    try:
        pointed = os.stat(source)
    except OSError:  # dangling, or a loop
        return None
    resolved = os.path.realpath(source)
    blobs = blobs_of(root)
    owned = inside(resolved, root) or (blobs is not None and inside(resolved, blobs))
    return resolved if stat.S_ISREG(pointed.st_mode) and owned else None


def carried_as_file(source_root: str, name: str, *, link: bool = False) -> bool:
    """Whether the entry `name` of `source_root` arrives in the output as a regular file of
    its own (a regular file, or for -o a cache snapshot's link to its blob), and not as a
    link whose target is never read."""
    try:
        mode = os.lstat(os.path.join(source_root, name)).st_mode
    except OSError:
        return False
    if stat.S_ISLNK(mode):
        return not link and _blob(os.path.realpath(source_root), name) is not None
    return stat.S_ISREG(mode)


def _carry_link(entry: _Entry, target: str, root: str, link: bool) -> int | None:
    """Recreate a link, or copy the cache blob it points to (-o only). Returns the bytes
    copied, None for a link."""
    blob = None if link else _blob(root, entry.relative)
    if blob is not None:
        return _copy_file(blob, target)
    os.symlink(entry.folder.readlink(entry.name), target)
    return None


def _hard_link(entry: _Entry, target: str, regular: bool) -> None:
    try:
        entry.folder.link(entry.name, target)
    except OSError as exc:
        if exc.errno not in _NO_LINK:
            raise
        if not regular:
            raise WriteError(
                entry.shown,
                "cannot keep a FIFO, socket or device across file systems",
                "move it out of the folder, then run again",
            ) from exc
        _copy_file(entry, target)


def _folders_above(name: str) -> list[str]:
    """`a`, `a/b` for `a/b/c`."""
    parts = name.split(os.sep)[:-1]
    return [os.sep.join(parts[: count + 1]) for count in range(len(parts))]


class _Carrier:
    """Carries entries into `staging` by the rules above; folders are walked through their
    handles (O_NOFOLLOW descriptors on POSIX), so a folder swapped for a link during the run
    is refused, never walked into."""

    def __init__(
        self, source_root: str, staging: str, link: bool, leave: Collection[str] = ()
    ) -> None:
        self.source_root, self.staging, self.link = source_root, staging, link
        self.root = os.path.realpath(source_root)
        self.written: list[WrittenFile] = []
        self.folders: list[tuple[str, int]] = []
        self.leave = {os.path.normpath(name) for name in leave}
        # The folders on the way to an entry left for the caller to place: always real ones.
        self.on_the_way = {folder for name in self.leave for folder in _folders_above(name)}

    def carry(self, entry: _Entry) -> FolderHandle | None:
        """Carry one entry; for a folder, return it open (the caller walks it)."""
        if entry.relative in self.leave:
            return None
        info = _source_lstat(entry)
        target, mode = os.path.join(self.staging, entry.relative), info.st_mode
        link = system().is_link(info)
        if stat.S_ISDIR(mode) and not link:
            folder = entry.folder.child(entry.name)
            try:
                os.mkdir(target)
            except BaseException:
                folder.close()
                raise
            self.folders.append((target, mode))
            return folder
        if link and entry.relative in self.on_the_way:
            os.mkdir(target)  # a real folder for what the caller places; the link never walked
        elif link:
            copied = _carry_link(entry, target, self.root, self.link)
            if copied is not None:
                self.written.append(WrittenFile(entry.relative, copied))
        elif stat.S_ISREG(mode):
            if self.link:
                _hard_link(entry, target, regular=True)
                size = info.st_size
            else:
                size = _copy_file(entry, target)
            self.written.append(WrittenFile(entry.relative, size))
        elif self.link:
            _hard_link(entry, target, regular=False)
        return None

    def walk(self, top: FolderHandle, names: Sequence[str]) -> None:
        """Depth first, parents before children; one folder open per level."""
        stack: list[tuple[FolderHandle, str, Iterator[str]]] = [(top, "", iter(names))]
        try:
            while stack:
                handle, folder, pending = stack[-1]
                name = next(pending, None)
                if name is None:
                    stack.pop()
                    if handle is not top:
                        handle.close()
                    continue
                relative = os.path.join(folder, name)
                shown = os.path.join(self.source_root, relative)
                child = self.carry(_Entry(handle, name, relative, shown))
                if child is not None:
                    stack.append((child, relative, iter(())))  # closed below if listing fails
                    stack[-1] = (child, relative, iter(_listed(child, shown)))
        finally:
            for handle, _, _ in stack:
                if handle is not top:
                    handle.close()

    def finish(self) -> None:
        """fsync the folders made and give them their source's permissions, innermost first
        and last of all: a read-only folder must not stop what is placed in it afterwards."""
        for target, mode in reversed(self.folders):
            system().sync_folder(target)
            os.chmod(target, stat.S_IMODE(mode))


def carry_extra(
    source_root: str,
    names: Sequence[str],
    staging: str,
    *,
    link: bool = False,
    leave: Collection[str] = (),
) -> _Carrier:
    """Carry the named entries of `source_root` into `staging` by the rules above (`link`:
    hard-link, for --in-place), except the entries `leave` names (paths inside the named
    folders, which the caller places itself; every folder on the way to one is a real
    folder in staging, even where the source has a link). The caller calls `finish()` once
    it has placed them; `written` lists the regular files carried, with their sizes."""
    carrier = _Carrier(source_root, staging, link, leave)
    with system().open_folder(source_root) as top:
        carrier.walk(top, names)
    return carrier


def copy_extra(
    source_root: str, names: Sequence[str], staging: str, *, link: bool = False
) -> list[WrittenFile]:
    """`carry_extra` of every entry named, finished."""
    carrier = carry_extra(source_root, names, staging, link=link)
    carrier.finish()
    return carrier.written


def _source_lstat(entry: _Entry) -> os.stat_result:
    try:
        return entry.folder.lstat(entry.name)
    except FileNotFoundError as exc:  # listed when the source was loaded, gone since
        raise _vanished(entry.shown) from exc


def _vanished(shown: str) -> SourceChangedError:
    """A source entry removed after the source was listed: the run read another folder."""
    return SourceChangedError(shown, "was removed during the run: the source changed")


# (device, inode, size, modification time in ns): a source's change token (io.source)
Identity = tuple[object, ...]


def _check_identity(shown: str, info: os.stat_result, expected: Identity | None) -> None:
    if expected is not None and (
        info.st_dev,
        info.st_ino,
        info.st_size,
        info.st_mtime_ns,
    ) != tuple(expected):
        raise SourceChangedError(shown, "file was replaced or modified since it was first read")


def carry_file(source: str, target: str, *, link: bool, expected: Identity | None = None) -> int:
    """One regular file into the staging folder under a name of its own (a shard `ckptfix
    fix` keeps as it is, or renames): hard-linked for --in-place, else copied and fsynced.
    With `expected`, the identity of the file as it was read: what is carried must be that
    file (a folder on its path swapped for a link since would bring in another). Returns
    its size."""
    if link:
        with system().open_folder(os.path.dirname(source) or ".") as folder:
            _hard_link(_Entry(folder, os.path.basename(source), source, source), target, True)
        _check_identity(source, os.stat(target), expected)
        return os.lstat(target).st_size
    # A link (a Hugging Face cache snapshot's, into blobs/): the file a loader would read.
    real = os.path.realpath(source) if os.path.islink(source) else source
    return _copy_file(real, target, expected, source)


def write_generated(staging: str, files: Mapping[str, bytes]) -> list[WrittenFile]:
    """Files the rewrite made (config.json of `convert --to-hf`): each created exclusively in
    the staging folder (permissions from the umask), written whole and fsynced."""
    written = []
    for name, data in files.items():
        fd = system().create(os.path.join(staging, name), 0o666)
        try:
            write_all(fd, data, 0)
            system().sync(fd)
        finally:
            os.close(fd)
        written.append(WrittenFile(name, len(data)))
    return written
