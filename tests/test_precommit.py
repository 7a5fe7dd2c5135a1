"""The pre-commit hook: one line per problem, exit 1 when a staged weight file fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ckptfix.core.text import shown
from ckptfix.ops.inspect import inspect
from ckptfix.precommit import main
from tests.builders import Factory
from tests.output_checks import hidden_characters, workflow_commands


def test_hook_definition_points_at_the_entry_point() -> None:
    hooks = yaml.safe_load((Path(__file__).parent.parent / ".pre-commit-hooks.yaml").read_text())
    assert [hook["id"] for hook in hooks] == ["ckptfix-inspect"]
    assert hooks[0]["entry"] == "ckptfix-precommit"


def test_good_and_bad_files(factory: Factory, capsys: pytest.CaptureFixture[str]) -> None:
    good = factory.safetensors("good.safetensors")
    plain = factory.safetensors("plain.safetensors", with_format=False)
    bad = factory.lfs_pointer("model.safetensors")
    assert main([str(good), str(plain)]) == 0
    assert capsys.readouterr().err == ""
    assert main([str(good), str(plain), "--fail-on", "warning"]) == 1
    assert capsys.readouterr().err.startswith(f"warning: {plain}: missing-format-metadata: ")
    assert main([str(good), str(bad)]) == 1
    lines = capsys.readouterr().err.splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"error: {bad}: lfs-pointer: file is a Git LFS")
    assert main([str(factory.root / "missing.safetensors")]) == 1
    assert "no such file or directory" in capsys.readouterr().err


def test_annotations_inside_github_actions(
    factory: Factory, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(factory.root)
    monkeypatch.setenv("GITHUB_WORKSPACE", str(factory.root))
    factory.safetensors("good.safetensors")
    factory.safetensors("plain.safetensors", with_format=False)
    factory.lfs_pointer("model.safetensors")
    staged = ["good.safetensors", "plain.safetensors", "model.safetensors", "gone.bin"]
    monkeypatch.delenv("GITHUB_ACTIONS", raising=False)
    assert main(staged) == 1
    assert capsys.readouterr().out == ""  # outside GitHub Actions: as before
    lines = {item.code: item.message for path in staged[1:3] for item in inspect(path).findings}
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    assert main(staged) == 1
    captured = capsys.readouterr()
    assert captured.out.splitlines() == [
        "::warning file=plain.safetensors,title=missing-format-metadata::"
        + lines["missing-format-metadata"],
        f"::error file=model.safetensors,title=lfs-pointer::{lines['lfs-pointer']}",
        "::error file=gone.bin,title=input-not-found::no such file or directory (rule input-not-found; check the path)",
    ]
    # the plain lines on stderr are unchanged: at or above --fail-on only
    assert [line.split(":")[0] for line in captured.err.splitlines()] == ["error", "error"]
    assert main(["good.safetensors"]) == 0
    assert capsys.readouterr().out == ""


# Staged files whose names look like options: argparse read the first as -h (and printed
# "ignored explicit argument" with the name raw), the second as --fail-on never (the hook
# then passed whatever was staged), the third as an unknown option, printed raw with its
# newlines, forging a workflow command in a GitHub Actions log.
OPTION_LIKE = [
    "-h.safetensors",
    "--fail-on=never",
    "--x\n::stop-commands::tok\n##[error]forged.bin",
]


@pytest.mark.parametrize("name", OPTION_LIKE, ids=["-h", "--fail-on", "workflow-command"])
def test_a_staged_file_named_like_an_option_is_checked(
    factory: Factory,
    capsys: pytest.CaptureFixture[str],
    monkeypatch: pytest.MonkeyPatch,
    name: str,
) -> None:
    monkeypatch.chdir(factory.root)
    monkeypatch.setenv("GITHUB_ACTIONS", "true")
    monkeypatch.setenv("GITHUB_WORKSPACE", str(factory.root))
    factory.lfs_pointer(name)
    factory.safetensors("plain.safetensors", with_format=False)
    assert main([name, "plain.safetensors", "--fail-on", "warning"]) == 1
    captured = capsys.readouterr()
    commands = workflow_commands(captured.out + captured.err)
    assert [(c.name, c.properties["title"]) for c in commands] == [
        ("error", "lfs-pointer"),
        ("warning", "missing-format-metadata"),
    ]
    assert commands[0].properties["file"] == shown(name)
    assert hidden_characters(captured.out + captured.err) == []
    assert len(captured.err.splitlines()) == 2


def test_an_unknown_option_is_one_usage_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["--fail-on", "warn\n::error::x", "a.safetensors"]) == 2
    [line] = capsys.readouterr().err.splitlines()
    assert line.startswith("error: --fail-on warn\\n::error::x: unknown option (rule usage; ")
    assert main(["--bogus"]) == 2
    assert capsys.readouterr().err.startswith("error: --bogus: unknown option (rule usage; ")
