"""Megatron-Core folders without spawning ranks: parts of chunked tensors as pieces (layers,
experts, row ranges) against numpy; stacked names; the tiny checkpoint of
tests/data/megatron-tiny read under Megatron's names and mapped to a Llama with --to-hf, each
tensor bitwise equal to the Llama it was made from; every way a mapping can fail, as one
error line naming both sides with nothing written."""

from __future__ import annotations

import itertools
import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from ckptfix.core.tensor import Piece, tiling_problem
from ckptfix.formats.dcp import Chunk, TensorEntry
from ckptfix.io.gather import tensor_bytes, tensor_chunks
from ckptfix.layouts.chunks import Placed, chunk_pieces
from ckptfix.layouts.megatron import indexed_name, joined_halves, stacked_axes
from ckptfix.layouts.slices import Parts, gather_rows, tensor_of
from tests import megatron_builders as tiny
from tests.helpers import MemorySource, cli

STACKED = "decoder.layers.mlp.experts.experts.linear_fc1.weight"


def _chunked(array: np.ndarray, cuts: list[list[int]]) -> tuple[MemorySource, list[Placed]]:
    """The array cut on a grid (`cuts`: bounds per dimension), each block stored row-major
    one after another at an odd offset, and where each block lies."""
    data, placed = bytearray(b"\xee" * 3), []
    for box in itertools.product(*(list(itertools.pairwise(c)) for c in cuts)):
        block = array[tuple(slice(a, b) for a, b in box)]
        offsets, sizes = tuple(a for a, _ in box), tuple(b - a for a, b in box)
        placed.append(Placed("chunks", len(data), offsets, sizes))
        data += np.ascontiguousarray(block).tobytes()
    return MemorySource(bytes(data)), placed


GRIDS = [
    [[0, 1, 2, 3], [0, 6], [0, 5]],  # one chunk per layer (Megatron's)
    [[0, 1, 2, 3], [0, 2, 6], [0, 3, 5]],  # per layer, cut by TP on rows and columns
    [[0, 3], [0, 6], [0, 5]],  # one chunk for every layer
    [[0, 2, 3], [0, 4, 6], [0, 1, 5]],  # chunks that span two layers
]


@pytest.mark.parametrize("cuts", GRIDS, ids=range(len(GRIDS)))
def test_layers_and_row_ranges_are_pieces_of_the_chunks(cuts: list[list[int]]) -> None:
    array = np.arange(3 * 6 * 5, dtype=np.float32).reshape(3, 6, 5) * 1.5
    source, placed = _chunked(array, cuts)
    pieces = [p for chunk in placed for p in chunk_pieces(chunk, array.shape, 4)]
    whole = tensor_of("stacked", "F32", array.shape, pieces, "chunks")
    assert tensor_bytes(lambda label: source, whole) == array.tobytes()
    for window in (4, 52, 120, 600):  # runs placed together, and runs cut by the window
        chunks = list(tensor_chunks(lambda label: source, whole, window))
        assert b"".join(chunks) == array.tobytes() and max(map(len, chunks)) <= window
    parts = Parts(whole, 6 * 5 * 4)
    for layer in range(3):
        part = parts.part(layer, f"layer.{layer}", (6, 5))
        assert tiling_problem(part) is None
        assert tensor_bytes(lambda label: source, part) == array[layer].tobytes()
        rows = gather_rows(part, "rows", [(1, 3), (4, 6), (0, 1)], (5, 5))
        want = np.concatenate([array[layer, 1:3], array[layer, 4:6], array[layer, 0:1]])
        assert tiling_problem(rows) is None
        assert tensor_bytes(lambda label: source, rows) == want.tobytes()


def _entry(name: str, size: tuple[int, ...], axes: int, step: int = 1) -> TensorEntry:
    """A tensor saved as megatron-core saves stacked ones: a chunk per index of its first
    `axes` dimensions (`step` indices per chunk along the first)."""
    rest = size[axes:]
    starts = [range(0, size[0], step), *(range(n) for n in size[1:axes])]
    chunks = tuple(
        Chunk((*index, *(0,) * len(rest)), (step, *(1,) * (axes - 1), *rest))
        for index in itertools.product(*starts)
    )
    return TensorEntry(name, "F32", size, chunks)


def test_stacked_axes_come_from_the_name_and_the_chunks() -> None:
    assert stacked_axes(STACKED, _entry(STACKED, (4, 8, 6, 3), 2)) == 2
    assert (
        indexed_name(STACKED, (3, 5)) == "decoder.layers.3.mlp.experts.experts.5.linear_fc1.weight"
    )
    one_layer = "decoder.layers.3.mlp.experts.experts.linear_fc1.weight"  # non-homogeneous
    assert stacked_axes(one_layer, _entry(one_layer, (8, 6, 3), 1)) == 1
    assert (
        indexed_name(one_layer, (5,)) == "decoder.layers.3.mlp.experts.experts.5.linear_fc1.weight"
    )
    plain = "decoder.layers.3.self_attention.linear_qkv.weight"
    assert stacked_axes(plain, _entry(plain, (8, 6), 0)) == 0
    # named as stacked, but its chunks are not one layer each: kept as saved
    assert stacked_axes(STACKED, _entry(STACKED, (4, 8, 6, 3), 2, step=2)) == 0
    assert stacked_axes("decoder.layers.norm.weight", _entry("x", (4,), 1)) == 1


