"""Where a finding is, for CI systems: the file it names, relative to the workspace.

CI systems attach a finding to a file of the repository by its path relative to the
checkout (`GITHUB_WORKSPACE`, `CI_PROJECT_DIR`). A finding without a file of its own (a
folder-level one such as `mixed-formats`) is placed on the checked PATH when that PATH is
a file, and otherwise has no file: the formats that must name a location use the PATH.
A file read from a URL is named by its URL (without credentials, as every label of a URL
is), never as a path under the workspace.
"""

from __future__ import annotations

import hashlib
import os
from collections import Counter
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass

from ckptfix.core.findings import Finding
from ckptfix.io.urls import is_url
from ckptfix.ops.report import Report

# Checked in this order; the current directory when none is set.
WORKSPACE_VARIABLES = ("GITHUB_WORKSPACE", "CI_PROJECT_DIR")


@dataclass(frozen=True)
class Located:
    """A finding with the PATH it was found under and the file it belongs to (or None)."""

    finding: Finding
    checked: str  # the PATH given to inspect
    file: str | None  # the finding's file, else the checked PATH when that is a file

    @property
    def anchor(self) -> str:
        """The file, or for a folder-level finding the checked folder."""
        return self.file if self.file is not None else self.checked


def workspace_root(environ: Mapping[str, str], cwd: str) -> str:
    """The folder paths are made relative to: the CI checkout, else the current folder."""
    for name in WORKSPACE_VARIABLES:
        value = environ.get(name)
        if value:
            return value
    return cwd


def relative(path: str, root: str) -> str | None:
    """`path` relative to `root` with `/` separators, or None when it lies outside root (a
    URL always does)."""
    if is_url(path):
        return None
    for resolve in (os.path.abspath, os.path.realpath):
        full, base = resolve(path), resolve(root)
        if full == base or full.startswith(base.rstrip(os.sep) + os.sep):
            return os.path.relpath(full, base).replace(os.sep, "/")
    return None


def display_path(path: str, root: str) -> str:
    """`path` relative to `root` when inside it, else absolute; a URL as it is."""
    inside = relative(path, root)
    if inside is not None:
        return inside
    return path if is_url(path) else os.path.abspath(path)


def is_file_report(report: Report) -> bool:
    """True when the checked PATH is itself one of the files read (not a folder)."""
    return any(item.path == report.path for item in report.files)


def located(reports: Sequence[Report]) -> Iterator[Located]:
    """Every finding of every report, in order, with its file decided. A finding that
    names the checked folder itself (`several-checkpoints`, `no-weights`, `training-state`,
    the manifest's) is a folder-level one: no file."""
    for report in reports:
        own_file = report.path if is_file_report(report) else None
        folder = None if own_file is not None else os.path.normpath(report.path)
        for item in report.findings:
            file = item.file or own_file
            if file is not None and os.path.normpath(file) == folder:
                file = None
            yield Located(item, report.path, file)


def fingerprints(items: Sequence[Located], root: str) -> list[str]:
    """A stable identity per finding: its code, its place relative to the workspace and its
    tensors (not the message, whose numbers may change, nor absolute paths or times).
    Identical keys are told apart by their occurrence number, so each is unique."""
    seen: Counter[str] = Counter()
    result = []
    for item in items:
        key = "\x00".join(
            [item.finding.code, display_path(item.anchor, root), *item.finding.tensors]
        )
        # surrogatepass: a file name's bytes that are not UTF-8 have a fingerprint too
        identity = f"{key}\x00{seen[key]}".encode("utf-8", "surrogatepass")
        result.append(hashlib.sha256(identity).hexdigest())
        seen[key] += 1
    return result
