"""Smaller usability points: help text, piped output, option values that match nothing, and
the format a rewrite keeps."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from safetensors import safe_open
from safetensors.numpy import save_file

from tests.helpers import cli


def _ckptfix(*args: str, columns: int = 60) -> subprocess.CompletedProcess[str]:
    """A fresh process with stdout piped and a narrow terminal width in the environment."""
    env = {**os.environ, "COLUMNS": str(columns)}
    return subprocess.run(
        [sys.executable, "-m", "ckptfix", *args],
        capture_output=True,
        text=True,
        env=env,
        check=False,
    )


@pytest.mark.parametrize(
    ("command", "usage"),
    [
        ("inspect", "Usage: ckptfix inspect [OPTIONS] PATH..."),
        ("convert", "Usage: ckptfix convert [OPTIONS] SRC"),
        ("diff", "Usage: ckptfix diff [OPTIONS] A B"),
    ],
)
def test_usage_lines_name_arguments_plainly(command: str, usage: str) -> None:
    run = cli(command, "--help")
    assert run.code == 0 and run.stdout.splitlines()[0] == usage


def test_top_level_help_shows_whole_command_summaries() -> None:
    run = _ckptfix("--help", columns=60)
    commands = run.stdout.split("Commands:")[1]
    assert run.returncode == 0 and "..." not in commands
    words = " ".join(run.stdout.split())
    assert (
        "convert Convert a PyTorch, safetensors, GGUF, DCP, DeepSpeed or Megatron checkpoint "
        "into " in words
    )
    assert "verified safetensors (or torch) shards." in words


def test_a_run_builds_only_the_command_it_names() -> None:
    from typer.main import get_command

    from ckptfix.cli.app import app, for_arguments

    def described(command: Any) -> list[tuple[Any, ...]]:
        return [(command.help,)] + [
            (p.name, p.opts, p.default, getattr(p, "help", None)) for p in command.params
        ]

    whole: Any = get_command(app)
    assert len(whole.commands) >= 7
    for name, full in whole.commands.items():
        narrowed: Any = get_command(for_arguments([name, "--help"]))
        assert list(narrowed.commands) == [name]
        assert described(narrowed.commands[name]) == described(full)
    for arguments in ([], ["--version"], ["--help", "inspect"], ["inspec"]):
        assert for_arguments(arguments) is app
    run = _ckptfix("inspec", "x")
    assert run.returncode == 2
    assert "No such command 'inspec'. Did you mean 'inspect'?" in run.stderr


def test_examples_in_help_are_never_rewrapped() -> None:
    run = _ckptfix("convert", "--help", columns=60)
    example = (
        "Example: ckptfix convert pytorch_model.bin -o ./model --dtype bf16 --strip-prefix auto"
    )
    assert example in [line.strip() for line in run.stdout.splitlines()]


@pytest.mark.slow
def test_piped_output_never_wraps_a_file_name(tmp_path: Path) -> None:
    folder = tmp_path / ("long-" * 40 + "model")
    folder.mkdir()
    name = "model.layers." + "x" * 150 + ".weight"
    save_file({name: np.ones(2, np.float32)}, str(folder / "model.safetensors"))
    run = _ckptfix("inspect", str(folder), "--tensors", columns=60)
    assert run.returncode == 0, run.stderr
    lines = run.stdout.splitlines()
    assert any(str(folder) in line for line in lines)
    assert any(name in line for line in lines)
    assert any(f"{folder}{os.sep}model.safetensors" in line for line in lines)


def _model(tmp_path: Path, metadata: dict[str, str] | None = None) -> Path:
    folder = tmp_path / "m"
    folder.mkdir()
    save_file({"model.a": np.ones(4, np.float32)}, str(folder / "model.safetensors"), metadata)
    return folder


def test_strip_prefix_that_matches_nothing_is_a_usage_error(tmp_path: Path) -> None:
    run = cli("convert", _model(tmp_path), "-o", tmp_path / "out", "--strip-prefix", "module.")
    assert run.code == 2 and not (tmp_path / "out").exists()
    assert run.error_lines == [
        "error: --strip-prefix: no tensor name starts with 'module.' (rule usage; names look like "
        "'model.a'; use auto to find the wrapper prefix)"
    ]


def test_a_missing_key_is_a_usage_error(tmp_path: Path) -> None:
    import torch

    source = tmp_path / "x.ckpt"
    torch.save({"state_dict": {"a": torch.ones(2)}, "epoch": 3}, source)
    run = cli("convert", source, "-o", tmp_path / "out", "--key", "missing")
    assert run.code == 2 and not (tmp_path / "out").exists()
    assert run.error_lines == [
        f"error: --key: {source} has no tensor dictionary at key 'missing' "
        "(rule usage; keys with tensors: state_dict)"
    ]


@pytest.mark.parametrize("fmt", ["np", "mlx", "pt"])
def test_reshard_keeps_an_existing_format(tmp_path: Path, fmt: str) -> None:
    source = _model(tmp_path, {"format": fmt, "note": "kept"})
    out = tmp_path / "out"
    assert cli("reshard", source, "-o", out).code == 0
    with safe_open(str(out / "model.safetensors"), "np") as handle:
        assert handle.metadata() == {"format": fmt, "note": "kept"}


def test_reshard_adds_pt_where_there_is_no_format(tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert cli("reshard", _model(tmp_path), "-o", out, "--max-shard", "10kB").code == 0
    with safe_open(str(out / "model.safetensors"), "np") as handle:
        assert handle.metadata() == {"format": "pt"}
    assert json.loads(cli("inspect", out, "--json").stdout)["findings"] == []


def test_json_input_errors_print_a_json_error_document(tmp_path: Path) -> None:
    run = cli("convert", _model(tmp_path), "-o", tmp_path / "out", "--strip-prefix", "x.", "--json")
    assert run.code == 2
    assert run.json() == {
        "schema_version": 1,
        "error": {
            "code": "usage",
            "rule": "usage",
            "file": "--strip-prefix",
            "message": "no tensor name starts with 'x.'",
            "fix": "names look like 'model.a'; use auto to find the wrapper prefix",
            "exit_code": 2,
        },
    }
    assert len(run.error_lines) == 1 and "(rule usage; names look like" in run.error_lines[0]


def test_json_corrupt_input_names_its_rule(tmp_path: Path) -> None:
    source = tmp_path / "short.safetensors"
    source.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{}")
    run = cli("convert", source, "-o", tmp_path / "out", "--json")
    assert run.code == 1 and not (tmp_path / "out").exists()
    error = run.json()["error"]
    assert error["file"] == str(source) and error["exit_code"] == 1
    assert error["rule"] and f"(rule {error['rule']}" in run.error_lines[0]


@pytest.mark.parametrize(
    ("args", "json_output"),
    [
        (["inspect", "x", "--json"], True),
        (["inspect", "x", "--format", "json"], True),
        (["inspect", "x", "--format=json"], True),
        (["inspect", "x", "--json", "--format", "sarif"], False),  # a usage error, not JSON
        (["inspect", "x", "--format", "github"], False),
        (["inspect", "--", "--json"], False),  # a path named --json
        ([], False),
    ],
)
def test_when_errors_are_json(args: list[str], json_output: bool) -> None:
    from ckptfix.cli.exits import wants_json

    assert wants_json(args) is json_output


def test_a_parse_error_with_json_is_a_json_document() -> None:
    run = cli("hash", "--bogus", "--json")
    assert run.code == 2
    assert run.json()["error"] == {
        "code": "usage",
        "rule": "usage",
        "file": None,
        "message": "No such option: --bogus",
        "fix": "see `ckptfix hash --help`",
        "exit_code": 2,
    }
