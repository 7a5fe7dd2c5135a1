"""Running the CLI in tests: exit code, stdout and stderr kept apart."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from typer.testing import CliRunner

from ckptfix.cli.app import app


@dataclass(frozen=True)
class Run:
    code: int
    stdout: str
    stderr: str

    def json(self) -> Any:
        return json.loads(self.stdout)

    @property
    def error_lines(self) -> list[str]:
        return [line for line in self.stderr.splitlines() if line]


def cli(*args: str | os.PathLike[str]) -> Run:
    result = CliRunner().invoke(
        app, [os.fspath(arg) for arg in args], catch_exceptions=False, prog_name="ckptfix"
    )
    return Run(result.exit_code, result.stdout, result.stderr)


def tree_snapshot(root: Path) -> dict[str, bytes]:
    """Every file under root with its bytes: for proving that nothing changed."""
    return {
        str(path.relative_to(root)): path.read_bytes()
        for path in sorted(root.rglob("*"))
        if path.is_file()
    }
