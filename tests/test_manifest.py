"""Manifests: `hash --manifest` writes the --json document atomically; `inspect --manifest`
verifies a checkpoint against it, reading only what it must, and refuses an edited one."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

import ckptfix
from ckptfix.ops import manifest as manifest_module
from tests.builders import Factory, Spec
from tests.helpers import cli, tree_snapshot


@pytest.fixture
def model(tmp_path: Path) -> tuple[Path, Path]:
    """A tied .bin and its converted, sharded safetensors folder, with a manifest of the .bin."""
    import torch

    torch.manual_seed(0)
    embed = torch.randn(8, 4)
    state = {"embed": embed, "head": embed, "norm": torch.randn(4), "t": torch.randn(4, 2).t()}
    torch.save(state, tmp_path / "model.bin")
    assert (
        cli("convert", tmp_path / "model.bin", "-o", tmp_path / "out", "--max-shard", "100").code
        == 0
    )
    run = cli("hash", tmp_path / "model.bin", "--manifest", tmp_path / "m.json")
    assert run.code == 0, run.stderr
    return tmp_path / "model.bin", tmp_path / "m.json"


def test_round_trip(model: tuple[Path, Path], tmp_path: Path) -> None:
    source, manifest = model
    assert json.loads(manifest.read_text()) == cli("hash", source, "--json").json()
    for path in (source, tmp_path / "out"):
        run = cli("inspect", path, "--manifest", manifest, "--json")
        assert run.code == 0, run.stderr
        document = run.json()
        assert document["manifest"] == {
            "path": str(manifest),
            "algorithm": "sha256",
            "digest": json.loads(manifest.read_text())["digest"],
            "tensor_count": 4,
            "verified": 4,
            "ok": True,
        }
        assert not [f for f in document["findings"] if f["code"].startswith("manifest")]
    human = cli("inspect", tmp_path / "out", "--manifest", manifest)
    digest = json.loads(manifest.read_text())["digest"]
    assert f"Manifest    {manifest}: 4 of 4 tensors match (sha256 {digest[:12]}…)" in human.stdout
    assert (
        cli("hash", source, "--manifest", tmp_path / "n.json")
        .stdout.splitlines()[1]
        .endswith(f"manifest written to {tmp_path / 'n.json'}")
    )


def test_tampered_checkpoint(model: tuple[Path, Path], tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    _, manifest = model
    save_file(
        {
            "embed": torch.zeros(8, 4),  # bytes changed
            "norm": torch.zeros(5),  # shape changed
            "extra": torch.zeros(1),
        },
        str(tmp_path / "bad.safetensors"),
        {"format": "pt"},
    )
    bad = tmp_path / "bad.safetensors"
    run = cli("inspect", bad, "--manifest", manifest, "--json")
    assert run.code == 1
    found = {f["code"]: f for f in run.json()["findings"]}
    assert found["manifest-mismatch"]["tensors"] == ["embed", "norm"]
    assert found["manifest-missing-tensor"]["tensors"] == ["head", "t"]
    assert found["manifest-extra-tensor"]["tensors"] == ["extra"]
    assert run.json()["manifest"]["verified"] == 0
    assert run.error_lines[0] == (
        f"error: {bad}: 2 tensor(s) differ from the manifest {manifest} (1 in bytes, 1 in dtype "
        "or shape): 'embed', 'norm'; the files changed since it was made, or are not that model "
        "(rule manifest-mismatch; re-download them, or regenerate the manifest if the change is "
        "intended)"
    )
    assert len(run.error_lines) == 3


def test_only_the_tensors_to_check_are_read(
    model: tuple[Path, Path], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import torch
    from safetensors.torch import save_file

    _, manifest = model
    read: list[str] = []
    original = manifest_module.content_digests

    def spy(tensors: Any, *args: Any, **kwargs: Any) -> Any:
        read.extend(tensor.name for tensor in tensors)
        return original(tensors, *args, **kwargs)

    monkeypatch.setattr(manifest_module, "content_digests", spy)
    save_file(
        {"embed": torch.zeros(8, 4), "norm": torch.zeros(5), "x": torch.zeros(1)},
        str(tmp_path / "b.safetensors"),
    )
    ckptfix.inspect(tmp_path / "b.safetensors", manifest=manifest)
    assert read == ["embed"]


def test_an_edited_manifest_is_refused(model: tuple[Path, Path], tmp_path: Path) -> None:
    source, manifest = model
    document = json.loads(manifest.read_text())
    entry = document["tensors"]["norm"]
    edits: dict[str, Callable[[dict[str, Any]], None]] = {
        "entry": lambda d: d["tensors"]["norm"].update(digest=d["tensors"]["embed"]["digest"]),
        "top": lambda d: d.update(digest="0" * 64),
        "content": lambda d: d["tensors"]["norm"].update(content=d["tensors"]["t"]["content"]),
    }
    for label, edit in edits.items():
        edited = json.loads(json.dumps(document))
        edit(edited)
        path = tmp_path / f"{label}.json"
        path.write_text(json.dumps(edited))
        run = cli("inspect", source, "--manifest", path)
        assert run.code == 1, label
        assert len(run.error_lines) == 1
        assert "(rule manifest-inconsistent;" in run.error_lines[0], run.error_lines
    # A manifest without content digests and without the model digest (as another tool might
    # write it) is checked tensor by tensor instead.
    del document["digest"]
    for value in document["tensors"].values():
        del value["content"]
    entry_digest = entry["digest"]
    document["tensors"]["norm"]["digest"] = document["tensors"]["embed"]["digest"]
    path = tmp_path / "plain.json"
    path.write_text(json.dumps(document))
    run = cli("inspect", source, "--manifest", path, "--json")
    assert [f["tensors"] for f in run.json()["findings"] if f["code"] == "manifest-mismatch"] == [
        ["norm"]
    ]
    assert entry_digest != document["tensors"]["norm"]["digest"]


@pytest.mark.parametrize(
    ("text", "rule"),
    [
        ("{", "manifest-not-json"),
        ("[]", "bad-manifest"),
        ('{"schema_version": 2, "algorithm": "sha256", "tensors": {}}', "manifest-version"),
        ('{"schema_version": 1, "algorithm": "md5", "tensors": {}}', "manifest-algorithm"),
        (
            '{"schema_version": 1, "algorithm": "sha256", "tensors": {"w": {"dtype": "F99", "shape": [], "digest": ""}}}',
            "bad-manifest",
        ),
        (
            '{"schema_version": 1, "algorithm": "sha256", "tensors": {"w": {"dtype": "F32", "shape": [-1], "digest": ""}}}',
            "bad-manifest",
        ),
        (
            '{"schema_version": 1, "algorithm": "sha256", "tensors": {"w": {"dtype": "F32", "shape": [1], "digest": "AB"}}}',
            "bad-manifest",
        ),
    ],
)
def test_a_malformed_manifest_is_one_line(factory: Factory, text: str, rule: str) -> None:
    path = factory.safetensors("m.safetensors")
    manifest = factory.bytes("m.json", text.encode())
    run = cli("inspect", path, "--manifest", manifest)
    assert run.code == 1
    assert len(run.error_lines) == 1
    assert run.error_lines[0].startswith(f"error: {manifest}: ")
    assert (
        f"(rule {rule}; regenerate it with `ckptfix hash PATH --manifest M.json`)"
        in run.error_lines[0]
    )


def test_a_missing_or_huge_manifest(factory: Factory) -> None:
    path = factory.safetensors("m.safetensors")
    missing = cli("inspect", path, "--manifest", factory.root / "none.json")
    assert missing.code == 2
    assert missing.error_lines == [
        f"error: {factory.root / 'none.json'}: no such manifest file (rule usage; pass the file `ckptfix hash --manifest` wrote)"
    ]
    huge = factory.path("huge.json")
    with open(huge, "wb") as handle:
        handle.truncate(10**9 + 1)
    run = cli("inspect", path, "--manifest", huge)
    assert run.code == 1
    assert "(rule manifest-too-large;" in run.error_lines[0]


def test_errors_in_the_checkpoint_leave_it_unverified(factory: Factory, tmp_path: Path) -> None:
    good = factory.safetensors("m.safetensors")
    assert cli("hash", good, "--manifest", tmp_path / "m.json").code == 0
    broken = factory.raw(
        "broken.safetensors",
        b'{"weight": {"dtype": "F32", "shape": [2, 3], "data_offsets": [0, 24]}}',
    )
    run = cli("inspect", broken, "--manifest", tmp_path / "m.json", "--json")
    assert run.code == 1
    codes = [f["code"] for f in run.json()["findings"]]
    assert codes == ["corrupt-file", "manifest-unverified"]


def test_writing_replaces_only_out(factory: Factory, tmp_path: Path) -> None:
    path = factory.safetensors("m.safetensors")
    folder = tmp_path / "manifests"
    folder.mkdir()
    (folder / "m.json").write_text("old")
    (folder / "other.txt").write_text("keep")
    old_umask = os.umask(0o027)
    try:
        assert cli("hash", path, "--manifest", folder / "m.json").code == 0
    finally:
        os.umask(old_umask)
    assert sorted(os.listdir(folder)) == ["m.json", "other.txt"]
    assert json.loads((folder / "m.json").read_text())["tensor_count"] == 1
    assert (folder / "m.json").stat().st_mode & 0o777 == 0o640
    link = folder / "link.json"
    link.symlink_to("m.json")
    assert cli("hash", path, "--manifest", link).code == 0
    assert link.is_symlink()


@pytest.mark.parametrize("kind", ["folder", "no-parent"])
def test_an_unusable_out_is_a_usage_error(factory: Factory, tmp_path: Path, kind: str) -> None:
    path = factory.safetensors("m.safetensors")
    out = tmp_path / "a-folder" if kind == "folder" else tmp_path / "missing" / "m.json"
    if kind == "folder":
        out.mkdir()
    before = tree_snapshot(tmp_path)
    run = cli("hash", path, "--manifest", out)
    assert run.code == 2
    assert len(run.error_lines) == 1
    assert tree_snapshot(tmp_path) == before


def test_a_full_disk_leaves_nothing(factory: Factory, mount: Callable[[str], Path]) -> None:
    path = factory.safetensors(
        "m.safetensors", [Spec(f"tensor.{i}", "U8", (1,)) for i in range(200)]
    )
    small = mount("size=16k")
    (small / "m.json").write_text("old")
    run = cli("hash", path, "--manifest", small / "m.json")
    assert run.code == 1
    assert run.error_lines == [
        f"error: {small / 'm.json'}: cannot write the manifest: No space left on device (rule write-failed; check the folder)"
    ]
    assert os.listdir(small) == ["m.json"]
    assert (small / "m.json").read_text() == "old"
