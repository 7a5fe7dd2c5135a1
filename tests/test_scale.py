"""Checkpoints of very many tensors (a mixture of experts: hundreds of experts × layers ×
matrices): the shortcuts that keep them fast give exactly what the plain code gives."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import orjson
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfix.core.dtypes import numel_of
from ckptfix.core.errors import CorruptFileError
from ckptfix.formats import safetensors, strict_json
from ckptfix.formats.safetensors import Fields, encode_fields, header_size, read_header
from tests.builders import Factory, Spec, seeded_bytes, torch_dtype
from tests.helpers import cli, load_safetensors_folder, tensor_names, torch_bytes

EXAMPLES = max(int(os.environ.get("CKPTFIX_FUZZ_EXAMPLES", "300")) // 3, 30)
# Names that need every kind of escape, and none: quotes, backslashes, control characters,
# DEL, non-ASCII, astral characters, the metadata key itself.
NAMES = st.one_of(
    st.text(alphabet="abc._0123", max_size=8),
    st.text(max_size=6),  # any character but a lone surrogate (hypothesis's default)
    st.sampled_from(["__metadata__", '"', "\\", "\n", "\x7f", "é", "😀"]),
)
SHAPES = st.lists(st.integers(0, 2**64 - 1), max_size=3).map(tuple)
METADATA = st.one_of(
    st.none(),
    st.just({}),
    st.dictionaries(st.text(max_size=5), st.text(max_size=5), max_size=3),
)


def _reference(entries: Sequence[Fields], metadata: Mapping[str, str] | None) -> bytes:
    """The encoder as it was written first: one dict, json.dumps."""
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = dict(metadata)
    for name, dtype, shape, begin, end in entries:
        header[name] = {"dtype": dtype, "shape": list(shape), "data_offsets": [begin, end]}
    body = json.dumps(header, separators=(",", ":"), ensure_ascii=False).encode("utf-8")
    body += b" " * (-len(body) % 8)
    return struct.pack("<Q", len(body)) + body


@st.composite
def headers(draw: st.DrawFn) -> tuple[list[Fields], Mapping[str, str] | None]:
    names = draw(st.lists(NAMES, max_size=12))
    entries: list[Fields] = []
    offset = 0
    for name in names:
        size = draw(st.integers(0, 2**40))
        dtype = draw(st.sampled_from(["F32", "BF16", "U8", "F8_E4M3"]))
        entries.append((name, dtype, draw(SHAPES), offset, offset + size))
        offset += size
    return entries, draw(METADATA)


@pytest.mark.slow
@settings(max_examples=EXAMPLES, deadline=None)
@given(headers())
def test_header_encoding_and_size_are_the_plain_encoders(
    header: tuple[list[Fields], Mapping[str, str] | None],
) -> None:
    """encode_fields (batched, orjson) writes the bytes json.dumps writes, and header_size
    counts them without encoding, whatever the names hold (repeated ones included)."""
    entries, metadata = header
    expected = _reference(entries, metadata)
    assert encode_fields(entries, metadata) == expected
    names = [entry[0] for entry in entries]
    offsets = [0, *(entry[4] for entry in entries)] if entries else [0]
    shapes = [tuple(entry[2]) for entry in entries]
    dtypes = [entry[1] for entry in entries]
    assert header_size(names, dtypes, shapes, offsets, metadata) == len(expected)


@pytest.mark.slow
def test_a_header_of_many_batches_is_one_document() -> None:
    """More entries than one batch (and a repeat across batches, where the last value wins
    at the first place, as in one dict)."""
    entries: list[Fields] = [(f"t.{i}", "U8", (1,), i, i + 1) for i in range(10_000)]
    entries.append(("t.3", "F32", (2,), 7, 9))
    for subset in (entries[:-1], entries):
        assert encode_fields(subset, {"format": "pt"}) == _reference(subset, {"format": "pt"})


# Experts as a mixture writes them: a few shapes and dtypes repeated across many names.
_KINDS = [("F32", (2, 3)), ("BF16", (4,)), ("U8", (3, 1)), ("F32", (1,)), ("I64", ())]


def _experts(factory: Factory, files: int, per_file: int) -> tuple[Path, list[Spec]]:
    """A model folder of `files` shards holding `per_file` expert tensors each, indexed."""
    specs = [
        Spec(f"model.layers.{f}.experts.{i}.w", *_KINDS[(f + i) % len(_KINDS)])
        for f in range(files)
        for i in range(per_file)
    ]
    weight_map = {}
    for f in range(files):
        shard = f"model-{f + 1:05d}-of-{files:05d}.safetensors"
        factory.safetensors(f"moe/{shard}", specs[f * per_file : (f + 1) * per_file])
        weight_map.update({spec.name: shard for spec in specs[f * per_file : (f + 1) * per_file]})
    total = sum(spec.nbytes() for spec in specs)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    factory.bytes("moe/model.safetensors.index.json", json.dumps(index).encode())
    return factory.root / "moe", specs


def _stored(specs: Sequence[Spec]) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    return {
        spec.name: (spec.dtype, spec.shape, seeded_bytes(spec.nbytes(), spec.name))
        for spec in specs
    }


@pytest.mark.slow
def test_many_tensors_over_several_files_are_counted_exactly(factory: Factory) -> None:
    """More tensors than any batch, over three files, several dtypes and shapes repeated:
    the report's totals are the sums over every tensor (the one-pass totals, the shared
    shapes), and no name is taken for stored twice."""
    folder, specs = _experts(factory, 3, 2_500)
    document = cli("inspect", folder, "--json").json()
    by_dtype: dict[str, int] = {}
    for spec in specs:
        by_dtype[spec.dtype] = by_dtype.get(spec.dtype, 0) + spec.nbytes()
    assert document["tensor_count"] == len(specs)
    assert document["total_bytes"] == sum(by_dtype.values())
    assert document["parameter_count"] == sum(numel_of(spec.shape) for spec in specs)
    assert list(document["dtypes"].items()) == sorted(by_dtype.items(), key=lambda i: (-i[1], i[0]))
    assert [t["name"] for t in document["tensors"]] == [spec.name for spec in specs]
    assert [t["shape"] for t in document["tensors"]] == [list(spec.shape) for spec in specs]
    codes = {item["code"] for item in document["findings"]}
    assert not codes & {"duplicate-name", "index-missing-tensor", "index-unlisted-tensor"}


@pytest.mark.slow
@pytest.mark.parametrize("max_shard", ["20KB", "10GB"], ids=["many-shards", "one-shard"])
def test_many_tensors_resharded_bitwise_in_order(
    factory: Factory, tmp_path: Path, max_shard: str
) -> None:
    """A reshard of 7,500 tensors (headers of more entries than one encoding batch) keeps
    every tensor's bytes, dtype and shape, read back by safetensors itself, in the source's
    order; each shard within the limit, or everything in one file when it all fits."""
    folder, specs = _experts(factory, 3, 2_500)
    out = tmp_path / "out"
    run = cli("reshard", folder, "-o", out, "--max-shard", max_shard)
    assert run.code == 0, run.stderr
    files = sorted(out.glob("*.safetensors"))
    if max_shard == "10GB":
        assert [file.name for file in files] == ["model.safetensors"]
    else:
        assert len(files) > 3
        assert all(
            read_header(file).file_size - read_header(file).header_size - 8 <= 20_000
            for file in files
        )
    assert tensor_names(out) == [spec.name for spec in specs]
    written = load_safetensors_folder(out)
    assert {
        name: (str(tensor.dtype), tuple(tensor.shape), torch_bytes(tensor))
        for name, tensor in written.items()
    } == {
        name: (str(torch_dtype(dtype)), shape, data)
        for name, (dtype, shape, data) in _stored(specs).items()
    }


# Keys that put `},"`, braces, brackets and commas inside strings, a name given twice, the
# metadata anywhere (or twice), values that are no tensor entry (nested objects, lists).
KEYS = st.one_of(
    st.sampled_from(["a", "b},", "c}", '{"', "},", "[", "__metadata__", ""]),
    st.text(alphabet="ab},[{:", min_size=1, max_size=6),
)
VALUES = st.one_of(
    st.builds(
        lambda size: f'{{"dtype":"U8","shape":[{size}],"data_offsets":[0,{size}]}}',
        st.integers(0, 3),
    ),
    st.just('{"format":"pt","note":"},\\"x"}'),  # an escape: the whole object is parsed
    st.just('{"format":"pt"}'),
    st.just('{"a":{"b":{}},"c":{}}'),
    st.just("[1]"),
    st.just('{"dtype":"U8","shape":[1],"data_offsets":[0,1],"extra":{"x":{}}}'),
)


def _headers(draw: st.DrawFn) -> bytes:
    members = draw(st.lists(st.tuples(KEYS, VALUES), max_size=8))
    text = "{" + ",".join(f"{json.dumps(key)}:{value}" for key, value in members) + "}"
    return text.encode() + b" " * draw(st.integers(0, 9))


@settings(max_examples=EXAMPLES, deadline=None)
@given(st.data(), st.integers(1, 40))
def test_a_header_read_in_parts_is_the_header_read_whole(
    data: st.DataObject, part_size: int
) -> None:
    """A large header is parsed a part at a time (strict_json.Parts; here parts of a few
    bytes); whatever the parts cut through (strings, nested objects), the result is the
    whole parse's, or none, and then the whole parse decides (its error, if any, is the one
    reported)."""
    raw = _headers(data.draw)
    parted = safetensors._read_in_parts(raw, 0, "x.safetensors", part_size)
    try:
        whole = safetensors._read_whole(raw, 0, "x.safetensors")
    except CorruptFileError:
        assert parted is None
    else:
        assert parted in (None, whole)


@settings(max_examples=EXAMPLES, deadline=None)
@given(
    st.lists(st.tuples(st.text(alphabet="ab},[{:", min_size=1, max_size=6), st.integers(0, 3))),
    st.integers(1, 40),
)
def test_a_well_formed_header_is_read_in_parts(
    entries: list[tuple[str, int]], part_size: int
) -> None:
    """Every well-formed header that orjson's parse is trusted with (strict_json._fast_json)
    is read in parts when large enough, names holding `},"`, braces and brackets included."""
    names = list(dict.fromkeys(name for name, _ in entries))
    sizes = [size for _, size in entries][: len(names)]
    offsets = [0]
    for size in sizes:
        offsets.append(offsets[-1] + size)
    header = {"__metadata__": {"format": "pt"}} | {
        name: {"dtype": "U8", "shape": [size], "data_offsets": [offsets[i], offsets[i + 1]]}
        for i, (name, size) in enumerate(zip(names, sizes, strict=True))
    }
    raw = json.dumps(header, separators=(",", ":")).encode()
    parted = safetensors._read_in_parts(raw, 8, "x.safetensors", part_size)
    if len(raw) < 2 * part_size or strict_json._fast_json(raw) is None:
        assert parted is None  # small, or a name orjson's parse is not trusted with
    else:
        assert parted == safetensors._read_whole(raw, 8, "x.safetensors")


class _Counting:
    """orjson, counting the texts it parses."""

    JSONDecodeError = orjson.JSONDecodeError

    def __init__(self, sizes: list[int]) -> None:
        self.sizes = sizes

    def loads(self, data: bytes) -> Any:
        self.sizes.append(len(data))
        return orjson.loads(data)


@pytest.mark.slow
def test_a_large_header_is_read_in_parts_exactly(
    factory: Factory, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A header of 60,000 tensors (several parts) is read a part at a time, with its
    metadata, as it is read whole."""
    specs = [Spec(f"experts.{index}.w", "U8", (index % 3,)) for index in range(60_000)]
    path = factory.safetensors("large.safetensors", specs, {"note": "},[x"})
    raw = path.read_bytes()
    size = struct.unpack("<Q", raw[:8])[0]
    body = raw[8 : 8 + size]
    parted = safetensors._read_in_parts(body, 8 + size, str(path))
    assert parted is not None
    assert parted == safetensors._read_whole(body, 8 + size, str(path))
    assert parted[0] == {"note": "},[x", "format": "pt"}
    sizes: list[int] = []
    monkeypatch.setattr(strict_json, "orjson", _Counting(sizes))
    # As a header the column reader leaves to the general reader (one with spaces, say).
    monkeypatch.setattr(safetensors, "read_columns", lambda *_: None)
    assert read_header(path).tensors == tuple(parted[2])
    assert len(sizes) > 2
    assert max(sizes) < 2 * strict_json.PART_SIZE  # a part at a time, never the whole
