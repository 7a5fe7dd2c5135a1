"""GitLab Code Quality (a subset of the Code Climate issue format): a JSON array of issues
with description, check_name, fingerprint, severity and location.path (+ lines.begin)."""

from __future__ import annotations

from collections.abc import Sequence

from ckptfix.core.findings import Severity
from ckptfix.core.text import json_bytes
from ckptfix.ops.report import Report
from ckptfix.reports.locations import display_path, fingerprints, located

# GitLab's scale is info, minor, major, critical, blocker; an error means a loader fails
# or silently loads the wrong weights.
SEVERITIES = {Severity.ERROR: "critical", Severity.WARNING: "minor", Severity.INFO: "info"}


def issues(reports: Sequence[Report], *, root: str) -> list[dict[str, object]]:
    items = list(located(reports))
    return [
        {
            "description": f"{item.finding.code}: {item.finding.message}",
            "check_name": item.finding.code,
            "fingerprint": fingerprint,
            "severity": SEVERITIES[item.finding.severity],
            # a weight file has no lines; GitLab needs lines.begin to show a file-level issue
            "location": {"path": display_path(item.anchor, root), "lines": {"begin": 1}},
        }
        for item, fingerprint in zip(items, fingerprints(items, root), strict=True)
    ]


def render(reports: Sequence[Report], *, root: str, fail_on: str = "error") -> bytes:
    """The Code Quality report (every finding; fail_on does not filter them)."""
    return json_bytes(issues(reports, root=root)) + b"\n"
