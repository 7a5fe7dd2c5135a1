"""Tensors made of pieces: row blocks in several files (dim-0 shards), column blocks as
repeated runs (dim-1 shards), flat ranges (ZeRO partitions). Read back in row-major order,
written by the streaming writer, and checked for exact tiling."""

from __future__ import annotations

import itertools
import os
from pathlib import Path
from unittest import mock

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfix.core.errors import CorruptFileError, SourceChangedError
from ckptfix.core.tensor import Piece, TensorInfo, tiling_problem
from ckptfix.formats.safetensors import read_header
from ckptfix.io import gather
from ckptfix.io.gather import tensor_bytes, tensor_into
from ckptfix.io.source import ByteSource, LocalFile
from ckptfix.plan.select import OutTensor
from ckptfix.plan.shards import plan_shards
from ckptfix.write.safetensors import ShardJob, write_shards

PROPERTY = settings(
    max_examples=60,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)


@st.composite
def layouts(draw: st.DrawFn, rows: int, cols: int) -> list[tuple[str, int, int]]:
    """How to split a rows×cols matrix: ("rows", start, stop) blocks, ("cols", ...) blocks,
    or ("flat", start, stop) element ranges."""
    kind = draw(st.sampled_from(["rows", "cols", "flat"]))
    total = {"rows": rows, "cols": cols, "flat": rows * cols}[kind]
    cuts = sorted(set(draw(st.lists(st.integers(1, max(total - 1, 1)), max_size=3))))
    bounds = [0, *[c for c in cuts if 0 < c < total], total]
    return [(kind, a, b) for a, b in itertools.pairwise(bounds)]


def _write_parts(
    root: Path, matrix: np.ndarray, parts: list[tuple[str, int, int]]
) -> tuple[Piece, ...]:
    """Each part saved row-major to its own file (after a few bytes of padding), and the
    piece that puts it back in place."""
    rows, cols = matrix.shape
    item = matrix.itemsize
    pieces = []
    for number, (kind, start, stop) in enumerate(parts):
        path = root / f"part{number}.bin"
        if kind == "rows":
            block = matrix[start:stop]
            piece = Piece(str(path), 3, block.nbytes, at=start * cols * item)
        elif kind == "cols":
            block = matrix[:, start:stop]
            width = (stop - start) * item
            piece = Piece(
                str(path),
                3,
                width,
                at=start * item,
                count=rows,
                source_step=width,
                tensor_step=cols * item,
            )
        else:
            block = matrix.reshape(-1)[start:stop]
            piece = Piece(str(path), 3, block.nbytes, at=start * item)
        path.write_bytes(b"pad" + np.ascontiguousarray(block).tobytes())
        pieces.append(piece)
    return tuple(pieces)


@pytest.mark.slow
@PROPERTY
@given(st.integers(1, 7), st.integers(1, 7), st.data())
def test_pieces_read_and_write_back_in_row_major_order(
    tmp_path_factory: pytest.TempPathFactory, rows: int, cols: int, data: st.DataObject
) -> None:
    root = tmp_path_factory.mktemp("pieces")
    matrix = np.arange(rows * cols, dtype=np.int32).reshape(rows, cols) * 7 + 1
    pieces = _write_parts(root, matrix, data.draw(layouts(rows, cols)))
    tensor = TensorInfo(
        "m", "I32", (rows, cols), matrix.nbytes, pieces[0].source, (0, 0), spread=pieces
    )
    assert tiling_problem(tensor) is None
    sources = {piece.source: LocalFile(piece.source) for piece in pieces}
    assert tensor_bytes(sources.__getitem__, tensor) == matrix.tobytes()
    # straight into memory (the library's get), from the files and through read_at, run by
    # run and (runs this short) gathered in windows
    for source_of in (sources.__getitem__, lambda label: _NoFd(sources[label])):
        for below in (0, gather.GATHER_BELOW):
            into = bytearray(matrix.nbytes)
            with mock.patch.object(gather, "GATHER_BELOW", below):
                tensor_into(source_of, tensor, memoryview(into))
            assert bytes(into) == matrix.tobytes()
    # through the writer, with a chunk-sized window smaller than the tensor
    out = root / "out"
    out.mkdir()
    plan = plan_shards([("m", matrix.nbytes)], 10**9)
    job = ShardJob(
        {"m": OutTensor.same(tensor)},
        [{"format": "pt"}],
        {},
        sources.__getitem__,
        str(out),
        str(out),
    )
    write_shards(plan, job)
    header = read_header(out / "model.safetensors")
    begin, end = header.tensors[0].byte_range
    assert (out / "model.safetensors").read_bytes()[begin:end] == matrix.tobytes()
    for source in sources.values():
        source.close()


