""".github/workflows/ci.yml, which cannot run here: actionlint finds nothing wrong with it
(and does find a broken one), it runs `make test-fast` on the three systems and the four
Pythons, and the Makefile it calls works with a Windows venv's layout."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parent.parent
WORKFLOW = ROOT / ".github" / "workflows" / "ci.yml"


def _actionlint(path: Path) -> subprocess.CompletedProcess[str]:
    tool = shutil.which("actionlint", path=os.path.dirname(sys.executable)) or shutil.which(
        "actionlint"
    )
    if tool is None:
        pytest.skip("actionlint is not installed (the dev extra installs it on Linux x86-64)")
    command = [tool, "-no-color", str(path)]
    return subprocess.run(command, capture_output=True, text=True, check=False, timeout=60)


def test_actionlint_finds_nothing_wrong() -> None:
    done = _actionlint(WORKFLOW)
    assert (done.returncode, done.stdout) == (0, "")


def test_actionlint_finds_a_broken_workflow(tmp_path: Path) -> None:
    broken = WORKFLOW.read_text().replace("matrix.python }}", "matrix.pyhton }}", 1)
    (tmp_path / "ci.yml").write_text(broken)
    done = _actionlint(tmp_path / "ci.yml")
    assert done.returncode == 1 and 'property "pyhton" is not defined' in done.stdout


def _job() -> Any:
    [job] = yaml.safe_load(WORKFLOW.read_text())["jobs"].values()
    return job


def test_make_test_fast_runs_on_three_systems_and_four_pythons() -> None:
    job = _job()
    matrix = job["strategy"]["matrix"]
    assert matrix["os"] == ["ubuntu-latest", "macos-latest", "windows-latest"]
    assert matrix["python"] == ["3.10", "3.11", "3.12", "3.13"]
    assert job["strategy"]["fail-fast"] is False
    assert job["steps"][-1]["run"] == "make test-fast PYTHON=python"
    assert job["defaults"]["run"]["shell"] == "bash"


@pytest.mark.parametrize(
    ("system", "python"),
    [("Linux", "/venv/bin/python"), ("Windows_NT", "/venv/Scripts/python.exe")],
)
def test_the_makefile_finds_the_venvs_python_on_each_system(system: str, python: str) -> None:
    if shutil.which("make") is None:
        pytest.skip("no make here")
    command = ["make", "--no-print-directory", "-n", "test-fast", f"OS={system}", "VENV=/venv"]
    # Under `make test` this runs inside a make: its MAKEFLAGS and MAKELEVEL would pass on.
    inherited = {"MAKEFLAGS", "MFLAGS", "MAKELEVEL", "MAKEOVERRIDES"}
    env = {key: value for key, value in os.environ.items() if key not in inherited}
    command.append("PYTHON=python")
    done = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, check=True)
    lines = done.stdout.splitlines()
    assert lines[0] == "python -m venv /venv"
    expected = (
        f'CKPTFIX_FUZZ_EXAMPLES=100 {python} -m pytest -q -m "not slow" -n 2 --dist loadgroup'
    )
    assert lines[-1] == f"PYTHONDONTWRITEBYTECODE= {expected}"
