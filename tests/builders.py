"""Builders for the checkpoints the tests read: safetensors files and sharded folders written
byte by byte (the `Factory`), PyTorch zip and legacy files from hand-written pickle opcodes
(hostile and malformed ones included, so nothing here ever runs a payload), and real
tensors and state dicts for torch.save.

torch is imported inside the builders that need it, never at import time: collecting the
suite must not import torch (tests/test_no_torch.py checks it).
"""

from __future__ import annotations

import io
import json
import os
import pickle
import random
import struct
import zipfile
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from hypothesis import strategies as st

from ckptfix.core.dtypes import DTYPES, byte_size, numel_of
from ckptfix.formats.safetensors import HeaderEntry, encode_header

if TYPE_CHECKING:
    import torch

# --- safetensors files and model folders, byte by byte ----------------------------------------


@dataclass(frozen=True)
class Spec:
    """A tensor to write: name, safetensors dtype, shape and optional exact bytes."""

    name: str
    dtype: str = "F32"
    shape: tuple[int, ...] = (2, 3)
    data: bytes | None = None

    def nbytes(self) -> int:
        size = byte_size(DTYPES[self.dtype], numel_of(self.shape))
        assert size is not None
        return size


def seeded_bytes(count: int, seed: object) -> bytes:
    """`count` random bytes that depend only on `seed`: fixtures are the same on every run."""
    return random.Random(str(seed)).randbytes(count)


class Factory:
    """Writes tiny checkpoints of every kind (valid and broken) under `root`."""

    def __init__(self, root: Path) -> None:
        self.root = root

    def path(self, name: str) -> Path:
        path = self.root / name
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def bytes(self, name: str, data: bytes) -> Path:
        path = self.path(name)
        path.write_bytes(data)
        return path

    def safetensors(
        self,
        name: str,
        specs: Sequence[Spec] = (Spec("weight"),),
        metadata: Mapping[str, str] | None = None,
        *,
        with_format: bool = True,
    ) -> Path:
        """A valid file laid out the way the reference writer lays it out."""
        meta = dict(metadata or {})
        if with_format:
            meta.setdefault("format", "pt")
        entries, blobs, offset = [], [], 0
        for spec in specs:
            data = spec.data if spec.data is not None else seeded_bytes(spec.nbytes(), spec.name)
            assert len(data) == spec.nbytes(), spec
            entries.append(
                HeaderEntry(spec.name, spec.dtype, spec.shape, offset, offset + len(data))
            )
            blobs.append(data)
            offset += len(data)
        path = self.path(name)
        path.write_bytes(encode_header(entries, meta) + b"".join(blobs))
        return path

    def raw(
        self,
        name: str,
        header: bytes | Mapping[str, Any],
        data: bytes = b"",
        *,
        declared_length: int | None = None,
    ) -> Path:
        """A file from exact header bytes (or a dict dumped as-is): for malformed inputs."""
        body = header if isinstance(header, bytes) else json.dumps(header).encode()
        length = len(body) if declared_length is None else declared_length
        path = self.path(name)
        path.write_bytes(struct.pack("<Q", length) + body + data)
        return path

    def sparse_safetensors(self, name: str, dtype: str, shape: tuple[int, ...]) -> Path:
        """One huge tensor whose data is a hole in a sparse file: no disk, exact size."""
        nbytes = byte_size(DTYPES[dtype], numel_of(shape))
        assert nbytes is not None
        header = encode_header([HeaderEntry("huge", dtype, shape, 0, nbytes)], {"format": "pt"})
        path = self.path(name)
        with open(path, "wb") as handle:
            handle.write(header)
            handle.truncate(len(header) + nbytes)
        return path

    def index(
        self,
        name: str,
        weight_map: Mapping[str, str],
        total_size: Any = None,
        extra: Mapping[str, Any] | None = None,
    ) -> Path:
        document: dict[str, Any] = {"metadata": {}, "weight_map": dict(weight_map)}
        if total_size is not None:
            document["metadata"]["total_size"] = total_size
        document.update(extra or {})
        path = self.path(name)
        path.write_text(json.dumps(document, indent=2, sort_keys=True))
        return path

    def sharded(
        self,
        folder: str,
        shards: Sequence[Sequence[Spec]],
        *,
        stem: str = "model",
        variant: str | None = None,
        write_index: bool = True,
    ) -> Path:
        """A Hugging Face sharded folder with a correct index."""
        count = len(shards)
        weight_map: dict[str, str] = {}
        total = 0
        middle = f".{variant}" if variant else ""
        for number, specs in enumerate(shards, start=1):
            shard = f"{stem}{middle}-{number:05d}-of-{count:05d}.safetensors"
            self.safetensors(f"{folder}/{shard}", specs)
            for spec in specs:
                weight_map[spec.name] = shard
                total += spec.nbytes()
        if write_index:
            suffix = f".{variant}" if variant else ""
            self.index(f"{folder}/{stem}.safetensors.index{suffix}.json", weight_map, total)
        return self.root / folder

    def config(self, folder: str, **values: Any) -> Path:
        path = self.path(f"{folder}/config.json")
        path.write_text(json.dumps({"model_type": "llama", **values}))
        return path

    def lfs_pointer(self, name: str, size: int = 4_976_698_672) -> Path:
        path = self.path(name)
        path.write_text(
            f"version https://git-lfs.github.com/spec/v1\noid sha256:{'ab' * 32}\nsize {size}\n"
        )
        return path


