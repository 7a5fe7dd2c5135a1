"""inspect reports in the formats CI systems read: GitHub workflow commands, SARIF 2.1.0,
GitLab Code Quality and JUnit XML; and the JSON list of several reports.

Pure functions from `Report`s to bytes; the CLI only chooses one and prints it. Paths are
written relative to the workspace root they are given (see `locations`).
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from typing import TYPE_CHECKING, Protocol

if TYPE_CHECKING:
    from ckptfix.ops.report import Report

CI_FORMATS = ("github", "gitlab", "sarif", "junit")  # each the name of its module here


class Renderer(Protocol):
    def __call__(self, reports: Sequence[Report], *, root: str, fail_on: str) -> bytes: ...


def render(fmt: str, reports: Sequence[Report], *, root: str, fail_on: str) -> bytes:
    """The reports in one of CI_FORMATS, as the bytes to print (its module loads on use)."""
    if fmt not in CI_FORMATS:
        raise ValueError(f"unknown report format {fmt!r}; expected one of {CI_FORMATS}")
    renderer: Renderer = importlib.import_module(f"{__name__}.{fmt}").render
    return renderer(reports, root=root, fail_on=fail_on)