class _NoFd:
    """A source without a descriptor (as a remote file is), reading through `read_at`."""

    def __init__(self, source: ByteSource) -> None:
        self.source, self.label, self.size = source, source.label, source.size

    def read_at(self, offset: int, size: int) -> bytes:
        return self.source.read_at(offset, size)


def test_a_file_that_shrinks_under_tensor_into_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "part.bin"
    path.write_bytes(bytes(range(64)))
    tensor = TensorInfo("t", "U8", (64,), 64, str(path), (0, 64), spread=(Piece(str(path), 0, 64),))
    with LocalFile(str(path)) as source:
        assert source.size == 64
        os.truncate(path, 40)  # after its size was taken: it changed under us
        with pytest.raises(SourceChangedError):
            tensor_into(source, tensor, memoryview(bytearray(64)))
        longer = TensorInfo(
            "t", "U8", (80,), 80, str(path), (0, 80), spread=(Piece(str(path), 0, 80),)
        )
        with pytest.raises(CorruptFileError, match="points to byte 80 but the file has 64"):
            tensor_into(source, longer, memoryview(bytearray(80)))


def test_a_local_file_closes_its_descriptor_once(tmp_path: Path) -> None:
    """A second close() (an owner's, after the file was closed once) must not close the
    number again, by then maybe another file's."""
    (tmp_path / "a").write_bytes(b"a")
    (tmp_path / "b").write_bytes(b"b")
    source = LocalFile(str(tmp_path / "a"))
    with source.held() as number:
        pass
    source.close()
    other = os.open(tmp_path / "b", os.O_RDONLY)  # the lowest free number: the same one
    try:
        assert other == number
        source.close()
        assert os.pread(other, 1, 0) == b"b"  # still open
    finally:
        os.close(other)


def test_window_assembly_across_chunks(tmp_path: Path) -> None:
    """Column blocks of a 300×200 int32 matrix read through windows of 4 KiB."""
    from ckptfix.io.gather import tensor_chunks

    matrix = np.arange(300 * 200, dtype=np.int32).reshape(300, 200)
    pieces = _write_parts(tmp_path, matrix, [("cols", 0, 77), ("cols", 77, 200)])
    tensor = TensorInfo(
        "m", "I32", (300, 200), matrix.nbytes, pieces[0].source, (0, 0), spread=pieces
    )
    sources = {piece.source: LocalFile(piece.source) for piece in pieces}
    chunks = list(tensor_chunks(sources.__getitem__, tensor, 4096))
    assert all(len(chunk) <= 4096 for chunk in chunks)
    assert b"".join(chunks) == matrix.tobytes()


def _tensor(*pieces: Piece, nbytes: int = 16) -> TensorInfo:
    return TensorInfo("t", "U8", (nbytes,), nbytes, "f", (0, 0), spread=pieces)


def test_tiling_problems_are_named() -> None:
    assert tiling_problem(_tensor(Piece("a", 0, 8), Piece("b", 0, 8, at=8))) is None
    assert "come from no piece" in str(
        tiling_problem(_tensor(Piece("a", 0, 8), Piece("b", 0, 4, at=12)))
    )
    assert "come from two pieces" in str(
        tiling_problem(_tensor(Piece("a", 0, 8), Piece("b", 0, 8, at=4)))
    )
    assert "reach past its end" in str(
        tiling_problem(_tensor(Piece("a", 0, 8), Piece("b", 0, 10, at=8)))
    )
    assert "only up to byte 8" in str(tiling_problem(_tensor(Piece("a", 0, 8))))
    repeated = Piece("a", 0, 2, count=8, source_step=2, tensor_step=2)
    assert tiling_problem(_tensor(repeated)) is None
    overlapping = Piece("a", 0, 4, count=4, source_step=4, tensor_step=2)
    assert "two pieces" in str(tiling_problem(_tensor(overlapping, nbytes=10)))


def test_one_piece_tensors_keep_their_range(tmp_path: Path) -> None:
    tensor = TensorInfo("w", "F32", (2,), 8, "x.safetensors", (100, 108))
    assert tensor.pieces == (Piece("x.safetensors", 100, 8),)
    view = TensorInfo("v", "F32", (2, 2), 16, "x.bin", (64, 96), contiguous=False, strides=(1, 2))
    assert view.pieces == (Piece("x.bin", 64, 32, view=((2, 2), (1, 2))),)
    assert os.path.basename(view.sources[0]) == "x.bin"
