"""`ckptfix fix` next to links and read-only folders (issue 21): -o never modifies the
source, nothing is ever removed or written through a link, the aside folder is a real
folder inside PATH, and a read-only folder never leaves a staging folder behind nor lets a
failed step print success."""

from __future__ import annotations

import os
import stat
from pathlib import Path
from typing import Any

import pytest

from tests.builders import Factory, Spec
from tests.fix_cases import INDEX, ONE, TWO, broken, loaded, stale
from tests.helpers import as_another_user, cli, give_away

ASIDE = "ckptfix-aside"


def leftovers(*folders: Path) -> list[Path]:
    return [path for folder in folders for path in folder.glob(".ckptfix-*")]


def entries(root: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every entry under root, links not followed: (type and mode, inode, bytes or target)."""
    found = {}
    for folder, subfolders, files in os.walk(root):
        for name in [*subfolders, *files]:
            path = Path(folder) / name
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                content = os.readlink(path).encode()
            elif stat.S_ISREG(info.st_mode):
                content = path.read_bytes()
            else:
                content = b""
            found[str(path.relative_to(root))] = (info.st_mode, info.st_ino, content)
    return found


def _linked(factory: Factory, relative: bool, *, rewrite: bool = True) -> tuple[Path, Path]:
    """PATH/sub is a link to ELSEWHERE/real, which holds both shards (and a file of the
    user's); the index names them as sub/…. With `rewrite`, the first shard lacks
    "format" (fix rewrites it); otherwise only the index's total_size is wrong."""
    real = factory.root / "elsewhere" / "real"
    factory.safetensors(f"elsewhere/real/{ONE}", [Spec("a")], with_format=not rewrite)
    factory.safetensors(f"elsewhere/real/{TWO}", [Spec("b")])
    (real / "notes.txt").write_text("mine")
    model = factory.root / "m"
    model.mkdir()
    os.symlink("../elsewhere/real" if relative else real, model / "sub")
    weight_map = {"a": f"sub/{ONE}", "b": f"sub/{TWO}"}
    factory.index(f"m/{INDEX}", weight_map, 48 if rewrite else 999)
    factory.config("m")
    return model, real


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_out_never_modifies_shards_behind_a_linked_sub_folder(
    factory: Factory, relative: bool
) -> None:
    """The link was recreated in the staging folder, then the shards "brought along by
    their folder" were removed through it: the user's only copy of shard 2 was deleted and
    shard 1 overwritten by its repaired version."""
    model, _ = _linked(factory, relative)
    before = entries(factory.root)
    out = factory.root / "out"
    run = cli("fix", model, "-o", out)
    assert run.code == 0, run.stderr
    after = entries(factory.root)
    assert {key: value for key, value in after.items() if not key.startswith("out")} == before
    assert (out / "sub").is_dir() and not (out / "sub").is_symlink()
    assert sorted(os.listdir(out / "sub")) == [ONE, TWO]  # never walked into: no notes.txt
    check = cli("inspect", out, "--fail-on", "warning")
    assert check.code == 0, check.stdout
    assert loaded(out) == loaded(model)
    assert leftovers(factory.root) == []


def _refused_in_place(factory: Factory, model: Path, line: str) -> None:
    """fix --in-place: exit 2, exactly `line`, and nothing anywhere changed."""
    before = entries(factory.root)
    run = cli("fix", model, "--in-place")
    assert run.code == 2, run.stderr
    assert run.error_lines == [line]
    assert entries(factory.root) == before


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_in_place_never_writes_behind_a_linked_sub_folder(factory: Factory, relative: bool) -> None:
    model, _ = _linked(factory, relative)
    _refused_in_place(
        factory,
        model,
        f"error: {model / 'sub'}: is a link (to {os.readlink(model / 'sub')}), and fix "
        f"--in-place would change sub/{ONE} behind it, outside {model} (rule usage; repair "
        "into a new folder with -o OUT, or replace the link with the folder it points to)",
    )


def test_in_place_keeps_a_linked_sub_folder_whose_shards_stay(factory: Factory) -> None:
    """Only the index changes: the link stays as it was, and nothing behind it is touched."""
    model, real = _linked(factory, relative=True, rewrite=False)
    behind = entries(real)
    old_index = (model / INDEX).read_bytes()
    run = cli("fix", model, "--in-place")
    assert run.code == 0, run.stderr
    assert os.readlink(model / "sub") == "../elsewhere/real"
    assert entries(real) == behind
    assert (model / ASIDE / INDEX).read_bytes() == old_index
    assert cli("inspect", model, "--fail-on", "warning").code == 0
    assert leftovers(factory.root) == []


def _aside_refusal(model: Path, link: str) -> str:
    return (
        f"error: {model / link}: is a link (to {os.readlink(model / link)}), not a folder: "
        f"fix --in-place moves what it takes out only into a real folder inside {model} "
        "(rule usage; remove the link, or repair into a new folder with -o OUT)"
    )


@pytest.mark.parametrize("relative", [False, True], ids=["absolute", "relative"])
def test_in_place_refuses_an_aside_folder_that_is_a_link(factory: Factory, relative: bool) -> None:
    """What fix took out was moved into whatever the link pointed at."""
    model = broken(factory, "stale-single")
    elsewhere = factory.root / "elsewhere"
    elsewhere.mkdir()
    os.symlink("../elsewhere" if relative else elsewhere, model / ASIDE)
    _refused_in_place(factory, model, _aside_refusal(model, ASIDE))
    run = cli("fix", model, "--in-place", "--dry-run")
    assert run.code == 2 and len(run.error_lines) == 1


def _nested_stale_copy(factory: Factory) -> Path:
    """A real sub-folder holding both shards, the second with a stale copy of the first's
    tensor: fix rewrites it without the copy and takes the original out, into
    ckptfix-aside/sub/."""
    factory.safetensors(f"m/sub/{ONE}", [Spec("a")])
    factory.safetensors(f"m/sub/{TWO}", [Spec("b"), stale(Spec("a"))])
    factory.index(f"m/{INDEX}", {"a": f"sub/{ONE}", "b": f"sub/{TWO}"}, 48)
    return factory.root / "m"


def test_in_place_refuses_a_link_inside_the_aside_folder(factory: Factory) -> None:
    model = _nested_stale_copy(factory)
    elsewhere = factory.root / "elsewhere"
    elsewhere.mkdir()
    (model / ASIDE).mkdir()
    os.symlink(elsewhere, model / ASIDE / "sub")
    _refused_in_place(factory, model, _aside_refusal(model, f"{ASIDE}/sub"))


def test_in_place_moves_a_nested_file_into_the_aside_folder(factory: Factory) -> None:
    model = _nested_stale_copy(factory)
    original = (model / "sub" / TWO).read_bytes()
    run = cli("fix", model, "--in-place")
    assert run.code == 0, run.stderr
    assert (model / ASIDE / "sub" / TWO).read_bytes() == original
    assert cli("inspect", model, "--fail-on", "warning").code == 0
    assert leftovers(factory.root) == []


def _stale_and_read_only(factory: Factory, where: str) -> Path:
    """A stale single-file export (taken out by fix) and a read-only folder: the aside
    folder itself, or a sub-folder of the user's."""
    model = broken(factory, "stale-single")
    folder = model / where
    folder.mkdir()
    (folder / "kept.txt").write_text("kept")
    folder.chmod(0o555)
    return model


@pytest.mark.slow
@pytest.mark.parametrize("where", [ASIDE, "docs"])
def test_in_place_with_a_read_only_folder_leaves_nothing_behind(
    factory: Factory, where: str
) -> None:
    """A read-only aside folder failed the move and left the staging folder; a read-only
    sub-folder of the user's was carried and swapped in, "wrote" was printed, and the old
    folder it was in stayed beside PATH as a .ckptfix-* folder."""
    model = _stale_and_read_only(factory, where)
    stale = (model / "model.safetensors").read_bytes()
    run = as_another_user("fix", model, "--in-place")
    assert run.code == 0, run.stderr
    assert leftovers(factory.root) == []
    assert (model / where / "kept.txt").read_text() == "kept"
    assert stat.S_IMODE((model / where).stat().st_mode) == 0o555
    assert (model / ASIDE / "model.safetensors").read_bytes() == stale
    assert cli("inspect", model, "--fail-on", "warning").code == 0


@pytest.mark.slow
@pytest.mark.parametrize("option", ["-o", "--in-place"])
def test_a_read_only_sub_folder_holding_shards(factory: Factory, option: str) -> None:
    """The staging copy of a read-only sub-folder was made read-only before fix placed the
    repaired shards in it: the write failed and the staging folder stayed."""
    model, real = _linked(factory, relative=False)
    (model / "sub").unlink()
    real.rename(model / "sub")
    (model / "sub").chmod(0o555)
    out = factory.root / "out"
    run = as_another_user("fix", model, *([option, out] if option == "-o" else [option]))
    assert run.code == 0, run.stderr
    result = out if option == "-o" else model
    assert stat.S_IMODE((result / "sub").stat().st_mode) == 0o555
    assert sorted(os.listdir(result / "sub")) == sorted([ONE, TWO, "notes.txt"])
    assert cli("inspect", result, "--fail-on", "warning").code == 0
    assert leftovers(factory.root) == []


@pytest.mark.slow
def test_in_place_refuses_a_folder_it_could_not_clear(factory: Factory) -> None:
    """A sub-folder another user owns and we cannot write: once swapped, the old folder
    could not be removed. Refused before anything is written."""
    model = broken(factory, "stale-single")
    theirs = model / "theirs"
    theirs.mkdir()
    (theirs / "data.txt").write_text("theirs")
    give_away(theirs)
    _refused_as_another_user(
        factory,
        ["fix", model, "--in-place"],
        f"error: {theirs}: folder is not writable and not ours to make writable, so its old "
        "entries could not be removed once the new folder is in place (rule write-failed; "
        "make it writable, or run as its owner)",
    )


def _refused_as_another_user(factory: Factory, args: list[str | Path], line: str) -> None:
    """Run as another user: exit 1, exactly `line`, and nothing anywhere changed."""
    before = entries(factory.root)
    run = as_another_user(*args)
    assert run.code == 1, run.stderr
    assert run.error_lines == [line]
    assert entries(factory.root) == before
    assert leftovers(factory.root) == []


def test_in_place_keeps_a_fifo_beside_the_checkpoint(factory: Factory) -> None:
    """A FIFO in the model folder is kept by a hard link: it was carried twice (as an entry
    of the folder and as a file left out for not being regular), and the second link
    failed with "write failed: File exists"."""
    model = broken(factory, "stale-single")
    os.mkfifo(model / "pipe")
    run = cli("fix", model, "--in-place")
    assert run.code == 0, run.stderr
    assert stat.S_ISFIFO(os.lstat(model / "pipe").st_mode)
    assert (model / ASIDE / "model.safetensors").is_file()
    assert leftovers(factory.root) == []


@pytest.mark.parametrize("kind", ["folder", "link to a folder"])
def test_in_place_aside_name_taken_by_a_folder(factory: Factory, kind: str) -> None:
    """The aside folder holds a folder (or a link to one) named like the file fix takes
    out: only files counted as taken, so the move collided with it ("write failed: File
    exists"). The file goes in beside it as NAME.2."""
    model = broken(factory, "stale-single")
    stale_bytes = (model / "model.safetensors").read_bytes()
    taken = model / ASIDE / "model.safetensors"
    taken.parent.mkdir()
    if kind == "folder":
        taken.mkdir()
        (taken / "keep.txt").write_text("keep")
    else:
        (factory.root / "elsewhere").mkdir()
        os.symlink(factory.root / "elsewhere", taken)
    run = cli("fix", model, "--in-place")
    assert run.code == 0, run.stderr
    assert (model / ASIDE / "model.safetensors.2").read_bytes() == stale_bytes
    assert taken.is_dir() and (kind == "folder") != taken.is_symlink()
    assert leftovers(factory.root) == []


def test_in_place_refuses_to_take_out_a_file_a_link_reaches(factory: Factory) -> None:
    """`sub -> .`: the index reaches the shards as sub/…, and the same files at the top
    level looked like orphans. fix --in-place took them out from under the link, and its
    own check then called the result a bug; it now refuses, naming the link."""
    factory.safetensors(f"m/{ONE}", [Spec("a")])
    factory.safetensors(f"m/{TWO}", [Spec("b")])
    factory.index(f"m/{INDEX}", {"a": f"sub/{ONE}", "b": f"sub/{TWO}"}, 9)
    model = factory.root / "m"
    os.symlink(".", model / "sub")
    _refused_in_place(
        factory,
        model,
        f"error: {model / 'sub'}: is a link (to .), and fix --in-place would take {ONE} out "
        f"from under it (it is sub/{ONE}, which the index reaches through the link) (rule "
        "usage; repair into a new folder with -o OUT, or replace the link with the folder it "
        "points to)",
    )
    out = factory.root / "out"
    assert cli("fix", model, "-o", out).code == 0
    assert cli("inspect", out, "--fail-on", "warning").code == 0


@pytest.mark.slow
@pytest.mark.parametrize("command", ["fix", "reshard"])
def test_in_place_refuses_another_users_file_in_a_sticky_folder(
    factory: Factory, command: str
) -> None:
    """A sticky folder (1777) of another user's holding their file: the new folder was
    swapped in, then the old one could not be emptied and stayed beside PATH as a
    .ckptfix-* folder (exit 1 after the swap). Refused before anything is written."""
    model = broken(factory, "stale-single")
    shared = model / "shared"
    shared.mkdir()
    (shared / "theirs.txt").write_text("theirs")
    give_away(shared)
    shared.chmod(0o1777)
    _refused_as_another_user(
        factory,
        [command, model, "--in-place"],
        f"error: {shared / 'theirs.txt'}: is another user's, in a sticky folder (mode +t) that "
        "is not ours either, so it could not be removed once the new folder is in place (rule "
        "write-failed; have its owner move it out, or run as the folder's owner)",
    )


@pytest.mark.parametrize("rewrite", [False, True], ids=["kept", "one-rewritten"])
@pytest.mark.parametrize("option", ["-o", "--in-place"])
def test_a_kept_shard_swapped_during_the_run_is_never_carried(
    factory: Factory, monkeypatch: pytest.MonkeyPatch, option: str, rewrite: bool
) -> None:
    """sub/ (a real folder, its shards kept) swapped for a link to a folder of other shards
    of the same names after fix read them: -o copied the other bytes into OUT, unchecked;
    --in-place, with the other shard rewritten, left the kept one behind the new link and
    called its own check's failure a bug."""
    from ckptfix.ops import fix

    model, real = _linked(factory, relative=False, rewrite=rewrite)
    (model / "sub").unlink()
    real.rename(model / "sub")
    factory.safetensors(f"decoy/{ONE}", [stale(Spec("a"))])
    factory.safetensors(f"decoy/{TWO}", [stale(Spec("b"))])
    fill = fix.fill

    def swapped_then_filled(*args: Any) -> Any:
        (model / "sub").rename(factory.root / "moved")
        os.symlink(factory.root / "decoy", model / "sub")
        return fill(*args)

    monkeypatch.setattr(fix, "fill", swapped_then_filled)
    out = factory.root / "out"
    run = cli("fix", model, *([option, out] if option == "-o" else [option]))
    assert run.code == 1, run.stderr
    kept = TWO if rewrite else ONE
    assert run.error_lines == [
        f"error: {model / 'sub' / kept}: file was replaced or modified since it was first read "
        "(rule source-changed; run again on a stable copy)"
    ]
    assert not out.exists() and leftovers(factory.root) == []
