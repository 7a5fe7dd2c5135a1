"""The CI formats and the pre-commit hook with names from the whole byte range (file names:
any bytes but NUL and `/`, UTF-8 or not; tensor names: any text): each output must stay
what its consumer parses — JSON that parses, SARIF valid against the official schema, JUnit
that junitparser reads, GitHub workflow commands one per finding and no other — with no
character a terminal or a log acts on, and a file name's bytes that are not UTF-8 written as
`\\xNN` in every one of them."""

from __future__ import annotations

import json
import os
import xml.etree.ElementTree as ET
from pathlib import Path
from typing import Any

import jsonschema
import junitparser
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfix.precommit import main as precommit
from tests.builders import Factory, Spec
from tests.helpers import cli
from tests.output_checks import hidden_characters, is_uri_reference, workflow_commands

SCHEMA = json.loads((Path(__file__).parent / "data" / "sarif-schema-2.1.0.json").read_text())
SARIF = jsonschema.validators.validator_for(SCHEMA)
FORMATS = ["github", "gitlab", "sarif", "junit", "json"]
EXAMPLES = max(int(os.environ.get("CKPTFIX_FUZZ_EXAMPLES", "300")) // 10, 20)

FILE_NAMES = st.binary(min_size=1, max_size=120).filter(
    lambda raw: b"/" not in raw and b"\0" not in raw and raw not in (b".", b"..")
)
TENSOR_NAMES = st.text(max_size=30)


def _build(root: Path, raw: bytes, tensors: tuple[str, str]) -> tuple[str, str]:
    """In root: folder `d` with the weight file named `raw` + `.safetensors` (no "format",
    two float dtypes: findings with a file and with tensors) and an index mapping the first
    tensor to a file that is not there. Returns (folder, file) as paths relative to root."""
    factory = Factory(root)
    file = os.path.join("d", os.fsdecode(raw + b".safetensors"))
    first, second = tensors
    specs = [Spec(first, "F16", (2,)), Spec(second if second != first else first + "2")]
    factory.safetensors(file, specs, with_format=False)
    factory.index("d/model.safetensors.index.json", {first: "model-00001-of-00001.safetensors"})
    return "d", file


def _check_github(stdout: str, findings: int) -> list[Any]:
    commands = workflow_commands(stdout)
    assert len(commands) == findings == len(stdout.splitlines())
    assert all(c.line.startswith(f"::{c.name} ") for c in commands)
    assert {c.name for c in commands} <= {"error", "warning", "notice"}
    return commands


def _check_document(fmt: str, stdout: str, findings: int, tmp: Path) -> None:
    if fmt == "github":
        _check_github(stdout, findings)
        return
    if fmt == "junit":
        root = ET.fromstring(stdout.encode())
        report = tmp / "junit.xml"
        report.write_text(stdout)
        suites = junitparser.JUnitXml.fromfile(str(report))
        cases = [case for suite in suites for case in suite]
        assert len(cases) == int(root.get("tests", "-1")) >= 1
        return
    document = json.loads(stdout)
    if fmt == "sarif":
        SARIF(SCHEMA, format_checker=SARIF.FORMAT_CHECKER).validate(document)
        results = document["runs"][0]["results"]
        assert len(results) == findings
        for result in results:
            uri = result["locations"][0]["physicalLocation"]["artifactLocation"]["uri"]
            assert is_uri_reference(uri), uri
    elif fmt == "gitlab":
        assert len(document) == findings
        assert len({issue["fingerprint"] for issue in document}) == findings


def _check_every_format(path: str, expected_file: str, tmp: Path) -> None:
    reference = cli("inspect", path, "--json")
    assert reference.code in (0, 1), reference.stderr
    document = reference.json()
    assert expected_file in [item["path"] for item in document["files"]]
    findings = len(document["findings"])
    assert findings >= 1
    for fmt in FORMATS:
        run = cli("inspect", path, "--format", fmt, "--fail-on", "info")
        assert run.code == 1, (fmt, run.stderr)
        output = run.stdout + run.stderr
        assert hidden_characters(output) == [], fmt
        if fmt != "github":
            assert workflow_commands(output) == [], fmt
        _check_document(fmt, run.stdout, findings, tmp)
    assert workflow_commands(reference.stderr) == []


def _check_hook(file: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert precommit([file, "--fail-on", "info"]) == 1
    captured = capsys.readouterr()
    assert hidden_characters(captured.out + captured.err) == []
    assert workflow_commands(captured.err) == []
    findings = len(cli("inspect", file, "--json").json()["findings"])
    for command in _check_github(captured.out, findings):
        assert hidden_characters(command.properties.get("file", "")) == []


@pytest.fixture
def workspace(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("GITHUB_WORKSPACE", str(tmp_path))
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.delenv("CI_PROJECT_DIR", raising=False)
    return tmp_path


HOSTILE = [
    # every ASCII byte but NUL, `/`, letters and digits; tensors that clear the screen and
    # forge lines
    (
        bytes(b for b in range(1, 128) if not chr(b).isalnum() and b != ord("/")),
        ("t\x1b[2J\n::warning::forged", "##[error]x\r\u2028"),
    ),
    (bytes(range(0x80, 0x100)), ("", "\x00")),  # no byte of the file name is UTF-8
    (
        "w\x1b]0;pwn\x07\n::error::forged\r##[error]y\u202e[red]z%0A,:".encode(),
        ("[red]a", ":smile:"),
    ),
    (b"\n::stop-commands::tok\n", ("::tok::", "\x9b31m")),
]


@pytest.mark.parametrize(
    ("raw", "tensors"),
    [
        pytest.param(*case, id=name, marks=[] if name == "ascii" else [pytest.mark.slow])
        for case, name in zip(
            HOSTILE, ["ascii", "not-utf8", "commands", "stop-commands"], strict=True
        )
    ],
)
def test_ci_formats_with_hostile_names(
    workspace: Path,
    capsys: pytest.CaptureFixture[str],
    raw: bytes,
    tensors: tuple[str, str],
) -> None:
    folder, file = _build(workspace, raw, tensors)
    expected = "d/" + (raw + b".safetensors").decode("utf-8", "backslashreplace")
    _check_every_format(folder, expected, workspace)
    _check_every_format(file, expected, workspace)
    _check_hook(file, capsys)


@pytest.mark.slow
@settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
@given(raw=FILE_NAMES, tensors=st.tuples(TENSOR_NAMES, TENSOR_NAMES))
def test_ci_formats_with_random_names(
    workspace: Path,
    capsys: pytest.CaptureFixture[str],
    raw: bytes,
    tensors: tuple[str, str],
) -> None:
    example = workspace / f"e{len(list(workspace.iterdir()))}"
    example.mkdir()
    with pytest.MonkeyPatch.context() as env:
        env.chdir(example)
        env.setenv("GITHUB_WORKSPACE", str(example))
        _random_example(example, raw, tensors, capsys)


def _random_example(
    example: Path, raw: bytes, tensors: tuple[str, str], capsys: pytest.CaptureFixture[str]
) -> None:
    folder, file = _build(example, raw, tensors)
    expected = "d/" + (raw + b".safetensors").decode("utf-8", "backslashreplace")
    _check_every_format(folder, expected, example)
    _check_hook(file, capsys)