# --- PyTorch files from hand-written pickles ---------------------------------------------------

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def canary_command(canary: Path) -> str:
    return f"touch {canary}"


def hostile_pickles(canary: Path) -> dict[str, bytes]:
    """Hostile pickles in each opcode form that reaches find_class. Each would create the
    canary if it were ever run."""
    command = canary_command(canary).encode()
    code = f"open({str(canary)!r}, 'w')".encode()
    return {
        "global-os-system": b"cos\nsystem\n(S'" + command + b"'\ntR.",
        "global-posix-system": b"\x80\x02cposix\nsystem\nq\x00X"
        + struct.pack("<I", len(command))
        + command
        + b"\x85R.",
        "stack-global-exec": b"\x80\x04\x8c\x08builtins\x8c\x04exec\x93\x8c"
        + bytes([len(code)])
        + code
        + b"\x85R.",
        "inst-os-system": b"(S'" + command + b"'\nios\nsystem\n.",
        "obj-os-system": b"(cos\nsystem\nS'" + command + b"'\no.",
        "global-eval": b"cbuiltins\neval\n(S'" + code + b"'\ntR.",
    }


HOSTILE_FORMS = list(hostile_pickles(Path("x")))


class Payload:
    """An object whose pickle runs `touch canary` when loaded: saved by torch.save beside
    real tensors, it is the hostile pickle as a real training script would produce it."""

    def __init__(self, canary: Path) -> None:
        self.canary = canary

    def __reduce__(self) -> tuple[object, tuple[str]]:
        return (os.system, (canary_command(self.canary),))


def zip_checkpoint(
    path: Path,
    data_pkl: bytes,
    storages: dict[str, bytes] | None = None,
    *,
    compress_storages: bool = False,
    extra: Sequence[tuple[str, bytes]] = (),
) -> Path:
    """A torch-style zip: archive/data.pkl, archive/data/<key>, byteorder, version."""
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", data_pkl)
        archive.writestr("archive/byteorder", b"little")
        for key, blob in (storages or {}).items():
            method = zipfile.ZIP_DEFLATED if compress_storages else zipfile.ZIP_STORED
            archive.writestr(zipfile.ZipInfo(f"archive/data/{key}"), blob, compress_type=method)
        archive.writestr("archive/version", b"3\n")
        for name, blob in extra:
            archive.writestr(name, blob)
    return path


