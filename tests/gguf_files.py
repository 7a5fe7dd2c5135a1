"""GGUF files for the tests: real ones written by the `gguf` package's GGUFWriter (several
architectures' metadata, every metadata value type, quantized and unquantized tensors, split
sets), and broken ones put together byte by byte (`RawGguf`), independently of ckptfix's own
encoder.

numpy and gguf are imported inside the builders: collecting the suite stays light."""

from __future__ import annotations

import random
import struct
import zlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tests.optional import need

# --- real files, by gguf-py ---------------------------------------------------------------


@dataclass(frozen=True)
class Tensor:
    """A tensor to write: name, ggml type name, row-major shape."""

    name: str
    ggml: str
    shape: tuple[int, ...]


LLAMA_TENSORS = (
    Tensor("token_embd.weight", "Q4_K", (8, 256)),
    Tensor("blk.0.attn_norm.weight", "F32", (256,)),
    Tensor("blk.0.attn_q.weight", "Q8_0", (4, 256)),
    Tensor("blk.0.attn_k.weight", "Q4_0", (2, 256)),
    Tensor("blk.0.ffn_down.weight", "Q6_K", (3, 256)),
    Tensor("blk.0.ffn_up.weight", "IQ4_XS", (2, 256)),
    Tensor("blk.0.ffn_gate.weight", "F16", (3, 64)),
    Tensor("blk.0.ffn_norm.weight", "BF16", (64,)),
    Tensor("output_norm.weight", "F32", (256,)),
    Tensor("output.weight", "Q5_K", (2, 256)),
)
PLAIN_TENSORS = (  # unquantized only: what safetensors can hold too
    Tensor("token_embd.weight", "F16", (16, 32)),
    Tensor("blk.0.attn_norm.weight", "F32", (32,)),
    Tensor("blk.0.attn_q.weight", "BF16", (32, 32)),
    Tensor("blk.0.ids", "I32", (7,)),
    Tensor("blk.0.mask", "I8", (3, 5)),
    Tensor("output.weight", "F64", (4, 32)),
)


def _llama(writer: Any) -> None:
    writer.add_block_count(1)
    writer.add_context_length(4096)
    writer.add_embedding_length(256)
    writer.add_feed_forward_length(688)
    writer.add_head_count(8)
    writer.add_head_count_kv(2)
    writer.add_rope_freq_base(500000.0)
    writer.add_layer_norm_rms_eps(1e-5)
    writer.add_file_type(15)
    writer.add_tokenizer_model("llama")
    writer.add_token_list(["<s>", "</s>", "▁hello", "wörld", "日本"])
    writer.add_token_scores([0.0, -1.5, -2.25, float("-inf"), 3.0])
    writer.add_token_types([3, 3, 1, 1, 1])
    writer.add_bos_token_id(0)
    writer.add_add_bos_token(True)
    writer.add_chat_template("{% for m in messages %}{{ m.content }}{% endfor %}")


def _qwen2(writer: Any) -> None:
    writer.add_block_count(1)
    writer.add_context_length(32768)
    writer.add_rope_freq_base(1000000.0)
    writer.add_tokenizer_model("gpt2")
    writer.add_tokenizer_pre("qwen2")
    writer.add_token_list(["a", "b", "ab", "Ġthe"])
    writer.add_token_merges(["a b", "Ġ t", "Ġt he"])
    writer.add_eos_token_id(3)


def _every_type(writer: Any) -> None:
    """Every metadata value type of the format, scalars and arrays."""
    need("gguf")
    from gguf import GGUFValueType as V

    writer.add_block_count(1)
    writer.add_sliding_window(1024)
    for key, value, kind in [
        ("test.u8", 255, V.UINT8),
        ("test.i8", -128, V.INT8),
        ("test.u16", 65535, V.UINT16),
        ("test.i16", -32768, V.INT16),
        ("test.u32", 2**32 - 1, V.UINT32),
        ("test.i32", -(2**31), V.INT32),
        ("test.f32", 0.5, V.FLOAT32),
        ("test.bool", False, V.BOOL),
        ("test.str", "ünïcode ✓", V.STRING),
        ("test.u64", 2**64 - 1, V.UINT64),
        ("test.i64", -(2**63), V.INT64),
        ("test.f64", float("nan"), V.FLOAT64),
    ]:
        writer.add_key_value(key, value, kind)
    writer.add_key_value("test.ints", [1, -2, 3], V.ARRAY, sub_type=V.INT64)
    writer.add_key_value("test.bools", [True, False], V.ARRAY, sub_type=V.BOOL)
    writer.add_key_value("test.floats", [1.0, 2.5], V.ARRAY, sub_type=V.FLOAT64)


ARCHITECTURES: dict[str, Callable[[Any], None]] = {
    "llama": _llama,
    "qwen2": _qwen2,
    "gemma3": _every_type,
}


