"""Atomic output folders that never lose what someone else put there.

A write first claims OUT (`claim_output`): a link is resolved to the real folder, an existing
OUT is locked for the run (a second ckptfix writing to it fails at once) and everything under
it is recorded. The output is built in a marked staging folder beside the real OUT (`staged`)
and swapped in at the end (`Staging.commit`): a new OUT appears by a rename that replaces
nothing, an existing one is exchanged only if it is still exactly as recorded, and is checked
once more after the exchange. A conflict is an error that loses nothing: OUT is left as the
other program left it and the staging folder is removed.

On any exception, SIGINT or SIGTERM the staging folder is removed and OUT is left as it was.
Nothing outside the staging folder is deleted unless it is the old OUT being replaced
(--force, --in-place), and that happens only after the new one is in place, through folder
descriptors that never follow a link (`write.tree`); an OUT holding a folder that could not
be emptied then (another user's) is refused before anything is written. Once the new
output is in place, SIGINT and SIGTERM no longer stop anything (see `command_signals`).
"""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Callable, Iterator, Sequence

from ckptfix.core.errors import OpenFilesError, OutputConflictError, UsageError, WriteError
from ckptfix.core.signals import Signals, restore
from ckptfix.core.signals import current as current_signals
from ckptfix.io.descriptors import out_of_descriptors, with_room
from ckptfix.io.folder import inside, unlistable
from ckptfix.io.urls import refuse_url
from ckptfix.layouts.names import foreign_entries
from ckptfix.platform import system
from ckptfix.platform.locks import FolderLock, NotOurLockFile
from ckptfix.write.tree import OutputState, blocked_folder, differences, record, remove_tree

# Inside every staging folder while it is being written: a staging folder is recognised by
# this file and its first line, never by its name alone (a user may name anything .ckptfix-*).
MARKER = ".ckptfix-staging"
PREFIX = ".ckptfix-"  # a staging folder's name: PREFIX and what mkdtemp adds
_MAGIC = b"ckptfix staging folder; safe to delete when no ckptfix run is writing\n"


def _some(names: Sequence[str], limit: int = 3) -> str:
    shown = ", ".join(names[:limit])
    return f"{shown} and {len(names) - limit} more" if len(names) > limit else shown


def write_marker(folder: str) -> None:
    """Mark `folder` as a ckptfix staging folder (see `is_staging_folder`)."""
    fd = system().create(os.path.join(folder, MARKER), 0o644)
    try:
        system().write_all(fd, _MAGIC + f"pid {os.getpid()}\n".encode(), 0)
    finally:
        os.close(fd)


def is_staging_folder(path: str) -> bool:
    """Whether `path` is a staging folder of a ckptfix run (a live one, or one a killed run
    left behind): a real folder named `.ckptfix-*` holding our marker file."""
    marker = os.path.join(path, MARKER)
    try:
        if not os.path.basename(path).startswith(PREFIX):
            return False
        if not stat.S_ISDIR(os.lstat(path).st_mode) or not stat.S_ISREG(os.lstat(marker).st_mode):
            return False
        fd = system().open_regular(marker, follow=False)
    except OSError:
        return False
    try:
        return system().pread(fd, len(_MAGIC), 0) == _MAGIC
    finally:
        os.close(fd)


def _first_non_folder(path: str) -> str | None:
    """The nearest existing ancestor of `path`, if it is not a folder (`-o file.txt/out`)."""
    folder = os.path.dirname(os.path.abspath(path))
    while not os.path.lexists(folder):
        folder = os.path.dirname(folder)
    return None if os.path.isdir(folder) else folder


def _existing_folder(out: str, real_out: str) -> bool:
    """Whether OUT is an existing folder; refuses what cannot become one."""
    if os.path.lexists(real_out) and not os.path.exists(real_out):  # realpath stops at a loop
        raise UsageError(
            out, "output is a link that cannot be followed (a loop of links)", "choose another -o"
        )
    if os.path.exists(out) and not os.path.isdir(out):
        raise UsageError(out, "output exists and is not a folder", "choose another -o folder")
    if not os.path.isdir(out):
        blocker = _first_non_folder(real_out)
        if blocker is not None:
            raise UsageError(out, f"{blocker} is not a folder", "choose another -o folder")
        return False
    return True


