"""The one place where failures become exit codes: one line on stderr naming the rule, and
with `--json` (or `--format json`) a JSON error document on stdout (docs/inspect.md, "Exit codes")."""

from __future__ import annotations

import itertools
import os
import sys
from typing import Any, NoReturn

import typer

from ckptfix.cli.help import WholeSummaries
from ckptfix.core.errors import CkptfixError
from ckptfix.core.signals import command_signals
from ckptfix.core.signals import current as current_signals
from ckptfix.core.text import json_bytes, redact, shown

ERROR_SCHEMA_VERSION = 1


class Group(WholeSummaries):
    """Runs a command and maps every failure to one stderr line and an exit code."""

    def main(  # type: ignore[override]
        self,
        args: Any = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> NoReturn:
        # Signals are answered for the whole command, rendering included: once the output is
        # committed, a Ctrl-C no longer turns the success into "interrupted".
        arguments = list(sys.argv[1:] if args is None else args)
        with command_signals():
            code = self._run(arguments, prog_name, complete_var, **extra)
        sys.exit(code)

    def _run(
        self, args: list[str], prog_name: str | None, complete_var: str | None, **extra: Any
    ) -> int:
        report = _Reporter(wants_json(args))
        try:
            result = super().main(args, prog_name, complete_var, standalone_mode=False, **extra)
            # The last safe point: a signal kept while other code ran (rich laying out the
            # output) ends the command as interrupted; once an output is committed it is not.
            signals = current_signals()
            if signals is not None:
                signals.raise_deferred()
            return result if isinstance(result, int) else 0
        except typer.TyperException as exc:  # usage errors and the like, from the parser
            return report.usage(exc)
        except (typer.Abort, KeyboardInterrupt):
            return report.failed("interrupted", None, "interrupted", None, 130)
        except CkptfixError as exc:
            if _debug():
                raise
            report.document(exc.to_dict())
            error_line(exc.line())
            return exc.exit_code
        except Exception as exc:  # the last resort: never a traceback for users
            if _debug():
                raise
            from ckptfix.io.descriptors import OUT_OF_DESCRIPTORS, out_of_descriptors

            if isinstance(exc, OSError) and exc.errno in OUT_OF_DESCRIPTORS:
                # out of descriptors outside the writers' own handling (a module imported
                # late, a config file): the run's limit, said as the writers say it
                error = out_of_descriptors(None)
                report.document(error.to_dict())
                error_line(error.line())
                return error.exit_code
            fix = "please report it; rerun with CKPTFIX_DEBUG=1 for the traceback"
            what = f"internal error: {type(exc).__name__}: {exc}"
            return report.failed("internal-error", None, what, fix, 1)


def wants_json(args: list[str]) -> bool:
    """Whether the command line asks for JSON on stdout, and for nothing else (options end
    at `--`): `--json`, or `--format json`."""
    options = args[: args.index("--")] if "--" in args else args
    formats = {b for a, b in itertools.pairwise(options) if a == "--format"}
    formats |= {o.removeprefix("--format=") for o in options if o.startswith("--format=")}
    return formats == {"json"} or (not formats and "--json" in options)


class _Reporter:
    """Prints a failure: the stderr line always, the JSON error document when asked for."""

    def __init__(self, json_output: bool) -> None:
        self.json_output = json_output

    def document(self, error: dict[str, object]) -> None:
        if self.json_output:
            document = {"schema_version": ERROR_SCHEMA_VERSION, "error": error}
            sys.stdout.flush()
            sys.stdout.buffer.write(json_bytes(document) + b"\n")
            sys.stdout.buffer.flush()

    def failed(
        self, code: str, path: str | None, what: str, fix: str | None, exit_code: int
    ) -> int:
        what = redact(what)  # an exception's own text may hold a URL as it was given
        error = {"code": code, "rule": code, "file": path, "message": what, "fix": fix}
        self.document({**error, "exit_code": exit_code})
        where = f"{path}: " if path else ""
        error_line(f"error: {where}{what} (rule {code}{f'; {fix}' if fix else ''})")
        return exit_code

    def usage(self, exc: typer.TyperException) -> int:
        message = exc.format_message()
        # `ckptfix` with no arguments: the help text itself (every other message, which may
        # quote what was typed, is an error line)
        if message.startswith("Usage:") and "\n" in message:
            sys.stderr.write(message + "\n")
            return exc.exit_code
        context = getattr(exc, "ctx", None)
        command = context.command_path if context is not None else "ckptfix"
        return self.failed("usage", None, message, f"see `{command} --help`", exc.exit_code)


def _debug() -> bool:
    return os.environ.get("CKPTFIX_DEBUG") == "1"


def error_line(line: str) -> None:
    """One line on stderr, shown as every line for a person or a CI log is (core.text)."""
    sys.stderr.write(shown(line) + "\n")
    sys.stderr.flush()