def legacy_checkpoint(
    path: Path, main_pickle: bytes, keys: list[str], storages: list[tuple[int, bytes]]
) -> Path:
    """magic, protocol, sys-info, the object pickle, the key list, then count + bytes each."""
    out = io.BytesIO()
    pickle.dump(LEGACY_MAGIC, out, protocol=2)
    pickle.dump(1001, out, protocol=2)
    pickle.dump(
        {
            "protocol_version": 1001,
            "little_endian": True,
            "type_sizes": {"short": 2, "int": 4, "long": 4},
        },
        out,
        protocol=2,
    )
    out.write(main_pickle)
    pickle.dump(keys, out, protocol=2)
    for count, blob in storages:
        out.write(struct.pack("<q", count) + blob)
    path.write_bytes(out.getvalue())
    return path


def hostile_checkpoint(path: Path, payload: bytes, container: str) -> Path:
    """A hostile pickle as the whole object pickle of a zip or legacy checkpoint."""
    if container == "zip":
        return zip_checkpoint(path, payload)
    assert container == "legacy", container
    return legacy_checkpoint(path, payload, [], [])


class Emit:
    """A tiny pickle writer for exact torch-style opcodes (protocol 2)."""

    def __init__(self, *, legacy_ids: bool = False) -> None:
        self.out = bytearray(b"\x80\x02")
        self.legacy_ids = legacy_ids  # persistent ids as legacy (pre-zip) files write them

    def op(self, raw: bytes) -> Emit:
        """Any opcodes, as bytes: for hostile shapes the methods here do not build."""
        self.out += raw
        return self

    def glob(self, module: str, name: str) -> Emit:
        self.out += f"c{module}\n{name}\n".encode()
        return self

    def mark(self) -> Emit:
        self.out += b"("
        return self

    def string(self, text: str) -> Emit:
        data = text.encode()
        self.out += b"X" + struct.pack("<I", len(data)) + data
        return self

    def int(self, value: int) -> Emit:
        if 0 <= value < 2**31:
            self.out += b"J" + struct.pack("<i", value)
        else:
            data = value.to_bytes((value.bit_length() + 8) // 8, "little", signed=True)
            if len(data) < 256:
                self.out += b"\x8a" + bytes([len(data)]) + data
            else:
                self.out += b"\x8b" + struct.pack("<I", len(data)) + data
        return self

    def ints(self, values: Sequence[int]) -> Emit:
        self.mark()
        for value in values:
            self.int(value)
        self.out += b"t"
        return self

    def tuple(self) -> Emit:
        self.out += b"t"
        return self

    def reduce(self) -> Emit:
        self.out += b"R"
        return self

    def persid(self) -> Emit:
        self.out += b"Q"
        return self

    def false(self) -> Emit:
        self.out += b"\x89"
        return self

    def none(self) -> Emit:
        self.out += b"N"
        return self

    def empty_dict(self) -> Emit:
        self.out += b"}"
        return self

    def setitems(self) -> Emit:
        self.out += b"u"
        return self

    def stop(self) -> bytes:
        return bytes(self.out + b".")

    def tensor(
        self,
        key: str,
        storage_type: str,
        numel: int,
        offset: int,
        shape: Sequence[int],
        stride: Sequence[int],
    ) -> Emit:
        """_rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict()); with
        `legacy_ids`, persistent ids carry a sixth item, the (unused) view metadata."""
        self.glob("torch._utils", "_rebuild_tensor_v2").mark()
        self.mark().string("storage").glob("torch", storage_type).string(key).string("cpu")
        self.int(numel)
        if self.legacy_ids:
            self.none()
        self.tuple().persid()
        self.int(offset).ints(shape).ints(stride).false()
        self.glob("collections", "OrderedDict").mark().tuple().reduce()
        self.tuple().reduce()
        return self


def state_dict_pickle(
    tensors: dict[str, tuple[str, str, int, int, Sequence[int], Sequence[int]]],
) -> bytes:
    """{name: (storage key, storage type, storage numel, offset, shape, stride)} as a pickle."""
    emit = Emit().empty_dict().mark()
    for name, (key, storage_type, numel, offset, shape, stride) in tensors.items():
        emit.string(name).tensor(key, storage_type, numel, offset, shape, stride)
    emit.setitems()
    return emit.stop()


def crafted_zip(
    path: Path,
    offset: int,
    shape: list[int],
    stride: list[int],
    numel: int = 6,
    data: bytes | None = None,
    **kwargs: Any,
) -> Path:
    """One float32 tensor "w" viewing storage "0" of `numel` elements (zeros unless `data`)
    with the given offset, shape and strides, which torch itself never checks on save."""
    pkl = state_dict_pickle({"w": ("0", "FloatStorage", numel, offset, shape, stride)})
    blob = data if data is not None else bytes(numel * 4)
    return zip_checkpoint(path, pkl, {"0": blob}, **kwargs)


# --- real tensors and state dicts for torch.save -----------------------------------------------

# torch dtypes by name: the tests parametrize over names so that collecting them needs no torch.
SAVED_DTYPES = [
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "int8",
    "uint8",
    "int16",
    "int32",
    "int64",
    "bool",
    "complex64",
]
# torch.save writes these only in the zip format.
ZIP_ONLY_DTYPES = [
    "uint16",
    "uint32",
    "uint64",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
]
# safetensors dtype -> the torch dtype's name, for every dtype both have.
SAFETENSORS_TORCH_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "I16": "int16",
    "U16": "uint16",
    "I32": "int32",
    "U32": "uint32",
    "I64": "int64",
    "U64": "uint64",
    "F16": "float16",
    "BF16": "bfloat16",
    "F32": "float32",
    "F64": "float64",
    "C64": "complex64",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}


