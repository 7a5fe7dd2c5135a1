"""Mutated headers and indexes: only our own error type may ever escape the readers.

`make test` runs a small budget; `make fuzz` sets CKPTFIX_FUZZ_EXAMPLES for a long run.
"""

from __future__ import annotations

import contextlib
import functools
import io
import json
import os
import pickletools
import shutil
import struct
import zipfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfix
from ckptfix.core.errors import CorruptFileError
from ckptfix.formats.index import read_index
from ckptfix.formats.safetensors import HeaderEntry, encode_header, read_header
from tests.builders import zip_checkpoint
from tests.helpers import read_weights

EXAMPLES = int(os.environ.get("CKPTFIX_FUZZ_EXAMPLES", "300"))
FUZZ = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)

VALID = encode_header(
    [
        HeaderEntry("embed.weight", "BF16", (4, 2), 0, 16),
        HeaderEntry("norm", "F32", (2,), 16, 24),
        HeaderEntry("empty", "U8", (0,), 24, 24),
    ],
    {"format": "pt"},
) + bytes(range(24))
VALID_INDEX = json.dumps(
    {
        "metadata": {"total_size": 24},
        "weight_map": {
            "embed.weight": "model-00001-of-00002.safetensors",
            "norm": "model-00002-of-00002.safetensors",
        },
    }
).encode()


@st.composite
def mutations(draw: st.DrawFn, base: bytes) -> bytes:
    data = bytearray(base)
    for _ in range(draw(st.integers(1, 4))):
        kind = draw(st.sampled_from(["flip", "truncate", "splice", "insert", "delete", "length"]))
        if not data:
            break
        at = draw(st.integers(0, len(data) - 1))
        if kind == "flip":
            data[at] ^= 1 << draw(st.integers(0, 7))
        elif kind == "truncate":
            del data[at:]
        elif kind == "splice":
            start = draw(st.integers(0, len(base) - 1))
            data[at : at + 8] = base[start : start + draw(st.integers(1, 16))]
        elif kind == "insert":
            data[at:at] = draw(st.binary(min_size=1, max_size=8))
        elif kind == "delete":
            del data[at : at + draw(st.integers(1, 8))]
        elif kind == "length" and len(data) >= 8:
            data[:8] = struct.pack("<Q", draw(st.integers(0, 2**64 - 1)))
    return bytes(data)


@pytest.mark.slow
@FUZZ
@given(mutations(VALID))
def test_mutated_safetensors_only_raise_our_error(tmp_path: Path, blob: bytes) -> None:
    path = tmp_path / "fuzz.safetensors"
    path.write_bytes(blob)
    try:
        header = read_header(path)
    except CorruptFileError as exc:
        assert exc.rule and "\n" not in exc.line()
    else:
        # Whatever is accepted must be self-consistent: tensors tile the data exactly.
        end = header.data_start
        for tensor in header.tensors:
            assert tensor.byte_range[0] == end
            end = tensor.byte_range[1]
        assert end == len(blob)
    report = ckptfix.inspect(path)  # inspect turns every problem into a finding
    assert all(
        item.code
        in {
            "corrupt-file",
            "lfs-pointer",
            "unsupported-format",
            "missing-format-metadata",
            "empty-name",
            "dtype-mix",
        }
        for item in report.findings
    )


@pytest.mark.slow
@FUZZ
@given(st.binary(max_size=256))
def test_random_bytes(tmp_path: Path, blob: bytes) -> None:
    path = tmp_path / "random.safetensors"
    path.write_bytes(blob)
    with contextlib.suppress(CorruptFileError):
        read_header(path)
    ckptfix.inspect(path)


@pytest.mark.slow
@FUZZ
@given(mutations(VALID_INDEX))
def test_mutated_index_only_raise_our_error(tmp_path: Path, blob: bytes) -> None:
    path = tmp_path / "model.safetensors.index.json"
    path.write_bytes(blob)
    try:
        index = read_index(path, str(path), "safetensors")
    except CorruptFileError as exc:
        assert exc.rule
    else:
        assert all(isinstance(name, str) for name in index.weight_map.values())
    ckptfix.inspect(tmp_path)


entries = st.fixed_dictionaries(
    {},
    optional={
        "dtype": st.one_of(st.sampled_from(["F32", "BF16", "F4", "U8", "f32", "X"]), st.integers()),
        "shape": st.one_of(
            st.lists(st.one_of(st.integers(-2, 2**65), st.booleans(), st.floats()), max_size=3),
            st.integers(),
            st.none(),
        ),
        "data_offsets": st.one_of(
            st.lists(st.one_of(st.integers(-2, 2**65), st.booleans()), max_size=3), st.none()
        ),
        "extra": st.integers(),
    },
)


