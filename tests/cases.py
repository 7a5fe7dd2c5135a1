"""The malformed-input corpus: each case builds one broken file and names the rule it breaks."""

from __future__ import annotations

import json
import struct
import zipfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from tests.builders import (
    HOSTILE_FORMS,
    Factory,
    Payload,
    hostile_checkpoint,
    hostile_pickles,
    state_dict_pickle,
    zip_checkpoint,
)
from tests.gguf_files import Info, RawGguf, gstr, kv, u32_kv

F32x2 = {"dtype": "F32", "shape": [2], "data_offsets": [0, 8]}


@dataclass(frozen=True)
class Case:
    id: str
    build: Callable[[Factory], Path]
    rule: str
    code: str = "corrupt-file"


def _entry(**override: object) -> dict[str, object]:
    return {**F32x2, **override}


def _raw_text(text: str, data: bytes = b"\0" * 8) -> Callable[[Factory], Path]:
    return lambda f: f.raw("bad.safetensors", text.encode(), data)


def _sharding(info: object, name: str = "bad.safetensors") -> Callable[[Factory], Path]:
    """A one-tensor file ('a', F32 [2]) whose header carries this DCP_SHARDING_INFO."""
    text = info if isinstance(info, str) else json.dumps(info)
    metadata = {"DCP_SHARDING_INFO": text, "DCP_VERSION": "1.0", "format": "pt"}
    return lambda f: f.raw(name, {"__metadata__": metadata, "a": F32x2}, b"\0" * 8)


def _pickle_renamed(f: Factory) -> Path:
    return f.bytes("pickle.safetensors", b"\x80\x02}q\x00.")


def _zip_renamed(f: Factory) -> Path:
    path = f.path("zip.safetensors")
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", b"\x80\x02}q\x00.")
    return path


