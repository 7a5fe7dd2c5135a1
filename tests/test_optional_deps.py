"""Without the optional packages, the tests that need them skip, naming the package, and none
fails or errors: a representative part of the suite (each way a test needs a package: a
module mark, a builder, a session fixture whose writer runs in a fresh process, an import in
a test's body, an oracle inside a fixture) run by a fresh pytest in which they are all
hidden (tests/hidden/sitecustomize.py), read back from its JUnit report."""

from __future__ import annotations

import ast
import os
import subprocess
import sys
import xml.etree.ElementTree as ElementTree
from pathlib import Path

import pytest

from tests.optional import OPTIONAL
from tests.source_trees import parsed

TESTS = Path(__file__).resolve().parent
SUBSET = [
    "tests/test_gguf_read.py",  # gguf, through the builders of tests/gguf_files.py
    "tests/test_remote_gcs.py",  # gcsfs: a module mark
    "tests/test_remote_s3.py",  # botocore and moto: a module mark
    "tests/test_align.py",  # huggingface_hub and transformers, imported in tests
    "tests/test_training_zero.py",  # deepspeed: its session fixture's writer
    "tests/test_benign_values.py",  # DeepSpeed model states, and tests that need nothing
    "tests/test_megatron.py::test_the_tiny_test_data_is_what_its_builder_builds",
    "tests/test_hash_interop.py",  # an oracle imported inside a module fixture
]
# The packages the subset must be seen skipping for.
SEEN = ["gguf", "gcsfs", "botocore", "moto", "huggingface_hub", "transformers", "deepspeed"]


def _outcomes(report: Path) -> dict[str, tuple[str, str]]:
    """test id -> (passed, skipped, failure or error; the skip's or failure's message)."""
    outcomes = {}
    for case in ElementTree.parse(report).iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        outcome, message = "passed", ""
        for child in case:
            if child.tag in ("skipped", "failure", "error"):
                outcome, message = child.tag, child.get("message") or ""
        outcomes[name] = (outcome, message)
    return outcomes


@pytest.mark.slow  # a pytest run of its own: tens of seconds
def test_tests_needing_a_missing_package_skip_naming_it(tmp_path: Path) -> None:
    hidden = sorted({name.partition(".")[0] for name in OPTIONAL})
    report = tmp_path / "report.xml"
    path = os.pathsep.join(
        [str(TESTS / "hidden"), str(TESTS.parent), os.environ.get("PYTHONPATH", "")]
    )
    env = {**os.environ, "CKPTFIX_TEST_HIDDEN": ",".join(hidden), "PYTHONPATH": path}
    options = ["-q", "-p", "no:cacheprovider", "-p", "no:xdist", "--junitxml", str(report)]
    done = subprocess.run(
        [sys.executable, "-m", "pytest", *options, "--basetemp", str(tmp_path / "run"), *SUBSET],
        cwd=TESTS.parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    outcomes = _outcomes(report)
    broken = {name: got for name, got in outcomes.items() if got[0] in ("failure", "error")}
    assert not broken, (broken, done.stdout[-3000:])
    assert done.returncode == 0, done.stdout[-3000:]
    skipped = [message for outcome, message in outcomes.values() if outcome == "skipped"]
    for message in skipped:  # each names the package it needs
        assert any(OPTIONAL[name].split()[0] in message for name in OPTIONAL), message
    for name in SEEN:
        assert any(f"{OPTIONAL[name]}" in message for message in skipped), name
    # what needs none of them still runs
    assert sum(outcome == "passed" for outcome, _ in outcomes.values()) >= 10, outcomes


def unnamed_skips(source: str) -> list[int]:
    """Lines of a test module's source that skip for an optional package with pytest's own
    `importorskip` (whose reason names an extra, or nothing) instead of `needs`/`need`,
    which name the package and the extra that installs it."""
    lines = []
    for node in ast.walk(parsed(source)):
        if (
            isinstance(node, ast.Call)
            and ast.unparse(node.func).endswith("importorskip")
            and node.args
            and not (
                isinstance(node.args[0], ast.Constant)
                and str(node.args[0].value).partition(".")[0]
                not in {name.partition(".")[0] for name in OPTIONAL}
            )
        ):
            lines.append(node.lineno)
    return lines


@pytest.mark.slow
def test_optional_packages_are_skipped_by_name() -> None:
    found = {
        path.name: lines
        for path in sorted(TESTS.glob("*.py"))
        if (lines := unnamed_skips(path.read_text()))
    }
    assert not found, found


def test_the_skip_scan_can_fail() -> None:
    source = (
        'pytest.importorskip("aiohttp", reason="the remote extra is not installed")\n'
        'importorskip("megatron.core")\nfor p in ("gcsfs",):\n    pytest.importorskip(p)\n'
        'pytest.importorskip("mypy", reason="mypy (the dev extra) is not installed")\n'
    )
    assert unnamed_skips(source) == [1, 2, 4]
