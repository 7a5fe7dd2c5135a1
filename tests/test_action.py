"""The composite action (action.yml), run step by step as the runner would: each `run:`
script with `bash --noprofile --norc -eo pipefail`, its `env:` evaluated from the inputs,
in a workspace whose PATH has a `pip` stub that records its arguments and this
repository's `ckptfix` (no network)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import yaml

from tests.builders import Factory, Spec
from tests.helpers import cli

ACTION: dict[str, Any] = yaml.safe_load((Path(__file__).parent.parent / "action.yml").read_text())
INPUT = re.compile(r"^\$\{\{\s*inputs\.([A-Za-z0-9_-]+)\s*\}\}$")
STUB = """#!/bin/sh
for arg in "$@"; do printf '%s\\n' "$arg"; done > {log}
"""


@dataclass(frozen=True)
class ActionRun:
    code: int
    stdout: str
    stderr: str
    outputs: str
    pip_args: list[str] | None  # None: pip was not run


def step_env(step: dict[str, Any], inputs: dict[str, str]) -> dict[str, str]:
    """The step's env with each `${{ inputs.NAME }}` replaced by the input's value."""
    env = {}
    for name, expression in step.get("env", {}).items():
        match = INPUT.match(str(expression))
        assert match, f"{name}: only ${{{{ inputs.NAME }}}} is expected in env, not {expression}"
        env[name] = inputs[match.group(1)]
    return env


def bin_folder(root: Path, *, record_ckptfix: bool) -> Path:
    """A fresh PATH folder (and no logs left from an earlier run in root)."""
    folder = root / "bin"
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir()
    for log in root.glob("*.log"):
        log.unlink()
    stubs = {"pip": root / "pip.log"}
    if record_ckptfix:
        stubs["ckptfix"] = root / "ckptfix.log"
    else:
        (folder / "ckptfix").symlink_to(Path(sys.executable).with_name("ckptfix"))
    for name, log in stubs.items():
        (folder / name).write_text(STUB.format(log=log))
        (folder / name).chmod(0o755)
    return folder


def run_action(
    workspace: Path, tools: Path, inputs: dict[str, str], *, record_ckptfix: bool = False
) -> ActionRun:
    values = {name: str(spec.get("default", "")) for name, spec in ACTION["inputs"].items()}
    values.update(inputs)
    bin_dir = bin_folder(tools, record_ckptfix=record_ckptfix)
    github_output = tools / "github_output"
    github_output.write_text("")
    stdout = stderr = ""
    code = 0
    for number, step in enumerate(ACTION["runs"]["steps"]):
        script = tools / f"step{number}.sh"
        script.write_text(step["run"])
        env = {
            "PATH": f"{bin_dir}{os.pathsep}{os.environ['PATH']}",
            "HOME": str(tools),
            "LANG": "C.UTF-8",
            "GITHUB_ACTIONS": "true",
            "GITHUB_WORKSPACE": str(workspace),
            "GITHUB_OUTPUT": str(github_output),
            **step_env(step, values),
        }
        done = subprocess.run(
            ["bash", "--noprofile", "--norc", "-eo", "pipefail", str(script)],
            cwd=workspace,
            env=env,
            capture_output=True,
            text=True,
            check=False,
            timeout=120,
        )
        stdout, stderr, code = stdout + done.stdout, stderr + done.stderr, done.returncode
        if code != 0:
            break  # the runner stops at the first failing step
    pip_log = tools / "pip.log"
    pip_args = pip_log.read_text().splitlines() if pip_log.exists() else None
    return ActionRun(code, stdout, stderr, github_output.read_text(), pip_args)


@pytest.fixture
def workspace(factory: Factory, monkeypatch: pytest.MonkeyPatch) -> Path:
    factory.sharded("m", [[Spec("a")], [Spec("b")]])
    factory.lfs_pointer("m/pytorch_model.bin")  # error; and mixed-formats (folder-level)
    factory.safetensors("plain.safetensors", with_format=False)  # warning
    factory.safetensors("big.safetensors", [Spec("big", "U8", (1500,))])  # > 1KB
    monkeypatch.chdir(factory.root)
    monkeypatch.setenv("GITHUB_WORKSPACE", str(factory.root))
    return factory.root


@pytest.fixture
def tools(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("runner")


def test_action_metadata() -> None:
    assert ACTION["runs"]["using"] == "composite"
    defaults = {name: spec.get("default") for name, spec in ACTION["inputs"].items()}
    assert defaults == {
        "path": None,
        "fail-on": "error",
        "max-shard": "5GB",
        "format": "github",
        "version": "",
        "output": "",
    }
    assert ACTION["inputs"]["path"]["required"] is True
    used = set()
    for step in ACTION["runs"]["steps"]:
        assert step["shell"] == "bash"
        assert "${{" not in step["run"]  # no expression inside a script: no injection
        used |= {INPUT.match(value).group(1) for value in step.get("env", {}).values()}  # type: ignore[union-attr]
    assert used == set(ACTION["inputs"])  # every input reaches a step


@pytest.mark.slow
def test_defaults_install_the_latest_release_and_annotate(workspace: Path, tools: Path) -> None:
    run = run_action(workspace, tools, {"path": "m plain.safetensors"})
    assert run.pip_args == ["install", "--disable-pip-version-check", "ckptfix"]
    assert run.code == 1
    expected = cli("inspect", "m", "plain.safetensors", "--format", "github")
    assert run.stdout == expected.stdout
    assert [line.split(",")[0] for line in run.stdout.splitlines()] == [
        "::error file=m/pytorch_model.bin",
        "::warning title=mixed-formats::m: 2 weight families in one folder: model*.safetensors (2 file(s)",
        "::warning file=plain.safetensors",
    ]
    assert run.stderr.startswith("error: m/pytorch_model.bin: file is a Git LFS pointer")
    assert run.outputs == "exit-code=1\n"


@pytest.mark.slow
def test_inputs_reach_the_command(workspace: Path, tools: Path) -> None:
    inputs = {
        "path": "big.safetensors\n  plain.safetensors  \n\n",
        "version": "0.1.0",
        "fail-on": "warning",
        "max-shard": "1KB",
        "format": "sarif",
        "output": "ckptfix.sarif",
    }
    run = run_action(workspace, tools, inputs)
    assert run.pip_args == ["install", "--disable-pip-version-check", "ckptfix==0.1.0"]
    assert (run.code, run.stdout, run.stderr) == (1, "", "")
    assert run.outputs == "exit-code=1\n"
    results = json.loads((workspace / "ckptfix.sarif").read_text())["runs"][0]["results"]
    assert [(r["ruleId"], r["level"]) for r in results] == [
        ("oversized-tensor", "warning"),  # --max-shard 1KB
        ("missing-format-metadata", "warning"),
    ]
    passing = run_action(workspace, tools, {**inputs, "fail-on": "error", "format": "junit"})
    assert passing.code == 0 and passing.outputs == "exit-code=0\n"
    assert (workspace / "ckptfix.sarif").read_text().startswith("<?xml")


def test_exact_command_line(workspace: Path, tools: Path) -> None:
    inputs = {"path": "models/with space\n-dash.safetensors\n$(touch pwned) `id`\n"}
    run = run_action(workspace, tools, inputs, record_ckptfix=True)
    assert run.code == 0
    assert (tools / "ckptfix.log").read_text().splitlines() == [
        "inspect",
        "--format",
        "github",
        "--fail-on",
        "error",
        "--max-shard",
        "5GB",
        "--",
        "models/with space",
        "-dash.safetensors",
        "$(touch pwned) `id`",
    ]
    assert not (workspace / "pwned").exists()
    inputs = {"path": "a  b\tc", "fail-on": "info", "max-shard": "2GiB", "format": "gitlab"}
    run_action(workspace, tools, inputs, record_ckptfix=True)
    argv = (tools / "ckptfix.log").read_text().splitlines()
    assert argv[1:] == [
        *("--format", "gitlab", "--fail-on", "info", "--max-shard", "2GiB", "--"),
        *("a", "b", "c"),
    ]


@pytest.mark.parametrize("version", ["1.0; rm -rf /", "latest", ">=0.1", "0.1 0.2"])
def test_a_bad_version_stops_before_pip(workspace: Path, tools: Path, version: str) -> None:
    run = run_action(workspace, tools, {"path": "m", "version": version})
    assert (run.code, run.pip_args, run.outputs) == (2, None, "")
    assert run.stderr == "error: the version input must be a version number such as 0.1.0\n"


def test_an_empty_path_is_a_usage_error(workspace: Path, tools: Path) -> None:
    run = run_action(workspace, tools, {"path": " \n \n"}, record_ckptfix=True)
    assert (run.code, run.outputs) == (2, "")
    assert run.stderr.endswith(
        "error: the path input is empty (give checkpoint files or model folders)\n"
    )
    assert not (tools / "ckptfix.log").exists()


@pytest.mark.slow
def test_a_missing_path_fails_with_exit_2(workspace: Path, tools: Path) -> None:
    run = run_action(workspace, tools, {"path": "plain.safetensors nowhere"})
    assert (run.code, run.stdout, run.outputs) == (2, "", "exit-code=2\n")
    assert (
        run.stderr
        == "error: nowhere: no such file or directory (rule input-not-found; check the path)\n"
    )


def test_documented_workflows_use_the_action_as_defined() -> None:
    ci_page = (Path(__file__).parent.parent / "docs" / "ci.md").read_text()
    workflows = re.findall(r"```yaml\n(# \.github/workflows/.*?)```", ci_page, re.S)
    assert len(workflows) == 2
    uses = []
    for text in workflows:
        steps = [step for job in yaml.safe_load(text)["jobs"].values() for step in job["steps"]]
        ours = [step for step in steps if "/ckptfix@" in step["uses"]]
        assert len(ours) == 1
        assert set(ours[0]["with"]) <= set(ACTION["inputs"])
        assert "path" in ours[0]["with"]
        uses.append(steps)
    sarif_steps = uses[1]
    upload = next(step for step in sarif_steps if "upload-sarif" in step["uses"])
    ours = next(step for step in sarif_steps if "/ckptfix@" in step["uses"])
    assert ours["with"]["format"] == "sarif"
    assert upload["with"]["sarif_file"] == ours["with"]["output"]
