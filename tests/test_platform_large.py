"""A tensor past 2^31 elements in a file past 4 GiB (sparse), on the system's own primitives
and on the portable ones (reads and writes at offsets without pread, buffered copies): sizes
and offsets are Python integers all the way down, so the bytes at 2^31 and 2^32 arrive
exact, as they did not in readers that kept them in a 32-bit long (safetensors #391)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

import ckptfix
from ckptfix.formats.safetensors import HeaderEntry, encode_header
from ckptfix.io.source import LocalFile
from ckptfix.ops.rewrite import ConvertOptions, ReshardOptions, convert, reshard
from tests.helpers import read_tensors

NUMEL = 2**32 + 2**16  # U8: one element a byte, so the file is past 4 GiB too
MARKED = (0, 2**31 - 1, 2**31, 2**32 - 1, 2**32, NUMEL - 1)  # offsets in the tensor
TAIL = bytes(range(256)) * 16


def _huge_file(path: Path) -> int:
    """`huge` (NUMEL U8 elements, a hole but for a byte at each MARKED offset) and `tail`
    after it; where the data starts."""
    entries = [
        HeaderEntry("huge", "U8", (NUMEL,), 0, NUMEL),
        HeaderEntry("tail", "U8", (len(TAIL),), NUMEL, NUMEL + len(TAIL)),
    ]
    header = encode_header(entries, {"format": "pt"})
    with open(path, "wb") as handle:
        handle.write(header)
        handle.truncate(len(header) + NUMEL + len(TAIL))
        for number, offset in enumerate(MARKED, 1):
            handle.seek(len(header) + offset)
            handle.write(bytes([number]))
        handle.seek(len(header) + NUMEL)
        handle.write(TAIL)
    return len(header)


def _marks(path: Path, start: int) -> list[bytes]:
    with LocalFile(str(path)) as source:
        return [source.read_at(start + offset, 1) for offset in MARKED]


def test_past_2_31_elements_and_4_gib_counted_and_read_exactly(
    each_platform: str, tmp_path: Path
) -> None:
    start = _huge_file(tmp_path / "model.safetensors")
    report = ckptfix.inspect(str(tmp_path / "model.safetensors"))
    assert (report.parameter_count, report.total_bytes) == (NUMEL + 4096, NUMEL + 4096)
    assert _marks(tmp_path / "model.safetensors", start) == [bytes([n]) for n in range(1, 7)]
    out = tmp_path / "out"  # the tensor that starts past 4 GiB, copied on its own
    convert(tmp_path / "model.safetensors", out, ConvertOptions(10**9, exclude=("huge",)))
    assert read_tensors(out) == {"tail": ("U8", (4096,), TAIL)}


@pytest.mark.slow
def test_a_tensor_past_4_gib_is_copied_exactly(each_platform: str, tmp_path: Path) -> None:
    """All of it, verified against its source (the portable mode writes and reads every one
    of those 4 GiB: it copies holes as zeros)."""
    _huge_file(tmp_path / "model.safetensors")
    out = tmp_path / "out"
    reshard(tmp_path / "model.safetensors", out, ReshardOptions(10 * 2**30))
    [written] = sorted(out.glob("*.safetensors"))
    header = ckptfix.inspect(str(written))
    assert (header.parameter_count, [f.code for f in header.findings]) == (
        NUMEL + 4096,
        ["huge-numel"],
    )
    data_start = os.path.getsize(written) - NUMEL - len(TAIL)
    assert _marks(written, data_start) == [bytes([n]) for n in range(1, 7)]
    with LocalFile(str(written)) as source:
        assert source.read_at(data_start + NUMEL, len(TAIL)) == TAIL