SAFETENSORS_CASES = [
    Case("empty-file", lambda f: f.bytes("bad.safetensors", b""), "too-small"),
    Case("five-bytes", lambda f: f.bytes("bad.safetensors", b"\x01\x02\x03\x04\x05"), "too-small"),
    Case(
        "text-file",
        lambda f: f.bytes("bad.safetensors", b"not a checkpoint at all"),
        "header-too-large",
    ),
    Case(
        "header-over-cap",
        lambda f: f.raw("bad.safetensors", b"{}", declared_length=100_000_001),
        "header-too-large",
    ),
    Case(
        "header-past-eof",
        lambda f: f.raw("bad.safetensors", b"{}", declared_length=4096),
        "bad-header-length",
    ),
    Case("not-utf8", lambda f: f.raw("bad.safetensors", b'{"a\xff": 1}'), "header-not-utf8"),
    Case("invalid-json", _raw_text('{"a": '), "header-not-json"),
    Case("bom", lambda f: f.raw("bad.safetensors", b"\xef\xbb\xbf{}"), "header-not-json"),
    Case(
        "nul-padding",
        lambda f: f.raw(
            "bad.safetensors", json.dumps({"a": F32x2}).encode() + b"\0\0\0", b"\0" * 8
        ),
        "header-not-json",
    ),
    Case(
        "formfeed-padding",
        lambda f: f.raw("bad.safetensors", json.dumps({"a": F32x2}).encode() + b"\x0c", b"\0" * 8),
        "header-not-json",
    ),
    Case(
        "two-objects",
        lambda f: f.raw("bad.safetensors", json.dumps({"a": F32x2}).encode() + b"{}", b"\0" * 8),
        "header-not-json",
    ),
    Case(
        "huge-int-literal",
        _raw_text('{"a": {"dtype": "F32", "shape": [' + "9" * 5000 + "]}}"),
        "header-not-json",
    ),
    Case("deep-nesting", _raw_text("[" * 100_000 + "]" * 100_000), "header-not-json"),
    Case(
        "top-level-array",
        lambda f: f.raw("bad.safetensors", [F32x2], b"\0" * 8),  # type: ignore[arg-type]
        "header-not-object",
    ),
    Case(
        "nan-constant",
        _raw_text('{"a": {"dtype": "F32", "shape": [NaN], "data_offsets": [0, 8]}}'),
        "nan-constant",
    ),
    Case("infinity-constant", _raw_text('{"__metadata__": {"x": Infinity}}'), "nan-constant"),
    Case(
        "duplicate-name",
        _raw_text(json.dumps({"a": F32x2})[:-1] + ', "a": ' + json.dumps(F32x2) + "}"),
        "duplicate-key",
    ),
    Case(
        "duplicate-field-in-entry",
        _raw_text('{"a": {"dtype": "F32", "dtype": "F32", "shape": [2], "data_offsets": [0, 8]}}'),
        "duplicate-key",
    ),
    Case(
        "duplicate-metadata-key",
        _raw_text('{"__metadata__": {"k": "1", "k": "2"}, "a": ' + json.dumps(F32x2) + "}"),
        "duplicate-key",
    ),
    Case(
        "duplicate-name-escaped",  # "a\u0062" is "ab"
        _raw_text('{"a\\u0062": ' + json.dumps(F32x2) + ', "ab": ' + json.dumps(F32x2) + "}"),
        "duplicate-key",
    ),
    Case(
        "duplicate-name-spaced",
        _raw_text('{"a" : ' + json.dumps(F32x2) + ', "a":' + json.dumps(F32x2) + "}"),
        "duplicate-key",
    ),
    Case(
        "duplicate-with-colon-value",
        _raw_text(
            '{"__metadata__": {"x": ":y"}, "a": '
            + json.dumps(F32x2)
            + ', "a": '
            + json.dumps(F32x2)
            + "}"
        ),
        "duplicate-key",
    ),
    Case(
        "metadata-string",
        lambda f: f.raw("bad.safetensors", {"__metadata__": "pt", "a": F32x2}, b"\0" * 8),
        "metadata-not-object",
    ),
    Case(
        "metadata-int-value",
        lambda f: f.raw("bad.safetensors", {"__metadata__": {"n": 1}, "a": F32x2}, b"\0" * 8),
        "metadata-not-string",
    ),
    Case(
        "metadata-as-tensor",
        lambda f: f.raw("bad.safetensors", {"__metadata__": F32x2}, b"\0" * 8),
        "metadata-as-tensor",
    ),
    Case(
        "tensor-not-object",
        lambda f: f.raw("bad.safetensors", {"a": [0, 8]}, b"\0" * 8),
        "tensor-not-object",
    ),
    Case(
        "missing-dtype",
        lambda f: f.raw(
            "bad.safetensors", {"a": {"shape": [2], "data_offsets": [0, 8]}}, b"\0" * 8
        ),
        "tensor-missing-field",
    ),
    Case(
        "unknown-dtype",
        lambda f: f.raw("bad.safetensors", {"a": _entry(dtype="F128")}, b"\0" * 8),
        "unknown-dtype",
    ),
    Case(
        "lowercase-dtype",
        lambda f: f.raw("bad.safetensors", {"a": _entry(dtype="f32")}, b"\0" * 8),
        "unknown-dtype",
    ),
    Case(
        "negative-dim",
        lambda f: f.raw("bad.safetensors", {"a": _entry(shape=[-2])}, b"\0" * 8),
        "bad-shape",
    ),
    Case(
        "bool-dim",
        lambda f: f.raw("bad.safetensors", {"a": _entry(shape=[True, 2])}, b"\0" * 8),
        "bad-shape",
    ),
    Case(
        "float-dim",
        lambda f: f.raw("bad.safetensors", {"a": _entry(shape=[2.0])}, b"\0" * 8),
        "bad-shape",
    ),
    Case(
        "negative-zero-dim",
        _raw_text('{"a": {"dtype": "U8", "shape": [-0], "data_offsets": [0, 0]}}', b""),
        "bad-shape",
    ),
    Case(
        "three-offsets",
        lambda f: f.raw("bad.safetensors", {"a": _entry(data_offsets=[0, 4, 8])}, b"\0" * 8),
        "bad-offsets",
    ),
    Case(
        "offsets-reversed",
        lambda f: f.raw("bad.safetensors", {"a": _entry(data_offsets=[8, 0])}, b"\0" * 8),
        "bad-offsets",
    ),
    Case(
        "offset-over-u64",
        lambda f: f.raw("bad.safetensors", {"a": _entry(data_offsets=[0, 2**64 + 8])}, b"\0" * 8),
        "bad-offsets",
    ),
    Case(
        "size-mismatch",
        lambda f: f.raw("bad.safetensors", {"a": _entry(shape=[3])}, b"\0" * 8),
        "size-mismatch",
    ),
    Case(
        "shape-overflow",
        lambda f: f.raw("bad.safetensors", {"a": _entry(shape=[2**40, 2**40])}, b"\0" * 8),
        "shape-overflow",
    ),
    Case(
        "partial-byte",
        lambda f: f.raw(
            "bad.safetensors",
            {"a": {"dtype": "F4", "shape": [3], "data_offsets": [0, 2]}},
            b"\0" * 2,
        ),
        "partial-byte",
    ),
    Case(
        "gap",
        lambda f: f.raw(
            "bad.safetensors", {"a": F32x2, "b": _entry(data_offsets=[12, 20])}, b"\0" * 20
        ),
        "offset-gap",
    ),
    Case(
        "first-not-at-zero",
        lambda f: f.raw("bad.safetensors", {"a": _entry(data_offsets=[4, 12])}, b"\0" * 12),
        "offset-gap",
    ),
    Case(
        "overlap",
        lambda f: f.raw(
            "bad.safetensors", {"a": F32x2, "b": _entry(data_offsets=[4, 12])}, b"\0" * 12
        ),
        "offset-overlap",
    ),
    Case(
        "zero-size-inside",
        lambda f: f.raw(
            "bad.safetensors",
            {"a": F32x2, "z": {"dtype": "F32", "shape": [0], "data_offsets": [4, 4]}},
            b"\0" * 8,
        ),
        "offset-overlap",
    ),
    Case("truncated", lambda f: f.raw("bad.safetensors", {"a": F32x2}, b"\0" * 5), "truncated"),
    Case(
        "trailing-bytes",
        lambda f: f.raw("bad.safetensors", {"a": F32x2}, b"\0" * 9),
        "trailing-bytes",
    ),
    Case("pickle-renamed", _pickle_renamed, "not-safetensors"),
    Case("zip-renamed", _zip_renamed, "not-safetensors"),
    Case("lfs-pointer", lambda f: f.lfs_pointer("model.safetensors"), "lfs-pointer", "lfs-pointer"),
]

