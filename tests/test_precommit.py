"""The pre-commit hook: one line per problem, exit 1 when a staged weight file fails."""

from __future__ import annotations

from pathlib import Path

import pytest
import yaml

from ckptfix.precommit import main
from tests.builders import Factory


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
