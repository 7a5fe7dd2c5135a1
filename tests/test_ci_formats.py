"""`inspect --format github|gitlab|sarif|junit`: exact annotations, SARIF valid against the
official schema, GitLab Code Quality, JUnit read back by ElementTree and by junitparser."""

from __future__ import annotations

import json
import os
import shutil
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import jsonschema
import junitparser
import pytest

import ckptfix
from ckptfix.core.findings import CODES, Finding, Severity
from ckptfix.ops.report import FileSummary, Report
from ckptfix.reports import github, rules
from tests.builders import Factory, Spec
from tests.helpers import Run, cli

SCHEMA = Path(__file__).parent / "data" / "sarif-schema-2.1.0.json"
PATHS = ["m", "plain.safetensors", "mix.safetensors"]


@pytest.fixture
def workspace(factory: Factory, monkeypatch: pytest.MonkeyPatch) -> Factory:
    """A checkout holding a folder with an LFS stub beside its shards (lfs-pointer error,
    mixed-formats warning about the folder), a file without "format" metadata (warning)
    and a file of two float dtypes (dtype-mix info, a finding without a file)."""
    factory.sharded("m", [[Spec("a")], [Spec("b")]])
    factory.lfs_pointer("m/pytorch_model.bin")
    factory.safetensors("plain.safetensors", with_format=False)
    factory.safetensors("mix.safetensors", [Spec("h", "F16", (2,)), Spec("f", "F32", (2,))])
    monkeypatch.chdir(factory.root)
    monkeypatch.setenv("GITHUB_WORKSPACE", str(factory.root))
    monkeypatch.delenv("CI_PROJECT_DIR", raising=False)
    return factory


def messages(*paths: str) -> dict[str, str]:
    """code -> message, from the --json documents of the same paths."""
    documents = [cli("inspect", path, "--json").json() for path in paths]
    return {f["code"]: f["message"] for document in documents for f in document["findings"]}


def run_format(fmt: str, *args: str) -> Run:
    run = cli("inspect", *PATHS, "--format", fmt, *args)
    lfs = "error: m/pytorch_model.bin: file is a Git LFS pointer"
    assert [line[: len(lfs)] for line in run.error_lines] == [lfs]  # stderr as for text
    return run


# -- github ------------------------------------------------------------------------------


def test_github_annotations_exact(workspace: Factory) -> None:
    text = messages(*PATHS)
    run = run_format("github")
    assert run.code == 1
    assert run.stdout.splitlines() == [
        f"::error file=m/pytorch_model.bin,title=lfs-pointer::{text['lfs-pointer']}",
        f"::warning title=mixed-formats::m: {text['mixed-formats']}",
        "::warning file=plain.safetensors,title=missing-format-metadata::"
        'header __metadata__ has no "format" entry, which some loaders require '
        '(rewrite with `ckptfix reshard`, which adds "format": "pt")',
        f"::notice file=mix.safetensors,title=dtype-mix::{text['dtype-mix']}",
    ]
    assert run_format("github", "--fail-on", "never").code == 0
    assert cli("inspect", "mix.safetensors", "--format", "github", "--fail-on", "info").code == 1


def test_findings_on_the_checked_folder_itself_have_no_file(workspace: Factory) -> None:
    """Findings that name the folder given (several-checkpoints, no-weights) are folder-level:
    no `file=` in GitHub's annotations; SARIF and GitLab, which need a location, use PATH."""
    workspace.safetensors("multi/x.safetensors")
    workspace.safetensors("multi/y.safetensors")
    (workspace.root / "empty").mkdir()
    text = messages("multi") | messages("empty")
    run = cli("inspect", "multi", "empty/", "--format", "github")
    assert run.code == 1
    assert run.stdout.splitlines() == [
        f"::warning title=several-checkpoints::multi: {text['several-checkpoints']}",
        f"::error title=no-weights::empty: {text['no-weights']}",
    ]
    document = cli("inspect", "multi", "--format", "sarif").json()
    (result,) = document["runs"][0]["results"]
    uri = result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
    assert (result["ruleId"], uri) == ("several-checkpoints", "multi")
    (issue,) = cli("inspect", "multi", "--format", "gitlab").json()
    assert (issue["check_name"], issue["location"]["path"]) == ("several-checkpoints", "multi")