# torch's HuggingFaceStorageWriter: DCP_SHARDING_INFO places a file's tensors in larger ones.
# The file itself reads; its header's sharding info is wrong, or says the file is a piece.
SHARDING_CASES = [
    Case("sharding-info-not-json", _sharding("{"), "dcp-sharding-info"),
    Case("sharding-info-list", _sharding("[]"), "dcp-sharding-info"),
    Case("sharding-info-other-name", _sharding({"b": {"saved_offsets": [0]}}), "dcp-sharding-info"),
    Case(
        "sharding-info-short-offsets", _sharding({"a": {"saved_offsets": []}}), "dcp-sharding-info"
    ),
    Case("sharding-info-negative", _sharding({"a": {"saved_offsets": [-2]}}), "dcp-sharding-info"),
    Case("sharding-info-no-offsets", _sharding({"a": {"offsets": [0]}}), "dcp-sharding-info"),
    Case("rank-piece", _sharding({"a": {"saved_offsets": [2]}}), "tensor-piece", "tensor-piece"),
    Case(
        "rank-file-alone",
        _sharding({"a": {"saved_offsets": [0]}}, "shard-00001-model-00001-of-00001.safetensors"),
        "tensor-piece",
        "tensor-piece",
    ),
]


def _folder_with_index(document: bytes | dict[str, object]) -> Callable[[Factory], Path]:
    """A broken index of the folder's only checkpoint: one numbered shard. (Beside a single
    `model.safetensors`, an index is never read by loaders, so it would not block a rewrite.)"""

    def build(f: Factory) -> Path:
        f.safetensors(f"m/{_SHARD}")
        text = document if isinstance(document, bytes) else json.dumps(document).encode()
        text = text.replace(b'"model.safetensors"', f'"{_SHARD}"'.encode())
        f.path("m/model.safetensors.index.json").write_bytes(text)
        return f.root / "m"

    return build