def check_output(
    out: str,
    sources: Sequence[str],
    *,
    force: bool,
    in_place: bool,
    replace_any: bool = False,
) -> None:
    """Refuse outputs that would clobber an input or a folder the user did not mean."""
    if in_place:
        return
    real_out = os.path.realpath(out)
    for source in sources:
        real_source = os.path.realpath(source)
        if inside(real_source, real_out) or inside(real_out, real_source):
            raise UsageError(
                out,
                f"output overlaps the input {source}",
                "choose another -o folder, or use --in-place",
            )
    if not _existing_folder(out, real_out) or not os.listdir(out):
        return
    if not force:
        raise UsageError(out, "output folder exists and is not empty", "pass --force to replace it")
    foreign = [] if replace_any else foreign_entries(real_out)
    if foreign:
        raise UsageError(
            out,
            f"output folder holds files that are not part of a checkpoint: {_some(foreign)}",
            "pass --replace-any to replace them too, or choose another -o",
        )


def _lock(out: str, real: str) -> FolderLock:
    """An exclusive lock on the existing OUT for the whole run; a second writer fails at once."""
    try:
        return system().lock_folder(real)
    except PermissionError as exc:  # not readable: not listable either, so never replaceable
        raise unlistable(out, exc) from exc
    except BlockingIOError as exc:
        raise OutputConflictError(
            out,
            "another ckptfix run is writing to this folder",
            "wait for it to finish, then run again",
        ) from exc
    except NotOurLockFile as exc:
        raise OutputConflictError(
            out,
            f"{exc.filename} beside it, where ckptfix keeps its lock, is not ckptfix's",
            "move that file away, then run again",
        ) from exc


class Claim:
    """OUT for one run: the path as given (for messages), the real folder behind any link
    (where the staging folder goes and the swap happens), and for a write the lock held on
    it and what it held at the start (`before`, None if it did not exist)."""

    def __init__(
        self, out: str, real: str, before: OutputState | None, lock: FolderLock | None
    ) -> None:
        self.out = out
        self.real = real
        self.before = before
        self._lock = lock
        self._outer: str | None = None
        self.staging: Staging | None = None  # while a write to it is staged

    def release(self) -> None:
        if self._lock is not None:
            self._lock.release()
            self._lock = None

    def __enter__(self) -> Claim:
        command = current_signals()
        if command is not None:  # a signal from now on names the output it left alone
            self._outer, command.out = command.out, self.out
        return self

    def __exit__(self, *exc_info: object) -> None:
        command = current_signals()
        if command is not None:
            command.out = self._outer
        self.release()


def claim_output(
    out: str,
    sources: Sequence[str],
    *,
    force: bool = False,
    replace_any: bool = False,
    in_place: bool = False,
    write: bool = True,
) -> Claim:
    """Check that OUT may be written (`check_output`); for a write, also lock an existing OUT
    and record what it holds, before the input is even read."""
    refuse_url(out, "ckptfix writes its output only to a local folder")
    real = os.path.realpath(out)
    lock = _lock(out, real) if write and os.path.isdir(real) else None
    try:
        before = record(real) if lock is not None else None
        check_output(out, sources, force=force, in_place=in_place, replace_any=replace_any)
        if before is not None:
            _refuse_blocked(real)
    except BaseException:
        if lock is not None:
            lock.release()
        raise
    return Claim(out, real, before, lock)


def _refuse_blocked(real: str) -> None:
    """An existing OUT is removed once the new one is in place: refuse now, before anything
    is written, a folder in it whose entries could not be removed then."""
    blocked = blocked_folder(real)
    if blocked is not None:
        raise WriteError(*blocked)


def _remove_replaced(folder: str) -> None:
    """Remove the replaced OUT (now at `folder`, beside the new one). The new output is in
    place; a failure here is still an error, never a success with the old one left behind."""
    try:
        remove_tree(folder)
    except OSError as exc:
        raise WriteError(
            folder,
            f"the new output is in place, but its old contents could not all be removed "
            f"({exc.strerror}); they are left here",
            "delete this folder",
        ) from exc


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def _exchange(first: str, second: str) -> bool:
    """Atomically swap two paths; False where the system cannot."""
    return system().exchange(first, second)


def _rename_new(first: str, second: str) -> None:
    """Rename `first` to `second`, which must not exist: a new OUT never replaces one that
    appeared meanwhile."""
    system().rename_new(first, second)


