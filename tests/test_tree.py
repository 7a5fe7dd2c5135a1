"""write.tree: trees a write makes or replaces are handled through folder descriptors, never
through a link; read-only folders in them are opened up before removal."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from ckptfix.core.errors import WriteError
from ckptfix.write.tree import blocked_folder, first_link, make_folders, remove_tree
from tests.helpers import give_away, python_as_another_user


def _outside(tmp_path: Path) -> Path:
    outside = tmp_path / "outside"
    (outside / "deeper").mkdir(parents=True)
    (outside / "keep.txt").write_text("keep")
    (outside / "deeper" / "keep.txt").write_text("keep")
    return outside


def _outside_intact(outside: Path) -> bool:
    return (outside / "keep.txt").read_text() == (outside / "deeper" / "keep.txt").read_text()


def test_remove_tree_removes_links_never_what_they_point_to(tmp_path: Path) -> None:
    outside = _outside(tmp_path)
    tree = tmp_path / "tree"
    (tree / "a" / "b").mkdir(parents=True)
    (tree / "a" / "b" / "file").write_text("x")
    os.symlink(outside, tree / "a" / "folder-link")
    os.symlink(outside / "keep.txt", tree / "file-link")
    os.symlink("../../outside/deeper", tree / "a" / "relative-link")
    remove_tree(str(tree))
    assert not tree.exists()
    assert _outside_intact(outside) and sorted(os.listdir(outside)) == ["deeper", "keep.txt"]


def test_remove_tree_of_a_link_removes_only_the_link(tmp_path: Path) -> None:
    outside = _outside(tmp_path)
    os.symlink(outside, tmp_path / "link")
    remove_tree(str(tmp_path / "link"))
    assert not os.path.lexists(tmp_path / "link") and _outside_intact(outside)


def test_remove_tree_opens_up_read_only_folders(tmp_path: Path) -> None:
    """As their owner, not as root: a folder without write, read or search permission."""
    tree = tmp_path / "tree"
    for name, mode in (("readonly", 0o555), ("closed", 0o000), ("search-only", 0o100)):
        (tree / name / "inner").mkdir(parents=True)
        (tree / name / "inner" / "file").write_text("x")
        (tree / name / "file").write_text("x")
        (tree / name).chmod(mode)
    (tree / "readonly" / "inner").chmod(0o500)
    run = python_as_another_user(
        "-c", f"from ckptfix.write.tree import remove_tree; remove_tree({str(tree)!r})"
    )
    assert run.code == 0, run.stderr
    assert not tree.exists()


def test_make_folders_never_goes_through_a_link(tmp_path: Path) -> None:
    outside = _outside(tmp_path)
    root = tmp_path / "staging"
    root.mkdir()
    os.symlink(outside, root / "sub")
    with pytest.raises(WriteError) as caught:
        make_folders(str(root), "sub/inner", "OUT")
    assert caught.value.line() == (
        "error: OUT/sub: is no longer a folder: the source changed during the run (rule "
        "write-failed; run again)"
    )
    assert sorted(os.listdir(outside)) == ["deeper", "keep.txt"]
    make_folders(str(root), "real/inner", "OUT")
    assert (root / "real" / "inner").is_dir()


def test_first_link(tmp_path: Path) -> None:
    (tmp_path / "a" / "b").mkdir(parents=True)
    os.symlink(tmp_path / "a", tmp_path / "a" / "b" / "c")
    (tmp_path / "file").write_text("x")
    assert first_link(str(tmp_path), "a/b") is None
    assert first_link(str(tmp_path), "a/b/c/d") == "a/b/c"
    assert first_link(str(tmp_path), "file/x") == "file"
    assert first_link(str(tmp_path), "missing/c") is None


def _blocked_script(tree: Path, parts: str = "[:1]") -> str:
    """A script printing the blocked entry of `tree` (and with "[:2]", why), or None."""
    found = f"blocked_folder({str(tree)!r})"
    return (
        "from ckptfix.write.tree import blocked_folder\n"
        f"found = {found}\nprint('|'.join(found{parts}) if found else None)"
    )


@pytest.mark.slow
def test_blocked_folder_names_another_users_folder(tmp_path: Path) -> None:
    tree = tmp_path / "tree"
    (tree / "mine" / "theirs").mkdir(parents=True)
    os.symlink("/", tree / "mine" / "root-link")  # never walked
    give_away(tree / "mine" / "theirs")
    script = _blocked_script(tree)
    run = python_as_another_user("-c", script)
    assert run.stdout.strip() == str(tree / "mine" / "theirs"), run.stderr
    (tree / "mine" / "theirs").chmod(0o777)  # open to anyone: its entries can be removed
    run = python_as_another_user("-c", script)
    assert run.stdout.strip() == "None", run.stderr
    assert blocked_folder(str(tree)) is None  # root may remove anything


@pytest.mark.slow
def test_blocked_folder_names_another_users_file_in_their_sticky_folder(tmp_path: Path) -> None:
    """A sticky folder (mode 1777) of another user's lets us write into it, but not remove
    their entries: a tree holding one was swapped in, then its old copy could not be
    removed, and stayed beside the output as a .ckptfix-* folder."""
    tree = tmp_path / "tree"
    shared = tree / "shared"
    shared.mkdir(parents=True)
    (shared / "theirs.txt").write_text("theirs")
    give_away(shared)
    shared.chmod(0o1777)
    run = python_as_another_user("-c", _blocked_script(tree, "[:2]"))
    assert run.stdout.strip().split("|")[0] == str(shared / "theirs.txt"), run.stderr
    assert "sticky folder" in run.stdout
    os.chown(shared / "theirs.txt", os.geteuid(), os.getegid())  # ours: removable
    run = python_as_another_user("-c", _blocked_script(tree))
    assert run.stdout.strip() == "None", run.stderr
