"""SIGINT and SIGTERM (and on Windows Ctrl-Break's SIGBREAK: `Platform.stop_signals`) while
ckptfix runs a command: they stop it, leave any output as it was, and never report a
completed output as interrupted (see Signals)."""

from __future__ import annotations

import contextlib
import os
import signal
import threading
from collections.abc import Iterator
from types import FrameType
from typing import Any

from ckptfix.core.errors import Interrupted
from ckptfix.platform import system
from ckptfix.platform.locks import release_held

# The package root: every frame of ckptfix code, whichever layer it is in.
_OURS = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _ours(frame: FrameType | None) -> bool:
    """Whether a signal arrived while ckptfix's own code ran: the only place where the
    handler raises. Raised in other code, the exception can do harm: in
    threading.Condition.__enter__ or __exit__ it leaves the lock taken, so that a worker
    thread of the write (settling a Future) and then the join with it wait forever (a hang
    seen under SIGTERM); in importlib's end-of-import callback it is printed as "ignored"
    and lost. There it is kept for the write's next safe point (`raise_deferred`)."""
    return frame is not None and frame.f_code.co_filename.startswith(_OURS)


class Signals:
    """How SIGINT and SIGTERM are answered while ckptfix holds them: they stop the command
    (a write in progress is removed and OUT left as it was), wait while a swap is under way,
    and are ignored once an output is committed, so that a complete output is never reported
    as interrupted. Python runs handlers in the main thread between bytecodes, so the handler
    sees this state exactly, whichever thread the signal reached."""

    def __init__(self, *, exit_outside_writes: bool = False) -> None:
        self.out: str | None = None  # the output claimed, for the message
        self.writing = False  # a staging folder exists: raise, so that it is removed
        self.holding = 0
        self.deferred: Interrupted | None = None
        self.committed = False
        self.exit_outside_writes = exit_outside_writes

    def handle(self, signum: int, frame: FrameType | None) -> None:
        if self.committed:
            return
        error = Interrupted(self.out, signal.Signals(signum).name, 128 + signum)
        if self.exit_outside_writes and not self.writing:
            # The console script, with nothing to undo: exit at once, which an exception
            # raised in the middle of an import or of a thread pool's locking may not do
            # (a lock file beside OUT, where the system has one, goes first).
            os.write(2, (error.line() + "\n").encode())
            release_held()
            os._exit(error.exit_code)
        if self.holding or not _ours(frame):
            self.deferred = self.deferred or error
            return
        raise error

    @contextlib.contextmanager
    def held(self) -> Iterator[None]:
        """Signals that arrive meanwhile wait for `raise_deferred`."""
        self.holding += 1
        try:
            yield
        finally:
            self.holding -= 1

    def raise_deferred(self) -> None:
        """A safe point: raise a signal kept while held or while other code ran."""
        error, self.deferred = self.deferred, None
        if error is not None and not self.committed:
            raise error

    def install(self) -> dict[int, Any]:
        """Take SIGINT and SIGTERM (from the main thread only; elsewhere the caller owns them),
        except a signal the caller ignores (nohup, a background job's SIGINT)."""
        previous: dict[int, Any] = {}
        if threading.current_thread() is threading.main_thread():
            for held in system().stop_signals():
                if signal.getsignal(held) is not signal.SIG_IGN:
                    previous[held] = signal.signal(held, self.handle)
        return previous


def restore(previous: dict[int, Any]) -> None:
    for number, handler in previous.items():
        signal.signal(number, handler)


_command: Signals | None = None  # set while a command owns the signals


@contextlib.contextmanager
def command_signals() -> Iterator[None]:
    """Answer SIGINT and SIGTERM for a whole command, rendering included: a signal after the
    output is committed is ignored instead of turning a success into "interrupted". The CLI
    runs every command inside this."""
    global _command
    if _command is not None:
        yield
        return
    signals = Signals()
    previous = signals.install()
    _command = signals
    try:
        yield
    finally:
        _command = None
        restore(previous)


def keep_command_signals() -> None:
    """`command_signals` without a restore, for the console script (cli/entry.py), which
    ignores both signals once the command is over. Outside a write it exits at once."""
    global _command
    if _command is None:
        _command = Signals(exit_outside_writes=True)
        _command.install()


def current() -> Signals | None:
    """The Signals a command holds, if one does."""
    return _command


@contextlib.contextmanager
def writing_to(out: str) -> Iterator[Signals]:
    """The command's Signals (or new ones, installed here) while a write to `out` that has
    something to undo is under way: a SIGINT or SIGTERM then raises, at the write's next safe
    point, so that the write is undone; restored at the end."""
    command = current()
    signals = command or Signals()
    previous = signals.install() if signals is not command else {}
    outer = signals.out, signals.writing
    signals.out, signals.writing = out, True
    try:
        yield signals
    finally:
        with signals.held():
            signals.out, signals.writing = outer
            restore(previous)
        signals.deferred = None