def test_github_escaping() -> None:
    assert github.escape_data("100% a\r\nb:c,d") == "100%25 a%0D%0Ab:c,d"
    assert github.escape_property("dir:x,y/100%\n") == "dir%3Ax%2Cy/100%25%0A"
    finding = Finding("corrupt-file", Severity.ERROR, "bad\n::error::forged %0A", "w:1,2.bin")
    report = Report(
        "w:1,2.bin", "unknown", (FileSummary("w:1,2.bin", "unknown", 1, 0),), (), (finding,)
    )
    # the newline is shown as every printed line shows it (core.text.shown), then escaped
    assert github.render([report], root=os.getcwd()) == (
        b"::error file=w%3A1%2C2.bin,title=corrupt-file::bad\\n::error::forged %250A\n"
    )


def test_github_paths_relative_to_the_workspace(
    workspace: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    sub = workspace.root / "sub"
    sub.mkdir()
    monkeypatch.chdir(sub)
    expected = "::warning file=plain.safetensors,title=missing-format-metadata::"
    for given in ("../plain.safetensors", str(workspace.root / "plain.safetensors")):
        assert cli("inspect", given, "--format", "github").stdout.startswith(expected)
    # without GITHUB_WORKSPACE: relative to the current folder
    monkeypatch.delenv("GITHUB_WORKSPACE")
    run = cli("inspect", "../plain.safetensors", "--format", "github")
    assert run.stdout.startswith(f"::warning file={workspace.root / 'plain.safetensors'},")
    monkeypatch.chdir(workspace.root)
    assert cli(
        "inspect", str(workspace.root / "plain.safetensors"), "--format", "github"
    ).stdout.startswith(expected)


def test_github_file_name_needing_escapes(workspace: Factory) -> None:
    workspace.safetensors("a,b:c%.safetensors", with_format=False)
    run = cli("inspect", "a,b:c%.safetensors", "--format", "github", "--fail-on", "warning")
    assert run.code == 1
    assert run.stdout.startswith(
        "::warning file=a%2Cb%3Ac%25.safetensors,title=missing-format-metadata::header"
    )
    assert run.stderr == ""


def test_clean_input_prints_nothing_in_github_format(workspace: Factory) -> None:
    run = cli("inspect", workspace.safetensors("ok.safetensors"), "--format", "github")
    assert (run.code, run.stdout, run.stderr) == (0, "", "")


# -- sarif -------------------------------------------------------------------------------


def sarif(*args: str) -> dict[str, Any]:
    run = run_format("sarif", *args)
    assert run.code == 1
    document: dict[str, Any] = run.json()
    return document


def validate(document: dict[str, Any]) -> None:
    schema = json.loads(SCHEMA.read_text())
    validator_class = jsonschema.validators.validator_for(schema)
    validator_class.check_schema(schema)
    validator = validator_class(schema, format_checker=validator_class.FORMAT_CHECKER)
    validator.validate(document)


def test_sarif_is_valid_against_the_official_schema(workspace: Factory) -> None:
    document = sarif()
    validate(document)
    broken = json.loads(json.dumps(document))
    broken["runs"][0]["results"][0]["level"] = "fatal"  # the validation can fail
    with pytest.raises(jsonschema.ValidationError):
        validate(broken)
    assert SCHEMA.read_bytes().startswith(b'{\n  "$schema": "http://json-schema.org/draft-04/')


def test_sarif_driver_and_rules(workspace: Factory) -> None:
    run = sarif()["runs"]
    assert len(run) == 1
    driver = run[0]["tool"]["driver"]
    assert (driver["name"], driver["version"]) == ("ckptfix", ckptfix.__version__)
    assert driver["informationUri"] == "https://pypi.org/project/ckptfix/"
    assert [item["id"] for item in driver["rules"]] == list(CODES)
    level = {"error": "error", "warning": "warning", "info": "note"}
    for item in driver["rules"]:
        assert item["defaultConfiguration"]["level"] == level[CODES[item["id"]].value]
        assert item["shortDescription"]["text"] == rules.rule(item["id"]).summary
        assert item["help"]["text"] == rules.rule(item["id"]).help
        assert item["fullDescription"]["text"].startswith(item["shortDescription"]["text"])
    lfs = driver["rules"][list(CODES).index("lfs-pointer")]
    assert lfs["shortDescription"]["text"].startswith("A weight file is a Git LFS pointer, not")
    assert run[0]["originalUriBaseIds"] == {"%SRCROOT%": {"uri": workspace.root.as_uri() + "/"}}


def test_every_code_has_its_own_rule_text() -> None:
    generic = {code for code in CODES if rules.rule(code).summary.startswith("ckptfix finding")}
    assert generic == set()
    assert rules.rule("some-new-code").summary == "ckptfix finding some-new-code."


def test_sarif_results(workspace: Factory) -> None:
    text = messages(*PATHS)
    run = sarif()["runs"][0]
    rule_ids = [item["id"] for item in run["tool"]["driver"]["rules"]]
    results = run["results"]
    where = [r["locations"][0]["physicalLocation"]["artifactLocation"]["uri"] for r in results]
    assert [(r["ruleId"], r["level"]) for r in results] == [
        ("lfs-pointer", "error"),
        ("mixed-formats", "warning"),
        ("missing-format-metadata", "warning"),
        ("dtype-mix", "note"),
    ]
    assert where == ["m/pytorch_model.bin", "m", "plain.safetensors", "mix.safetensors"]
    for result in results:
        assert rule_ids[result["ruleIndex"]] == result["ruleId"]
        assert result["message"]["text"] == text[result["ruleId"]]
        location = result["locations"][0]["physicalLocation"]
        assert location["artifactLocation"]["uriBaseId"] == "%SRCROOT%"
        assert location["region"] == {"startLine": 1}
        assert len(result["partialFingerprints"]["ckptfixFinding/v1"]) == 64
    assert results[1]["properties"] == {"checkedPath": "m"}


def test_sarif_fingerprints_are_stable_and_unique(
    workspace: Factory, tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch
) -> None:
    def prints() -> list[str]:
        results = sarif()["runs"][0]["results"]
        return [r["partialFingerprints"]["ckptfixFinding/v1"] for r in results]

    first = prints()
    assert len(set(first)) == len(first) and first == prints()
    moved = tmp_path_factory.mktemp("elsewhere") / "checkout"
    shutil.copytree(workspace.root, moved)
    monkeypatch.chdir(moved)
    monkeypatch.setenv("GITHUB_WORKSPACE", str(moved))
    assert prints() == first  # no absolute path in them
    # the same finding twice (a PATH given twice) still gets two fingerprints
    doubled = cli("inspect", "plain.safetensors", "plain.safetensors", "--format", "sarif").json()
    twice = [r["partialFingerprints"] for r in doubled["runs"][0]["results"]]
    assert len(twice) == 2 and twice[0] != twice[1]


@pytest.mark.slow
def test_sarif_location_outside_the_workspace(
    workspace: Factory, tmp_path_factory: pytest.TempPathFactory
) -> None:
    outside = Factory(tmp_path_factory.mktemp("other dir")).safetensors(
        "x y.safetensors", with_format=False
    )
    document = cli("inspect", outside, "--format", "sarif").json()
    validate(document)
    location = document["runs"][0]["results"][0]["locations"][0]["physicalLocation"]
    assert location["artifactLocation"] == {"uri": outside.as_uri()}
    assert "%20" in outside.as_uri()
    inside = workspace.safetensors("sp ace/a b.safetensors", with_format=False)
    document = cli("inspect", inside, "--format", "sarif").json()
    validate(document)
    location = document["runs"][0]["results"][0]["locations"][0]["physicalLocation"]
    assert location["artifactLocation"] == {
        "uri": "sp%20ace/a%20b.safetensors",
        "uriBaseId": "%SRCROOT%",
    }


# -- gitlab ------------------------------------------------------------------------------


def test_gitlab_code_quality(workspace: Factory, monkeypatch: pytest.MonkeyPatch) -> None:
    text = messages(*PATHS)
    monkeypatch.delenv("GITHUB_WORKSPACE")
    monkeypatch.setenv("CI_PROJECT_DIR", str(workspace.root))
    run = run_format("gitlab")
    assert run.code == 1
    issues = run.json()
    prints = [issue.pop("fingerprint") for issue in issues]
    assert all(len(value) == 64 and int(value, 16) >= 0 for value in prints)
    assert len(set(prints)) == len(prints)

    def issue(code: str, severity: str, path: str) -> dict[str, Any]:
        return {
            "description": f"{code}: {text[code]}",
            "check_name": code,
            "severity": severity,
            "location": {"path": path, "lines": {"begin": 1}},
        }

    assert issues == [
        issue("lfs-pointer", "critical", "m/pytorch_model.bin"),
        issue("mixed-formats", "minor", "m"),
        issue("missing-format-metadata", "minor", "plain.safetensors"),
        issue("dtype-mix", "info", "mix.safetensors"),
    ]
    again = [issue["fingerprint"] for issue in run_format("gitlab").json()]
    assert again == prints
    clean = cli("inspect", workspace.safetensors("ok.safetensors"), "--format", "gitlab")
    assert (clean.code, clean.json()) == (0, [])


# -- junit -------------------------------------------------------------------------------


def cases(root: ET.Element) -> list[tuple[str, str, str | None, str | None, str | None]]:
    """(classname, name, failure type, failure message, system-out) per testcase."""
    found = []
    for case in root.iter("testcase"):
        failure = case.find("failure")
        out = case.find("system-out")
        found.append(
            (
                case.get("classname", ""),
                case.get("name", ""),
                None if failure is None else failure.get("type"),
                None if failure is None else failure.get("message"),
                None if out is None else out.text,
            )
        )
    return found


def test_junit_with_elementtree(workspace: Factory) -> None:
    text = messages(*PATHS)
    run = run_format("junit")
    assert run.code == 1
    assert run.stdout.startswith('<?xml version="1.0" encoding="UTF-8"?>\n<testsuites ')
    root = ET.fromstring(run.stdout.encode())
    assert root.tag == "testsuites"
    [suite] = root.findall("testsuite")
    assert suite.get("name") == "ckptfix inspect"
    for element in (root, suite):
        assert (element.get("tests"), element.get("failures"), element.get("errors")) == (
            "7",
            "1",
            "0",
        )
    shard = "m/model-0000{}-of-00002.safetensors"
    assert cases(root) == [
        ("m", shard.format(1), None, None, None),
        ("m", shard.format(2), None, None, None),
        ("m", "m/pytorch_model.bin", "lfs-pointer", text["lfs-pointer"], None),
        ("m", "m/model.safetensors.index.json", None, None, None),
        ("m", "m", None, None, f"warning mixed-formats: {text['mixed-formats']}"),
        (
            "plain.safetensors",
            "plain.safetensors",
            None,
            None,
            f"warning missing-format-metadata: {text['missing-format-metadata']}",
        ),
        ("mix.safetensors", "mix.safetensors", None, None, f"info dtype-mix: {text['dtype-mix']}"),
    ]
    failure = root.find("testsuite/testcase/failure")
    assert failure is not None and failure.text == f"error lfs-pointer: {text['lfs-pointer']}"


@pytest.mark.parametrize(
    ("fail_on", "failures", "code"), [("warning", 3, 1), ("info", 4, 1), ("never", 0, 0)]
)
def test_junit_fail_on_decides_the_failures(
    workspace: Factory, fail_on: str, failures: int, code: int
) -> None:
    run = run_format("junit", "--fail-on", fail_on)
    assert run.code == code
    root = ET.fromstring(run.stdout.encode())
    assert root.get("failures") == str(failures)
    assert sum(case[2] is not None for case in cases(root)) == failures


def test_junit_several_failures_in_one_file(workspace: Factory) -> None:
    workspace.safetensors(
        "two.safetensors", [Spec("h", "F16", (2,)), Spec("f", "F32", (2,))], with_format=False
    )
    root = ET.fromstring(
        cli("inspect", "two.safetensors", "--format", "junit", "--fail-on", "info").stdout
    )
    [case] = cases(root)
    text = messages("two.safetensors")
    assert case[2:4] == (
        "missing-format-metadata",
        f"{text['missing-format-metadata']} (and 1 more)",
    )
    failure = root.find("testsuite/testcase/failure")
    assert failure is not None and failure.text is not None
    assert failure.text.splitlines() == [
        f"warning missing-format-metadata: {text['missing-format-metadata']}",
        f"info dtype-mix: {text['dtype-mix']}",
    ]


def test_junit_with_junitparser(workspace: Factory, tmp_path: Path) -> None:
    report = tmp_path / "junit.xml"
    report.write_text(run_format("junit", "--fail-on", "warning").stdout)
    xml = junitparser.JUnitXml.fromfile(str(report))
    suites = list(xml) if isinstance(xml, junitparser.JUnitXml) else [xml]
    [suite] = suites
    assert (suite.name, suite.tests, suite.failures, suite.errors) == ("ckptfix inspect", 7, 3, 0)
    failed = {
        case.name: [(result.type, type(result).__name__) for result in case.result]
        for case in suite
        if not case.is_passed
    }
    assert failed == {
        "m/pytorch_model.bin": [("lfs-pointer", "Failure")],
        "m": [("mixed-formats", "Failure")],
        "plain.safetensors": [("missing-format-metadata", "Failure")],
    }
    passed = [case for case in suite if case.is_passed]
    assert [case.classname for case in passed] == ["m", "m", "m", "mix.safetensors"]
    assert "dtype-mix" in (passed[-1].system_out or "")


def test_junit_control_characters_are_kept_readable(workspace: Factory) -> None:
    workspace.safetensors("bell\x07.safetensors", with_format=False)
    run = cli("inspect", "bell\x07.safetensors", "--format", "junit", "--fail-on", "warning")
    root = ET.fromstring(run.stdout.encode())
    assert [case[1] for case in cases(root)] == ["bell\\x07.safetensors"]


def test_clean_input_in_sarif_and_junit(workspace: Factory) -> None:
    path = workspace.safetensors("ok.safetensors")
    run = cli("inspect", path, "--format", "sarif", "--fail-on", "info")
    assert (run.code, run.stderr) == (0, "")
    validate(run.json())
    assert run.json()["runs"][0]["results"] == []
    run = cli("inspect", path, "--format", "junit", "--fail-on", "info")
    root = ET.fromstring(run.stdout.encode())
    assert (root.get("tests"), root.get("failures")) == ("1", "0")
    assert cases(root) == [("ok.safetensors", "ok.safetensors", None, None, None)]


def test_unknown_format_name_in_the_library() -> None:
    from ckptfix.reports import render

    with pytest.raises(ValueError, match="unknown report format 'xml'"):
        render("xml", [], root=".", fail_on="error")
