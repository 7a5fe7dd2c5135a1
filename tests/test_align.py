"""Zero-copy layout, the pure part: which bytes of a run can be cloned, where a shard's data
starts, and that a padded header stays inside the format (our reader, safetensors,
huggingface_hub). No filesystem with reflinks needed: tests/test_zero_copy.py has those."""

from __future__ import annotations

import random
from dataclasses import replace
from pathlib import Path

import pytest

from ckptfix.core.tensor import TensorInfo
from ckptfix.formats.safetensors import HeaderEntry, encode_header, read_header
from ckptfix.plan.align import (
    Alignment,
    Run,
    aligned_split,
    choose_data_start,
    residue,
    shareable,
)
from ckptfix.plan.select import OutTensor
from ckptfix.plan.shards import PlannedShard
from ckptfix.write.safetensors import pad_header
from ckptfix.write.zerocopy import NO_CLONING, Cloning, data_start, lines_up
from tests.builders import seeded_bytes

BLOCK = 4096


def _whole_blocks(begin: int, end: int, block: int) -> list[int]:
    """The block numbers lying entirely inside [begin, end): the oracle, one block at a time."""
    return [
        n
        for n in range(begin // block, end // block + 1)
        if begin <= n * block < (n + 1) * block <= end
    ]


@pytest.mark.parametrize("block", [512, 4096])
def test_aligned_split_matches_counting_blocks(block: int) -> None:
    rng = random.Random(12)
    for _ in range(2000):
        src, length = rng.randrange(0, 5 * block), rng.randrange(0, 5 * block)
        dst = src + rng.choice([0, block, 3 * block, -src // block * block])
        head, body = aligned_split(src, dst, length, block)
        blocks = _whole_blocks(src, src + length, block)
        assert body == len(blocks) * block
        if blocks:
            assert src + head == blocks[0] * block and (dst + head) % block == 0
        assert 0 <= head <= length and head + body <= length
        assert length - head - body < block or not body  # the tail is under one block


def test_offsets_not_congruent_share_nothing() -> None:
    assert aligned_split(0, 8, 10 * BLOCK, BLOCK) == (10 * BLOCK, 0)
    assert aligned_split(100, 100 + BLOCK + 1, 10 * BLOCK, BLOCK) == (10 * BLOCK, 0)
    assert aligned_split(0, 0, 10 * BLOCK, 0) == (10 * BLOCK, 0)  # no block: no cloning


def test_shareable_and_residue() -> None:
    run = Run("a", offset=BLOCK + 100, at=36, length=3 * BLOCK)
    assert shareable(run, BLOCK) == len(_whole_blocks(BLOCK + 100, 4 * BLOCK + 100, BLOCK)) * BLOCK
    start = residue(run, BLOCK)
    assert (start + run.at) % BLOCK == run.offset % BLOCK
    assert shareable(Run("a", 10, 0, BLOCK - 20), BLOCK) == 0


def test_data_start_aligns_the_run_with_the_most_blocks() -> None:
    small = Run("a", offset=8 * BLOCK + 8, at=0, length=2 * BLOCK)
    large = Run("b", offset=3 * BLOCK + 200, at=2 * BLOCK, length=20 * BLOCK)
    start = choose_data_start(136, [small, large], BLOCK, room=BLOCK)
    assert start >= 136 and start - 136 < BLOCK
    assert (start + large.at) % BLOCK == large.offset % BLOCK  # the large run lines up
    assert (start + small.at) % BLOCK != small.offset % BLOCK


def test_runs_needing_the_same_start_add_up() -> None:
    """Two runs from different files that need the same start beat one larger run."""
    one = Run("a", offset=40, at=0, length=6 * BLOCK)
    two = Run("b", offset=40 + 7 * BLOCK, at=7 * BLOCK, length=6 * BLOCK)
    other = Run("c", offset=16, at=14 * BLOCK, length=8 * BLOCK)
    start = choose_data_start(8, [one, two, other], BLOCK, room=BLOCK)
    assert start % BLOCK == 40


def test_data_start_stays_within_room_and_alignment() -> None:
    run = Run("a", offset=BLOCK - 8, at=0, length=10 * BLOCK)  # wants start ≡ 4088
    assert choose_data_start(16, [run], BLOCK, room=BLOCK) == BLOCK - 8
    assert choose_data_start(16, [run], BLOCK, room=100) == 16  # padding would not fit
    odd = Run("a", offset=BLOCK + 2, at=0, length=10 * BLOCK)  # wants start ≡ 2
    assert choose_data_start(16, [odd], BLOCK, room=BLOCK) == 16  # 8-aligned by default
    bf16 = Alignment([(0, 2, None)])
    assert choose_data_start(16, [odd], BLOCK, room=BLOCK, alignment=bf16) == BLOCK + 2
    f32 = Alignment([(0, 4, None)])
    assert choose_data_start(16, [odd], BLOCK, room=BLOCK, alignment=f32) == 16
    assert choose_data_start(16, [Run("a", 0, 0, 100)], BLOCK, room=BLOCK) == 16  # no block


def test_alignment_needs_the_largest_element_size_aligned_unpadded() -> None:
    assert Alignment().modulus(0) == 1
    assert Alignment([(0, 1, None), (3, 1, None)]).modulus(5) == 1
    assert Alignment([(0, 2, None), (6, 2, None)]).modulus(5) == 2
    assert Alignment([(0, 2, None), (6, 4, None)]).modulus(5) == 2  # F32 at 6: misaligned anyway
    assert Alignment([(0, 8, None), (8, 4, None)]).modulus(5) == 8
    assert Alignment([(0, 16, None)]).modulus(5) == 8  # no reader needs more than the format's 8


def test_alignment_lets_a_tensor_keep_its_source_alignment() -> None:
    """An F32 tensor that lands at its source offset modulo the block is exactly as aligned
    as in its source, whatever the data start: it does not hold the start to 4."""
    tensors = [(0, 2, 6), (4000, 4, 6), (8000, 4, None)]
    assert Alignment(tensors).modulus(6) == 4  # the third F32 is not from that run
    assert Alignment(tensors[:2]).modulus(6) == 1  # both land at their source offsets
    assert Alignment(tensors[:2]).modulus(10) == 4  # at another start neither is exempt


def _tensor(name: str, offset: int, nbytes: int, dtype: str = "U8") -> OutTensor:
    width = {"U8": 1, "BF16": 2, "F32": 4}[dtype]
    info = TensorInfo(name, dtype, (nbytes // width,), nbytes, "src", (offset, offset + nbytes))
    return OutTensor.same(info)


def test_padding_never_takes_a_shard_past_max_shard() -> None:
    tensors = {"a": _tensor("a", 8 + BLOCK - 8, 10 * BLOCK)}  # wants start ≡ BLOCK - 8 + 8
    shard = PlannedShard("model.safetensors", ("a",), 10 * BLOCK)
    cloning = Cloning(BLOCK, frozenset({"src"}))
    padded = data_start(shard, tensors, 80, cloning, max_shard=20 * BLOCK)
    assert padded % BLOCK == BLOCK % BLOCK and padded > 80
    assert data_start(shard, tensors, 80, cloning, max_shard=10 * BLOCK + 100) == 80
    oversized = data_start(shard, tensors, 80, cloning, max_shard=BLOCK)
    assert oversized == padded  # one tensor over the limit: the shard is past it anyway
    assert data_start(shard, tensors, 80, NO_CLONING, max_shard=20 * BLOCK) == 80
    other = Cloning(BLOCK, frozenset({"elsewhere"}))  # this source does not clone
    assert data_start(shard, tensors, 80, other, max_shard=20 * BLOCK) == 80


def test_padding_keeps_each_tensor_aligned_for_its_dtype() -> None:
    # A BF16 tensor after 2 bytes of U8: the pad may move the data start by 2, not by 1.
    tensors = {"u": _tensor("u", 1000, 2), "w": _tensor("w", 1002, 10 * BLOCK, "BF16")}
    shard = PlannedShard("model.safetensors", ("u", "w"), 10 * BLOCK + 2)
    cloning = Cloning(BLOCK, frozenset({"src"}))
    start = data_start(shard, tensors, 64, cloning, max_shard=20 * BLOCK)
    assert start % 2 == 0 and (start + 2) % BLOCK == 1002 % BLOCK
    # At an odd source offset, the BF16 tensor keeps that (mis)alignment when cloned ...
    tensors["w"] = _tensor("w", 1003, 10 * BLOCK, "BF16")
    start = data_start(shard, tensors, 64, cloning, max_shard=20 * BLOCK)
    assert (start + 2) % BLOCK == 1003 % BLOCK
    # ... but an F32 tensor from elsewhere, aligned without padding, is not moved off 4.
    other = _tensor("x", 0, 4, "F32")
    tensors["x"] = OutTensor.same(replace(other.source, file="other"))
    shard = PlannedShard("model.safetensors", ("x", "w"), 10 * BLOCK + 4)
    assert data_start(shard, tensors, 64, cloning, max_shard=20 * BLOCK) == 64


def _padded_file(path: Path, pad_to: int) -> tuple[Path, dict[str, bytes]]:
    specs = [("a", "F32", (3, 5), 60), ("b", "U8", (7,), 7), ("c", "BF16", (4,), 8)]
    entries, blobs, offset = [], {}, 0
    for name, dtype, shape, size in specs:
        blobs[name] = seeded_bytes(size, name)
        entries.append(HeaderEntry(name, dtype, shape, offset, offset + size))
        offset += size
    header = pad_header(encode_header(entries, {"format": "pt"}), pad_to)
    path.write_bytes(header + b"".join(blobs.values()))
    return path, blobs


@pytest.mark.parametrize("start", [BLOCK, BLOCK + 8, 3 * BLOCK - 2])
def test_a_padded_header_is_read_by_every_reader(tmp_path: Path, start: int) -> None:
    from huggingface_hub import load_state_dict_from_file
    from safetensors import safe_open

    from tests.helpers import cli, torch_bytes

    path, blobs = _padded_file(tmp_path / "model.safetensors", start)
    data = path.read_bytes()
    assert data[8:start].rstrip(b" ").endswith(b"}") and data[start - 1 : start] == b" "
    header = read_header(path)
    assert header.data_start == start
    assert {t.name: data[slice(*t.byte_range)] for t in header.tensors} == blobs
    with safe_open(str(path), "pt") as handle:
        assert {key: torch_bytes(handle.get_tensor(key)) for key in handle.keys()} == blobs  # noqa: SIM118
    loaded = load_state_dict_from_file(path)
    assert {key: torch_bytes(value) for key, value in loaded.items()} == blobs
    assert cli("inspect", path, "--fail-on", "warning").code == 0


def test_pad_header_leaves_an_aligned_header_alone() -> None:
    header = encode_header([HeaderEntry("a", "U8", (1,), 0, 1)], {"format": "pt"})
    assert pad_header(header, len(header)) == header
    assert pad_header(header, 0) == header


def test_lines_up_only_where_every_run_lands_at_its_source_offset() -> None:
    cloning = Cloning(BLOCK, frozenset({"src"}))
    tensor = _tensor("a", 3 * BLOCK + 100, 5 * BLOCK)
    assert lines_up(tensor, 100, cloning) and lines_up(tensor, 7 * BLOCK + 100, cloning)
    assert not lines_up(tensor, 108, cloning)
    assert not lines_up(tensor, 100, NO_CLONING)
    assert not lines_up(tensor, 100, Cloning(BLOCK, frozenset({"elsewhere"})))


@pytest.mark.slow  # imports transformers
@pytest.mark.parametrize("start", [BLOCK, 2 * BLOCK + 6])
def test_transformers_loads_a_padded_checkpoint(tmp_path: Path, start: int) -> None:
    """The same padding on any filesystem: a model's file with its data start moved (to a
    block, and to an offset that misaligns its F32 tensors) loads with identical logits."""
    import torch
    from transformers import AutoModelForCausalLM

    from tests.builders import tiny_llama

    model = tiny_llama()
    model.save_pretrained(tmp_path)
    path = tmp_path / "model.safetensors"
    header, data = read_header(path), path.read_bytes()
    entries = [
        HeaderEntry(
            t.name,
            t.dtype,
            t.shape,
            t.byte_range[0] - header.data_start,
            t.byte_range[1] - header.data_start,
        )
        for t in header.tensors
    ]
    padded = pad_header(encode_header(entries, header.metadata), start)
    assert len(padded) == start
    path.write_bytes(padded + data[header.data_start :])
    loaded = AutoModelForCausalLM.from_pretrained(tmp_path).eval()
    tokens = torch.arange(12).reshape(1, 12)
    with torch.no_grad():
        assert torch.equal(loaded(tokens).logits, model(tokens).logits)