def _read(folder: Path) -> dict[str, np.ndarray]:
    from safetensors.numpy import load_file

    found: dict[str, np.ndarray] = {}
    for path in sorted(folder.glob("*.safetensors")):
        found.update(load_file(path))
    return found


def test_megatron_names_are_the_saved_tensors_split_by_layer(tmp_path: Path) -> None:
    run = cli("convert", tiny.SAVED, "-o", tmp_path / "out")
    assert run.code == 0, run.stderr
    saved = tiny.megatron_tensors(tiny.hf_tensors())
    want = {}
    for name, array in saved.items():
        if "layers." in name:
            want.update({indexed_name(name, (i,)): array[i] for i in range(tiny.LAYERS)})
        else:
            want[name] = array
    got = _read(tmp_path / "out")
    assert sorted(got) == sorted(want)
    assert all(got[name].tobytes() == want[name].tobytes() for name in want)


def test_to_hf_writes_the_llama_it_was_made_from(tmp_path: Path) -> None:
    config = tiny.config_file(tmp_path / "base")
    run = cli("convert", tiny.SAVED, "-o", tmp_path / "hf", "--to-hf", config, "--json")
    assert run.code == 0, run.stderr
    want, got = tiny.hf_tensors(), _read(tmp_path / "hf")
    assert sorted(got) == sorted(want)
    for name, array in want.items():
        assert got[name].dtype == array.dtype and got[name].shape == array.shape, name
        assert got[name].tobytes() == array.tobytes(), name
    assert (tmp_path / "hf" / "config.json").read_bytes() == config.read_bytes()
    assert "config.json" in run.json()["plan"]["copied_files"]
    same = cli("diff", tiny.SAVED, tmp_path / "hf", "--to-hf", config)
    assert same.code == 0, same.stdout + same.stderr


def test_to_hf_from_the_training_arguments(tmp_path: Path) -> None:
    run = cli("convert", tiny.SAVED, "-o", tmp_path / "hf", "--to-hf", "llama")
    assert run.code == 0, run.stderr
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    given = {k: v for k, v in tiny.CONFIG.items() if k != "architectures"}
    assert {k: config[k] for k in given} == given
    assert config["dtype"] == "float32" and config["architectures"] == ["LlamaForCausalLM"]
    assert config["rope_parameters"] == {"rope_type": "default", "rope_theta": 10000}
    want, got = tiny.hf_tensors(), _read(tmp_path / "hf")
    assert sorted(got) == sorted(want)
    assert all(got[name].tobytes() == want[name].tobytes() for name in want)


def test_diff_to_hf_names_what_differs(tmp_path: Path) -> None:
    from safetensors.numpy import save_file

    config = tiny.config_file(tmp_path / "base")
    tensors = tiny.hf_tensors()
    tensors["model.layers.1.self_attn.k_proj.weight"][0, 0] += 1  # one value of one head
    del tensors["model.layers.0.mlp.up_proj.weight"]
    (tmp_path / "other").mkdir()
    save_file(tensors, str(tmp_path / "other" / "model.safetensors"))
    run = cli("diff", tmp_path / "other", tiny.SAVED, "--to-hf", config, "--json")
    assert run.code == 1, run.stderr
    document = run.json()
    assert document["only_in_b"] == ["model.layers.0.mlp.up_proj.weight"]
    assert [c["name"] for c in document["bytes_changed"]] == [
        "model.layers.1.self_attn.k_proj.weight"
    ]


def _refused(tmp_path: Path, rule: str, *spec: str, **config: object) -> str:
    target = spec[0] if spec else str(tiny.config_file(tmp_path / "base", **config))
    out = tmp_path / "never"
    run = cli("convert", tiny.SAVED, "-o", out, "--to-hf", target)
    assert run.code == 1, run.stdout
    assert len(run.error_lines) == 1, run.stderr
    assert f"(rule {rule};" in run.error_lines[0], run.error_lines
    assert not out.exists() and not list(tmp_path.glob(".ckptfix-*"))
    return run.error_lines[0]


def test_a_target_with_no_source_names_both_sides(tmp_path: Path) -> None:
    line = _refused(tmp_path, "hf-unsourced", model_type="qwen3")
    assert "'model.layers.0.self_attn.q_norm.weight' of a qwen3 model has no source" in line
    assert "Megatron 'decoder.layers.0.self_attention.q_layernorm.weight'" in line
    assert "and 3 more problem(s)" in line  # q_norm and k_norm, in each of 2 layers


