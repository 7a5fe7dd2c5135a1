"""`ckptfix fix` refusing: what the shard headers cannot answer exits 1 with one error line
naming the finding and the way out, and changes nothing (no OUT, no staging folder left);
likewise a write that fails; usage errors exit 2."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.builders import Factory, Spec
from tests.fix_cases import INDEX, MAP, ONE, S1, S2, TOTAL, TWO, broken, clean, lfs_folder
from tests.helpers import cli, tree_snapshot

# --- refusals: exit 1, one error line, nothing changed -------------------------------------


def _truncated(f: Factory) -> tuple[Path, str]:
    folder = clean(f, "m")
    path = folder / TWO
    path.write_bytes(path.read_bytes()[:-10])
    return folder, (
        f"error: {path}: file is truncated: its header needs {path.stat().st_size + 10} bytes "
        f"but the file has {path.stat().st_size} (rule truncated; re-download the file, then "
        "run `ckptfix fix` again)"
    )


def _missing_shard(f: Factory) -> tuple[Path, str]:
    folder = clean(f, "m")
    (folder / TWO).unlink()
    return folder, (
        f"error: {folder / INDEX}: index maps 1 tensor(s) such as 'lm_head.weight' to "
        f"'{TWO}', which does not exist, and no other file of the family holds them (rule "
        f"index-missing-file; download {TWO} again, then run `ckptfix fix` again)"
    )


def _ghost_tensor(f: Factory) -> tuple[Path, str]:
    folder = clean(f, "m")
    f.index(f"m/{INDEX}", {**MAP, "model.layers.0.ghost": ONE}, TOTAL)
    return folder, (
        f"error: {folder / INDEX}: index maps 1 tensor(s) such as 'model.layers.0.ghost' to "
        f"'{ONE}', which does not hold them, and no other file of the family holds them (rule "
        f"index-missing-tensor; download {ONE} again, then run `ckptfix fix` again)"
    )


def _ties(f: Factory) -> tuple[Path, str]:
    folder = f.sharded("m", [S1])
    (folder / "model-00001-of-00001.safetensors").rename(folder / "model.safetensors")
    (folder / INDEX).unlink()
    f.config("m", tie_word_embeddings=False)
    return folder, (
        f"error: {folder / 'config.json'}: the repaired checkpoint would still have this: "
        "config.json sets tie_word_embeddings=false but no output head (lm_head.weight) is "
        "stored, only 'model.embed_tokens.weight'; the head would be randomly initialised "
        "(rule tied-config-mismatch; set it to true, or store the head)"
    )


def _duplicate_without_index(f: Factory) -> tuple[Path, str]:
    folder = f.sharded("m", [S1, [*S2, S1[1]]], write_index=False)
    return folder, (
        f"error: {folder / ONE}: 1 tensor name(s) such as 'model.norm.weight' are stored in "
        f"several files ({ONE}, {TWO}) and no index entry says which copy is current (rule "
        "duplicate-name; move the stale file out of the folder, then run `ckptfix fix` again)"
    )


def _part_missing(f: Factory) -> tuple[Path, str]:
    folder = f.sharded("m", [S1, S2, [Spec("extra")]], write_index=False)
    (folder / "model-00002-of-00003.safetensors").unlink()
    return folder, (
        f"error: {folder / 'model-00001-of-00003.safetensors'}: shard names are not a complete "
        "1..3 set (part(s) 2 absent or misnamed) and there is no index to say which tensors "
        "the missing part held (rule shard-numbering; download the missing shard(s), then run "
        "`ckptfix fix` again)"
    )


REFUSALS = {
    "lfs-pointer": lfs_folder,
    "truncated": _truncated,
    "index-missing-file": _missing_shard,
    "index-missing-tensor": _ghost_tensor,
    "tied-config-mismatch": _ties,
    "duplicate-name": _duplicate_without_index,
    "shard-numbering": _part_missing,
}


@pytest.mark.parametrize("rule", sorted(REFUSALS))
@pytest.mark.parametrize("mode", ["-o", "--in-place"])
def test_refusal(factory: Factory, tmp_path: Path, rule: str, mode: str) -> None:
    folder, line = REFUSALS[rule](factory)
    before = tree_snapshot(folder)
    siblings = sorted(os.listdir(folder.parent))
    out = tmp_path / "out"
    args = ["-o", out] if mode == "-o" else ["--in-place"]
    run = cli("fix", folder, *args)
    assert run.code == 1
    assert run.error_lines == [line]
    assert tree_snapshot(folder) == before
    assert sorted(os.listdir(folder.parent)) == siblings  # no staging folder left behind
    assert not out.exists()
    document = cli("fix", folder, *args, "--json")
    assert document.code == 1
    error = document.json()["error"]
    assert error["rule"] == rule and error["exit_code"] == 1
    assert line == f"error: {error['file']}: {error['message']} (rule {rule}; {error['fix']})"


def test_refusal_dry_run_prints_the_plan(factory: Factory) -> None:
    folder, line = lfs_folder(factory)
    factory.safetensors(f"m/{ONE}", S1, with_format=False)
    (folder / "config.json").unlink()  # else lm_head's absence is a tie finding too
    run = cli("fix", folder, "--in-place", "--dry-run", "--json")
    assert run.code == 1
    assert run.error_lines == [line]
    repair = run.json()["plan"]
    assert repair["refused"] is True
    verdicts = {item["code"]: item["verdict"] for item in repair["findings"]}
    assert verdicts == {"lfs-pointer": "refuse", "missing-format-metadata": "repair"}


def test_usage_errors(factory: Factory, tmp_path: Path) -> None:
    folder = broken(factory, "total-size")
    run = cli("fix", folder)
    assert run.code == 2
    assert run.error_lines == [
        "error: -o: an output folder is required (rule usage; pass -o OUT, or --in-place)"
    ]
    run = cli("fix", tmp_path / "nope", "--in-place")
    assert run.code == 2
    assert run.error_lines == [
        f"error: {tmp_path / 'nope'}: no such file or directory (rule input-not-found; check "
        "the path)"
    ]
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "x.txt").write_text("mine")
    run = cli("fix", folder, "-o", tmp_path / "full")
    assert run.code == 2
    assert (tmp_path / "full" / "x.txt").read_text() == "mine"
    for mode in (["-o", str(tmp_path / "out")], ["--in-place"]):
        run = cli("fix", "s3://bucket/model", *mode)
        assert run.code == 2
        assert run.error_lines == [
            "error: s3://bucket/model: fix repairs local checkpoints only (rule usage; "
            "download it, then fix the copy)"
        ]
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("mode", ["-o", "--in-place"])
def test_a_failed_write_leaves_everything_as_it_was(
    factory: Factory, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, mode: str
) -> None:
    import errno

    import ckptfix.write.repair

    def full(*args: object, **kwargs: object) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(ckptfix.write.repair, "write_shards", full)
    folder = broken(factory, "format")
    before = tree_snapshot(folder)
    siblings = sorted(os.listdir(folder.parent))
    out = tmp_path / "out"
    run = cli("fix", folder, *(["-o", out] if mode == "-o" else ["--in-place"]))
    assert run.code == 1
    assert run.error_lines == [
        f"error: {out if mode == '-o' else folder}: no space left on device; nothing was "
        "written (rule write-failed; free some space or choose another -o folder)"
    ]
    assert tree_snapshot(folder) == before
    assert sorted(os.listdir(folder.parent)) == siblings
    assert not out.exists()
