"""`ckptfix fix`: each repairable finding repaired from the shard headers (-o and
--in-place), the result clean for `inspect --fail-on warning` with every tensor of the
chosen family bitwise equal to the clean folder's; what is taken out moved aside, never
deleted; refusals exit 1 with one error line and change nothing; --dry-run writes nothing."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests.builders import Factory, Spec
from tests.fix_cases import (
    INDEX,
    MAP,
    ONE,
    REPAIRABLE,
    S1,
    S2,
    TOTAL,
    TWO,
    broken,
    clean,
    header_metadata,
    lfs_folder,
    loaded,
    stale,
)
from tests.helpers import cli, tree_snapshot

ASIDE = "ckptfix-aside"
RESULT = {ONE, TWO, INDEX, "config.json", "tokenizer.json"}

# case -> the files fix takes out of the checkpoint
MOVED = {
    "unlisted": [INDEX],
    "total-size": [INDEX],
    "missing-tensor": [INDEX],
    "missing-file": [INDEX],
    "lost-index": [],
    "numbering": [INDEX],
    "format": [],
    "duplicate": [TWO],
    "stale-single": ["model.safetensors"],
    "orphan": ["model-00003-of-00003.safetensors"],
    "other-family": ["pytorch_model.bin"],
}


def clean_after_fix(out: Path) -> None:
    check = cli("inspect", out, "--fail-on", "warning", "--json")
    assert check.code == 0, check.stdout
    assert check.json()["findings"] == []


@pytest.mark.parametrize("case", sorted(REPAIRABLE))
def test_fix_to_out(factory: Factory, tmp_path: Path, case: str) -> None:
    reference = loaded(clean(factory, "clean"))
    folder = broken(factory, case)
    before = tree_snapshot(folder)
    out = tmp_path / "out"
    run = cli("fix", folder, "-o", out, "--json")
    assert run.code == 0, run.stderr
    assert run.stderr == ""
    document = run.json()
    repair = document["plan"]
    assert repair["refused"] is False and repair["refusals"] == []
    assert {item["code"] for item in document["findings"]} == REPAIRABLE[case][1]
    assert {item["verdict"] for item in repair["findings"]} == {"repair"}
    assert [move["source"] for move in repair["moved"]] == MOVED[case]
    assert document["moved"] == []  # -o moves nothing: it leaves those files out
    assert sorted(repair["copied_files"]) == ["config.json", "tokenizer.json"]
    assert document["written"]["verified"] is True
    assert {path.name for path in out.iterdir()} == RESULT
    assert loaded(out) == reference
    assert tree_snapshot(folder) == before  # the source is never touched by -o
    assert (out / "tokenizer.json").read_bytes() == (folder / "tokenizer.json").read_bytes()
    index = json.loads((out / INDEX).read_text())
    assert index == {"metadata": {"total_size": TOTAL}, "weight_map": dict(sorted(MAP.items()))}
    for shard in (ONE, TWO):
        assert header_metadata(out / shard).get("format") == "pt"
    clean_after_fix(out)


@pytest.mark.parametrize("case", sorted(REPAIRABLE))
def test_fix_in_place(factory: Factory, case: str) -> None:
    reference = loaded(clean(factory, "clean"))
    folder = broken(factory, case)
    before = tree_snapshot(folder)
    run = cli("fix", folder, "--in-place", "--json")
    assert run.code == 0, run.stderr
    document = run.json()
    renamed = [
        {"from": str(folder / name.replace("-of-00002", "-of-00003")), "to": str(folder / name)}
        for name in (ONE, TWO)
        if case == "numbering"
    ]
    expected_moves = renamed + [
        {"from": str(folder / name), "to": str(folder / ASIDE / name)} for name in MOVED[case]
    ]
    assert document["moved"] == expected_moves
    for name in MOVED[case]:  # moved aside byte for byte, never deleted
        assert (folder / ASIDE / name).read_bytes() == before[name]
    top = {path.name for path in folder.iterdir()}
    assert top == RESULT | ({ASIDE} if MOVED[case] else set())
    assert loaded(folder) == reference
    clean_after_fix(folder)
    # Everything the source held is still somewhere in the folder, under its name or aside.
    kept = {name for name in before if (folder / name).exists() or (folder / ASIDE / name).exists()}
    renamed = {ONE.replace("-of-00002", "-of-00003"), TWO.replace("-of-00002", "-of-00003")}
    assert set(before) - kept <= (renamed if case == "numbering" else set())


def test_in_place_human_report_lists_every_move(factory: Factory) -> None:
    folder = broken(factory, "stale-single")
    factory.lfs_pointer("broken/pytorch_model.bin")
    run = cli("fix", folder, "--in-place")
    assert run.code == 0, run.stderr
    lines = run.stdout.splitlines()
    for name in ("model.safetensors", "pytorch_model.bin"):
        assert f"moved: {folder / name} → {folder / ASIDE / name}" in lines
    assert "3 finding(s) repaired, 0 cannot be, 0 left as they are" in lines


def test_in_place_twice_keeps_both_stale_files(factory: Factory) -> None:
    folder = broken(factory, "stale-single")
    first = (folder / "model.safetensors").read_bytes()
    assert cli("fix", folder, "--in-place").code == 0
    factory.safetensors("broken/model.safetensors", [stale(S2[0])])
    second = (folder / "model.safetensors").read_bytes()
    run = cli("fix", folder, "--in-place", "--json")
    assert run.code == 0, run.stderr
    aside = folder / ASIDE
    assert run.json()["moved"] == [
        {"from": str(folder / "model.safetensors"), "to": str(aside / "model.safetensors.2")}
    ]
    assert (aside / "model.safetensors").read_bytes() == first
    assert (aside / "model.safetensors.2").read_bytes() == second
    # a third run finds nothing to repair and changes nothing
    before = tree_snapshot(folder)
    run = cli("fix", folder, "--in-place")
    assert run.code == 0
    assert run.stdout.splitlines()[-1] == "nothing to repair: nothing was written"
    assert tree_snapshot(folder) == before


def test_out_keeps_the_users_other_files(factory: Factory, tmp_path: Path) -> None:
    folder = broken(factory, "other-family")
    factory.bytes("broken/notes/README.md", b"# my notes\n")
    factory.bytes("broken/generation_config.json", b"{}")
    out = tmp_path / "out"
    run = cli("fix", folder, "-o", out, "--json")
    assert run.code == 0, run.stderr
    assert (out / "notes" / "README.md").read_bytes() == b"# my notes\n"
    assert (out / "generation_config.json").read_bytes() == b"{}"
    assert not (out / "pytorch_model.bin").exists()
    assert not (out / ASIDE).exists()
    assert run.json()["plan"]["left_out"] == {}


def test_out_leaves_the_aside_folder_out(factory: Factory, tmp_path: Path) -> None:
    folder = broken(factory, "stale-single")
    assert cli("fix", folder, "--in-place").code == 0
    out = tmp_path / "out"
    run = cli("fix", folder, "-o", out, "--json")
    assert run.code == 0, run.stderr
    assert run.json()["plan"]["left_out"] == {ASIDE: "what ckptfix fix took out"}
    assert not (out / ASIDE).exists()


def test_format_rewrite_keeps_every_tensor_byte(factory: Factory, tmp_path: Path) -> None:
    folder = broken(factory, "format")
    source = (folder / TWO).read_bytes()
    run = cli("fix", folder, "--in-place", "--json")
    assert run.code == 0, run.stderr
    assert run.json()["written"]["replaced"] == [str(folder / TWO)]
    header = header_metadata(folder / TWO)
    assert header == {"format": "pt"}
    data = source[8 + int.from_bytes(source[:8], "little") :]
    assert (folder / TWO).read_bytes().endswith(data)
    assert not (folder / ASIDE).exists()


def test_single_file_missing_format(factory: Factory, tmp_path: Path) -> None:
    path = factory.safetensors("one.safetensors", S1, {"producer": "me"}, with_format=False)
    out = tmp_path / "out"
    run = cli("fix", path, "-o", out, "--json")
    assert run.code == 0, run.stderr
    assert header_metadata(out / "one.safetensors") == {"producer": "me", "format": "pt"}
    assert loaded_file(out / "one.safetensors") == loaded_file(path)
    run = cli("fix", path, "--in-place", "--json")
    assert run.code == 0, run.stderr
    written = run.json()["written"]
    assert written["files"] == [{"path": str(path), "bytes": path.stat().st_size}]
    assert written["replaced"] == [str(path)]
    assert header_metadata(path) == {"producer": "me", "format": "pt"}
    clean_after_fix(path)


def loaded_file(path: Path) -> dict[str, bytes]:
    from tests.helpers import read_tensors

    return {name: data for name, (_, _, data) in read_tensors(path).items()}


def test_dry_run_changes_nothing(factory: Factory, tmp_path: Path) -> None:
    folder = broken(factory, "duplicate")
    before = tree_snapshot(folder)
    out = tmp_path / "out"
    run = cli("fix", folder, "-o", out, "--dry-run", "--json")
    assert run.code == 0, run.stderr
    document = run.json()
    assert document["written"] is None
    assert document["plan"]["findings"] == [
        {
            "code": "duplicate-name",
            "severity": "error",
            "file": str(folder / TWO),
            "verdict": "repair",
            "action": f"keep the copy in {ONE}, the one {INDEX} points to; rewrite {TWO} "
            "without its stale copy",
        }
    ]
    assert not out.exists()
    run = cli("fix", folder, "--in-place", "--dry-run")
    assert run.code == 0
    assert run.stdout.splitlines()[-1] == "dry run: nothing was written"
    assert tree_snapshot(folder) == before


def test_clean_folder(factory: Factory, tmp_path: Path) -> None:
    folder = clean(factory, "clean")
    before = tree_snapshot(folder)
    run = cli("fix", folder, "--in-place", "--json")
    assert run.code == 0
    assert run.json()["written"] is None
    assert tree_snapshot(folder) == before
    out = tmp_path / "out"
    assert cli("fix", folder, "-o", out).code == 0
    assert tree_snapshot(out) == before


# --- inspect: every finding's `fix`, and the summary's count --------------------------------


def test_inspect_fix_field(factory: Factory) -> None:
    folder = broken(factory, "missing-tensor")
    run = cli("inspect", folder, "--json")
    command = f"ckptfix fix {folder} -o OUT (or --in-place)"
    fixes = {item["code"]: item["fix"] for item in run.json()["findings"]}
    anew = f"{command}: write {INDEX} anew from the shard headers"
    assert fixes == {
        "index-missing-tensor": anew,
        "index-unlisted-tensor": anew,
        "index-total-size": anew,
    }
    human = cli("inspect", folder)
    assert f"    fix: {anew}" in human.stdout.splitlines()
    assert human.stdout.splitlines()[-1] == (
        f"1 error(s), 2 warning(s), 0 info → exit 1 (--fail-on error); `ckptfix fix {folder}` "
        "would repair 3"
    )


def test_inspect_fix_field_when_fix_refuses(factory: Factory) -> None:
    folder, _ = lfs_folder(factory)
    factory.safetensors(f"m/{ONE}", S1, with_format=False)
    (folder / "config.json").unlink()  # else lm_head's absence is a tie finding too
    document = cli("inspect", folder, "--json").json()
    fixes = {item["code"]: item["fix"] for item in document["findings"]}
    assert fixes == {
        "lfs-pointer": "none: run `git lfs pull`, or download the file itself, then run "
        "`ckptfix fix` again",
        "missing-format-metadata": f"ckptfix fix {folder} -o OUT (or --in-place): add "
        '"format": "pt" to the header, once what it cannot repair (lfs-pointer) is resolved',
    }
    human = cli("inspect", folder).stdout.splitlines()[-1]
    assert human.endswith(f"; `ckptfix fix {folder}` repairs none until lfs-pointer is resolved")


def test_inspect_fix_field_of_other_commands(factory: Factory) -> None:
    path = factory.safetensors(
        "mix.safetensors", [Spec("a", "F32", (2,)), Spec("b", "BF16", (2,))], with_format=False
    )
    document = cli("inspect", path, "--json").json()
    fixes = {item["code"]: item["fix"] for item in document["findings"]}
    assert fixes == {
        "missing-format-metadata": f"ckptfix fix {path} -o OUT (or --in-place): rewrite the "
        'header of mix.safetensors with "format": "pt" (tensor bytes unchanged)',
        "dtype-mix": f"ckptfix convert {path} -o OUT --dtype bf16 (if one dtype is wanted)",
    }
    human = cli("inspect", path).stdout.splitlines()[-1]
    assert human == (
        f"0 error(s), 1 warning(s), 1 info → exit 0 (--fail-on error); `ckptfix fix {path}` "
        "would repair 1"
    )


def test_a_clean_report_has_no_repair_clause(factory: Factory) -> None:
    folder = clean(factory, "clean")
    last = cli("inspect", folder).stdout.splitlines()[-1]
    assert last == "0 error(s), 0 warning(s), 0 info → exit 0 (--fail-on error)  clean"


def test_huge_tensor_is_left_as_it_is(factory: Factory, tmp_path: Path) -> None:
    """A tensor of 2^31 elements is not damage: fix repairs the rest and says so."""
    folder = tmp_path / "huge"
    factory.sparse_safetensors("huge/model.safetensors", "U8", (2**31,))
    factory.index("huge/model.safetensors.index.json", {"huge": "model.safetensors"}, 1)
    run = cli("fix", folder, "--in-place", "--json")
    assert run.code == 0, run.stderr
    repair = run.json()["plan"]
    verdicts = {item["code"]: item["verdict"] for item in repair["findings"]}
    assert verdicts == {
        "huge-numel": "keep",
        "shadowed-shards": "repair",
        "index-total-size": "repair",
    }
    assert [(item["code"], item["verdict"]) for item in repair["remaining"]] == [
        ("huge-numel", "keep")
    ]
    assert [item["source"] for item in repair["moved"]] == [INDEX]
    check = cli("inspect", folder, "--fail-on", "warning", "--json")
    assert [item["code"] for item in check.json()["findings"]] == ["huge-numel"]


@pytest.mark.slow
def test_inspect_plans_without_writers_or_torch(factory: Factory) -> None:
    """The `fix` of inspect's findings comes from the repair planner alone (data, no I/O):
    no writer, staging or torch is imported for it."""
    import subprocess
    import sys

    folder = broken(factory, "duplicate")
    code = (
        "import sys; from ckptfix.cli.entry import main; sys.argv = ['ckptfix', 'inspect', "
        f"{str(folder)!r}]\n"
        "try:\n    main()\nexcept SystemExit:\n"
        "    loaded = sorted(m for m in sys.modules if m.startswith(('ckptfix.write', "
        "'ckptfix.ops.rewrite', 'ckptfix.ops.fix', 'torch')))\n"
        "    print(loaded, file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.stderr.strip().splitlines()[-1] == "[]"


def test_a_torch_checkpoint_is_for_convert(tmp_path: Path) -> None:
    import torch

    path = tmp_path / "tied.bin"
    weight = torch.arange(16, dtype=torch.float32).reshape(4, 4)
    torch.save({"embed.weight": weight, "lm_head.weight": weight}, path)
    inspected = cli("inspect", path, "--json")
    assert [(item["code"], item["fix"]) for item in inspected.json()["findings"]] == [
        ("shared-storage", f"ckptfix convert {path} -o OUT")
    ]
    last = cli("inspect", path).stdout.splitlines()[-1]
    assert last.endswith(
        f"; `ckptfix fix {path}` repairs none: it rewrites safetensors checkpoints only"
    )
    run = cli("fix", path, "-o", tmp_path / "out")
    assert run.code == 1
    assert run.error_lines == [
        f"error: {path}: file is torch-zip, which fix does not rewrite (rule "
        f"unsupported-format; `ckptfix convert {path} -o OUT` writes it as safetensors)"
    ]