def _make_parents(folder: str) -> list[str]:
    """Create the missing folders up to `folder`; returns those made here, innermost first."""
    missing = []
    while not os.path.isdir(folder):
        missing.append(folder)
        folder = os.path.dirname(folder)
    made: list[str] = []
    try:
        for path in reversed(missing):
            try:
                os.mkdir(path)
            except FileExistsError:
                continue
            made.insert(0, path)
    except BaseException:
        for path in made:
            with contextlib.suppress(OSError):
                os.rmdir(path)
        raise
    return made


class Staging:
    """A marked staging folder beside the real OUT; `commit()` makes it OUT."""

    def __init__(self, claim: Claim, signals: Signals) -> None:
        self.claim = claim
        self.signals = signals
        self.committed = False
        self.replaced: tuple[str, ...] = ()  # the old OUT's top-level entries, once deleted
        parent = os.path.dirname(claim.real)
        self.made = _make_parents(parent)
        self.path = ""
        self.marked = False
        self.adopted: list[tuple[str, str]] = []  # (folder, name): moved in, put back if undone
        claim.staging = self
        try:
            self.path = tempfile.mkdtemp(prefix=PREFIX, dir=parent)
            write_marker(self.path)
            self.marked = True
        except BaseException:
            self.remove()
            raise

    def checkpoint(self) -> None:
        """A safe point of the write: raise a signal that arrived while other code ran."""
        self.signals.raise_deferred()

    def unmark(self) -> None:
        """Drop the marker: before the swap, or for a file of the same name from the source."""
        if self.marked:
            os.remove(os.path.join(self.path, MARKER))
            self.marked = False

    def adopt(self, folder: str, names: Sequence[str]) -> None:
        """Move these files of `folder` into the staging folder, where they stay if the write
        is committed and from where they go back to `folder` if it is not (whatever stops
        it: an error, a signal, which waits while they move)."""
        with self.signals.held():
            for name in names:
                system().rename_new(os.path.join(folder, name), os.path.join(self.path, name))
                self.adopted.append((folder, name))
        self.signals.raise_deferred()

    def _put_back(self) -> bool:
        """The adopted files back where they were; False if one cannot go back (it then
        stays in the staging folder, which is kept: never lose a file that was not ours)."""
        kept = True
        for folder, name in reversed(self.adopted):
            try:
                system().rename_new(os.path.join(self.path, name), os.path.join(folder, name))
            except OSError:
                kept = kept and not os.path.lexists(os.path.join(self.path, name))
        self.adopted.clear()
        return kept

    def remove(self) -> None:
        """Unless committed: put back what was adopted, remove the staging folder and the
        parents made for it."""
        self.claim.staging = None
        if self.committed or (self.adopted and not self._put_back()):
            return
        if self.path:
            with contextlib.suppress(OSError):  # already failing: the first error stands
                # out of descriptors (the failure itself, often): the sources' idle ones
                # make room, or the staging folder would stay behind
                with_room(lambda: remove_tree(self.path))
        for folder in self.made:
            with contextlib.suppress(OSError):
                os.rmdir(folder)  # only while empty: another writer may have used it

    def commit(self) -> None:
        """fsync the staging folder and swap it in as OUT, if nobody else changed OUT.

        A SIGINT or SIGTERM that arrives meanwhile is held until the swap is over: if the
        swap failed it stops the write as usual, otherwise the output is complete and it is
        ignored.
        """
        self.signals.raise_deferred()  # a signal kept until now still stops the write
        with self.signals.held():
            self._swap()
        self.signals.raise_deferred()

    def commit_file(self, name: str, target: str, unchanged: Callable[[], bool]) -> None:
        """A single file rewritten in place: rename the staged file `name` over `target` (the
        real file), if `unchanged()` says it is still as it was read; the staging folder is
        then removed as usual. Signals wait during the swap, as for `commit`."""
        self.signals.raise_deferred()
        with self.signals.held():
            if not unchanged():
                raise OutputConflictError(
                    target,
                    "file changed during the run; it was left as it is now and nothing was written",
                    "run again",
                )
            staged_file = os.path.join(self.path, name)
            os.chmod(staged_file, stat.S_IMODE(os.stat(target).st_mode))
            system().replace(staged_file, target)
            system().sync_folder(os.path.dirname(target))
            self.signals.committed = True
            self.replaced = (target,)
        self.signals.raise_deferred()

    def _swap(self) -> None:
        self.unmark()
        os.chmod(self.path, 0o777 & ~_umask())
        system().sync_folder(self.path)
        if self.claim.before is None:
            self._create_out()
        else:
            self._replace_out(self.claim.before)
        system().sync_folder(os.path.dirname(self.claim.real))

    def _conflict(self, what: str, changed: Sequence[str] = ()) -> OutputConflictError:
        detail = f" ({_some(changed)})" if changed else ""
        return OutputConflictError(
            self.claim.out,
            f"output folder {what} during the run{detail}; it was left as it is now and "
            "nothing was written",
            "run again",
        )

    def _check_unchanged(self, folder: str, before: OutputState) -> None:
        try:
            now = record(folder)
        except FileNotFoundError:
            raise self._conflict("was removed by another program") from None
        if now.identity != before.identity:
            raise self._conflict("was replaced by another program")
        if now.entries != before.entries:
            raise self._conflict("changed", differences(before, now))

    def _done(self, replaced: tuple[str, ...]) -> None:
        self.committed = self.signals.committed = True
        self.replaced = replaced

    def _create_out(self) -> None:
        """OUT did not exist at the start, so it must not exist now either."""
        try:
            _rename_new(self.path, self.claim.real)
        except OSError as exc:
            if exc.errno in (errno.EEXIST, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR):
                raise self._conflict("was created by another program") from exc
            raise
        self._done(())

    def _replace_out(self, before: OutputState) -> None:
        """OUT existed: exchange it for the staging folder only if it is still as recorded,
        and look once more after the exchange, for a write that landed in between."""
        real = self.claim.real
        self._check_unchanged(real, before)
        if not _exchange(self.path, real):
            self._replace_by_renames(before)
            return
        old, self.path = self.path, ""  # `old` holds the old OUT now: never ours to remove
        try:
            self._check_unchanged(old, before)
        except OutputConflictError:
            _exchange(old, real)  # theirs back; ours back at `old`, removed as usual
            self.path = old
            raise
        self._done(before.top_level)
        _remove_replaced(old)

    def _replace_by_renames(self, before: OutputState) -> None:
        """Without an atomic exchange: move the old OUT aside, check it, rename the new one in."""
        real = self.claim.real
        aside = tempfile.mkdtemp(prefix=".ckptfix-old-", dir=os.path.dirname(real))
        old = os.path.join(aside, "old")
        system().rename_new(real, old)
        try:
            self._check_unchanged(old, before)
            _rename_new(self.path, real)
        except BaseException as exc:
            try:
                _rename_new(old, real)
            except OSError:
                raise OutputConflictError(
                    self.claim.out,
                    "output folder was created by another program during the swap; the "
                    f"previous contents are kept in {aside}",
                    "move them back, then run again",
                ) from exc
            os.rmdir(aside)
            if isinstance(exc, OSError) and exc.errno in (errno.EEXIST, errno.ENOTEMPTY):
                raise self._conflict("was created by another program") from exc
            raise
        self._done(before.top_level)
        _remove_replaced(aside)


@contextlib.contextmanager
def staged(claim: Claim) -> Iterator[Staging]:
    """Yield a Staging for a claimed OUT; remove it unless committed, whatever happens
    (SIGINT and SIGTERM too, which are held while the staging folder is being made)."""
    command = current_signals()
    signals = command or Signals()
    previous = signals.install() if signals is not command else {}
    outer = signals.out, signals.writing
    signals.out = claim.out
    staging: Staging | None = None
    try:
        with signals.held():
            signals.writing = True
            staging = Staging(claim, signals)
        signals.raise_deferred()
        yield staging
    except OpenFilesError as exc:
        # The run's fault, not the file's it was opening (a source, a shard read back, which
        # of them depends on the workers' timing): said of OUT, whose write it stopped.
        raise out_of_descriptors(claim.out) from exc
    finally:
        with signals.held():  # a second Ctrl-C must not cut the clean-up short
            if staging is not None:
                staging.remove()
            signals.out, signals.writing = outer
            restore(previous)
        signals.deferred = None  # this write is over: committed, or already failing
