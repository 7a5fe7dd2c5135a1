"""GGUF split and merge on real filesystems with reflinks (XFS and btrfs images loop-mounted
by tests/loop_mounts.py): each part's data start is moved (a `ckptfix.padding` key) so that
its tensors sit at their source offsets modulo the block, and every whole block is shared
with the source, verified by its extents; the parts read back with gguf-py; a split set
merged back is the original file, byte for byte, its blocks shared too."""

from __future__ import annotations

import os
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.gguf_files import Tensor, gguf_py_fields, gguf_py_tensors, write_gguf
from tests.helpers import cli, read_weights
from tests.loop_mounts import own_bytes, shared_bytes, used_bytes

pytestmark = pytest.mark.slow

# Sizes that are not whole blocks, quantized and not: about 30 MB.
TENSORS = [
    Tensor("token_embd.weight", "F16", (1000, 4096)),
    Tensor("blk.0.attn_norm.weight", "F32", (3,)),
    Tensor("blk.0.attn_q.weight", "Q4_K", (2048, 2560)),
    Tensor("blk.0.ffn_down.weight", "F32", (1024, 2049)),
    Tensor("blk.0.ffn_up.weight", "Q8_0", (4096, 1024)),
    Tensor("output.weight", "BF16", (2048, 1500)),
]
ALLOWANCE = 2**20  # what the filesystems take for new files themselves (inodes, b-trees)


@pytest.fixture
def place(filesystem: Path, request: pytest.FixtureRequest) -> Iterator[Path]:
    folder = filesystem / request.node.name.replace("[", "-").replace("]", "")
    folder.mkdir()
    yield folder
    shutil.rmtree(folder, ignore_errors=True)


def _check(written: dict[str, Any], tensors: int, block: int) -> None:
    """All but the partial blocks at either end of each tensor were cloned, each cloned
    block verified by its extents, every byte verified one way."""
    account, ways = written["zero_copy"], written["verified_by"]
    total = account["cloned"] + account["copied"]
    assert account["block"] == block
    assert account["cloned"] >= total - 2 * tensors * block
    assert ways["extents"] <= account["cloned"] <= ways["extents"] + tensors * block
    assert ways["extents"] + ways["compared"] + ways["digest"] == total
    assert written["verified"] is True


def test_split_and_merge_share_every_whole_block(place: Path) -> None:
    source = write_gguf(place / "src" / "m.gguf", tensors=TENSORS)
    block = os.statvfs(place).f_bsize
    before = used_bytes(place)
    run = cli("reshard", source, "-o", place / "split", "--max-shard", "12MB", "--json")
    assert run.code == 0, run.stderr
    parts = sorted((place / "split").glob("*.gguf"))
    assert len(parts) > 1
    _check(run.json()["written"], len(TENSORS), block)
    assert run.json()["written"]["zero_copy"]["padding"] > 0  # the start was moved
    grown = used_bytes(place) - before
    assert grown <= sum(own_bytes(p) for p in parts) + ALLOWANCE
    assert grown < run.json()["written"]["bytes"] // 10  # a copy would take it all
    assert sum(shared_bytes(p) for p in parts) >= run.json()["written"]["zero_copy"]["cloned"]
    original = gguf_py_tensors(source)
    where = {t.name: t.byte_range[0] for t in read_weights(source).tensors}
    for part in parts:  # every tensor at its source offset modulo the block
        assert all(
            (t.byte_range[0] - where[t.name]) % block == 0 for t in read_weights(part).tensors
        )
    assert any("ckptfix.padding" in gguf_py_fields(part) for part in parts)
    for number, part in enumerate(parts):
        fields = gguf_py_fields(part)
        assert fields["split.no"] == number
        assert fields.get("ckptfix.padding", "").strip() == ""  # spaces only, if any
        for name, tensor in gguf_py_tensors(part).items():
            assert tensor == original[name], name

    merged = cli("reshard", parts[0], "-o", place / "merged", "--max-shard", "1GB", "--json")
    assert merged.code == 0, merged.stderr
    _check(merged.json()["written"], len(TENSORS), block)
    assert (place / "merged" / "m.gguf").read_bytes() == source.read_bytes()
    # The parts' tensors sit at the source's offsets modulo the block: one start fits all.
    account = merged.json()["written"]["zero_copy"]
    assert account["cloned"] >= account["cloned"] + account["copied"] - 2 * len(TENSORS) * block


def test_elsewhere_the_layout_is_gguf_splits(tmp_path: Path) -> None:
    """On a filesystem without reflinks nothing is padded: parts are exactly what
    llama.cpp's gguf-split lays out (no ckptfix key, the data right after the header)."""
    source = write_gguf(tmp_path / "src" / "m.gguf", tensors=TENSORS[:3])
    run = cli("reshard", source, "-o", tmp_path / "split", "--max-shard", "5MB", "--json")
    assert run.code == 0, run.stderr
    assert run.json()["written"]["zero_copy"]["padding"] == 0
    for part in sorted((tmp_path / "split").glob("*.gguf")):
        assert not any(key.startswith("ckptfix.") for key in gguf_py_fields(part))
