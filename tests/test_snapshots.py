"""The human (non-JSON) output pinned byte for byte: `inspect` of a small folder with a few
findings, a `reshard` into shards, and a `convert --dry-run`. The expected outputs are files
under tests/snapshots/; CKPTFIX_UPDATE_SNAPSHOTS=1 rewrites them after an intended change.

Commands run in tmp_path on relative paths, so no temporary path (whose length would move
rich's wrapping) reaches the output; colour is off and the width fixed.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.builders import Factory, Spec, state_dict_pickle, zip_checkpoint
from tests.helpers import UPDATE_SNAPSHOTS, assert_snapshot, cli


@pytest.fixture
def here(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Factory:
    """A Factory on the current directory, with the output settings pinned."""
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("NO_COLOR", "1")
    monkeypatch.setenv("COLUMNS", "120")
    for name in ("FORCE_COLOR", "TTY_COMPATIBLE", "TTY_INTERACTIVE", "CKPTFIX_DEBUG"):
        monkeypatch.delenv(name, raising=False)
    return Factory(Path("."))


def transcript(*args: str) -> str:
    """The command, its exit code, stdout and stderr, as one text to compare."""
    run = cli(*args)
    text = (
        f"$ ckptfix {' '.join(args)}\nexit code {run.code}\n"
        f"--- stdout\n{run.stdout}--- stderr\n{run.stderr}"
    )
    return text.replace(str(Path.cwd()), "<TMP>")


def test_inspect_folder_with_findings(here: Factory) -> None:
    """An error, warnings and an info note, each section of the report."""
    here.safetensors(
        "m/model-00001-of-00002.safetensors",
        [Spec("model.embed.weight", "BF16", (8, 4)), Spec("model.norm.weight", "F32", (4,))],
    )
    here.safetensors(
        "m/model-00002-of-00002.safetensors",
        [Spec("lm_head.weight", "BF16", (8, 4))],
        with_format=False,
    )
    here.index(
        "m/model.safetensors.index.json",
        {
            "model.embed.weight": "model-00001-of-00002.safetensors",
            "model.norm.weight": "model-00001-of-00002.safetensors",
            "lm_head.weight": "model-00002-of-00002.safetensors",
        },
        total_size=999,
    )
    here.lfs_pointer("m/pytorch_model.bin")
    here.config("m")
    assert_snapshot("inspect-folder.txt", transcript("inspect", "m"))


def test_reshard_into_shards(here: Factory) -> None:
    here.sharded(
        "m", [[Spec("a", "F32", (4, 4)), Spec("b", "F32", (8,))], [Spec("c", "BF16", (16,))]]
    )
    here.config("m")
    assert_snapshot("reshard.txt", transcript("reshard", "m", "-o", "out", "--max-shard", "64"))


def test_convert_dry_run(here: Factory) -> None:
    """Tied weights (one dropped) and a transposed view, from a hand-built torch zip."""
    pickle = state_dict_pickle(
        {
            "embed": ("0", "FloatStorage", 12, 0, [3, 4], [4, 1]),
            "lm_head": ("0", "FloatStorage", 12, 0, [3, 4], [4, 1]),
            "t": ("1", "FloatStorage", 6, 0, [3, 2], [1, 3]),
        }
    )
    zip_checkpoint(here.path("pytorch_model.bin"), pickle, {"0": bytes(48), "1": bytes(24)})
    output = transcript("convert", "pytorch_model.bin", "-o", "out", "--dry-run")
    assert not Path("out").exists()
    assert_snapshot("convert-dry-run.txt", output)


def test_a_changed_output_fails(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The default compares; only the update mode writes."""
    monkeypatch.delenv(UPDATE_SNAPSHOTS, raising=False)
    with pytest.raises(AssertionError, match="no snapshot"):
        assert_snapshot("new.txt", "a\n", tmp_path)
    (tmp_path / "old.txt").write_bytes(b"same\nline  \n")
    assert_snapshot("old.txt", "same\nline  \n", tmp_path)
    with pytest.raises(AssertionError, match=r"(?s)-line  \n\+line \n"):
        assert_snapshot("old.txt", "same\nline \n", tmp_path)  # one trailing space less
    monkeypatch.setenv(UPDATE_SNAPSHOTS, "1")
    assert_snapshot("old.txt", "changed\n", tmp_path)
    assert (tmp_path / "old.txt").read_bytes() == b"changed\n"
