"""A DeepSpeed folder that holds the fp32 weights twice: ZeRO optimizer partitions and a
universal checkpoint (`zero/<param>/fp32.pt`), in the tag folder itself (ds_to_universal given
the tag folder as its output) or beside it (`latest_universal`). One copy is read, the one
`--zero-weights` names (the partitions by default, as DeepSpeed and zero_to_fp32.py do), and
the other is named in the output, the JSON and hash and diff; the two are never mixed.
Hand-built folders (tests/zero_builders.py); the same with DeepSpeed's own files is in
tests/test_training_universal_beside.py."""

from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Any

from tests.helpers import cli, torch_bytes
from tests.zero_builders import MODEL, ZeroSpec, universal_zero, weights, zero_folder

TAG = "global_step1"


def _universal_values() -> dict[str, Any]:
    """The universal copy's weights: other values than the partitions', so that the output
    says which copy it came from."""
    return {name: tensor * 10 + 1 for name, tensor in weights(ZeroSpec()).items()}


def _in_tag(tmp_path: Path) -> Path:
    """`latest` and global_step1/ with the partitions, and zero/ in global_step1/."""
    root = zero_folder(tmp_path / "ds", ZeroSpec())
    universal_zero(root / TAG, _universal_values())
    return root


def _beside(tmp_path: Path) -> Path:
    """`latest` -> global_step1/ (partitions), `latest_universal` -> global_step1_universal/."""
    root = zero_folder(tmp_path / "ds", ZeroSpec())
    other = root / f"{TAG}_universal"
    other.mkdir()
    shutil.copy(root / TAG / MODEL, other / MODEL)
    universal_zero(other, _universal_values())
    (root / "latest_universal").write_text(f"{TAG}_universal")
    return root


