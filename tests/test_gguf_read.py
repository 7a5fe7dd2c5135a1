"""GGUF files written by gguf-py's GGUFWriter, read by ckptfix: every tensor's name, ggml
type, row-major shape, byte range and bytes as gguf-py's GGUFReader reads them, metadata of
several architectures (every value type), versions 2 and 3, custom alignments; the dtype
table against gguf-py's GGML_QUANT_SIZES; block-quantized sizes wherever sizes are used."""

from __future__ import annotations

import struct
import sys
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptfix.core.dtypes import DTYPES, byte_size
from ckptfix.core.errors import CorruptFileError
from ckptfix.formats import gguf_header
from ckptfix.formats.gguf_file import GGML_TYPES, GgufFile
from ckptfix.io.gather import tensor_bytes, tensor_chunks
from ckptfix.io.source import LocalFile
from tests.builders import Factory
from tests.gguf_files import (
    ARCHITECTURES,
    LLAMA_TENSORS,
    PLAIN_TENSORS,
    Tensor,
    gguf_py_fields,
    gguf_py_tensors,
    write_gguf,
)
from tests.helpers import cli, read_weights


def test_the_dtype_table_matches_ggml() -> None:
    """Every ggml type gguf-py knows has the same id, block and bytes in ckptfix."""
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    for ggml in GGMLQuantizationType:
        assert GGML_TYPES[ggml.value] == ggml.name
        block, size = GGML_QUANT_SIZES[ggml]
        dtype = DTYPES[ggml.name]
        if dtype.quantized:
            assert (dtype.block, dtype.block_bytes) == (block, size), ggml.name
        else:
            assert (block, dtype.bits // 8) == (1, size), ggml.name
    assert len(GGML_TYPES) == len(GGMLQuantizationType)


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_tensors_read_as_gguf_py_reads_them(tmp_path: Path, arch: str) -> None:
    path = write_gguf(tmp_path / f"{arch}.gguf", arch)
    read = read_weights(path)
    assert isinstance(read, GgufFile) and read.format == "gguf"
    expected = gguf_py_tensors(path)
    with LocalFile(str(path)) as source:
        got = {t.name: (t.dtype, t.shape, tensor_bytes(source, t)) for t in read.tensors}
    assert got == expected
    assert [t.name for t in read.tensors] == [t.name for t in LLAMA_TENSORS]
    from gguf import GGUFReader

    offsets = {t.name: (t.data_offset, t.n_bytes) for t in GGUFReader(path).tensors}
    assert {t.name: (t.byte_range[0], t.nbytes) for t in read.tensors} == offsets


@pytest.mark.parametrize("arch", sorted(ARCHITECTURES))
def test_metadata_keys_and_values_as_gguf_py_reads_them(tmp_path: Path, arch: str) -> None:
    path = write_gguf(tmp_path / f"{arch}.gguf", arch)
    read = read_weights(path)
    fields = gguf_py_fields(path)
    assert [key.key for key in read.keys] == list(fields)
    for key in read.keys:
        if key.type == "ARRAY":
            assert key.count == len(fields[key.key]), key.key
            assert key.value is None
        elif key.type == "STRING" or fields[key.key] == fields[key.key]:  # NaN aside
            assert key.value == fields[key.key], key.key
    assert read.architecture == arch


def test_quantized_sizes_count_blocks(tmp_path: Path) -> None:
    """Q4_K: 144 bytes per 256 elements, not elements x bits / 8."""
    path = write_gguf(tmp_path / "m.gguf")
    tensor = next(t for t in read_weights(path).tensors if t.name == "token_embd.weight")
    assert (tensor.dtype, tensor.shape, tensor.nbytes, tensor.numel) == (
        "Q4_K",
        (8, 256),
        1152,
        2048,
    )
    assert byte_size(DTYPES["Q4_K"], 2048) == 1152
    assert byte_size(DTYPES["Q4_K"], 100) is None  # not whole blocks


def test_chunks_never_split_a_block(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    tensor = next(t for t in read_weights(path).tensors if t.name == "token_embd.weight")
    assert (tensor.dtype, tensor.nbytes) == ("Q4_K", 1152)  # 8 blocks of 144 bytes
    with LocalFile(str(path)) as source:
        chunks = list(tensor_chunks(source, tensor, 1000))
    assert [len(chunk) for chunk in chunks] == [864, 288]  # 6 blocks, then 2
    assert b"".join(chunks) == gguf_py_tensors(path)[tensor.name][2]


def test_version_2_reads_as_version_3(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    data = bytearray(path.read_bytes())
    data[4:8] = struct.pack("<I", 2)
    old = tmp_path / "v2.gguf"
    old.write_bytes(bytes(data))
    assert read_weights(old).version == 2
    assert [t.byte_range for t in read_weights(old).tensors] == [
        t.byte_range for t in read_weights(path).tensors
    ]


@pytest.mark.parametrize("alignment", [8, 64, 4096])
def test_custom_alignment(tmp_path: Path, alignment: int) -> None:
    path = write_gguf(tmp_path / "m.gguf", alignment=alignment)
    read = read_weights(path)
    assert read.alignment == alignment
    assert all((t.byte_range[0] - read.data_start) % alignment == 0 for t in read.tensors)
    with LocalFile(str(path)) as source:
        got = {t.name: (t.dtype, t.shape, tensor_bytes(source, t)) for t in read.tensors}
    assert got == gguf_py_tensors(path)


def test_inspect_reports_ggml_dtypes_and_row_major_shapes(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf")
    run = cli("inspect", path, "--json", "--tensors")
    assert run.code == 0, run.stderr
    document = run.json()
    assert document["format"] == "gguf"
    shapes = {t["name"]: (t["dtype"], t["shape"]) for t in document["tensors"]}
    assert shapes["blk.0.attn_q.weight"] == ("Q8_0", [4, 256])
    assert shapes["blk.0.ffn_gate.weight"] == ("F16", [3, 64])
    assert document["parameter_count"] == sum(_numel(t.shape) for t in LLAMA_TENSORS)
    assert document["dtypes"]["Q4_K"] == 1152


def _numel(shape: tuple[int, ...]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def test_a_safetensors_header_may_not_name_a_ggml_block_type(factory: Factory) -> None:
    """The table learned Q4_K for GGUF; safetensors still refuses it."""
    path = factory.raw(
        "q.safetensors",
        {"w": {"dtype": "Q4_K", "shape": [256], "data_offsets": [0, 144]}},
        bytes(144),
    )
    run = cli("inspect", path)
    assert run.code == 1
    assert 'has unknown dtype "Q4_K"' in run.stdout + run.stderr
    assert "(rule unknown-dtype;" in run.error_lines[0]


def test_huge_numel_counts_quantized_elements(tmp_path: Path) -> None:
    """A Q4_0 tensor of 2^31 elements takes 1.2 GB: huge-numel names 2^31 elements, counted
    by blocks (a sparse file)."""
    from tests.gguf_files import Info, RawGguf

    rows = 2**31 // 32 * 18
    raw = RawGguf(infos=[Info("big", [2**16, 2**15], 2, 0)], data=b"")
    path = tmp_path / "big.gguf"
    raw.write(path)
    with open(path, "r+b") as handle:
        handle.truncate(path.stat().st_size + rows)
        handle.seek(path.stat().st_size - 1)
        handle.write(b"\1")
    run = cli("inspect", path, "--json")
    assert run.code == 0, run.stderr
    huge = [item for item in run.json()["findings"] if item["code"] == "huge-numel"]
    assert len(huge) == 1 and f"{2**31} elements ({rows} bytes)" in huge[0]["message"]
    assert run.json()["parameter_count"] == 2**31


def test_plain_tensors_hash_as_in_safetensors(tmp_path: Path) -> None:
    """A GGUF's unquantized tensors and the same names, dtypes, shapes and bytes in
    safetensors have one digest."""
    from ckptfix.formats.safetensors import HeaderEntry, encode_header

    path = write_gguf(tmp_path / "plain.gguf", "qwen2", PLAIN_TENSORS)
    tensors = gguf_py_tensors(path)
    entries, blobs, offset = [], [], 0
    for name, (dtype, shape, data) in tensors.items():
        entries.append(HeaderEntry(name, dtype, shape, offset, offset + len(data)))
        blobs.append(data)
        offset += len(data)
    twin = tmp_path / "twin.safetensors"
    twin.write_bytes(encode_header(entries, {"format": "pt"}) + b"".join(blobs))
    first, second = cli("hash", path, "--json"), cli("hash", twin, "--json")
    assert first.code == second.code == 0, first.stderr + second.stderr
    assert first.json()["digest"] == second.json()["digest"]
    assert cli("diff", path, twin).code == 0


def test_quantized_tensors_diff_by_bytes(tmp_path: Path) -> None:
    """diff --values on quantized tensors says which differ, without values to measure;
    unquantized ones get their statistics."""
    first = write_gguf(tmp_path / "a.gguf")
    second = write_gguf(tmp_path / "b.gguf", seed=1)
    run = cli("diff", first, second, "--values", "--json")
    assert run.code == 1, run.stderr
    changed = {item["name"]: item["values"] for item in run.json()["bytes_changed"]}
    assert set(changed) == {t.name for t in LLAMA_TENSORS}
    for tensor in LLAMA_TENSORS:
        measured = changed[tensor.name]
        if DTYPES[tensor.ggml].quantized:
            assert measured is None, tensor.name
        else:
            assert measured["numel"] == _numel(tensor.shape), tensor.name


def test_bf16_tensor_bytes(tmp_path: Path) -> None:
    path = write_gguf(tmp_path / "m.gguf", tensors=[Tensor("b", "BF16", (3, 8))])
    [tensor] = read_weights(path).tensors
    assert (tensor.dtype, tensor.shape, tensor.nbytes) == ("BF16", (3, 8), 48)


class _Bytes:
    """An in-memory ByteSource that counts its reads."""

    label = "strings.gguf"

    def __init__(self, data: bytes) -> None:
        self.data, self.reads = data, 0

    @property
    def size(self) -> int:
        return len(self.data)

    def read_at(self, offset: int, size: int) -> bytes:
        self.reads += 1
        return self.data[offset : offset + size]

    def change_token(self) -> tuple[object, ...]:
        return ()


@given(
    lengths=st.lists(st.integers(0, 300), min_size=1, max_size=400),
    window=st.sampled_from([16, 64, 257, 4096]),
    native=st.booleans(),
)
@pytest.mark.slow
def test_an_array_of_strings_is_walked_to_its_end_across_windows(
    lengths: list[int], window: int, native: bool
) -> None:
    """skip_strings walks whole lengths within the window and stops at the first length that
    is not whole in it: it must end exactly after the last string, whatever the window, read
    as u64 views (little-endian hosts) or by struct (the others)."""
    body = b"".join(struct.pack("<Q", n) + bytes([n % 251]) * n for n in lengths)
    source = _Bytes(body + b"tail")
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(gguf_header, "WINDOW", window)
        patch.setattr(gguf_header, "_LITTLE_ENDIAN", native and sys.byteorder == "little")
        cursor = gguf_header.Cursor(source)
        cursor.skip_strings(len(lengths))
    assert cursor.position == len(body)


@given(
    lengths=st.lists(st.integers(0, 40), min_size=0, max_size=60),
    cut=st.integers(0, 2000),
    start=st.integers(0, 7),
)
@pytest.mark.skipif(sys.byteorder != "little", reason="u64 views are native: little-endian")
def test_the_walk_stops_where_one_string_at_a_time_stops(
    lengths: list[int], cut: int, start: int
) -> None:
    """_walk's turns of eight reach the offset and count a walk of one string at a time
    reaches, in a buffer cut anywhere (the window's end) and from any alignment."""
    body = bytes(start) + b"".join(struct.pack("<Q", n) + b"x" * n for n in lengths)
    buffer = body[:cut]
    at, done = start, 0
    while done < len(lengths) and at + 8 <= len(buffer):
        at += 8 + struct.unpack_from("<Q", buffer, at)[0]
        done += 1
    views = gguf_header._u64_views(buffer)
    assert gguf_header._walk(views, start, len(lengths)) == (at, done)


def test_a_string_length_past_the_file_is_refused() -> None:
    body = struct.pack("<Q", 3) + b"abc" + struct.pack("<Q", 2**63)
    cursor = gguf_header.Cursor(_Bytes(body))
    with pytest.raises(CorruptFileError) as caught:
        cursor.skip_strings(2)
    assert caught.value.rule == "gguf-past-end"
