"""SARIF 2.1.0: one run of ckptfix, a rule per finding code, a result per finding.

Uploadable to GitHub code scanning: results carry `partialFingerprints` (so alerts are
tracked across runs without GitHub reading the binary files) and a `region.startLine` of 1
(code scanning requires a line; weight files have none). Locations inside the workspace
are relative URIs with `uriBaseId` `%SRCROOT%`; others are absolute `file:` URIs, and a
file read from a URL has that URL. A URI holds a file name's bytes percent-encoded (those
that are not UTF-8 too); texts are JSON strings (core.text.json_bytes).
"""

from __future__ import annotations

import os
import re
from collections.abc import Sequence
from pathlib import Path
from urllib.parse import quote

import ckptfix
from ckptfix.core.findings import Severity
from ckptfix.core.text import json_bytes
from ckptfix.io.urls import is_url
from ckptfix.ops.report import Report
from ckptfix.reports.locations import Located, fingerprints, located, relative
from ckptfix.reports.rules import Rule, rule, rules

SCHEMA = (
    "https://docs.oasis-open.org/sarif/sarif/v2.1.0/errata01/os/schemas/sarif-schema-2.1.0.json"
)
INFORMATION_URI = "https://pypi.org/project/ckptfix/"
ROOT_ID = "%SRCROOT%"
FINGERPRINT_KEY = "ckptfixFinding/v1"
LEVELS = {Severity.ERROR: "error", Severity.WARNING: "warning", Severity.INFO: "note"}


def _rule_name(code: str) -> str:
    return "".join(part.capitalize() for part in code.split("-"))


def rule_descriptor(item: Rule) -> dict[str, object]:
    properties: dict[str, object] = {"tags": ["checkpoint"]}
    if item.code == "unsafe-pickle":  # code scanning ranks security alerts by this score
        properties = {"tags": ["checkpoint", "security"], "security-severity": "9.0"}
    return {
        "id": item.code,
        "name": _rule_name(item.code),
        "shortDescription": {"text": item.summary},
        "fullDescription": {"text": f"{item.summary} {item.help}"},
        "help": {"text": item.help},
        "defaultConfiguration": {"level": LEVELS[item.severity]},
        "properties": properties,
    }


# What RFC 3986 allows unencoded in a URI, besides letters, digits and `-._~`; a URL keeps
# its own `%XX` escapes, and any other `%` is encoded.
_URI_CHARACTERS = ":/?#[]@!$&'()*+,;=%"
_LONE_PERCENT = re.compile(r"%(?![0-9A-Fa-f]{2})")


def _url_uri(url: str) -> str:
    return _LONE_PERCENT.sub("%25", quote(os.fsencode(url), safe=_URI_CHARACTERS))


def artifact_location(path: str, root: str) -> dict[str, str]:
    if is_url(path):
        return {"uri": _url_uri(path)}
    inside = relative(path, root)
    if inside is None:
        return {"uri": Path(os.path.abspath(path)).as_uri()}
    return {"uri": quote(os.fsencode(inside), safe="/"), "uriBaseId": ROOT_ID}


def result(item: Located, index: int, fingerprint: str, root: str) -> dict[str, object]:
    finding = item.finding
    properties: dict[str, object] = {"checkedPath": item.checked}
    if finding.tensors:
        properties["tensors"] = list(finding.tensors)
    location = {
        "artifactLocation": artifact_location(item.anchor, root),
        "region": {"startLine": 1},
    }
    return {
        "ruleId": finding.code,
        "ruleIndex": index,
        "level": LEVELS[finding.severity],
        "message": {"text": finding.message},
        "locations": [{"physicalLocation": location}],
        "partialFingerprints": {FINGERPRINT_KEY: fingerprint},
        "properties": properties,
    }


def sarif_log(reports: Sequence[Report], *, root: str) -> dict[str, object]:
    """The SARIF log as a dict: every rule of CODES (plus any other code found), every finding."""
    items = list(located(reports))
    codes = [entry.code for entry in rules()]
    codes += sorted({item.finding.code for item in items} - set(codes))
    index = {code: number for number, code in enumerate(codes)}
    results = [
        result(item, index[item.finding.code], fingerprint, root)
        for item, fingerprint in zip(items, fingerprints(items, root), strict=True)
    ]
    driver = {
        "name": "ckptfix",
        "version": ckptfix.__version__,
        "informationUri": INFORMATION_URI,
        "rules": [rule_descriptor(rule(code)) for code in codes],
    }
    base = Path(os.path.abspath(root)).as_uri().rstrip("/") + "/"
    run = {
        "tool": {"driver": driver},
        "originalUriBaseIds": {ROOT_ID: {"uri": base}},
        "results": results,
    }
    return {"$schema": SCHEMA, "version": "2.1.0", "runs": [run]}


def render(reports: Sequence[Report], *, root: str, fail_on: str = "error") -> bytes:
    """The SARIF log (every finding, at its own level; fail_on does not filter them)."""
    return json_bytes(sarif_log(reports, root=root)) + b"\n"