def test_a_tensor_with_no_destination_names_both_sides(tmp_path: Path) -> None:
    line = _refused(tmp_path, "megatron-unmapped", tie_word_embeddings=True)
    assert "Megatron tensor 'output_layer.weight' has no destination in the llama model" in line
    assert "(its config ties the embeddings)" in line
    layers = _refused(tmp_path, "megatron-unmapped", num_hidden_layers=1)
    assert "'decoder.layers.1.self_attention.linear_qkv.layer_norm_weight'" in layers
    _refused(tmp_path, "hf-unsourced", num_hidden_layers=3)


def test_sizes_that_disagree_with_the_config(tmp_path: Path) -> None:
    line = _refused(tmp_path, "megatron-shape", intermediate_size=16)
    assert "Megatron 'decoder.layers.0.mlp.linear_fc1.weight' has shape [24, 8]" in line
    assert "need [32, 8]" in line
    assert "at least 17 rows" in _refused(tmp_path, "megatron-shape", vocab_size=17)
    _refused(tmp_path, "megatron-shape", num_key_value_heads=4)  # q/k/v interleave differs
    _refused(tmp_path, "hf-config", num_attention_heads=3)


def test_to_hf_usage(tmp_path: Path) -> None:
    mixtral = tiny.config_file(tmp_path / "mixtral", model_type="gpt2")
    for target in ("bert", str(mixtral)):
        run = cli("convert", tiny.SAVED, "-o", tmp_path / "out", "--to-hf", target)
        assert run.code == 2 and "llama, mistral, mixtral, qwen2, qwen3, qwen3_moe" in run.stderr
    hf = tmp_path / "hf"
    assert cli("convert", tiny.SAVED, "-o", hf, "--to-hf", "llama").code == 0
    run = cli("convert", hf, "-o", tmp_path / "again", "--to-hf", "llama")
    assert run.code == 2 and "is not a Megatron-Core checkpoint" in run.stderr
    run = cli("diff", hf, hf, "--to-hf", "llama")
    assert run.code == 2 and "is not a Megatron-Core checkpoint" in run.stderr
    run = cli("inspect", tiny.SAVED / "common.pt")
    assert run.code == 1  # a plain torch file: Megatron's enum classes are not allowed there
    assert not (tmp_path / "out").exists()


def test_a_stack_without_a_chunk_per_layer_is_not_split() -> None:
    """An edited .metadata claiming 10^12 empty layers (no chunks) is kept as saved: the
    parts of a split are bounded by the chunks .metadata lists."""
    empty = TensorEntry(STACKED, "F32", (10**6, 10**6, 0, 3), ())
    assert stacked_axes(STACKED, empty) == 0
    two_of_three = TensorEntry(
        "decoder.layers.w", "F32", (3, 2), (Chunk((0, 0), (1, 2)), Chunk((1, 0), (1, 2)))
    )
    assert stacked_axes("decoder.layers.w", two_of_three) == 0


def test_a_config_larger_than_the_checkpoint_is_refused_at_once(tmp_path: Path) -> None:
    line = _refused(tmp_path, "hf-unsourced", num_hidden_layers=10**12)
    assert "has 1,000,000,000,000 layers, but the checkpoint holds 15 tensors" in line
    big = 2**40  # q/k/v rows checked against the checkpoint before any range is made
    _refused(
        tmp_path, "megatron-shape", num_attention_heads=big, num_key_value_heads=big, head_dim=1
    )


def test_swiglu_halves_saved_apart_are_joined() -> None:
    """megatron-core's singleton_local_shards saves linear_fc1 as `_w` (gate) and `_v` (up):
    read as the [gate; up] tensor every other save holds, from both halves' pieces."""
    gate = np.arange(12, dtype=np.float32).reshape(3, 4)
    up = gate + 100
    source = MemorySource(b"\0" * 5 + up.tobytes() + gate.tobytes())
    name = "decoder.layers.0.mlp.linear_fc1.weight"

    def half(suffix: str, offset: int) -> Any:
        return tensor_of(name + suffix, "F32", (3, 4), [Piece("chunks", offset, 48)], "chunks")

    tensors = [half("_v", 5), Parts(half("_w", 53), 16).part(0, "other", (4,)), half("_w", 53)]
    joined = joined_halves(tensors)
    assert [t.name for t in joined] == ["other", name]
    assert joined[1].shape == (6, 4)
    assert tensor_bytes(lambda label: source, joined[1]) == np.concatenate([gate, up]).tobytes()
    alone = joined_halves([half("_w", 53)])
    assert [t.name for t in alone] == [name + "_w"]  # no up half: kept as saved
