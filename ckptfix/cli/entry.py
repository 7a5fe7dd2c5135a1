"""The console script (`ckptfix`, `python -m ckptfix`): quiet about signals from the start.

Python answers SIGINT with KeyboardInterrupt, which prints a traceback when it lands while
typer, rich and ckptfix are being imported, and SIGTERM kills the process outright. So the
first thing done here, before anything else is imported, is to answer both with one error
line and the exit code (nothing has been written yet, so there is nothing to undo); then
ckptfix.write.staging's command handler takes over for the command, and once the command is over
both signals are ignored until the process has exited.

What happens before `main` runs is Python's: a signal that early is answered by Python
itself (a KeyboardInterrupt traceback). That is the interpreter's own start-up, `site`,
`runpy` or the console-script wrapper pip writes (which imports `re` first), and
the import of `ckptfix`, `ckptfix.cli` and this module. Timed with strace (SECURITY.md,
"Signals"), the window is about 18 ms, of which these three imports take 1.1 ms; they took
2.2 ms while they also imported `__future__`, `importlib` and `gc`.
"""

# Nothing here, nor in ckptfix/__init__.py and cli/__init__.py, imports a module Python has
# not loaded already (tests/test_output_safety.py checks it): not `from __future__` (hence
# the quoted annotation below), not `gc` until the end. `signal` builds its enums when
# imported (about 3 ms, during which Ctrl-C would still print a traceback); its C core is
# there at once.
import _signal  # type: ignore[import-not-found]
import os
import sys

TYPE_CHECKING = False
if TYPE_CHECKING:
    from types import FrameType

# The signals that stop a command: Platform.stop_signals(), which this module may not import
# yet (it imports modules Python has not loaded); Ctrl-Break's SIGBREAK exists on Windows
# only. tests/test_platform.py checks that the two agree. Statements, not a comprehension:
# a comprehension is a function's frame, where a Ctrl-C would be a traceback in ckptfix.
_NAMES = {_signal.SIGINT: "SIGINT", _signal.SIGTERM: "SIGTERM"}
if hasattr(_signal, "SIGBREAK"):
    _NAMES[_signal.SIGBREAK] = "SIGBREAK"


def _quit(signum: int, frame: "FrameType | None") -> None:
    os.write(2, f"error: interrupted by {_NAMES[signum]} (rule interrupted)\n".encode())
    os._exit(128 + signum)


def main() -> None:
    """Console-script entry point."""
    for number in _NAMES:
        if _signal.getsignal(number) is not _signal.SIG_IGN:  # nohup and the like stay so
            _signal.signal(number, _quit)
    import gc

    # The imports build some 100,000 objects that live as long as the process and form few
    # cycles: collected as they are built, they cost 5-10 ms of a 150 ms inspect (measured);
    # frozen once built, later collections do not walk them again.
    gc.disable()
    from ckptfix.io.descriptors import raise_open_files_limit

    raise_open_files_limit()  # a folder of 1,100 shards under a soft limit of 1,024
    from ckptfix.cli.app import for_arguments
    from ckptfix.core.memory import freeze_what_pauses_build
    from ckptfix.core.signals import keep_command_signals

    gc.freeze()
    gc.enable()
    keep_command_signals()
    freeze_what_pauses_build()
    try:
        for_arguments(sys.argv[1:])(prog_name="ckptfix")  # exits with the command's code
    finally:
        # The command is over and its exit code decided. Python's shutdown would restore the
        # default handlers, and a late signal would then kill the process; it leaves
        # ignored signals alone.
        for number in _NAMES:
            _signal.signal(number, _signal.SIG_IGN)
        # Nor is anything the command made needed any more (its files are closed, its output
        # written): frozen, the objects still alive are not traversed again by the collection
        # at shutdown, which took 0.1-0.3 s of a run that had built botocore's S3 client
        # (measured; 0.02-0.04 s of a local inspect).
        gc.freeze()
