"""`inspect PATH...`: one combined report and exit code; --json a list for several paths;
--format chosen once; a missing PATH stops everything before any output."""

from __future__ import annotations

import orjson
import pytest

import ckptfix
from tests.builders import Factory, Spec
from tests.helpers import cli

FORMATS = ["text", "json", "github", "gitlab", "sarif", "junit"]


@pytest.fixture
def inputs(factory: Factory, monkeypatch: pytest.MonkeyPatch) -> Factory:
    factory.safetensors("ok.safetensors")
    factory.safetensors("plain.safetensors", with_format=False)  # a warning
    factory.lfs_pointer("stub.safetensors")  # an error
    factory.sharded("m", [[Spec("a")], [Spec("b")]])  # clean folder
    monkeypatch.chdir(factory.root)
    monkeypatch.delenv("GITHUB_WORKSPACE", raising=False)
    monkeypatch.delenv("CI_PROJECT_DIR", raising=False)
    return factory


def test_json_with_one_path_is_the_single_document(inputs: Factory) -> None:
    run = cli("inspect", "plain.safetensors", "--json")
    expected = ckptfix.inspect("plain.safetensors").to_dict()
    assert run.stdout.encode() == orjson.dumps(expected, option=orjson.OPT_INDENT_2) + b"\n"
    assert cli("inspect", "plain.safetensors", "--format", "json").stdout == run.stdout
    assert cli("inspect", "plain.safetensors", "--json", "--format", "json").stdout == run.stdout


def test_json_with_several_paths_is_a_list_of_documents(inputs: Factory) -> None:
    paths = ["m", "plain.safetensors", "stub.safetensors"]
    run = cli("inspect", *paths, "--json")
    assert run.code == 1
    documents = [ckptfix.inspect(path).to_dict() for path in paths]
    assert run.stdout.encode() == orjson.dumps(documents, option=orjson.OPT_INDENT_2) + b"\n"
    assert [document["path"] for document in run.json()] == paths
    assert run.json()[0]["findings"] == []
    assert len(run.error_lines) == 1 and run.error_lines[0].startswith("error: stub.safetensors: ")


@pytest.mark.parametrize(
    ("paths", "fail_on", "code"),
    [
        (["ok.safetensors", "m"], "error", 0),
        (["ok.safetensors", "plain.safetensors"], "error", 0),
        (["ok.safetensors", "plain.safetensors"], "warning", 1),
        (["ok.safetensors", "stub.safetensors", "m"], "error", 1),
        (["stub.safetensors", "plain.safetensors"], "never", 0),
    ],
)
@pytest.mark.parametrize("fmt", FORMATS)
def test_one_exit_code_for_all_paths(
    inputs: Factory, paths: list[str], fail_on: str, code: int, fmt: str
) -> None:
    run = cli("inspect", *paths, "--fail-on", fail_on, "--format", fmt)
    assert run.code == code
    errors = ["stub.safetensors"] if "stub.safetensors" in paths else []
    assert [line.split(":")[1].strip() for line in run.error_lines] == errors


@pytest.mark.parametrize("fmt", FORMATS)
def test_a_missing_path_is_a_usage_error_before_any_output(inputs: Factory, fmt: str) -> None:
    run = cli(
        "inspect", "stub.safetensors", "missing.safetensors", "ok.safetensors", "--format", fmt
    )
    assert run.code == 2
    if fmt == "json":  # the error as a JSON document, and nothing else, on stdout
        assert run.json() == {
            "schema_version": 1,
            "error": {
                "code": "input-not-found",
                "rule": "input-not-found",
                "file": "missing.safetensors",
                "message": "no such file or directory",
                "fix": "check the path",
                "exit_code": 2,
            },
        }
    else:
        assert run.stdout == ""
    assert run.error_lines == [
        "error: missing.safetensors: no such file or directory (rule input-not-found; check the path)"
    ]


def test_text_output_has_a_heading_per_path_and_a_total(inputs: Factory) -> None:
    run = cli("inspect", "ok.safetensors", "plain.safetensors", "stub.safetensors")
    assert run.code == 1
    lines = run.stdout.splitlines()
    headings = [line.split(" ─")[0] for line in lines if line.endswith("──")]
    # 80 columns when piped (a rule across the unwrapped console was 1,000,000 long)
    assert {len(line) for line in lines if line.endswith("──")} == {80}
    assert len(run.stdout) < 5_000
    assert headings == [
        "ok.safetensors (1 of 3)",
        "plain.safetensors (2 of 3)",
        "stub.safetensors (3 of 3)",
    ]
    verdicts = [line for line in lines if "→ exit" in line]
    assert verdicts == [
        "0 error(s), 0 warning(s), 0 info → exit 0 (--fail-on error)  clean",
        "0 error(s), 1 warning(s), 0 info → exit 0 (--fail-on error); "
        "`ckptfix fix plain.safetensors` would repair 1",
        "1 error(s), 0 warning(s), 0 info → exit 1 (--fail-on error); "
        "`ckptfix fix stub.safetensors` repairs none until lfs-pointer is resolved",
        "3 paths: 1 error(s), 1 warning(s), 0 info → exit 1 (--fail-on error); "
        "`ckptfix fix` would repair 1",
    ]
    assert lines[-1] == verdicts[-1]


def test_text_output_for_one_path_is_unchanged(inputs: Factory) -> None:
    run = cli("inspect", "plain.safetensors")
    assert "──" not in run.stdout and "paths:" not in run.stdout
    assert run.stdout.splitlines()[0].startswith("Path        plain.safetensors")


@pytest.mark.parametrize("fmt", ["text", "github", "gitlab", "sarif", "junit"])
def test_json_flag_conflicts_with_another_format(inputs: Factory, fmt: str) -> None:
    run = cli("inspect", "ok.safetensors", "--json", "--format", fmt)
    assert run.code == 2
    assert run.stdout == ""
    assert run.error_lines == [
        "error: Invalid value for '--json': --json is short for --format json; it cannot be "
        f"combined with --format {fmt} (rule usage; see `ckptfix inspect --help`)"
    ]


def test_unknown_format_is_a_usage_error(inputs: Factory) -> None:
    run = cli("inspect", "ok.safetensors", "--format", "xml")
    assert run.code == 2
    assert run.error_lines[0].startswith("error: Invalid value for '--format': 'xml' is not one of")


def test_machine_formats_write_stdout_only(inputs: Factory) -> None:
    for fmt in ("json", "gitlab", "sarif"):
        run = cli("inspect", "stub.safetensors", "plain.safetensors", "--format", fmt)
        orjson.loads(run.stdout)  # nothing but the document on stdout
        assert run.stderr.count("error: ") == 1