@pytest.mark.slow
@FUZZ
@given(st.one_of(entries, st.integers(), st.lists(st.integers())))
def test_fast_path_never_accepts_what_the_slow_path_refuses(entry: object) -> None:
    from ckptfix.formats.safetensors import _check_entry, _fast_entry

    fast = _fast_entry(entry)
    try:
        slow = _check_entry("t", entry, "x.safetensors")
    except CorruptFileError:
        assert fast is None
    else:
        assert fast in (None, slow)


json_scalars = st.one_of(
    st.integers(-3, 2**66), st.text(max_size=6), st.booleans(), st.none(), st.floats()
)
json_values = st.recursive(
    json_scalars,
    lambda inner: (
        st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=4), inner, max_size=3)
    ),
    max_leaves=12,
)


@pytest.mark.slow  # about a second: 300 recursive JSON documents
@FUZZ
@given(
    st.dictionaries(st.text(max_size=6), json_values, max_size=6),
    st.sampled_from([(",", ":"), (", ", ": "), (",", " : "), (",\n", ":\t")]),
    st.booleans(),
    st.data(),
)
def test_fast_json_equals_strict_json(
    document: dict[str, object], separators: tuple[str, str], duplicate: bool, data: st.DataObject
) -> None:
    from ckptfix.formats.strict_json import _fast_json, strict_json

    text = json.dumps(document, separators=separators, ensure_ascii=data.draw(st.booleans()))
    if duplicate and document:
        key = data.draw(st.sampled_from(sorted(document)))
        entry = json.dumps({key: document[key]}, separators=separators)[1:-1]
        text = text[:-1] + separators[0] + entry + "}"
    raw = text.encode("utf-8", "surrogatepass")
    fast = _fast_json(raw)
    try:
        strict = strict_json(raw, "x")
    except CorruptFileError:
        assert fast is None
    else:
        assert fast is None or fast == strict


# --- pickles, and write commands on mutated inputs ------------------------------------------


# The pickles torch itself writes are built on first use, not at import: collecting the suite
# must not import torch. st.deferred builds the strategies over them when a test first draws.


def _views_state() -> dict[str, object]:
    import torch

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    return {"w": base, "t": base.t(), "row": base[1], "tied": base, "i": torch.arange(3)}


@functools.cache
def data_pkl() -> bytes:
    """data.pkl of a torch.save zip holding views, an alias and an integer tensor."""
    import torch

    buffer = io.BytesIO()
    torch.save(_views_state(), buffer)
    with zipfile.ZipFile(io.BytesIO(buffer.getvalue())) as archive:
        return archive.read(next(n for n in archive.namelist() if n.endswith("data.pkl")))


@functools.cache
def legacy_file() -> bytes:
    """The same state dict as a legacy (pre-1.6) torch.save file."""
    import torch

    legacy = io.BytesIO()
    torch.save(_views_state(), legacy, _use_new_zipfile_serialization=False)
    return legacy.getvalue()