def torch_dtype(name: str) -> torch.dtype:
    """The torch dtype for a torch name ("bfloat16") or a safetensors one ("BF16")."""
    import torch

    dtype = getattr(torch, SAFETENSORS_TORCH_DTYPES.get(name, name))
    assert isinstance(dtype, torch.dtype), name
    return dtype


def random_tensor(
    dtype: torch.dtype | str, shape: tuple[int, ...], seed: int, *, any_bool_bytes: bool = False
) -> torch.Tensor:
    """Random bytes viewed as `dtype` (so every bit pattern, NaNs included, can occur).
    Bool tensors hold only 0 and 1, which is all torch keeps on a copy, unless
    `any_bool_bytes`: safetensors stores whatever bytes it is given."""
    import torch

    if isinstance(dtype, str):
        dtype = torch_dtype(dtype)
    generator = torch.Generator().manual_seed(seed)
    if dtype == torch.bool and not any_bool_bytes:
        return torch.randint(0, 2, shape, generator=generator).to(torch.bool)
    size = torch.empty((), dtype=dtype).element_size()
    count = 1
    for dim in shape:
        count *= dim
    return (
        torch.randint(0, 256, (count * size,), generator=generator, dtype=torch.uint8)
        .view(dtype)
        .reshape(shape)
    )


def every_dtype_state(
    matrix: tuple[int, ...], *, scalar_seed: int, empty: tuple[int, ...]
) -> dict[str, torch.Tensor]:
    """For every safetensors dtype torch has: a random matrix, a scalar and an empty tensor
    (random bytes, bools included), named `<dtype>.matrix`, `.scalar`, `.empty`."""
    import torch

    tensors: dict[str, torch.Tensor] = {}
    for index, name in enumerate(sorted(SAFETENSORS_TORCH_DTYPES)):
        dtype = torch_dtype(name)
        tensors[f"{name}.matrix"] = random_tensor(dtype, matrix, index, any_bool_bytes=True)
        tensors[f"{name}.scalar"] = random_tensor(
            dtype, (), index + scalar_seed, any_bool_bytes=True
        )
        tensors[f"{name}.empty"] = torch.empty(empty, dtype=dtype)
    return tensors


