"""Hostile PyTorch files from the security review: each builds one attack shape by hand, at
the opcode or zip-header level, and names the rule that must refuse it. Run against every
command by tests/test_bad_inputs.py (one error line, nothing written, nothing executed)."""

from __future__ import annotations

import struct
import zipfile
from collections.abc import Callable
from pathlib import Path

from tests.builders import Emit, Factory, zip_checkpoint
from tests.cases import Case

STORAGE = {"0": bytes(24)}  # six float32 zeros, the storage every tensor below views


def _tensor(emit: Emit, name: str = "w") -> Emit:
    return emit.string(name).tensor("0", "FloatStorage", 6, 0, [2, 3], [3, 1])


def _zip(pickle: bytes, storages: dict[str, bytes] | None = None) -> Callable[[Factory], Path]:
    def build(factory: Factory) -> Path:
        return zip_checkpoint(
            factory.path("attack.pt"), pickle, STORAGE if storages is None else storages
        )

    return build


def _build_on_tensor(state: Callable[[Emit], Emit]) -> bytes:
    """{"w": tensor} where the tensor gets BUILD(state) right after it is made."""
    emit = _tensor(Emit().empty_dict())
    return state(emit).op(b"b").op(b"s").stop()


def _strides_state(emit: Emit) -> Emit:
    return emit.empty_dict().string("stride").ints([2**40, -(2**40)]).op(b"s")


def _slot_state(emit: Emit) -> Emit:
    return emit.mark().none().empty_dict().string("offset").int(-5).op(b"s").tuple()


def _dtype_state(emit: Emit) -> Emit:
    return emit.empty_dict().string("dtype").string("garbage").op(b"s")


def _build_on_storage() -> bytes:
    """The storage descriptor rewritten to claim 2^50 bytes, then used by a tensor."""
    emit = Emit().empty_dict().string("w").glob("torch._utils", "_rebuild_tensor_v2").mark()
    emit.mark().string("storage").glob("torch", "FloatStorage").string("0").string("cpu")
    emit.int(6).tuple().persid()
    emit.empty_dict().string("nbytes").int(2**50).op(b"s").op(b"b")  # BUILD on the storage
    emit.int(0).ints([2, 3]).ints([3, 1]).false()
    emit.glob("collections", "OrderedDict").mark().tuple().reduce().tuple().reduce()
    return emit.op(b"s").stop()


def _build_on_builder() -> bytes:
    emit = Emit().empty_dict().glob("torch._utils", "_rebuild_tensor_v2")
    emit.empty_dict().string("__call__").int(1).op(b"s").op(b"b").op(b"0")
    return _tensor(emit).op(b"s").stop()


def _setitem_on_tensor() -> bytes:
    emit = _tensor(Emit().empty_dict())
    return emit.string("stride").int(7).op(b"s").op(b"s").stop()


def _append_on_tensor() -> bytes:
    return _tensor(Emit().empty_dict()).int(7).op(b"a").op(b"s").stop()


def _memo_bomb() -> bytes:
    return _tensor(Emit().empty_dict()).op(b"r" + struct.pack("<I", 2**31)).op(b"s").stop()


def _deep_tuple_key(depth: int) -> bytes:
    """A tuple nested `depth` deep used as a dict key: hashing it recursed in C and, a million
    deep, overflowed the stack (SIGSEGV)."""
    emit = _tensor(Emit().empty_dict())
    emit.op(b"s").op(b")" + b"\x85" * depth).int(1).op(b"s")
    return emit.stop()


def _same_name_keys() -> bytes:
    """Keys 1 and "1": both become the tensor name "1", so one tensor would vanish."""
    emit = Emit().empty_dict()
    emit.int(1).tensor("0", "FloatStorage", 6, 0, [2, 3], [3, 1]).op(b"s")
    emit.string("1").tensor("0", "FloatStorage", 6, 0, [3], [1]).op(b"s")
    return emit.stop()


def _huge_int_key() -> bytes:
    emit = Emit().empty_dict().int(10**5000)
    return emit.tensor("0", "FloatStorage", 6, 0, [2, 3], [3, 1]).op(b"s").stop()


def _huge_frame() -> bytes:
    return b"\x80\x04\x95" + struct.pack("<Q", 2**63) + b"}."


def _zip_patch(
    pickle: bytes, entry: str, *, flags: int = 0, method: int | None = None
) -> Callable[[Factory], Path]:
    """A valid checkpoint whose `entry` then gets extra flag bits or another compression
    method written into both its local header and its central directory record."""

    def build(factory: Factory) -> Path:
        path = zip_checkpoint(factory.path("attack.pt"), pickle, STORAGE)
        data = bytearray(path.read_bytes())
        with zipfile.ZipFile(path) as archive:
            info = archive.getinfo(entry)
        central = _central_record(data, entry)
        for at, flag_at, method_at in ((info.header_offset, 6, 8), (central, 8, 10)):
            (old_flags,) = struct.unpack_from("<H", data, at + flag_at)
            struct.pack_into("<H", data, at + flag_at, old_flags | flags)
            if method is not None:
                struct.pack_into("<H", data, at + method_at, method)
        path.write_bytes(bytes(data))
        return path

    return build


