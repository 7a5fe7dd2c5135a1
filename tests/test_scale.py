"""Checkpoints of very many tensors (a mixture of experts: hundreds of experts × layers ×
matrices): the shortcuts that keep them fast give exactly what the plain code gives."""

from __future__ import annotations

import json
import os
import struct
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfix.core.dtypes import numel_of
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
