"""The torch zip ckptfix writes, against what torch.save (2.13) writes: data.pkl byte for byte,
the whole archive byte for byte but the serialization id's first half, and the ZIP64 layout
of a > 4 GiB archive as torch wrote it (recorded below, so the test needs no 4 GiB file)."""

from __future__ import annotations

import io
import struct
import zipfile
import zlib
from collections import OrderedDict
from typing import TYPE_CHECKING

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfix.core.dtypes import DTYPES, TORCH_DTYPES
from ckptfix.formats import torch_zip_writer as layout
from ckptfix.formats.pickle_writer import TensorEntry, contiguous_strides, state_dict_pickle
from tests.builders import random_tensor

if TYPE_CHECKING:
    import torch


def entries_of(state: OrderedDict[str, torch.Tensor]) -> tuple[list[TensorEntry], dict[str, bytes]]:
    """The state dict as ckptfix describes it (keys numbered as torch numbers them), and each
    storage's bytes."""
    import torch

    keys: dict[object, str] = {}
    entries, storages = [], {}
    for name, tensor in state.items():
        storage = tensor.untyped_storage()
        key = keys.setdefault(storage._cdata, str(len(keys)))
        dtype = TORCH_DTYPES[str(tensor.dtype).removeprefix("torch.")]
        entries.append(TensorEntry(name, key, dtype, storage.nbytes(), tuple(tensor.shape)))
        # a byte view of the whole storage: bytes(storage) reads it one element at a time
        whole = torch.empty(0, dtype=torch.uint8).set_(storage)
        storages[key] = whole.numpy().tobytes()
    return entries, storages


def archive_bytes(entries: list[TensorEntry], storages: dict[str, bytes]) -> bytes:
    """A whole archive in memory, through the same layout the streaming writer uses."""
    pickle = state_dict_pickle(entries)
    records = layout.torch_records(len(pickle), [(k, len(v)) for k, v in storages.items()])
    placed = layout.place(records)
    contents = layout.small_records(pickle) | {f"data/{k}": v for k, v in storages.items()}
    out, crcs = bytearray(), []
    for (name, _), entry in zip(records, placed, strict=True):
        data = contents[name] if name in contents else layout.serialization_id(placed[:-1], crcs)
        crcs.append(zlib.crc32(data))
        assert len(out) == entry.header_offset
        out += entry.local_header() + data + entry.descriptor(crcs[-1])
    for piece in layout.central_directory(placed, crcs, batch=3):
        out += piece
    return bytes(out)


def saved(state: OrderedDict[str, torch.Tensor]) -> bytes:
    import torch

    buffer = io.BytesIO()
    torch.save(state, buffer)
    return buffer.getvalue()


def assert_like_torch(state: OrderedDict[str, torch.Tensor]) -> None:
    """Our archive equals torch.save's except the first 20 digits of the serialization id
    (torch hashes the record names with C++'s std::hash) and that record's CRC."""
    ours, theirs = archive_bytes(*entries_of(state)), saved(state)
    assert zipfile.ZipFile(io.BytesIO(theirs)).read("archive/data.pkl") == state_dict_pickle(
        entries_of(state)[0]
    )
    assert len(ours) == len(theirs)
    record = zipfile.ZipFile(io.BytesIO(theirs)).getinfo(f"archive/{layout.SERIALIZATION_ID}")
    ours_id = zipfile.ZipFile(io.BytesIO(ours)).read(f"archive/{layout.SERIALIZATION_ID}")
    theirs_id = zipfile.ZipFile(io.BytesIO(theirs)).read(f"archive/{layout.SERIALIZATION_ID}")
    assert ours_id[20:] == theirs_id[20:]  # torch's own c10::hash_combine of the CRCs
    start = theirs.index(theirs_id, record.header_offset)
    differing = [i for i, (a, b) in enumerate(zip(ours, theirs, strict=True)) if a != b]
    allowed = set(range(start, start + 20))  # the id's first half
    allowed |= set(range(start + 44, start + 48))  # its CRC in the data descriptor
    central = theirs.rindex(b"PK\x01\x02")  # its central directory record, the last
    allowed |= set(range(central + 16, central + 20))
    assert set(differing) <= allowed, differing


def test_every_dtype_shape_and_alias_like_torch() -> None:
    import torch

    state: OrderedDict[str, torch.Tensor] = OrderedDict()
    for index, dtype in enumerate(sorted(n for n in TORCH_DTYPES.values() if DTYPES[n].bits >= 8)):
        state[f"{dtype}.matrix"] = random_tensor(dtype, (3, 5), index)
        state[f"{dtype}.scalar"] = random_tensor(dtype, (), index + 100)
        state[f"{dtype}.empty"] = random_tensor(dtype, (2, 0, 3), index)
    state["tied"] = state["F32.matrix"].detach()  # another tensor on the same storage
    state["ünïcode name"] = torch.arange(70000, dtype=torch.int32)  # BININT and BININT2
    assert_like_torch(state)


