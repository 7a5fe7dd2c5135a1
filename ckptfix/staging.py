"""Atomic output folders: build in a staging folder beside OUT, swap it in at the end.

On any exception, SIGINT or SIGTERM the staging folder is removed and OUT is left as it
was. Nothing outside the staging folder is deleted unless it is the old OUT being
replaced (--force, --in-place), and that happens only after the new one is in place.
"""

from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import errno
import os
import shutil
import signal
import tempfile
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from ckptfix.errors import Interrupted, UsageError, WriteError

_RENAME_EXCHANGE = 2


def _inside(child: str, parent: str) -> bool:
    return child == parent or child.startswith(parent.rstrip(os.sep) + os.sep)


def check_output(out: str, sources: list[str], *, force: bool, in_place: bool) -> None:
    """Refuse outputs that would clobber an input or a folder the user did not mean."""
    real_out = os.path.realpath(out)
    if in_place:
        return
    for source in sources:
        real_source = os.path.realpath(source)
        if _inside(real_source, real_out) or _inside(real_out, real_source):
            raise UsageError(
                out,
                f"output overlaps the input {source}",
                "choose another -o folder, or use --in-place",
            )
    if os.path.isfile(out) or (os.path.exists(out) and not os.path.isdir(out)):
        raise UsageError(out, "output exists and is not a folder", "choose another -o folder")
    if os.path.isdir(out) and os.listdir(out) and not force:
        raise UsageError(out, "output folder exists and is not empty", "pass --force to replace it")


def _umask() -> int:
    current = os.umask(0)
    os.umask(current)
    return current


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _exchange(first: str, second: str) -> bool:
    """Atomically swap two paths with renameat2(RENAME_EXCHANGE); False if unsupported."""
    libc_name = ctypes.util.find_library("c")
    if libc_name is None:
        return False
    libc = ctypes.CDLL(libc_name, use_errno=True)
    renameat2 = getattr(libc, "renameat2", None)
    if renameat2 is None:
        return False
    at_fdcwd = -100
    result = renameat2(
        at_fdcwd, os.fsencode(first), at_fdcwd, os.fsencode(second), _RENAME_EXCHANGE
    )
    if result == 0:
        return True
    code = ctypes.get_errno()
    if code in (errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP):
        return False
    raise OSError(code, os.strerror(code), second)


class Staging:
    """A staging folder for OUT; `commit()` makes it OUT, leaving no moment without OUT."""

    def __init__(self, out: str) -> None:
        self.out = out
        parent = os.path.dirname(os.path.abspath(out))
        try:
            os.makedirs(parent, exist_ok=True)
            self.path = tempfile.mkdtemp(prefix=".ckptfix-", dir=parent)
        except OSError as exc:
            raise WriteError(
                out,
                f"cannot create a staging folder: {exc.strerror}",
                "check the folder's permissions",
            ) from exc
        self.committed = False
        self.swapping = False
        self.deferred: Interrupted | None = None

    def interrupt(self, signal_name: str, exit_code: int) -> None:
        """What a signal does: stop the write, unless it is being committed or is done."""
        error = Interrupted(self.out, signal_name, exit_code)
        if self.swapping:
            self.deferred = error
        elif not self.committed:
            raise error

    def remove(self) -> None:
        if not self.committed:
            shutil.rmtree(self.path, ignore_errors=True)

    def commit(self) -> None:
        """fsync the staging folder, then swap it in as OUT (atomically where possible).

        A SIGINT or SIGTERM that arrives meanwhile is deferred (see `staged`), so a signal
        cannot split the swap from the clean-up of the old folder; once the swap is done
        the output is complete and the signal no longer undoes anything.
        """
        self.swapping = True
        try:
            self._swap()
        finally:
            self.swapping = False
        if self.deferred is not None and not self.committed:
            raise self.deferred

    def _swap(self) -> None:
        os.chmod(self.path, 0o777 & ~_umask())
        _fsync_dir(self.path)
        out = os.path.abspath(self.out)
        parent = os.path.dirname(out)
        if os.path.isdir(out) and os.listdir(out):
            if _exchange(self.path, out):
                self.committed = True
                _fsync_dir(parent)
                shutil.rmtree(self.path)  # now holds the old OUT
            else:
                aside = tempfile.mkdtemp(prefix=".ckptfix-old-", dir=parent)
                os.rename(out, os.path.join(aside, "old"))
                os.rename(self.path, out)
                self.committed = True
                _fsync_dir(parent)
                shutil.rmtree(aside)
        else:
            if os.path.isdir(out):
                os.rmdir(out)  # empty: ours to replace
            os.rename(self.path, out)
            self.committed = True
            _fsync_dir(parent)


@contextlib.contextmanager
def staged(out: str) -> Iterator[Staging]:
    """Yield a Staging for OUT; remove it unless committed, whatever happens (SIGINT and
    SIGTERM too). Python runs signal handlers in the main thread between bytecodes, so the
    handlers below see the staging state exactly, whichever thread the signal reached."""
    staging = Staging(out)

    def on_signal(signum: int, frame: FrameType | None) -> None:
        staging.interrupt(signal.Signals(signum).name, 128 + signum)

    # Handlers can only be set from the main thread (elsewhere the caller owns them), and a
    # signal the caller ignores (nohup, a background job's SIGINT) stays ignored.
    previous: dict[int, Any] = {}
    if threading.current_thread() is threading.main_thread():
        for held in (signal.SIGINT, signal.SIGTERM):
            if signal.getsignal(held) is not signal.SIG_IGN:
                previous[held] = signal.signal(held, on_signal)
    try:
        yield staging
    finally:
        staging.remove()
        for number, handler in previous.items():
            signal.signal(number, handler)