_SHARD = "model-00001-of-00001.safetensors"
_OK_MAP = {"weight": "model.safetensors"}
INDEX_CASES = [
    Case("index-not-json", _folder_with_index(b'{"weight_map": '), "index-not-json"),
    Case("index-array", _folder_with_index(b"[1, 2]"), "index-not-json"),
    Case("index-no-weight-map", _folder_with_index({"metadata": {}}), "index-no-weight-map"),
    Case(
        "index-weight-map-list",
        _folder_with_index({"weight_map": ["model.safetensors"]}),
        "index-no-weight-map",
    ),
    Case(
        "index-non-string-entry",
        _folder_with_index({"weight_map": {"weight": 1}}),
        "index-bad-entry",
    ),
    Case(
        "index-traversal",
        _folder_with_index({"weight_map": {"weight": "../x.safetensors"}}),
        "unsafe-shard-path",
    ),
    Case(
        "index-absolute",
        _folder_with_index({"weight_map": {"weight": "/etc/x.safetensors"}}),
        "unsafe-shard-path",
    ),
    Case(
        "index-drive-letter",
        _folder_with_index({"weight_map": {"weight": "C:x.safetensors"}}),
        "unsafe-shard-path",
    ),
    Case(
        "index-backslash-traversal",
        _folder_with_index({"weight_map": {"weight": "..\\..\\x.safetensors"}}),
        "unsafe-shard-path",
    ),
    Case(
        "index-nul",
        _folder_with_index({"weight_map": {"weight": "model\u0000.safetensors"}}),
        "unsafe-shard-path",
    ),
    Case(
        "index-bin-shard",
        _folder_with_index({"weight_map": {"weight": "pytorch_model.bin"}}),
        "wrong-shard-format",
    ),
    Case(
        "index-bad-metadata",
        _folder_with_index({"metadata": [1], "weight_map": _OK_MAP}),
        "index-bad-metadata",
    ),
    Case(
        "index-duplicate-key",
        _folder_with_index(
            b'{"weight_map": {"weight": "model.safetensors", "weight": "model.safetensors"}}'
        ),
        "duplicate-key",
    ),
    Case(
        "index-nan",
        _folder_with_index(
            b'{"metadata": {"total_size": NaN}, "weight_map": {"weight": "model.safetensors"}}'
        ),
        "nan-constant",
    ),
]


# --- PyTorch files -------------------------------------------------------------------------


def _pickle_case(form: str, container: str) -> Callable[[Factory], Path]:
    def build(f: Factory) -> Path:
        payload = hostile_pickles(f.root / "CANARY")[form]
        return hostile_checkpoint(f.path(f"{form}.bin"), payload, container)

    return build


def _hidden_payload(f: Factory) -> Path:
    import torch

    path = f.path("pytorch_model.bin")
    torch.save({"weight": torch.ones(3), "extra": Payload(f.root / "CANARY")}, path)
    return path


