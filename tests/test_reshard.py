"""reshard: bitwise round trips, Hugging Face naming and index, atomic output, refusals."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from safetensors import safe_open

import ckptfix
from ckptfix.core.sizes import parse_size
from ckptfix.formats.safetensors import read_header
from ckptfix.ops.rewrite import ReshardOptions, reshard
from tests.builders import Factory, Spec, every_dtype_state, random_tensor, tiny_llama
from tests.helpers import (
    cli,
    load_safetensors_folder,
    read_tensors,
    tensor_names,
    torch_bytes,
    tree_snapshot,
)

if TYPE_CHECKING:
    import torch


def all_dtypes_state_dict() -> dict[str, torch.Tensor]:
    return every_dtype_state((17, 33), scalar_seed=50, empty=(0, 3))


def raw_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (dtype, shape, raw bytes) for a file or the safetensors shards of a folder."""
    return read_tensors(path, suffixes=(".safetensors",))


@pytest.fixture
def source(tmp_path: Path) -> Path:
    from safetensors.torch import save_file

    path = tmp_path / "src.safetensors"
    save_file(all_dtypes_state_dict(), str(path), metadata={"format": "pt", "producer": "test"})
    return path


@pytest.mark.parametrize("limit", ["1KB", "3KiB", "8KB", "1GB"])
def test_round_trip_every_dtype(source: Path, tmp_path: Path, limit: str) -> None:
    out = tmp_path / f"out-{limit}"
    run = cli("reshard", source, "-o", out, "--max-shard", limit, "--json")
    assert run.code == 0, run.stderr
    assert raw_tensors(out) == raw_tensors(source)
    assert tensor_names(out) == [t.name for t in read_header(source).tensors]
    document = run.json()
    shards = sorted(out.glob("*.safetensors"))
    if limit == "1GB":
        assert [p.name for p in shards] == ["model.safetensors"]
        assert not (out / "model.safetensors.index.json").exists()
    else:
        count = len(shards)
        assert count > 1
        assert [p.name for p in shards] == [
            f"model-{i:05d}-of-{count:05d}.safetensors" for i in range(1, count + 1)
        ]
        index = json.loads((out / "model.safetensors.index.json").read_text())
        assert index["metadata"]["total_size"] == sum(
            len(v[2]) for v in raw_tensors(source).values()
        )
        assert index["weight_map"] == {
            name: shard["file"] for shard in document["plan"]["shards"] for name in shard["tensors"]
        }
    limit_bytes = parse_size(limit)
    for shard in document["plan"]["shards"]:
        assert shard["bytes"] <= limit_bytes or len(shard["tensors"]) == 1
    for path in shards:
        header = read_header(path)
        assert header.metadata == {"format": "pt", "producer": "test"}
    assert document["written"]["verified"] is True
    assert [item.code for item in ckptfix.inspect(out).findings] == ["dtype-mix"]


def test_merge_shards_back(source: Path, tmp_path: Path) -> None:
    sharded, merged = tmp_path / "sharded", tmp_path / "merged"
    assert cli("reshard", source, "-o", sharded, "--max-shard", "2KB").code == 0
    assert cli("reshard", sharded, "-o", merged, "--max-shard", "5GB").code == 0
    assert [p.name for p in merged.iterdir()] == ["model.safetensors"]
    assert raw_tensors(merged) == raw_tensors(source)
    assert tensor_names(merged) == [t.name for t in read_header(source).tensors]