def tensor_data(tensor: Tensor, seed: object = 0) -> Any:
    """The array GGUFWriter takes for a tensor: values for F32/F16/F64/I8/I32, bytes in the
    ggml byte shape for BF16 and block types (random, seeded: the same on every run)."""
    need("gguf")
    import numpy as np
    from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

    rng = np.random.default_rng(zlib.crc32(f"{tensor.name}|{seed}".encode()))
    plain = {"F32": np.float32, "F16": np.float16, "F64": np.float64, "I8": np.int8}
    if tensor.ggml in plain:
        return rng.standard_normal(tensor.shape).astype(plain[tensor.ggml]) * 3
    if tensor.ggml == "I32":
        return rng.integers(-(2**31), 2**31 - 1, tensor.shape, dtype=np.int32)
    block, size = GGML_QUANT_SIZES[GGMLQuantizationType[tensor.ggml]]
    row = tensor.shape[-1] // block * size
    raw = rng.integers(0, 256, (*tensor.shape[:-1], row), dtype=np.uint8)
    if tensor.ggml in ("Q8_0", "Q4_0"):  # real quantized values
        from gguf.quants import quantize

        values = rng.standard_normal(tensor.shape).astype(np.float32)
        raw = quantize(values, GGMLQuantizationType[tensor.ggml])
    return raw


def write_gguf(
    path: Path,
    arch: str = "llama",
    tensors: Sequence[Tensor] = LLAMA_TENSORS,
    *,
    alignment: int | None = None,
    split_max_tensors: int = 0,
    seed: object = 0,
) -> Path:
    """A GGUF file (or, with `split_max_tensors`, a split set) as gguf-py writes it."""
    need("gguf")
    from gguf import GGMLQuantizationType, GGUFWriter

    path.parent.mkdir(parents=True, exist_ok=True)
    writer = GGUFWriter(path, arch, split_max_tensors=split_max_tensors)
    ARCHITECTURES[arch](writer)
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    for tensor in tensors:
        data = tensor_data(tensor, seed)
        raw = GGMLQuantizationType[tensor.ggml] if data.dtype.name == "uint8" else None
        writer.add_tensor(tensor.name, data, raw_dtype=raw)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


def gguf_py_tensors(path: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> (ggml type, row-major shape, bytes) as gguf-py's GGUFReader reads a file."""
    need("gguf")
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {
        t.name: (t.tensor_type.name, tuple(int(d) for d in reversed(t.shape)), t.data.tobytes())
        for t in reader.tensors
    }


def gguf_py_fields(path: Path) -> dict[str, Any]:
    """key -> value of every metadata field as gguf-py reads it (GGUF.* fields left out)."""
    need("gguf")
    from gguf import GGUFReader

    reader = GGUFReader(path)
    return {
        name: field.contents()
        for name, field in reader.fields.items()
        if not name.startswith("GGUF.")
    }


# --- broken files, byte by byte ----------------------------------------------------------


def gstr(text: str | bytes) -> bytes:
    raw = text.encode() if isinstance(text, str) else text
    return struct.pack("<Q", len(raw)) + raw


def kv(key: str | bytes, type_id: int, payload: bytes) -> bytes:
    """A key/value record: key, value type, value bytes as given."""
    return gstr(key) + struct.pack("<I", type_id) + payload


def u32_kv(key: str, value: int) -> bytes:
    return kv(key, 4, struct.pack("<I", value))


@dataclass
class Info:
    name: str | bytes
    dims: Sequence[int]  # ggml order: ne[0] (the row) first
    type_id: int = 0
    offset: int = 0

    def encode(self) -> bytes:
        return (
            gstr(self.name)
            + struct.pack(f"<I{len(self.dims)}Q", len(self.dims), *self.dims)
            + struct.pack("<IQ", self.type_id, self.offset)
        )


@dataclass
class RawGguf:
    """A GGUF file put together field by field; counts are the real ones unless given."""

    keys: list[bytes] = field(
        default_factory=lambda: [kv("general.architecture", 8, gstr("llama"))]
    )
    infos: list[Info] = field(default_factory=lambda: [Info("w", [4], 0, 0)])
    data: bytes | None = None  # default: seeded bytes for the tensors, each padded
    version: int = 3
    alignment: int = 32
    tensor_count: int | None = None
    key_count: int | None = None
    magic: bytes = b"GGUF"

    def header(self) -> bytes:
        tensors = len(self.infos) if self.tensor_count is None else self.tensor_count
        keys = len(self.keys) if self.key_count is None else self.key_count
        body = b"".join(self.keys) + b"".join(info.encode() for info in self.infos)
        return self.magic + struct.pack("<IQQ", self.version, tensors, keys) + body

    def build(self) -> bytes:
        header = self.header()
        header += b"\0" * (-len(header) % self.alignment)
        if self.data is not None:
            return header + self.data
        sizes = {0: 4, 1: 2, 24: 1, 26: 4}
        blob = b""
        for info in self.infos:
            count = 1
            for dim in info.dims:
                count *= dim
            size = count * sizes.get(info.type_id, 1)
            blob += random.Random(str(info.name)).randbytes(size)
            blob += b"\0" * (-len(blob) % self.alignment)
        return header + blob

    def write(self, path: Path) -> Path:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(self.build())
        return path