@pytest.mark.slow
def test_many_tensors_like_torch() -> None:
    """Over 256 memo entries (LONG_BINPUT/LONG_BINGET) and over 1000 items (SETITEMS
    batches, and a batch of one after them)."""
    import torch

    state = OrderedDict(
        (f"t.{i}", torch.full((i % 4,), i, dtype=torch.float16)) for i in range(2001)
    )
    assert_like_torch(state)
    assert_like_torch(OrderedDict(one=torch.ones(1)))
    assert_like_torch(OrderedDict())


@pytest.mark.slow
@settings(max_examples=40, deadline=None)
@given(
    st.lists(
        st.tuples(
            st.sampled_from(["float32", "bfloat16", "float16", "int64", "uint8", "bool"]),
            st.lists(st.integers(0, 300), max_size=4),
            st.booleans(),
        ),
        max_size=12,
    )
)
def test_random_state_dicts_like_torch(specs: list[tuple[str, list[int], bool]]) -> None:
    state: OrderedDict[str, torch.Tensor] = OrderedDict()
    for number, (dtype, shape, tie) in enumerate(specs):
        if tie and state:  # a tied name on the previous tensor's storage
            state[f"tie{number}"] = next(reversed(state.values())).detach()
        else:
            state[f"w{number}"] = random_tensor(dtype, tuple(shape[:2]) if shape else (), number)
    assert_like_torch(state)


@pytest.mark.parametrize(
    "shape", [(), (0,), (3, 0), (2, 0, 3), (1, 1), (4, 1, 2), (5, 7, 9)], ids=str
)
def test_contiguous_strides_are_torchs(shape: tuple[int, ...]) -> None:
    import torch

    assert contiguous_strides(shape) == torch.empty(shape).stride()


# What torch.save wrote for {"small": ones(3), "big": zeros(2**32 + 100, uint8), "after":
# arange(5)} into big.bin (4,294,969,533 bytes): every record's offset and extra field,
# the ZIP64 fields, and the end records.
BIG_RECORDS = [
    ("data.pkl", 338),
    (".format_version", 1),
    (".storage_alignment", 2),
    ("byteorder", 6),
    ("data/0", 12),
    ("data/1", 2**32 + 100),
    ("data/2", 40),
    ("version", 2),
    (".data/serialization_id", 40),
]
BIG_OFFSETS = [0, 418, 529, 658, 790, 924, 4294968444, 4294968576, 4294968666]
BIG_EXTRA_LENGTHS = [22, 45, 59, 67, 66, 60, 28, 23, 46]
BIG_ZIP64_LOCAL = {
    "big/data/1": "0100100064000000010000000000000000000000",
    "big/data/2": "010008007c04000001000000",
    "big/version": "010008000005000001000000",
    "big/.data/serialization_id": "010008005a05000001000000",
}
BIG_ZIP64_CENTRAL = {
    "big/data/1": "0100100064000000010000006400000001000000",
    "big/data/2": "010008007c04000001000000",
    "big/version": "010008000005000001000000",
    "big/.data/serialization_id": "010008005a05000001000000",
}
BIG_END = (
    "504b06062c000000000000001e032d00000000000000000009000000000000000900000000000000"
    "5b020000000000000006000001000000504b0607000000005b0800000100000001000000"
    "504b050600000000090009005b020000ffffffff0000"
)


def test_zip64_layout_like_torch() -> None:
    placed = layout.place(BIG_RECORDS, "big")
    assert [entry.header_offset for entry in placed] == BIG_OFFSETS
    for entry, extra_length in zip(placed, BIG_EXTRA_LENGTHS, strict=True):
        header = entry.local_header()
        fields = struct.unpack("<4sHHHHHIIIHH", header[:30])
        assert fields[2] == 0x0808 and fields[9:] == (len(entry.name), extra_length)
        extra = header[30 + len(entry.name) :]
        assert extra.hex().startswith(BIG_ZIP64_LOCAL.get(entry.name, "") + "4642")
        assert entry.data_offset % 64 == 0
        assert entry.data_offset == entry.header_offset + len(header)
    big = placed[5]
    assert big.descriptor(0xA92A4CE5).hex() == "504b0708e54c2aa9" + "6400000001000000" * 2
    assert len(placed[1].descriptor(0)) == 16 and len(placed[6].descriptor(0)) == 24
    crcs = list(range(len(placed)))
    for entry in placed:
        record = entry.central_record(crcs[placed.index(entry)])
        fields = struct.unpack("<4sHHHHHHIIIHHHHHII", record[:46])
        extra = record[46 + len(entry.name) :]
        assert extra.hex() == BIG_ZIP64_CENTRAL.get(entry.name, "")
        assert fields[16] == min(entry.header_offset, 0xFFFFFFFF)
        assert fields[8] == fields[9] == min(entry.size, 0xFFFFFFFF)
    *directory, end = layout.central_directory(placed, crcs)
    assert sum(map(len, directory)) == 603
    assert end.hex() == BIG_END
    assert placed[-1].end + 603 + len(end) == 4_294_969_533


def test_an_empty_record_has_no_descriptor() -> None:
    (entry,) = layout.place([("data/0", 0)])
    assert entry.descriptor(0) == b"" and entry.end == entry.data_offset
    assert struct.unpack("<H", entry.local_header()[6:8])[0] == 0x0800
