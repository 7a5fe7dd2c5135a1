"""`ckptfix.open` of the inputs the CLI gained with the framework layouts, GGUF and
Megatron-Core: each tensor `get` reads is the tensor `ckptfix convert` writes, bitwise (GGUF
also what gguf-py reads); a block-quantized GGUF tensor is a ValueError naming its dtype,
its `info` still given."""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

import pytest

import ckptfix
from tests import megatron_builders as tiny
from tests import training_fixtures as fixtures
from tests.gguf_files import LLAMA_TENSORS, PLAIN_TENSORS, gguf_py_tensors, write_gguf
from tests.helpers import cli, torch_bytes

if TYPE_CHECKING:
    import torch

accelerate_saved = fixtures.accelerate_saved  # written by the frameworks themselves
hf_writer_saved = fixtures.hf_writer_saved
universal_saved = fixtures.universal_saved
zero_saved = fixtures.zero_saved
megatron_saved = fixtures.megatron_saved


def _converted(src: Path, out: Path) -> tuple[dict[str, torch.Tensor], dict[str, str]]:
    """What `ckptfix convert` writes of `src`: its tensors, and the names it dropped."""
    from safetensors.torch import load_file

    run = cli("convert", src, "-o", out, "--json")
    assert run.code == 0, run.stderr
    written: dict[str, torch.Tensor] = {}
    for shard in sorted(out.glob("*.safetensors")):
        written.update(load_file(shard))
    return written, run.json()["plan"]["dropped"]


def assert_reads_as_converted(src: Path, out: Path) -> int:
    """open(src) has every name convert writes or records, each read as convert wrote it
    (dtype, shape and bytes); the number of tensors compared."""
    written, dropped = _converted(src, out)
    with ckptfix.open(src) as reader:
        names = reader.keys()
        assert sorted(names) == sorted([*written, *dropped])
        for name in names:
            want = written[dropped.get(name, name)]
            got = reader.get(name, framework="pt")
            assert (got.dtype, got.shape) == (want.dtype, want.shape), name
            assert torch_bytes(got) == torch_bytes(want), name
    return len(written)


def test_a_gguf_file_reads_as_convert_writes_it_and_as_gguf_py_reads_it(tmp_path: Path) -> None:
    source = write_gguf(tmp_path / "m.gguf", "gemma3", PLAIN_TENSORS)
    assert assert_reads_as_converted(source, tmp_path / "out") == len(PLAIN_TENSORS)
    with ckptfix.open(source) as reader:
        for name, (_, shape, data) in gguf_py_tensors(source).items():
            assert reader.info(name).shape == shape
            if reader.info(name).dtype != "BF16":  # numpy has no bf16
                assert reader.get(name).tobytes() == data, name


def test_a_quantized_gguf_tensor_is_a_value_error_naming_its_dtype(tmp_path: Path) -> None:
    source = write_gguf(tmp_path / "llama-Q4_K.gguf")
    stored = gguf_py_tensors(source)
    with ckptfix.open(source) as reader:
        assert reader.keys() == [t.name for t in LLAMA_TENSORS]
        spec = reader.info("token_embd.weight")  # 8 x 256 in Q4_K: 8 blocks of 144 bytes
        assert (spec.dtype, spec.shape, spec.nbytes) == ("Q4_K", (8, 256), 8 * 144)
        for framework in ("numpy", "pt"):
            with pytest.raises(ValueError) as refused:
                reader.get("token_embd.weight", framework=framework)  # type: ignore[call-overload]
            assert isinstance(refused.value, ckptfix.CkptfixError)
            assert refused.value.rule == "quantized-tensor"
            assert "'token_embd.weight' is block-quantized (Q4_K)" in str(refused.value)
            assert "--dequantize" in str(refused.value)
        # the file's unquantized tensors read as ever
        assert reader.get("output_norm.weight").tobytes() == stored["output_norm.weight"][2]
        assert reader.get("blk.0.ffn_gate.weight").tobytes() == stored["blk.0.ffn_gate.weight"][2]


