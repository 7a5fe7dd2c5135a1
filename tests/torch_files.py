"""Builders for PyTorch files in tests: real ones via torch.save, hostile and malformed ones
from hand-written pickle opcodes (so nothing here ever runs a payload either)."""

from __future__ import annotations

import io
import pickle
import struct
import zipfile
from collections.abc import Sequence
from pathlib import Path

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C


def canary_command(canary: Path) -> str:
    return f"touch {canary}"


# Hostile pickles in each opcode form that reaches find_class. Each would create the canary.
def hostile_pickles(canary: Path) -> dict[str, bytes]:
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


class Emit:
    """A tiny pickle writer for exact torch-style opcodes (protocol 2)."""

    def __init__(self) -> None:
        self.out = bytearray(b"\x80\x02")

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

    def tensor(  # noqa: PLR0913  (one argument per field of the pickled call)
        self,
        key: str,
        storage_type: str,
        numel: int,
        offset: int,
        shape: Sequence[int],
        stride: Sequence[int],
        *,
        legacy: bool = False,
    ) -> Emit:
        """_rebuild_tensor_v2(storage, offset, size, stride, False, OrderedDict()); legacy
        persistent ids carry a sixth item, the (unused) view metadata."""
        self.glob("torch._utils", "_rebuild_tensor_v2").mark()
        self.mark().string("storage").glob("torch", storage_type).string(key).string("cpu")
        self.int(numel)
        if legacy:
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