def _written(out: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(out / "model.safetensors")


def _assert_copy(out: Path, expected: dict[str, Any]) -> None:
    """Every tensor written is the one copy's, bitwise."""
    written = _written(out)
    assert set(written) == set(expected)
    for name, tensor in expected.items():
        assert torch_bytes(written[name]) == torch_bytes(tensor.float()), name


def _message(read: str, unread: str, kind: str) -> str:
    pronoun = "them" if kind == "master" else "it"
    return (
        f"folder holds the fp32 weights twice: {read}, and {unread} (--zero-weights {kind} "
        f"reads {pronoun} instead; the two are never mixed)"
    )


def _note(layout: dict[str, Any]) -> str:
    ((kind, where),) = layout["other_weights"].items()
    return (
        f"read: the {layout['weights']} weights of tag {layout['tag']}; not read: the {kind} "
        f"weights in {where} (what --zero-weights {kind} reads)"
    )


def _other_weights(run_json: dict[str, Any]) -> dict[str, Any]:
    [item] = [item for item in run_json["findings"] if item["code"] == "other-weights"]
    return dict(item)


def test_a_tag_folder_holding_both_reads_the_partitions_and_says_so(tmp_path: Path) -> None:
    """It was read as the partitions without a word: zero/ was listed as "not read by a
    loader of the model"."""
    root = _in_tag(tmp_path)
    tag = root / TAG
    run = cli("inspect", tag, "--json")
    assert run.code == 0, run.stderr
    layout = run.json()["layout"]
    assert (layout["tag"], layout["weights"]) == (TAG, "master")
    assert layout["other_weights"] == {"universal": str(tag / "zero")}
    item = _other_weights(run.json())
    assert item["severity"] == "info" and item["file"] == str(tag / "zero")
    assert item["message"] == _message(
        f"the ZeRO optimizer partitions in {tag}, which are read",
        f"a universal checkpoint in {tag / 'zero'}, which is not read or checked",
        "universal",
    )
    assert item["fix"] == (
        f"ckptfix convert {tag} -o OUT --zero-weights universal (reads {tag / 'zero'} instead)"
    )
    human = cli("inspect", tag)
    assert f"master weights · universal weights in {tag / 'zero'} not read" in human.stdout
    converted = cli("convert", tag, "-o", tmp_path / "out")
    assert converted.code == 0, converted.stderr
    _assert_copy(tmp_path / "out", weights(ZeroSpec()))
    assert _note(layout) in converted.stdout
    assert "left out (training state): zero" in converted.stdout


def test_the_universal_copy_is_read_alone_when_asked(tmp_path: Path) -> None:
    for build in (_in_tag, _beside):
        root = build(tmp_path / build.__name__)
        out = tmp_path / build.__name__ / "out"
        run = cli("convert", root, "-o", out, "--zero-weights", "universal", "--json")
        assert run.code == 0, run.stderr
        _assert_copy(out, _universal_values())
        layout = run.json()["layout"]
        universal = root / (TAG if build is _in_tag else f"{TAG}_universal")
        assert (layout["tag"], layout["weights"]) == (universal.name, "universal")
        assert layout["other_weights"] == {"master": str(root / TAG)}
        assert _other_weights(run.json())["message"] == _message(
            f"a universal checkpoint in {universal / 'zero'}, which is read "
            "(--zero-weights universal)",
            f"the ZeRO optimizer partitions in {root / TAG}, which are not read or checked",
            "master",
        )


def test_latest_and_latest_universal_read_latest_and_say_so(tmp_path: Path) -> None:
    """What DeepSpeed loads unless told to load the universal checkpoint, now stated."""
    root = _beside(tmp_path)
    run = cli("convert", root, "-o", tmp_path / "out", "--json")
    assert run.code == 0, run.stderr
    _assert_copy(tmp_path / "out", weights(ZeroSpec()))
    layout = run.json()["layout"]
    assert (layout["tag"], layout["weights"]) == (TAG, "master")
    other = root / f"{TAG}_universal"
    assert layout["other_weights"] == {"universal": str(other)}
    assert _other_weights(run.json())["message"] == _message(
        f"the ZeRO optimizer partitions in {root / TAG} (named by `latest`, what DeepSpeed "
        "loads by default), which are read",
        f"a universal checkpoint in {other}, which is not read or checked",
        "universal",
    )
    human = cli("convert", root, "-o", tmp_path / "again")
    assert _note(layout) in human.stdout
    assert f"left out (training state): {TAG}_universal, latest, latest_universal" in human.stdout


def test_a_partial_universal_copy_is_never_completed_from_the_partitions(
    tmp_path: Path,
) -> None:
    """ds_to_universal stopped half-way: zero/ lacks a parameter. The partitions are whole
    and read by default; the universal copy, asked for, is refused, not filled in."""
    root = _in_tag(tmp_path)
    shutil.rmtree(root / TAG / "zero" / "body.weight")
    default = cli("convert", root, "-o", tmp_path / "out")
    assert default.code == 0, default.stderr
    _assert_copy(tmp_path / "out", weights(ZeroSpec()))
    out = tmp_path / "never"
    refused = cli("convert", root, "-o", out, "--zero-weights", "universal")
    assert refused.code == 1
    missing = root / TAG / "zero" / "body.weight" / "fp32.pt"
    assert refused.error_lines == [
        f"error: {missing}: the fp32 weight of 'body.weight' is missing (rule "
        "missing-rank-file; copy zero/body.weight/ again, run ds_to_universal again on the "
        "ZeRO checkpoint, or read the partitions: --zero-weights master)"
    ]
    [item] = cli("inspect", root, "--zero-weights", "universal", "--json").json()["findings"][:1]
    assert (item["code"], item["file"]) == ("missing-rank-file", str(missing))
    assert item["fix"] == f"ckptfix convert {root} -o OUT --zero-weights master"
    assert not out.exists() and not list(tmp_path.glob(".ckptfix-*"))


def test_a_missing_partition_is_never_filled_in_from_the_universal_copy(tmp_path: Path) -> None:
    """The partitions read by default, one rank's missing: refused, with the fp32 copy beside
    them as the fix (it said `--zero-weights module`, the training-dtype copy)."""
    root = _in_tag(tmp_path)
    missing = root / TAG / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    missing.unlink()
    out = tmp_path / "never"
    refused = cli("convert", root, "-o", out)
    assert refused.code == 1
    assert refused.error_lines == [
        f"error: {missing}: rank 1's optimizer partition is missing (rule missing-rank-file; "
        "convert with --zero-weights universal to take the fp32 weights the universal "
        "checkpoint beside it holds, or copy it from the training run's output)"
    ]
    assert not out.exists() and not list(tmp_path.glob(".ckptfix-*"))
    [item] = cli("inspect", root, "--json").json()["findings"][:1]
    assert item["fix"] == f"ckptfix convert {root} -o OUT --zero-weights universal"
    assert cli("convert", root, "-o", out, "--zero-weights", "universal").code == 0
    _assert_copy(out, _universal_values())


def test_a_universal_checkpoint_in_the_root_does_not_hide_latest(tmp_path: Path) -> None:
    """ds_to_universal given the checkpoint root as its output: the root became a universal
    tag folder and `latest` (the partitions) was passed over without a word."""
    root = zero_folder(tmp_path / "ds", ZeroSpec())
    shutil.copy(root / TAG / MODEL, root / MODEL)
    universal_zero(root, _universal_values())
    run = cli("convert", root, "-o", tmp_path / "out", "--json")
    assert run.code == 0, run.stderr
    _assert_copy(tmp_path / "out", weights(ZeroSpec()))
    layout = run.json()["layout"]
    assert (layout["tag"], layout["other_weights"]) == (TAG, {"universal": str(root)})
    asked = cli("convert", root, "-o", tmp_path / "u", "--zero-weights", "universal", "--json")
    assert asked.code == 0, asked.stderr
    _assert_copy(tmp_path / "u", _universal_values())
    assert asked.json()["layout"]["other_weights"] == {"master": str(root / TAG)}


def test_what_is_left_out_counts_the_copy_not_read(tmp_path: Path) -> None:
    """The partitions' moments and the whole zero/ when the partitions are read; the
    partition files and zero/'s optimizer state when the universal copy is; both copies for
    `module`."""
    root = _in_tag(tmp_path)
    tag = root / TAG
    zero = sorted(path for path in (tag / "zero").rglob("*") if path.is_file())
    zero_bytes = sum(path.stat().st_size for path in zero)
    tensors = sum(path.name != "optimizer_state.pt" for path in zero)  # weights and moments
    optims = [path.stat().st_size for path in tag.glob("*_optim_states.pt")]
    alone = tmp_path / "alone"
    shutil.copytree(root, alone)
    shutil.rmtree(alone / TAG / "zero")
    plain = cli("inspect", alone, "--json").json()["layout"]["left_out"]

    def left_out(*options: str) -> dict[str, Any]:
        run = cli("inspect", root, "--json", *options)
        assert run.code == 0, run.stderr
        return dict(run.json()["layout"]["left_out"])

    master = left_out()
    assert master["parts"] == [*plain["parts"], "universal checkpoint"]
    assert master["tensor_bytes"] == plain["tensor_bytes"] + zero_bytes
    assert master["tensors"] == plain["tensors"] + tensors
    universal = left_out("--zero-weights", "universal")
    weights_bytes = sum(path.stat().st_size for path in zero if path.name == "fp32.pt")
    assert universal["parts"] == ["optimizer states"]
    assert universal["tensor_bytes"] == zero_bytes - weights_bytes + sum(optims)
    module = left_out("--zero-weights", "module")
    assert module["tensor_bytes"] == sum(optims) + zero_bytes


def test_hash_and_diff_say_which_copy_they_read(tmp_path: Path) -> None:
    root = _beside(tmp_path)
    layout = cli("inspect", root, "--json").json()["layout"]
    hashed = cli("hash", root)
    assert hashed.code == 0, hashed.stderr
    assert hashed.stdout.splitlines()[2] == _note(layout)
    assert cli("hash", root, "--json").json()["weights_note"] == _note(layout)
    manifest = tmp_path / "m.json"
    assert cli("hash", root, "--manifest", manifest).code == 0
    assert "weights_note" not in json.loads(manifest.read_text())  # it describes the model
    alone = zero_folder(tmp_path / "alone", ZeroSpec())
    compared = cli("diff", alone, root)
    assert compared.code == 0, compared.stdout
    assert compared.stdout.splitlines()[0] == f"B: {_note(layout)}"
    document = cli("diff", root, alone, "--json").json()
    assert document["identical"] and document["weights_notes"] == {"a": _note(layout)}


def test_universal_weights_asked_of_a_folder_without_them(tmp_path: Path) -> None:
    root = zero_folder(tmp_path / "ds", ZeroSpec())
    for path in (root, root / TAG):
        run = cli("convert", path, "-o", tmp_path / "out", "--zero-weights", "universal")
        assert run.code == 2
        assert run.error_lines == [
            f"error: --zero-weights: universal: {path} holds no DeepSpeed universal checkpoint "
            "(no zero/ folder, no `latest_universal` naming one) (rule usage; use --zero-weights master, "
            "or convert the folder ds_to_universal writes)"
        ]
    assert not (tmp_path / "out").exists()