def test_a_gguf_split_set_reads_as_its_parts_hold_it(tmp_path: Path) -> None:
    source = write_gguf(tmp_path / "in" / "m.gguf", "gemma3", PLAIN_TENSORS)
    run = cli("reshard", source, "-o", tmp_path / "split", "--max-shard", "2000")
    assert run.code == 0, run.stderr
    parts = sorted((tmp_path / "split").glob("*.gguf"))
    assert len(parts) > 1
    assert assert_reads_as_converted(parts[0], tmp_path / "out") == len(PLAIN_TENSORS)


def test_a_megatron_folder_reads_as_convert_writes_it(tmp_path: Path) -> None:
    """Under Megatron's names, stacked layers split as convert splits them."""
    count = assert_reads_as_converted(tiny.SAVED, tmp_path / "out")
    assert count > len(tiny.megatron_tensors(tiny.hf_tensors()))  # layers split out


def test_a_per_rank_hf_writer_set_reads_as_convert_writes_it(tmp_path: Path) -> None:
    from tests.hf_shard_builders import rank_folder

    folder = rank_folder(tmp_path / "ranks")
    assert assert_reads_as_converted(folder, tmp_path / "out") == 2
    with ckptfix.open(folder) as reader:  # embed.weight: rows 0-2 on rank 1, 3-4 on rank 2
        assert reader.get("embed.weight").ravel().tolist() == [float(i) for i in range(15)]


def test_zero_weights_picks_the_copy_a_deepspeed_folder_holding_two_reads(tmp_path: Path) -> None:
    """ZeRO partitions and a universal checkpoint in one tag folder: the partitions by
    default, the universal copy with zero_weights="universal" (as --zero-weights), never a mix."""
    from tests.zero_builders import ZeroSpec, universal_zero, weights, zero_folder

    root = zero_folder(tmp_path / "ds", ZeroSpec())
    master = weights(ZeroSpec())
    universal = {name: tensor * 10 + 1 for name, tensor in master.items()}
    universal_zero(root / "global_step1", universal)
    for kind, expected in (("master", master), ("universal", universal)):
        with ckptfix.open(root, zero_weights=kind) as reader:
            assert sorted(reader.keys()) == sorted(expected)
            for name, tensor in expected.items():
                got = reader.get(name, framework="pt")
                assert torch_bytes(got) == torch_bytes(tensor.float()), (kind, name)
    with pytest.raises(ValueError, match="unknown choice 'universl'"):
        ckptfix.open(root, zero_weights="universl")  # type: ignore[arg-type]


@pytest.mark.slow
def test_framework_folders_read_as_convert_writes_them(
    accelerate_saved: Path, hf_writer_saved: Path, tmp_path: Path
) -> None:
    """accelerate's save_state under FSDP2, and torch's HuggingFaceStorageWriter per rank."""
    for number, folder in enumerate([accelerate_saved / "state", hf_writer_saved / "per_rank"]):
        assert assert_reads_as_converted(folder, tmp_path / f"out{number}") > 0


@pytest.mark.slow
@pytest.mark.parametrize("name", ["zero2_bf16", "zero3_fp32"])
def test_a_deepspeed_universal_checkpoint_reads_as_convert_writes_it(
    universal_saved: Path, tmp_path: Path, name: str
) -> None:
    """The tied head (stored by each rank, written once by convert) reads as the embedding."""
    folder = universal_saved / name / "global_step2_universal"
    assert assert_reads_as_converted(folder, tmp_path / "out") > 0
    with ckptfix.open(folder) as reader:
        assert reader.get("head.weight").tobytes() == reader.get("embed.weight").tobytes()


@pytest.mark.slow
@pytest.mark.parametrize("case", ["llama", "mixtral"])
def test_megatron_core_saves_read_as_convert_writes_them(
    megatron_saved: Path, tmp_path: Path, case: str
) -> None:
    """Saved by megatron-core on 2 ranks (tensor-parallel column shards: runs too short to
    read one by one, gathered in windows; experts split out of stacks)."""
    from ckptfix.io.gather import fragmented
    from ckptfix.ops.tensorset import opened

    ckpt = megatron_saved / case / "ckpt"
    with opened(ckpt) as tensors:
        assert any(fragmented(tensor) for tensor in tensors.tensors.values())
    assert assert_reads_as_converted(ckpt, tmp_path / "out") > 0
