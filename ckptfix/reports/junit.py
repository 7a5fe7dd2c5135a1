"""JUnit XML: a test suite "ckptfix inspect" with one test case per checked file.

A test case is named after the file and classed under the checked PATH (both relative to
the workspace when inside it); a checked folder also has a test case of its own, named
after the folder, for the findings about the folder as a whole (mixed families, dtype mix,
no weights). Findings at or above --fail-on make the case fail: one `<failure>`, typed by
the most severe code, listing every such finding; the others are listed in `<system-out>`.
Every text is shown as every printed line is (core.text.shown), one line per finding: XML
cannot hold most control characters, and a CI log prints the report line by line.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from collections.abc import Sequence

from ckptfix.core.findings import Finding, Severity
from ckptfix.core.text import shown
from ckptfix.ops.report import Report
from ckptfix.reports.locations import display_path, is_file_report

SUITE_NAME = "ckptfix inspect"


def test_cases(report: Report) -> dict[str, list[Finding]]:
    """Test case (a file read, a file named by a finding, or the checked folder) -> the
    findings about it, in the report's order."""
    cases: dict[str, list[Finding]] = {item.path: [] for item in report.files}
    if not is_file_report(report):
        cases.setdefault(report.path, [])
    for item in report.findings:
        cases.setdefault(item.file or report.path, []).append(item)
    return cases


def _line(item: Finding) -> str:
    return shown(f"{item.severity.value} {item.code}: {item.message}")


def _add_case(
    suite: ET.Element, classname: str, name: str, found: list[Finding], threshold: int
) -> bool:
    """One <testcase>; True when it failed."""
    case = ET.SubElement(suite, "testcase", classname=shown(classname), name=shown(name))
    failing = sorted(
        (item for item in found if item.severity.rank >= threshold),
        key=lambda item: -item.severity.rank,
    )
    passing = [item for item in found if item.severity.rank < threshold]
    if failing:
        first = failing[0]
        more = f" (and {len(failing) - 1} more)" if len(failing) > 1 else ""
        failure = ET.SubElement(
            case, "failure", type=first.code, message=shown(first.message + more)
        )
        failure.text = "\n".join(_line(item) for item in failing)
    if passing:
        ET.SubElement(case, "system-out").text = "\n".join(map(_line, passing))
    return bool(failing)


def render(reports: Sequence[Report], *, root: str, fail_on: str = "error") -> bytes:
    """The JUnit XML document, UTF-8 with an XML declaration."""
    threshold = Severity(fail_on).rank if fail_on != "never" else 4  # above every rank
    suites = ET.Element("testsuites", name="ckptfix")
    suite = ET.SubElement(suites, "testsuite", name=SUITE_NAME)
    tests = failures = 0
    for report in reports:
        classname = display_path(report.path, root)
        for file, found in test_cases(report).items():
            tests += 1
            failures += _add_case(suite, classname, display_path(file, root), found, threshold)
    for element in (suites, suite):
        element.attrib.update(tests=str(tests), failures=str(failures), errors="0", skipped="0")
    ET.indent(suites)
    body = ET.tostring(suites, encoding="unicode")
    return ('<?xml version="1.0" encoding="UTF-8"?>\n' + body + "\n").encode()
