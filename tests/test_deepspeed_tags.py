"""DeepSpeed's tag files (`latest`, `latest_universal`) and tag folders as a hostile folder
holds them: links out of the checkpoint, FIFOs, folders nobody may list. Hand-built ZeRO
folders (tests/zero_builders.py), no DeepSpeed."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import cli, measured, with_locked_folder
from tests.zero_builders import ZeroSpec, zero_folder

SECRET = "SECRET-TOKEN-1234"


def _folder(tmp_path: Path) -> Path:
    """A ZeRO folder as DeepSpeed leaves it: `latest`, the tag folder, zero_to_fp32.py."""
    folder = zero_folder(tmp_path / "ds", ZeroSpec())
    (folder / "zero_to_fp32.py").write_text("# DeepSpeed's script\n")
    return folder


def test_a_tag_file_linking_out_of_the_checkpoint_is_never_read(tmp_path: Path) -> None:
    """`latest` -> a file of the user's: its text was read and printed as the tag."""
    folder = _folder(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text(SECRET)
    (folder / "latest").unlink()
    (folder / "latest").symlink_to(secret)
    for command in (["inspect", folder], ["convert", folder, "-o", tmp_path / "out"]):
        run = cli(*command)
        assert run.code == 1, run.stdout
        assert SECRET not in run.stdout + run.stderr
        assert len(run.error_lines) == 1
        line = run.error_lines[0]
        assert line.startswith(f"error: {folder / 'latest'}: `latest` is a link to a file outside")
        assert "(rule tag-missing;" in line and "tag folders present: global_step1" in line
    assert not (tmp_path / "out").exists()


def test_a_tag_file_linking_inside_the_checkpoint_is_read(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    (folder / "tags").mkdir()
    (folder / "tags" / "current").write_text("global_step1")
    (folder / "latest").unlink()
    (folder / "latest").symlink_to(Path("tags") / "current")
    run = cli("inspect", folder, "--json")
    assert run.code == 0, run.stderr
    assert run.json()["layout"]["tag"] == "global_step1"


@pytest.mark.slow
def test_a_tag_file_that_is_a_fifo_is_never_opened(tmp_path: Path) -> None:
    """`latest` a FIFO and `latest_universal` naming no folder: reading `latest` waited for
    a writer for ever."""
    folder = _folder(tmp_path)
    (folder / "latest").unlink()
    os.mkfifo(folder / "latest")
    (folder / "latest_universal").write_text("global_step1_universal")
    run = measured("inspect", folder, timeout=30)
    assert run.code == 1, run.stderr
    assert run.error_lines == [
        f"error: {folder / 'latest'}: `latest`: cannot read the tag: not a regular file; tag "
        "folders present: global_step1 (rule tag-missing; pass a tag folder itself, or fix "
        "`latest`)"
    ]


@pytest.mark.slow
def test_a_folder_nobody_may_list_beside_a_missing_tag(tmp_path: Path) -> None:
    """Looking for the tag folders present, a sub-folder that cannot be listed ended in
    'internal error: PermissionError'; it is not one of them."""
    folder = _folder(tmp_path)
    (folder / "latest").write_text("global_step9")
    (folder / "locked").mkdir()
    run = with_locked_folder(folder / "locked", "inspect", folder)
    assert run.code == 1, run.stderr
    assert run.error_lines == [
        f"error: {folder / 'latest'}: `latest` names the tag 'global_step9', but there is no "
        "such folder; tag folders present: global_step1 (rule tag-missing; pass a tag folder "
        "itself, or fix `latest`)"
    ]


@pytest.mark.slow
def test_a_tag_folder_nobody_may_list(tmp_path: Path) -> None:
    folder = _folder(tmp_path)
    tag = folder / "global_step1"
    run = with_locked_folder(tag, "inspect", folder)
    assert run.code == 1, run.stderr
    assert run.error_lines == [
        f"error: {tag}: cannot list the folder: Permission denied (rule unreadable; check its "
        "permissions)"
    ]


def test_module_weights_beside_an_optimizer_file_that_is_a_dangling_link(tmp_path: Path) -> None:
    """--zero-weights module counts the optimizer files' sizes as left out: a dangling link
    among them ended in 'internal error: FileNotFoundError'. It holds nothing to leave out."""
    folder = _folder(tmp_path)
    optim = folder / "global_step1" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    optim.unlink()
    optim.symlink_to(tmp_path / "gone.pt")
    out = tmp_path / "out"
    run = cli("convert", folder, "-o", out, "--zero-weights", "module")
    assert run.code == 0, run.stderr
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
