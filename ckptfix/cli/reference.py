"""docs/cli.md, the command-line reference: every command's usage, arguments and options,
rendered from the click commands the Typer app builds, so that it says what `--help` says.
`python -m ckptfix.cli.reference docs/cli.md` (`make docs`) writes it; a test fails when the
file differs from what this renders now, so an option changed without it is caught."""

from __future__ import annotations

import inspect
import sys
from enum import Enum
from typing import Any

import typer
import typer.main

from ckptfix.cli.app import app

EXAMPLE = "Example:"
HEADER = [
    "# Command-line reference",
    "",
    "<!-- Generated from the Typer app by `make docs` (python -m ckptfix.cli.reference",
    "     docs/cli.md); tests/test_docs_links.py fails when it is stale. Do not edit. -->",
    "",
    "Every command of `ckptfix`, as its `--help` gives it. What each option does in detail is",
    "on the command's page: [inspect](inspect.md), [fix](fix.md), [reshard](reshard.md),",
    "[convert and dedupe](convert.md), [hash and diff](hash.md); exit codes and error lines in",
    "[inspect](inspect.md#exit-codes).",
]


def render(application: typer.Typer = app) -> str:
    """The whole of docs/cli.md, for ckptfix's app (or another, for the tests)."""
    group: Any = typer.main.get_command(application)
    root = typer.Context(group, info_name="ckptfix")
    lines = [*HEADER, *_command_section("ckptfix", group, root)]
    for name in group.list_commands(root):
        command = group.get_command(root, name)
        if command is not None and not command.hidden:
            context = typer.Context(command, info_name=name, parent=root)
            lines += _command_section(f"ckptfix {name}", command, context)
    return "\n".join(lines) + "\n"


def _command_section(title: str, command: Any, context: typer.Context) -> list[str]:
    """A command's heading, usage line, help text, arguments and options."""
    usage = " ".join([context.command_path, *command.collect_usage_pieces(context)])
    lines = ["", f"## `{title}`", "", "```", usage, "```", ""]
    lines += _help_text(command.help or "")
    # typer builds its parameters on the click it vendors (not the click package): they are
    # told apart by param_type_name, not by click's classes.
    params = command.get_params(context)
    arguments = [p for p in params if p.param_type_name == "argument"]
    options = [p for p in params if p.param_type_name == "option" and not p.hidden]
    if arguments:
        lines += ["", "| argument | meaning |", "|---|---|"]
        lines += [f"| `{_metavar(p)}` | {_cell(_help(p))} |" for p in arguments]
    if options:
        lines += ["", "| option | value | default | meaning |", "|---|---|---|---|"]
        lines += [_option_row(p, context) for p in options]
    return lines


def _help_text(text: str) -> list[str]:
    """A docstring's paragraphs, without click's `\\b` (no-rewrap) markers; an `Example:`
    line becomes a code block (which the docs tests parse with the real command line)."""
    lines: list[str] = []
    for line in inspect.cleandoc(text).splitlines():
        if line.strip() == "\b":
            continue
        if line.startswith(EXAMPLE):
            lines += ["Example:", "", "```sh", line[len(EXAMPLE) :].strip(), "```"]
        else:
            lines.append(line.rstrip())
    return lines


def _option_row(option: Any, context: typer.Context) -> str:
    names = ", ".join(f"`{name}`" for name in [*option.opts, *option.secondary_opts])
    # What it takes, as --help writes it: `SIZE`, `<error|warning|info|never>`, `<str>`.
    value = "" if option.is_flag else f"`{option.make_metavar(context)}`"
    if option.multiple:
        value += " (repeatable)"
    return f"| {names} | {_cell(value)} | {_cell(_default(option))} | {_cell(_help(option))} |"


def _metavar(argument: Any) -> str:
    return str(argument.metavar or str(argument.name).upper())


def _default(option: Any) -> str:
    default: Any = option.default
    if option.is_flag or default is None or callable(default):
        return ""
    if isinstance(default, Enum):
        default = default.value
    return f"`{default}`"


def _help(param: Any) -> str:
    return " ".join(str(getattr(param, "help", "") or "").split())


def _cell(text: str) -> str:
    """Text that stays inside one cell of a markdown table."""
    return text.replace("|", "\\|")


def main(argv: list[str] | None = None) -> None:
    """Write the reference to the file named, or to stdout."""
    args = sys.argv[1:] if argv is None else argv
    text = render()
    if args:
        with open(args[0], "w", encoding="utf-8", newline="\n") as handle:
            handle.write(text)
    else:
        sys.stdout.write(text)


if __name__ == "__main__":
    main()