def views_state_dict() -> OrderedDict[str, torch.Tensor]:
    """Everything torch.save shares or strides: tied aliases, disjoint and overlapping views
    of one buffer, transposed, strided and expanded tensors, a scalar, an empty tensor."""
    import torch

    base = random_tensor(torch.float32, (8, 6), 1)
    qkv = random_tensor(torch.bfloat16, (12, 4), 2)
    embed = torch.nn.Parameter(random_tensor(torch.float32, (10, 4), 3))
    return OrderedDict(
        embed=embed,
        lm_head=embed,  # alias: tied weights
        q=qkv[0:4],
        k=qkv[4:8],
        v=qkv[8:12],  # disjoint views of a fused buffer
        rows=base[1:5],
        overlap=base[3:7],  # overlapping views
        t=base.t(),  # transposed
        strided=base[::2, ::3],
        expanded=random_tensor(torch.float16, (1, 5), 4).expand(3, 5),
        scalar=torch.tensor(3.5),
        empty=torch.empty(0, 7),
        ints=torch.arange(10, dtype=torch.int64),
        flags=torch.tensor([True, False, True]),
        complex=random_tensor(torch.complex64, (3,), 5),
    )


VIEW_KINDS = ["row", "col", "t", "alias", "step", "expand"]
# (which of three bases, which kind of view of it), for state_from_specs.
view_specs = st.lists(
    st.tuples(st.integers(0, 2), st.sampled_from(VIEW_KINDS)), min_size=1, max_size=8
)


def state_from_specs(
    bases: list[torch.Tensor], specs: list[tuple[int, str]]
) -> dict[str, torch.Tensor]:
    """Views and aliases of a few base tensors, as a random state dict."""
    state: dict[str, torch.Tensor] = {}
    for number, (which, kind) in enumerate(specs):
        base = bases[which]
        state[f"t{number}"] = {
            "row": base[1:3],
            "col": base[:, 2:5],
            "t": base.t(),
            "alias": base,
            "step": base[::2, ::3],
            "expand": base[0:1].expand(3, base.shape[1]),
        }[kind]
    return state


def random_views_state(dtype: str, specs: list[tuple[int, str]]) -> dict[str, torch.Tensor]:
    """state_from_specs over three random bases of 4, 5 and 6 rows of `dtype`."""
    bases = [random_tensor(dtype, (4 + i, 6), i) for i in range(3)]
    return state_from_specs(bases, specs)


# --- tiny transformers models --------------------------------------------------------------


def tiny_llama(**overrides: Any) -> Any:
    """A two-layer LlamaForCausalLM (untied head), weights seeded, in eval mode."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    settings: dict[str, Any] = {
        "vocab_size": 96,
        "hidden_size": 32,
        "intermediate_size": 64,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "tie_word_embeddings": False,
        **overrides,
    }
    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(**settings)).eval()


def tiny_gpt2(**overrides: Any) -> Any:
    """A two-layer GPT2LMHeadModel (lm_head tied to the embedding), weights seeded, in eval
    mode."""
    import torch
    from transformers import GPT2Config, GPT2LMHeadModel

    settings: dict[str, Any] = {
        "n_layer": 2,
        "n_head": 2,
        "n_embd": 32,
        "vocab_size": 96,
        "n_positions": 32,
        "bos_token_id": 0,
        "eos_token_id": 0,
        **overrides,
    }
    torch.manual_seed(0)
    return GPT2LMHeadModel(GPT2Config(**settings)).eval()


def tiny_models() -> dict[str, Any]:
    """The two tiny transformers models the interop tests convert: untied and tied."""
    return {
        "llama-untied": tiny_llama(bos_token_id=0, eos_token_id=1),
        "gpt2-tied": tiny_gpt2(),
    }