def test_loads_in_safetensors(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    assert cli("reshard", source, "-o", out, "--max-shard", "4KB").code == 0
    expected = all_dtypes_state_dict()
    loaded = load_safetensors_folder(out)
    assert loaded.keys() == expected.keys()
    for name, tensor in expected.items():
        got = loaded[name]
        assert got.dtype == tensor.dtype and got.shape == tensor.shape
        assert torch_bytes(got) == torch_bytes(tensor)


@pytest.mark.slow
def test_index_matches_huggingface_hub(tmp_path: Path) -> None:
    from huggingface_hub import save_torch_state_dict
    from safetensors.torch import save_file

    state = {f"layer.{i}.weight": random_tensor("bfloat16", (32, 16 + i), i) for i in range(12)}
    state["norm"] = random_tensor("float32", (16,), 99)
    source = tmp_path / "src.safetensors"
    save_file(state, str(source))
    # huggingface_hub keeps dict order; give it the file's order so both see the same order.
    ordered = {t.name: state[t.name] for t in read_header(source).tensors}
    theirs, ours = tmp_path / "hf", tmp_path / "ours"
    theirs.mkdir()
    save_torch_state_dict(ordered, theirs, max_shard_size=3000)
    assert cli("reshard", source, "-o", ours, "--max-shard", "3000").code == 0
    assert sorted(p.name for p in ours.iterdir()) == sorted(p.name for p in theirs.iterdir())
    index_name = "model.safetensors.index.json"
    assert json.loads((ours / index_name).read_text()) == json.loads(
        (theirs / index_name).read_text()
    )
    for shard in theirs.glob("*.safetensors"):
        with safe_open(str(shard), "pt") as handle:
            assert handle.metadata() == {"format": "pt"}
        assert raw_tensors(shard) == raw_tensors(ours / shard.name)


@pytest.mark.slow
def test_loads_with_huggingface_hub_and_transformers(tmp_path: Path) -> None:
    import torch
    from huggingface_hub import load_torch_model
    from transformers import LlamaForCausalLM

    model = tiny_llama(vocab_size=128)
    config = model.config
    saved, out = tmp_path / "saved", tmp_path / "resharded"
    model.save_pretrained(saved, max_shard_size="20KB")
    assert len(list(saved.glob("*.safetensors"))) > 1
    run = cli("reshard", saved, "-o", out, "--max-shard", "50KB")
    assert run.code == 0, run.stderr
    assert (out / "config.json").read_bytes() == (saved / "config.json").read_bytes()
    reloaded = LlamaForCausalLM.from_pretrained(out).eval()
    original = model.state_dict()
    for name, tensor in reloaded.state_dict().items():
        assert torch.equal(tensor.view(torch.uint8), original[name].view(torch.uint8)), name
    tokens = torch.tensor([[1, 5, 9, 3]])
    with torch.no_grad():
        assert torch.equal(reloaded(tokens).logits, model(tokens).logits)
    fresh = LlamaForCausalLM(config)
    missing, unexpected = load_torch_model(fresh, out, strict=True)
    assert (missing, unexpected) == ([], [])
    for name, tensor in fresh.state_dict().items():
        assert torch.equal(tensor.view(torch.uint8), original[name].view(torch.uint8)), name


@pytest.mark.slow
def test_huge_tensor_gets_its_own_shard_intact(factory: Factory, tmp_path: Path) -> None:
    numel = 2**31 + 8
    header_source = factory.sparse_safetensors("huge.safetensors", "U8", (numel,))
    folder = tmp_path / "src"
    folder.mkdir()
    # A real shard folder around the huge tensor: small tensors before and after it.
    factory.safetensors("src/model-00001-of-00002.safetensors")
    os.rename(header_source, folder / "model-00002-of-00002.safetensors")
    factory.index(
        "src/model.safetensors.index.json",
        {
            "weight": "model-00001-of-00002.safetensors",
            "huge": "model-00002-of-00002.safetensors",
        },
        total_size=24 + numel,
    )
    out = tmp_path / "out"
    run = cli("reshard", folder, "-o", out, "--max-shard", "1GB", "--json")
    assert run.code == 0, run.stderr
    plan = run.json()["plan"]
    assert [s["tensors"] for s in plan["shards"]] == [["weight"], ["huge"]]
    assert plan["oversized"] == ["huge"]
    shard = out / "model-00002-of-00002.safetensors"
    header = read_header(shard)
    assert [(t.name, t.shape, t.nbytes) for t in header.tensors] == [("huge", (numel,), numel)]
    assert shard.stat().st_size == header.data_start + numel
    assert shard.stat().st_blocks * 512 < 2**20  # the hole stayed a hole: no 2 GB written
    assert {f.code for f in ckptfix.inspect(out, max_shard=10**9).findings} == {
        "huge-numel",
        "oversized-tensor",
    }


def test_dry_run_writes_nothing(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    run = cli("reshard", source, "-o", out, "--max-shard", "2KB", "--dry-run", "--json")
    assert run.code == 0
    assert not out.exists()
    document = run.json()
    assert document["written"] is None
    assert document["plan"]["max_shard"] == 2000
    assert len(document["plan"]["shards"]) > 1
    assert not list(tmp_path.glob(".ckptfix-*"))
    human = cli("reshard", source, "-o", out, "--max-shard", "2KB", "--dry-run")
    assert "dry run: nothing was written" in human.stdout
    assert "Plan: shards of at most 2,000 bytes" in human.stdout


def test_folder_copies_non_weight_files_and_leaves_other_families(factory: Factory) -> None:
    folder = factory.sharded("m", [[Spec("a")], [Spec("b")]])
    factory.config("m")
    factory.bytes("m/tokenizer.json", b"{}")
    factory.bytes("m/sub/notes.txt", b"hello")
    factory.bytes("m/pytorch_model.bin", b"PK\x03\x04" + b"\0" * 60)
    factory.bytes("m/.git/HEAD", b"ref")
    out = factory.root / "out"
    run = cli("reshard", folder, "-o", out, "--max-shard", "1GB", "--json")
    assert run.code == 0, run.stderr
    assert sorted(p.name for p in out.iterdir()) == [
        "config.json",
        "model.safetensors",
        "sub",
        "tokenizer.json",
    ]
    assert (out / "sub" / "notes.txt").read_bytes() == b"hello"
    plan = run.json()["plan"]
    assert plan["copied_files"] == ["config.json", "sub", "tokenizer.json"]
    assert plan["left_out"] == [".git", "pytorch_model.bin"]


def test_refuses_non_empty_output_then_force_replaces(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    (out / "keep.txt").write_text("mine")
    run = cli("reshard", source, "-o", out)
    assert run.code == 2
    assert run.error_lines == [
        f"error: {out}: output folder exists and is not empty (rule usage; pass --force to replace it)"
    ]
    assert (out / "keep.txt").read_text() == "mine"
    assert cli("reshard", source, "-o", out, "--force").code == 0
    assert sorted(p.name for p in out.iterdir()) == ["model.safetensors"]
    assert not list(tmp_path.glob(".ckptfix-*"))


def test_empty_existing_output_is_fine(source: Path, tmp_path: Path) -> None:
    out = tmp_path / "out"
    out.mkdir()
    assert cli("reshard", source, "-o", out).code == 0
    assert (out / "model.safetensors").exists()


@pytest.mark.parametrize("where", ["same", "inside", "parent"])
def test_refuses_output_overlapping_source(factory: Factory, where: str) -> None:
    folder = factory.sharded("m", [[Spec("a")], [Spec("b")]])
    out = {"same": folder, "inside": folder / "sub", "parent": factory.root}[where]
    before = tree_snapshot(factory.root)
    run = cli("reshard", folder, "-o", out, "--force")
    assert run.code == 2
    assert len(run.error_lines) == 1 and "overlaps the input" in run.error_lines[0]
    assert tree_snapshot(factory.root) == before


def test_in_place(factory: Factory) -> None:
    folder = factory.sharded("m", [[Spec("a")], [Spec("b")], [Spec("c")]])
    factory.config("m")
    factory.bytes("m/pytorch_model.bin", b"PK\x03\x04" + b"\0" * 60)
    expected = raw_tensors(folder)
    config = (folder / "config.json").read_bytes()
    run = cli("reshard", folder, "--in-place", "--max-shard", "1GB")
    assert run.code == 0, run.stderr
    assert sorted(p.name for p in folder.iterdir()) == [
        "config.json",
        "model.safetensors",
        "pytorch_model.bin",
    ]
    assert raw_tensors(folder) == expected
    assert (folder / "config.json").read_bytes() == config
    assert not list(factory.root.glob(".ckptfix-*"))


def test_in_place_refuses_a_file(source: Path) -> None:
    run = cli("reshard", source, "--in-place")
    assert run.code == 2
    assert run.error_lines == [
        f"error: {source}: --in-place needs a model folder (rule usage; use -o OUT for a file)"
    ]


def test_output_is_required(source: Path) -> None:
    run = cli("reshard", source)
    assert run.code == 2
    assert run.error_lines == [
        "error: -o: an output folder is required (rule usage; pass -o OUT, or --in-place)"
    ]


def test_permissions_follow_umask(source: Path, tmp_path: Path) -> None:
    previous = os.umask(0o027)
    try:
        reshard(source, tmp_path / "out", ReshardOptions(max_shard=2000))
    finally:
        os.umask(previous)
    assert (tmp_path / "out").stat().st_mode & 0o777 == 0o750
    for path in (tmp_path / "out").iterdir():
        assert path.stat().st_mode & 0o777 == 0o640


@pytest.mark.slow
def test_progress_bar_only_on_a_terminal(source: Path, tmp_path: Path) -> None:
    import pty
    import select
    import subprocess
    import sys

    leader, follower = pty.openpty()
    env = {**os.environ, "TERM": "xterm", "COLUMNS": "120"}
    env.pop("NO_COLOR", None)
    process = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "ckptfix",
            "reshard",
            str(source),
            "-o",
            str(tmp_path / "tty"),
            "--max-shard",
            "2KB",
        ],
        stdout=subprocess.DEVNULL,
        stderr=follower,
        env=env,
    )
    os.close(follower)
    seen = b""
    poller = select.poll()  # not select(): a worker may hold descriptors past 1,023 by now
    poller.register(leader, select.POLLIN)
    while True:
        if not poller.poll(10_000):
            break
        try:
            chunk = os.read(leader, 65536)
        except OSError:  # the child closed the terminal
            break
        if not chunk:
            break
        seen += chunk
    assert process.wait() == 0
    os.close(leader)
    assert b"writing" in seen and b"kB" in seen  # the bar: description, bytes done / total
    piped = cli("reshard", source, "-o", tmp_path / "piped", "--max-shard", "2KB")
    assert piped.stderr == ""  # not a terminal: no bar


def test_errors_in_other_families_do_not_block(factory: Factory) -> None:
    folder = factory.sharded("m", [[Spec("a")], [Spec("b")]])
    factory.lfs_pointer("m/pytorch_model.bin")
    out = factory.root / "out"
    run = cli("reshard", folder, "-o", out, "--json")
    assert run.code == 0, run.stderr
    assert run.json()["plan"]["left_out"] == ["pytorch_model.bin"]
    broken = factory.root / "m" / "model-00002-of-00002.safetensors"
    broken.write_bytes(broken.read_bytes()[:-1])
    run = cli("reshard", folder, "-o", factory.root / "out2")
    assert run.code == 1
    assert run.error_lines == [
        f"error: {broken}: file is truncated: its header needs {broken.stat().st_size + 1} bytes "
        f"but the file has {broken.stat().st_size} (rule truncated; re-download the file)"
    ]
