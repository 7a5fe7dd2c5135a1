"""`ckptfix-precommit FILE...`: the pre-commit hook. Inspects each staged weight file and
prints one line per problem; exits 1 when any file has a finding at or above --fail-on.
Inside GitHub Actions (GITHUB_ACTIONS=true) it also prints a workflow command per finding,
as `ckptfix inspect --format github` does, so they show as annotations on the files. Every
line is shown as the CLI shows its lines (core.text.shown: no control character, no
workflow command but its own)."""

from __future__ import annotations

import argparse
import os
import sys

from ckptfix.core.errors import CkptfixError
from ckptfix.core.findings import Severity
from ckptfix.core.text import shown
from ckptfix.ops.inspect import inspect
from ckptfix.ops.report import FAIL_ON_LEVELS, Report


def main(argv: list[str] | None = None) -> int:
    usage = "ckptfix-precommit [-h] [--fail-on {error,warning,info,never}] [--] FILE..."
    parser = argparse.ArgumentParser(prog="ckptfix-precommit", usage=usage, description=__doc__)
    parser.add_argument("--fail-on", choices=FAIL_ON_LEVELS, default="error")
    split = _split(sys.argv[1:] if argv is None else argv)
    if isinstance(split, str):
        _line(
            f"error: {split}: unknown option (rule usage; pass --fail-on LEVEL, LEVEL one of "
            f"{', '.join(FAIL_ON_LEVELS)}, then the files)"
        )
        return 2
    options, files = split
    args = parser.parse_args(options)
    annotate = os.environ.get("GITHUB_ACTIONS") == "true"
    failed = False
    for path in files:
        try:
            report = inspect(path)
        except CkptfixError as exc:
            _line(exc.line())
            if annotate:
                _annotate_error(path, exc)
            failed = True
            continue
        if annotate:
            _annotate(report)
        if report.exit_code(args.fail_on) == 0:
            continue
        failed = True
        threshold = Severity(args.fail_on).rank
        for item in report.findings:
            if item.severity.rank >= threshold:
                where = item.file or path
                _line(f"{item.severity.value}: {where}: {item.code}: {item.message}")
    return 1 if failed else 0


def _split(argv: list[str]) -> tuple[list[str], list[str]] | str:
    """(options, files) of the command line, or the unknown option. pre-commit passes the
    names of the staged files, which may look like anything: an existing path is always a
    file (argparse read `-h.safetensors` as -h, checked nothing and printed the name raw, a
    newline and `::stop-commands::` included). Only `-h`, `--help`, `--fail-on LEVEL` and
    `--fail-on=LEVEL` are options; `--` ends them."""
    options: list[str] = []
    files: list[str] = []
    tokens = iter(argv)
    for token in tokens:
        if token == "--" and not os.path.lexists(token):
            return options, files + list(tokens)
        if os.path.lexists(token) or not token.startswith("-"):
            files.append(token)
        elif token in ("-h", "--help") or token.removeprefix("--fail-on=") in FAIL_ON_LEVELS:
            options.append(token)
        elif token == "--fail-on":
            level = next(tokens, "")
            if level not in FAIL_ON_LEVELS:
                return f"--fail-on {level}".strip()
            options += [token, level]
        else:
            return token
    return options, files


def _line(line: str) -> None:
    print(shown(line), file=sys.stderr)


def _root() -> str:
    from ckptfix.reports.locations import workspace_root

    return workspace_root(os.environ, os.getcwd())


def _annotate(report: Report) -> None:
    from ckptfix.reports.github import render

    sys.stdout.write(render([report], root=_root()).decode())
    sys.stdout.flush()


def _annotate_error(path: str, exc: CkptfixError) -> None:
    from ckptfix.reports.github import command
    from ckptfix.reports.locations import display_path

    file = display_path(exc.path or path, _root())
    title = exc.code or exc.label
    print(command("error", exc.message(), title=title, file=file), flush=True)


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