def _central_record(data: bytearray, entry: str) -> int:
    name = entry.encode()
    at = data.index(b"PK\x01\x02")
    while True:
        name_length = struct.unpack_from("<H", data, at + 28)[0]
        if data[at + 46 : at + 46 + name_length] == name:
            return at
        extra, comment = struct.unpack_from("<HH", data, at + 30)
        at += 46 + name_length + extra + comment


def _compressed_pickle(factory: Factory) -> Path:
    """data.pkl deflated: a small entry that inflates to whatever the pickle cap allows."""
    path = factory.path("attack.pt")
    pickle = _tensor(Emit().empty_dict()).op(b"s").stop()
    with zipfile.ZipFile(path, "w") as archive:
        archive.writestr("archive/data.pkl", pickle, compress_type=zipfile.ZIP_DEFLATED)
        archive.writestr("archive/data/0", STORAGE["0"])
    return path


def _surrogate_key() -> bytes:
    """A key pickled as CPython pickles a lone surrogate ("surrogatepass" UTF-8): a name that
    no safetensors header, JSON document or terminal can hold."""
    emit = Emit().empty_dict().op(b"X" + struct.pack("<I", 3) + b"\xed\xa0\x80")
    return emit.tensor("0", "FloatStorage", 6, 0, [2, 3], [3, 1]).op(b"s").stop()


def _surrogate_line_key() -> bytes:
    """The same through the protocol-0 UNICODE opcode (raw-unicode-escape text)."""
    emit = Emit().empty_dict().op(b"V\\ud800\n")
    return emit.tensor("0", "FloatStorage", 6, 0, [2, 3], [3, 1]).op(b"s").stop()


def _expanded_many(count: int) -> bytes:
    """`count` tensors, each 4 bytes expanded to 16 GiB (the per-tensor cap): together
    terabytes claimed from four stored bytes, hours of hashing."""
    emit = Emit().empty_dict()
    for number in range(count):
        emit.string(f"t{number}").tensor("0", "FloatStorage", 1, 0, [2**32], [0]).op(b"s")
    return emit.stop()


def _surrogate_header(factory: Factory) -> Path:
    """A safetensors header whose name is a \\u escape of a lone surrogate (serde refuses)."""
    header = b'{"\\ud800":{"dtype":"F32","shape":[1],"data_offsets":[0,4]}}'
    header += b" " * (-len(header) % 8)
    return factory.bytes("attack.safetensors", struct.pack("<Q", len(header)) + header + bytes(4))


_PLAIN = _tensor(Emit().empty_dict()).op(b"s").stop()

ATTACK_CASES = [
    Case("build-rewrites-strides", _zip(_build_on_tensor(_strides_state)), "mutated-object"),
    Case("build-slot-state", _zip(_build_on_tensor(_slot_state)), "mutated-object"),
    Case("build-rewrites-dtype", _zip(_build_on_tensor(_dtype_state)), "mutated-object"),
    Case("build-rewrites-storage", _zip(_build_on_storage()), "mutated-object"),
    Case("build-on-builder", _zip(_build_on_builder()), "mutated-object"),
    Case("setitem-on-tensor", _zip(_setitem_on_tensor()), "bad-pickle"),
    Case("append-on-tensor", _zip(_append_on_tensor()), "bad-pickle"),
    Case("memo-index-bomb", _zip(_memo_bomb()), "memo-index"),
    Case("deep-tuple-key", _zip(_deep_tuple_key(1_000_000)), "nesting-too-deep"),
    Case("int-and-str-keys", _zip(_same_name_keys()), "duplicate-name", "duplicate-name"),
    Case("huge-int-key", _zip(_huge_int_key()), "bad-tensor-name"),
    Case("frame-length-2-63", _zip(_huge_frame()), "bad-pickle"),
    Case("compressed-pickle", _compressed_pickle, "compressed-pickle"),
    Case("encrypted-entry", _zip_patch(_PLAIN, "archive/data/0", flags=0x1), "zip-encrypted"),
    Case(
        "unknown-compression",
        _zip_patch(_PLAIN, "archive/data.pkl", method=99),
        "compressed-pickle",
    ),
    Case("lone-surrogate-key", _zip(_surrogate_key()), "bad-pickle"),
    Case("lone-surrogate-unicode-line", _zip(_surrogate_line_key()), "bad-pickle"),
    Case("expansion-across-tensors", _zip(_expanded_many(8), {"0": bytes(4)}), "expansion-bomb"),
    Case("lone-surrogate-header", _surrogate_header, "header-not-json"),
    Case(
        "deflate-over-stored",
        _zip_patch(_PLAIN, "archive/data/0", method=zipfile.ZIP_DEFLATED),
        "compressed-storage",
    ),
]