def _crafted_zip(
    tensor: tuple[int, list[int], list[int]], blob_size: int = 24, **kwargs: object
) -> Callable[[Factory], Path]:
    def build(f: Factory) -> Path:
        offset, shape, stride = tensor
        pkl = state_dict_pickle({"w": ("0", "FloatStorage", 6, offset, shape, stride)})
        storages = {"0": bytes(blob_size)} if blob_size >= 0 else {}
        return zip_checkpoint(f.path("crafted.pt"), pkl, storages, **kwargs)  # type: ignore[arg-type]

    return build


def _legacy_edit(edit: Callable[[bytes], bytes]) -> Callable[[Factory], Path]:
    def build(f: Factory) -> Path:
        import torch

        path = f.path("legacy.pt")
        torch.save({"w": torch.ones(64)}, path, _use_new_zipfile_serialization=False)
        path.write_bytes(edit(path.read_bytes()))
        return path

    return build


def _zip_edit(edit: Callable[[bytes], bytes]) -> Callable[[Factory], Path]:
    """A real torch.save zip, then damaged."""

    def build(f: Factory) -> Path:
        import torch

        path = f.path("damaged.pt")
        torch.save({"w": torch.ones(64)}, path)
        path.write_bytes(edit(path.read_bytes()))
        return path

    return build


def _flip_in_pickle(data: bytes) -> bytes:
    """Change one byte inside data.pkl (a string it holds) so its CRC-32 no longer matches."""
    at = data.index(b"FloatStorage")
    return data[:at] + b"G" + data[at + 1 :]


def _torchscript(f: Factory) -> Path:
    import torch

    path = f.path("scripted.pt")
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), path)
    return path


def _tar(f: Factory) -> Path:
    import io
    import tarfile

    path = f.path("ancient.pt")
    with tarfile.open(path, "w") as archive:
        info = tarfile.TarInfo("sys_info")
        info.size = 6
        archive.addfile(info, io.BytesIO(b"\x80\x02}q\x00."))
    return path


def _zip_with_pickle(data: bytes) -> Callable[[Factory], Path]:
    return lambda f: zip_checkpoint(f.path("weird.pt"), data)


_BAD_PID = (
    b"\x80\x02}(X\x01\x00\x00\x00wctorch._utils\n_rebuild_tensor_v2\n((X\x07\x00\x00\x00storage"
    b"X\x01\x00\x00\x000tQJ\x00\x00\x00\x00(J\x01\x00\x00\x00t(J\x01\x00\x00\x00t\x89"
    b"ccollections\nOrderedDict\n)RtRu."
)