WRITE_FUZZ = settings(
    max_examples=max(EXAMPLES // 3, 20),
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)


def _write_attempt(source: Path, out: Path) -> None:
    """convert must either fail with our error and leave nothing, or write valid output."""
    from ckptfix.core.errors import CkptfixError
    from ckptfix.ops.rewrite import convert

    try:
        convert(source, out)
    except CkptfixError:
        assert not out.exists()
    else:
        assert not [f for f in ckptfix.inspect(out).findings if f.severity.value == "error"]
        shutil.rmtree(out)
    assert not list(out.parent.glob(".ckptfix-*"))


@pytest.mark.slow
@WRITE_FUZZ
@given(st.deferred(lambda: mutations(data_pkl())))
def test_mutated_pickle_in_zip(tmp_path: Path, blob: bytes) -> None:
    from ckptfix.core.errors import CkptfixError

    storages = {str(key): bytes(48) for key in range(4)}
    path = zip_checkpoint(tmp_path / "m.pt", blob, storages)
    with contextlib.suppress(CkptfixError):
        read_weights(path)
    ckptfix.inspect(path)
    _write_attempt(path, tmp_path / "out")


@WRITE_FUZZ
@given(st.deferred(lambda: mutations(legacy_file())))
def test_mutated_legacy_file(tmp_path: Path, blob: bytes) -> None:
    path = tmp_path / "legacy.pt"
    path.write_bytes(blob)
    ckptfix.inspect(path)
    _write_attempt(path, tmp_path / "out")


@WRITE_FUZZ
@given(mutations(VALID))
def test_mutated_safetensors_through_reshard(tmp_path: Path, blob: bytes) -> None:
    from ckptfix.core.errors import CkptfixError
    from ckptfix.ops.rewrite import ReshardOptions, reshard

    path = tmp_path / "m.safetensors"
    path.write_bytes(blob)
    out = tmp_path / "out"
    try:
        reshard(path, out, ReshardOptions(max_shard=16))
    except CkptfixError:
        assert not out.exists()
    else:
        assert ckptfix.inspect(out).exit_code() == 0
        shutil.rmtree(out)
    assert not list(tmp_path.glob(".ckptfix-*"))


# --- opcode-level pickle mutations and zip header mutations (the security review's shapes) ---


@functools.cache
def op_boundaries() -> list[int]:
    """Where each opcode of data_pkl() starts."""
    return [position for _, _, position in pickletools.genops(data_pkl())]


_FIELDS = ["stride", "dtype", "nbytes", "offset", "shape", "storage", "__call__", "key"]


@st.composite
def hostile_opcodes(draw: st.DrawFn) -> bytes:
    """One opcode (with an argument drawn to hurt) of the kinds that mutate, index or size."""
    kind = draw(st.sampled_from(["single", "put", "get", "frame", "build", "int"]))
    if kind == "single":
        return draw(st.sampled_from(list(b"bsua e012(t\x85\x86\x87)}]N\x94R\x81Q\x93."))).to_bytes(
            1, "little"
        )
    if kind == "put":
        return b"r" + struct.pack("<I", draw(st.integers(0, 2**32 - 1)))
    if kind == "get":
        return (
            draw(st.sampled_from([b"j", b"h"]))
            + struct.pack("<I", draw(st.integers(0, 2**32 - 1)))[:4]
        )
    if kind == "frame":
        return b"\x95" + struct.pack("<Q", draw(st.integers(0, 2**64 - 1)))
    if kind == "int":
        return b"J" + struct.pack("<i", draw(st.integers(-(2**31), 2**31 - 1)))
    field = draw(st.sampled_from(_FIELDS)).encode()
    value = draw(
        st.sampled_from([b"N", b"J\xff\xff\xff\xff", b")", b"K\x07\x85", b"X\x01\x00\x00\x00x"])
    )
    return b"}X" + struct.pack("<I", len(field)) + field + value + b"sb"


@st.composite
def opcode_mutations(draw: st.DrawFn) -> bytes:
    """data_pkl() with hostile opcodes inserted at (or replacing the opcode at) opcode
    boundaries after a valid prefix."""
    data = bytearray(data_pkl())
    for _ in range(draw(st.integers(1, 3))):
        at = draw(st.sampled_from(op_boundaries()[1:]))
        if at >= len(data):
            continue
        ops = draw(hostile_opcodes())
        if draw(st.booleans()):
            data[at:at] = ops
        else:
            data[at : at + 1] = ops
    return bytes(data)


@pytest.mark.slow
@WRITE_FUZZ
@given(opcode_mutations())
def test_opcode_mutations_in_zip(tmp_path: Path, blob: bytes) -> None:
    path = zip_checkpoint(tmp_path / "m.pt", blob, {str(key): bytes(48) for key in range(4)})
    ckptfix.inspect(path)
    _write_attempt(path, tmp_path / "out")


def _zip_fields(data: bytes) -> list[tuple[int, int]]:
    """(offset, width) of every header field worth corrupting: flags, method, CRC, sizes and
    name lengths of local headers and central records, and the end record's counts and offset."""
    fields: list[tuple[int, int]] = []
    for signature, layout in (
        (b"PK\x03\x04", [(6, 2), (8, 2), (14, 4), (18, 4), (22, 4), (26, 2), (28, 2)]),
        (b"PK\x01\x02", [(8, 2), (10, 2), (16, 4), (20, 4), (24, 4), (28, 2), (30, 2), (42, 4)]),
        (b"PK\x05\x06", [(8, 2), (10, 2), (12, 4), (16, 4)]),
    ):
        at = data.find(signature)
        while at >= 0:
            fields.extend((at + offset, width) for offset, width in layout)
            at = data.find(signature, at + 4)
    return fields


@functools.cache
def torch_zip() -> bytes:
    """A whole torch.save zip: a matrix, its transpose and an integer tensor."""
    import torch

    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    buffer = io.BytesIO()
    torch.save({"w": base, "t": base.t(), "i": torch.arange(3)}, buffer)
    return buffer.getvalue()


@pytest.mark.slow
@WRITE_FUZZ
@given(
    st.lists(
        st.tuples(
            st.deferred(lambda: st.sampled_from(_zip_fields(torch_zip()))),
            st.integers(0, 2**32 - 1),
        ),
        min_size=1,
        max_size=3,
    )
)
def test_zip_header_mutations(tmp_path: Path, edits: list[tuple[tuple[int, int], int]]) -> None:
    data = bytearray(torch_zip())
    for (offset, width), value in edits:
        data[offset : offset + width] = (value % (1 << (8 * width))).to_bytes(width, "little")
    path = tmp_path / "m.pt"
    path.write_bytes(bytes(data))
    ckptfix.inspect(path)
    _write_attempt(path, tmp_path / "out")
