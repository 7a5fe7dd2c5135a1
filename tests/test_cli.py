"""The command line: exit codes 0/1/2, --fail-on, --json schema, human output."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

import ckptfix
from tests.builders import Factory, Spec
from tests.helpers import cli

TOP_KEYS = [
    "schema_version",
    "path",
    "format",
    "files",
    "tensor_count",
    "parameter_count",
    "total_bytes",
    "dtypes",
    "tensors",
    "findings",
]


def test_version() -> None:
    run = cli("--version")
    assert (run.code, run.stdout) == (0, f"ckptfix {ckptfix.__version__}\n")


@pytest.mark.slow
def test_python_dash_m_and_console_script(factory: Factory) -> None:
    path = factory.safetensors("ok.safetensors")
    for command in (
        [sys.executable, "-m", "ckptfix"],
        [str(Path(sys.executable).with_name("ckptfix"))],
    ):
        done = subprocess.run(
            [*command, "inspect", str(path), "--json"], capture_output=True, text=True, check=False
        )
        assert done.returncode == 0, done.stderr
        assert json.loads(done.stdout)["tensor_count"] == 1


def test_clean_file_exit_0(factory: Factory) -> None:
    path = factory.safetensors("ok.safetensors", [Spec("a", "F32", (2, 3)), Spec("b", "I64", (4,))])
    run = cli("inspect", path)
    assert run.code == 0
    assert run.stderr == ""
    assert "0 error(s), 0 warning(s), 0 info → exit 0 (--fail-on error)" in run.stdout
    assert "clean" in run.stdout


def test_json_schema_is_pinned(factory: Factory) -> None:
    path = factory.safetensors(
        "ok.safetensors", [Spec("a", "BF16", (2, 3)), Spec("b", "I64", (4,))], {"producer": "test"}
    )
    run = cli("inspect", path, "--json")
    assert run.code == 0
    document = run.json()
    assert list(document) == TOP_KEYS
    header = path.stat().st_size - 12 - 32
    assert document == {
        "schema_version": 1,
        "path": str(path),
        "format": "safetensors",
        "files": [
            {
                "path": str(path),
                "format": "safetensors",
                "bytes": path.stat().st_size,
                "tensor_count": 2,
            }
        ],
        "tensor_count": 2,
        "parameter_count": 10,
        "total_bytes": 44,
        "dtypes": {"I64": 32, "BF16": 12},
        "tensors": [
            {
                "name": "a",
                "dtype": "BF16",
                "shape": [2, 3],
                "nbytes": 12,
                "file": str(path),
                "contiguous": True,
                "storage": None,
            },
            {
                "name": "b",
                "dtype": "I64",
                "shape": [4],
                "nbytes": 32,
                "file": str(path),
                "contiguous": True,
                "storage": None,
            },
        ],
        "findings": [],
    }
    assert header > 0


def test_json_stdout_holds_only_json_even_on_errors(factory: Factory) -> None:
    path = factory.bytes("bad.safetensors", b"garbage!garbage!")
    run = cli("inspect", path, "--json")
    assert run.code == 1
    assert json.loads(run.stdout)["findings"][0]["code"] == "corrupt-file"
    assert len(run.error_lines) == 1


@pytest.mark.parametrize(
    ("fail_on", "expected"),
    [("error", 0), ("warning", 1), ("info", 1), ("never", 0)],
)
def test_fail_on_with_a_warning(factory: Factory, fail_on: str, expected: int) -> None:
    path = factory.safetensors("noformat.safetensors", with_format=False)
    run = cli("inspect", path, "--fail-on", fail_on)
    assert run.code == expected
    assert "missing-format-metadata" in run.stdout
    assert run.stderr == ""  # warnings are reported on stdout only


@pytest.mark.parametrize(("fail_on", "expected"), [("warning", 0), ("info", 1)])
def test_fail_on_with_only_info(factory: Factory, fail_on: str, expected: int) -> None:
    path = factory.safetensors("mix.safetensors", [Spec("a", "F16", (2,)), Spec("b", "F32", (2,))])
    assert cli("inspect", path, "--fail-on", fail_on).code == expected


def test_fail_on_never_still_reports_errors(factory: Factory) -> None:
    path = factory.bytes("bad.safetensors", b"short")
    run = cli("inspect", path, "--fail-on", "never")
    assert run.code == 0
    assert len(run.error_lines) == 1


@pytest.mark.parametrize(
    ("args", "line"),
    [
        (
            ["inspect", "/nonexistent/model"],
            "error: /nonexistent/model: no such file or directory (rule input-not-found; check the path)",
        ),
        (
            ["inspect", "{ok}", "--max-shard", "5G"],
            "error: --max-shard: invalid size '5G' (rule usage; use a byte count, or a number with KB MB GB TB "
            "(powers of 1000) or KiB MiB GiB TiB, e.g. 5GB)",
        ),
        (
            ["inspect", "{ok}", "--max-shard", "5gb"],
            "error: --max-shard: invalid size '5gb' (rule usage; use a byte count, or a number with KB MB GB TB "
            "(powers of 1000) or KiB MiB GiB TiB, e.g. 5GB)",
        ),
        (
            ["inspect", "{ok}", "--max-shard", "-1"],
            "error: --max-shard: invalid size '-1' (rule usage; use a byte count, or a number with KB MB GB TB "
            "(powers of 1000) or KiB MiB GiB TiB, e.g. 5GB)",
        ),
        (
            ["inspect", "{ok}", "--bogus"],
            "error: No such option: --bogus (rule usage; see `ckptfix inspect --help`)",
        ),
        (
            ["inspect"],
            "error: Missing argument 'PATH...'. (rule usage; see `ckptfix inspect --help`)",
        ),
    ],
)
def test_usage_errors_exit_2(factory: Factory, args: list[str], line: str) -> None:
    ok = factory.safetensors("ok.safetensors")
    run = cli(*[arg.replace("{ok}", str(ok)) for arg in args])
    assert run.code == 2
    assert run.error_lines == [line]
    assert run.stdout == ""


def test_bad_fail_on_value(factory: Factory) -> None:
    run = cli("inspect", factory.safetensors("ok.safetensors"), "--fail-on", "sometimes")
    assert run.code == 2
    assert len(run.error_lines) == 1
    assert run.error_lines[0].startswith("error: Invalid value for '--fail-on'")


def test_no_arguments_shows_help() -> None:
    run = cli()
    assert run.code == 2
    assert "inspect" in run.stderr and "Usage:" in run.stderr


def test_tensors_table_and_escaping(factory: Factory) -> None:
    path = factory.safetensors("ok.safetensors", [Spec("[bold]layer[/bold].w", "F32", (3, 2))])
    run = cli("inspect", path, "--tensors")
    assert run.code == 0
    assert "[bold]layer[/bold].w" in run.stdout  # shown literally, not as markup
    assert "[3, 2]" in run.stdout


def test_human_summary(factory: Factory) -> None:
    path = factory.safetensors("ok.safetensors", [Spec("a", "BF16", (1000, 1000))])
    run = cli("inspect", path)
    assert "Parameters  1,000,000 (1.00M)" in run.stdout
    assert "Bytes       2,000,000 (2.00 MB)" in run.stdout
    assert "BF16 2.00 MB" in run.stdout


@pytest.mark.slow
def test_no_color_and_debug_traceback(factory: Factory) -> None:
    path = factory.safetensors("noformat.safetensors", with_format=False)
    env = {**os.environ, "NO_COLOR": "1", "TERM": "xterm-256color"}
    done = subprocess.run(
        [sys.executable, "-m", "ckptfix", "inspect", str(path)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert "\x1b[" not in done.stdout
    missing = str(path) + ".missing"
    env["CKPTFIX_DEBUG"] = "1"
    done = subprocess.run(
        [sys.executable, "-m", "ckptfix", "inspect", missing],
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert "Traceback" in done.stderr and done.returncode == 1


def test_max_shard_sets_oversized_threshold(factory: Factory) -> None:
    path = factory.safetensors(
        "ok.safetensors", [Spec("big", "U8", (1500,)), Spec("s", "U8", (10,))]
    )
    assert cli("inspect", path, "--max-shard", "2KB", "--json").json()["findings"] == []
    document = cli("inspect", path, "--max-shard", "1KB", "--json").json()
    assert [(f["code"], f["tensors"]) for f in document["findings"]] == [
        ("oversized-tensor", ["big"])
    ]
    assert "exceed the shard limit of 1000 bytes" in document["findings"][0]["message"]
    document = cli("inspect", path, "--max-shard", "1KiB", "--json").json()
    assert "limit of 1024 bytes" in document["findings"][0]["message"]
