"""Help text as click would print it, without two of typer's and click's habits."""

from __future__ import annotations

from typing import Any

from typer.core import TyperArgument, TyperCommand, TyperGroup


class WholeSummaries(TyperGroup):
    """A group whose command list shows each command's whole first sentence (click cuts it to
    the terminal width and ends it with '...'); long ones wrap instead."""

    def format_commands(self, ctx: Any, formatter: Any) -> None:
        names = [name for name, command in self.commands.items() if not command.hidden]
        rows = [(name, self.commands[name].get_short_help_str(limit=1000)) for name in names]
        if rows:
            with formatter.section("Commands"):
                formatter.write_dl(rows)


class PlainUsage(TyperCommand):
    """Usage lines name arguments as the help does: `SRC`, not typer's `{SRC}`."""

    def collect_usage_pieces(self, ctx: Any) -> list[str]:
        pieces = [self.options_metavar] if self.options_metavar else []
        for param in self.get_params(ctx):
            if isinstance(param, TyperArgument) and param.metavar:
                pieces.append(param.metavar if param.required else f"[{param.metavar}]")
            else:
                pieces += param.get_usage_pieces(ctx)
        return pieces