PICKLE_CASES = [
    *(
        Case(f"{form}-{container}", _pickle_case(form, container), "unsafe-pickle", "unsafe-pickle")
        for form in HOSTILE_FORMS
        for container in ("zip", "legacy")
    ),
    Case("payload-beside-tensors", _hidden_payload, "unsafe-pickle", "unsafe-pickle"),
    Case(
        "compressed-storage",
        _crafted_zip((0, [2, 3], [3, 1]), compress_storages=True),
        "compressed-storage",
    ),
    Case("storage-size", _crafted_zip((0, [2, 3], [3, 1]), blob_size=20), "storage-size"),
    Case("missing-storage", _crafted_zip((0, [2, 3], [3, 1]), blob_size=-1), "missing-storage"),
    Case(
        "two-pickles",
        _crafted_zip((0, [2, 3], [3, 1]), extra=[("archive/other.pkl", b"\x80\x02}.")]),
        "zip-layout",
    ),
    Case(
        "duplicate-entry",
        _crafted_zip((0, [2, 3], [3, 1]), extra=[("archive/data/0", bytes(24))]),
        "zip-duplicate-entry",
    ),
    Case(
        "path-traversal-entry",
        _crafted_zip((0, [2, 3], [3, 1]), extra=[("../evil/data.bin", b"x")]),
        "zip-layout",
    ),
    Case("view-out-of-bounds", _crafted_zip((4, [2, 3], [3, 1])), "view-out-of-bounds"),
    Case("negative-stride", _crafted_zip((0, [2, 3], [-3, 1])), "bad-tensor"),
    Case("stride-0-bomb", _crafted_zip((0, [2**20, 2**20, 16], [0, 0, 0])), "expansion-bomb"),
    Case("absurd-shape", _crafted_zip((0, [2**40, 2**40], [1, 1])), "view-out-of-bounds"),
    # no elements, so no bytes to check: a dimension no safetensors file can hold
    Case("empty-shape-past-2-64", _crafted_zip((0, [2**70, 0], [0, 1])), "bad-shape"),
    Case("garbage-pickle", _zip_with_pickle(b"\x80\x02\xff\xfe garbage"), "bad-pickle"),
    Case("bad-persistent-id", _zip_with_pickle(_BAD_PID), "bad-storage-ref"),
    Case("not-a-zip", lambda f: f.bytes("broken.bin", b"PK\x03\x04" + b"\x00" * 40), "bad-zip"),
    Case("legacy-truncated", _legacy_edit(lambda b: b[:-10]), "truncated"),
    Case("legacy-trailing", _legacy_edit(lambda b: b + b"junk"), "trailing-bytes"),
    Case(
        "legacy-bad-magic",
        _legacy_edit(
            lambda b: b.replace(
                b"\x8a\nl\xfc\x9cF\xf9 j\xa8P\x19", b"\x8a\nl\xfc\x9cF\xf9 j\xa8P\x18", 1
            )
        ),
        "bad-magic",
    ),
    Case("zip-crc-mismatch", _zip_edit(_flip_in_pickle), "bad-zip"),
    Case("zip-truncated", _zip_edit(lambda b: b[: len(b) // 2]), "bad-zip"),
    Case("torchscript", _torchscript, "torchscript", "unsupported-format"),
    Case("tar-format", _tar, "tar", "unsupported-format"),
]


# --- GGUF files --------------------------------------------------------------------------


def _gguf(
    raw: RawGguf | Callable[[], RawGguf], name: str = "bad.gguf"
) -> Callable[[Factory], Path]:
    return lambda f: (raw() if callable(raw) else raw).write(f.path(name))


def _gguf_bytes(data: bytes, name: str = "bad.gguf") -> Callable[[Factory], Path]:
    return lambda f: f.bytes(name, data)


def _gguf_edit(edit: Callable[[bytes], bytes]) -> Callable[[Factory], Path]:
    """A valid two-tensor file, then edited."""
    return lambda f: f.bytes("bad.gguf", edit(_TWO.build()))


_TWO = RawGguf(infos=[Info("a", [8]), Info("b", [8], 0, 32)])
_ARCH = kv("general.architecture", 8, gstr("llama"))
_HTML = b"<!DOCTYPE html>\n<html><head><title>Sign in - Hugging Face</title></head><body>"

GGUF_CASES = [
    Case("gguf-too-small", _gguf_bytes(b"GGUF\x03\0\0\0"), "gguf-too-small"),
    Case("gguf-html", _gguf_bytes(_HTML + b" " * 100), "gguf-bad-magic"),
    Case("gguf-json", _gguf_bytes(b'{"error":"Repository not found"}'), "gguf-bad-magic"),
    Case("gguf-zeros", _gguf_bytes(bytes(4096)), "gguf-bad-magic"),
    Case("gguf-binary", _gguf_bytes(b"\x7fELF\x02\x01\x01" + bytes(64)), "gguf-bad-magic"),
    Case(
        "gguf-safetensors",
        lambda f: f.bytes("bad.gguf", f.safetensors("x.safetensors").read_bytes()),
        "gguf-bad-magic",
    ),
    Case("gguf-lfs", lambda f: f.lfs_pointer("model.gguf"), "lfs-pointer", "lfs-pointer"),
    Case(
        "gguf-big-endian", _gguf(RawGguf(version=3 << 24)), "gguf-big-endian", "unsupported-format"
    ),
    Case("gguf-version-1", _gguf(RawGguf(version=1)), "gguf-version"),
    Case("gguf-version-4", _gguf(RawGguf(version=4)), "gguf-version"),
    Case("gguf-tensors-2-60", _gguf(RawGguf(tensor_count=2**60)), "gguf-counts"),
    Case("gguf-keys-2-60", _gguf(RawGguf(key_count=2**60)), "gguf-counts"),
    Case("gguf-tensors-claimed", _gguf(RawGguf(tensor_count=999_999)), "gguf-past-end"),
    Case(
        "gguf-key-2-50",
        _gguf(RawGguf(keys=[struct.pack("<Q", 2**50) + b"general.architecture"])),
        "gguf-past-end",
    ),
    Case(
        "gguf-string-2-50",
        _gguf(RawGguf(keys=[kv("general.name", 8, struct.pack("<Q", 2**50) + b"x")])),
        "gguf-past-end",
    ),
    Case(
        "gguf-array-2-60",
        _gguf(RawGguf(keys=[kv("a", 9, struct.pack("<IQ", 4, 2**60))])),
        "gguf-past-end",
    ),
    Case(
        "gguf-strings-2-60",
        _gguf(RawGguf(keys=[kv("tokenizer.ggml.tokens", 9, struct.pack("<IQ", 8, 2**60))])),
        "gguf-past-end",
    ),
    Case("gguf-metadata-cut", _gguf_edit(lambda b: b[:40]), "gguf-past-end"),
    Case("gguf-infos-cut", _gguf_edit(lambda b: b[:90]), "gguf-past-end"),
    Case(
        "gguf-key-not-utf8",
        _gguf(RawGguf(keys=[kv(b"general.\xff", 4, bytes(4))])),
        "gguf-bad-string",
    ),
    Case("gguf-duplicate-key", _gguf(RawGguf(keys=[_ARCH, _ARCH])), "gguf-duplicate-key"),
    Case("gguf-value-type", _gguf(RawGguf(keys=[kv("a", 13, bytes(8))])), "gguf-bad-value-type"),
    Case(
        "gguf-nested-array",
        _gguf(RawGguf(keys=[kv("a", 9, struct.pack("<IQ", 9, 1) + struct.pack("<IQ", 4, 0))])),
        "gguf-bad-value-type",
    ),
    Case("gguf-bool-2", _gguf(RawGguf(keys=[kv("a", 7, b"\2")])), "gguf-bad-value"),
    Case(
        "gguf-alignment-48",
        _gguf(RawGguf(keys=[u32_kv("general.alignment", 48)])),
        "gguf-alignment",
    ),
    Case(
        "gguf-alignment-u64",
        _gguf(RawGguf(keys=[kv("general.alignment", 10, struct.pack("<Q", 32))])),
        "gguf-alignment",
    ),
    Case(
        "gguf-split-string",
        _gguf(RawGguf(keys=[kv("split.count", 8, gstr("3"))])),
        "gguf-bad-value",
    ),
    Case(
        "gguf-split-u32", _gguf(RawGguf(keys=[_ARCH, u32_kv("split.count", 1)])), "gguf-bad-value"
    ),
    Case(
        "gguf-split-negative",
        _gguf(RawGguf(keys=[_ARCH, kv("split.tensors.count", 5, struct.pack("<i", -1))])),
        "gguf-bad-value",
    ),
    Case(
        "gguf-alignment-0", _gguf(RawGguf(keys=[u32_kv("general.alignment", 0)])), "gguf-alignment"
    ),
    Case("gguf-key-70000", _gguf(RawGguf(keys=[u32_kv("k" * 70_000, 1)])), "gguf-bad-string"),
    Case(
        "gguf-array-item-2-32",
        _gguf(RawGguf(keys=[kv("a", 9, struct.pack("<IQ", 2**32 - 1, 1))])),
        "gguf-bad-value-type",
    ),
    Case(
        "gguf-bool-array-2",
        _gguf(RawGguf(keys=[kv("a", 9, struct.pack("<IQ", 7, 3) + b"\0\1\2")])),
        "gguf-bad-value",
    ),
    Case(
        "gguf-html-escapes",
        _gguf_bytes(b"<html><title>\x1b]0;pwned\x07\n::error::x ##[y]</title>" + b" " * 64),
        "gguf-bad-magic",
    ),
    Case("gguf-name-64", _gguf(RawGguf(infos=[Info("n" * 64, [4])])), "gguf-name-too-long"),
    Case("gguf-name-not-utf8", _gguf(RawGguf(infos=[Info(b"w\xff", [4])])), "gguf-bad-string"),
    Case("gguf-5-dims", _gguf(RawGguf(infos=[Info("w", [1, 1, 1, 1, 4])])), "gguf-dims"),
    Case("gguf-zero-dim", _gguf(RawGguf(infos=[Info("w", [4, 0])])), "gguf-zero-dim"),
    Case("gguf-type-99", _gguf(RawGguf(infos=[Info("w", [32], 99)])), "gguf-unknown-type"),
    Case("gguf-type-removed", _gguf(RawGguf(infos=[Info("w", [32], 4)])), "gguf-unknown-type"),
    Case("gguf-partial-block", _gguf(RawGguf(infos=[Info("w", [33, 2], 2)])), "gguf-partial-block"),
    Case(
        "gguf-shape-overflow",
        _gguf(RawGguf(infos=[Info("w", [2**32, 2**32])], data=b"")),
        "gguf-shape-overflow",
    ),
    Case("gguf-misaligned", _gguf(RawGguf(infos=[Info("w", [4], 0, 8)])), "gguf-misaligned"),
    Case("gguf-offset-2-64", _gguf(RawGguf(infos=[Info("w", [4], 0, 2**64 - 32)])), "gguf-layout"),
    Case(
        "gguf-rank-2-32",
        _gguf_bytes(
            b"GGUF"
            + struct.pack("<IQQ", 3, 1, 1)
            + _ARCH
            + gstr("w")
            + struct.pack("<I", 2**32 - 1)
            + bytes(64)
        ),
        "gguf-dims",
    ),
    Case("gguf-type-2-32", _gguf(RawGguf(infos=[Info("w", [32], 2**32 - 1)])), "gguf-unknown-type"),
    Case(
        "gguf-bytes-2-65",
        _gguf(RawGguf(infos=[Info("w", [2**62], 28)], data=bytes(64))),
        "truncated",
    ),
    Case(
        "gguf-overlap",
        _gguf(RawGguf(infos=[Info("a", [16]), Info("b", [8], 0, 32)], data=bytes(96))),
        "gguf-overlap",
    ),
    Case(
        "gguf-gap",
        _gguf(RawGguf(infos=[Info("a", [8]), Info("b", [8], 0, 64)], data=bytes(96))),
        "gguf-layout",
    ),
    Case(
        "gguf-out-of-order",
        _gguf(RawGguf(infos=[Info("a", [8], 0, 32), Info("b", [8], 0, 0)], data=bytes(64))),
        "gguf-layout",
    ),
    Case(
        "gguf-duplicate-name",
        _gguf(RawGguf(infos=[Info("a", [8]), Info("a", [8], 0, 32)])),
        "gguf-duplicate-name",
    ),
    Case("gguf-truncated", _gguf_edit(lambda b: b[:-40]), "truncated"),
    Case("gguf-trailing", _gguf_edit(lambda b: b + b"junk"), "trailing-bytes"),
]
