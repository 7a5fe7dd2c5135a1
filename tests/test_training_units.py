"""The arithmetic of training layouts on plain data: chunks placed as pieces (gathered back
with io.gather and compared with numpy), chunk tiling, and ZeRO's reconstruction (compared
with a numpy transcription of zero_to_fp32.py's concatenations)."""

from __future__ import annotations

import itertools
from pathlib import Path

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ckptfix.core.tensor import Piece, TensorInfo, tiling_problem
from ckptfix.io.gather import tensor_bytes
from ckptfix.io.source import LocalFile
from ckptfix.layouts.chunks import (
    Placed,
    TooManyChunks,
    chunk_pieces,
    first_overlap,
    pieces_needed,
)
from ckptfix.layouts.zero_weights import ReconstructionError, Segment, stage3, stage12


def _cuts(size: int, parts: int) -> list[tuple[int, int]]:
    """Uneven cuts, like torch.chunk: ceil-sized parts, the last ones shorter or empty."""
    step = -(-size // parts) if size else 0
    return [(min(i * step, size), max(0, min(step, size - i * step))) for i in range(parts)]


@pytest.mark.slow
@settings(max_examples=60, deadline=None)
@given(
    shape=st.lists(st.integers(0, 5), min_size=0, max_size=4).map(tuple),
    parts=st.lists(st.integers(1, 3), min_size=4, max_size=4),
)
def test_chunks_placed_as_pieces_rebuild_the_tensor(
    tmp_path_factory: pytest.TempPathFactory, shape: tuple[int, ...], parts: list[int]
) -> None:
    full = np.arange(int(np.prod(shape)), dtype=np.int32).reshape(shape)
    grids = [_cuts(dim, count) for dim, count in zip(shape, parts, strict=False)]
    path: Path = tmp_path_factory.mktemp("chunks") / "rank.bin"
    data, placed = bytearray(b"junk"), []
    for cell in itertools.product(*grids):
        offsets = tuple(o for o, _ in cell)
        sizes = tuple(s for _, s in cell)
        block = full[tuple(slice(o, o + s) for o, s in cell)]
        if block.size:
            placed.append(Placed(str(path), len(data), offsets, sizes))
            data += block.tobytes()
    path.write_bytes(bytes(data))
    pieces = [p for c in placed for p in chunk_pieces(c, shape, 4)]
    assert all(len(chunk_pieces(c, shape, 4)) == pieces_needed(shape, c.sizes) for c in placed)
    tensor = TensorInfo("t", "I32", shape, full.nbytes, str(path), (0, 0), spread=tuple(pieces))
    assert tiling_problem(tensor) is None
    assert first_overlap(placed) is None
    with LocalFile(str(path)) as source:
        assert tensor_bytes(source, tensor) == full.tobytes()


def test_a_dim0_chunk_is_one_range_and_a_column_chunk_one_piece_of_rows() -> None:
    rows = chunk_pieces(Placed("f", 100, (3, 0), (2, 4)), (5, 4), 2)
    assert rows == [Piece("f", 100, 16, at=24)]
    columns = chunk_pieces(Placed("f", 100, (0, 1), (5, 2)), (5, 4), 2)
    assert columns == [Piece("f", 100, 4, at=2, count=5, source_step=4, tensor_step=8)]


@pytest.mark.slow
@settings(max_examples=200, deadline=None)
@given(
    st.lists(
        st.tuples(st.integers(0, 6), st.integers(1, 3), st.integers(0, 6), st.integers(1, 3)),
        min_size=0,
        max_size=8,
    )
)
def test_overlap_check_agrees_with_comparing_every_pair(
    boxes: list[tuple[int, int, int, int]],
) -> None:
    placed = [Placed(str(i), 0, (a, c), (b, d)) for i, (a, b, c, d) in enumerate(boxes)]

    def meet(x: Placed, y: Placed) -> bool:
        return all(
            xo < yo + ys and yo < xo + xs
            for xo, xs, yo, ys in zip(x.offsets, x.sizes, y.offsets, y.sizes, strict=True)
        )

    expected = any(meet(x, y) for x, y in itertools.combinations(placed, 2))
    found = first_overlap(placed)
    assert (found is not None) == expected
    if found is not None:
        assert meet(*found) and found[0] is not found[1]


@pytest.mark.slow
def test_many_chunks_are_checked_in_bounded_time() -> None:
    import time

    row = [Placed("r", 0, (0, i), (1, 1)) for i in range(200_000)]  # a 1 x 200,000 tensor
    grid = [Placed("g", 0, (i, j), (1, 1)) for i in range(400) for j in range(400)]
    start = time.perf_counter()
    assert first_overlap(row) is None
    assert first_overlap(grid) is None
    assert time.perf_counter() - start < 10
    scattered = [Placed("s", 0, (i, i), (100_000, 1)) for i in range(100_000)]  # staircase
    with pytest.raises(TooManyChunks):
        first_overlap(scattered)


def test_overlaps_are_found() -> None:
    a = Placed("a", 0, (0, 0), (3, 3))
    b = Placed("b", 0, (2, 2), (2, 2))
    c = Placed("c", 0, (3, 0), (2, 2))
    assert first_overlap([a, b]) == (a, b)
    assert first_overlap([a, c]) is None


def _segments(arrays: list[np.ndarray], name: str, path: Path) -> list[Segment]:
    with open(path, "ab") as handle:
        start = handle.tell()
        segments = []
        for array in arrays:
            segments.append(Segment(str(path), start, array.size, 4))
            handle.write(array.tobytes())
            start += array.nbytes
    return segments


def _gathered(path: Path, pieces: list[Piece], shape: tuple[int, ...]) -> np.ndarray:
    nbytes = int(np.prod(shape)) * 4
    tensor = TensorInfo("t", "F32", shape, nbytes, str(path), (0, 0), spread=tuple(pieces))
    assert tiling_problem(tensor) is None
    with LocalFile(str(path)) as source:
        return np.frombuffer(tensor_bytes(source, tensor), dtype=np.float32).reshape(shape)


def test_stage12_slices_the_concatenated_partitions(tmp_path: Path) -> None:
    shapes = [{"a": (3, 5), "b": (7,), "c": (2, 2)}, {"d": (9,)}]
    world, path = 2, tmp_path / "optim.bin"
    flat = [np.arange(26, dtype=np.float32), np.arange(100, 109, dtype=np.float32)]
    # each group padded to a multiple of 2 * world, then cut into `world` partitions
    groups = []
    for vector in flat:
        padded = np.concatenate([vector, np.zeros(-len(vector) % (2 * world), np.float32)])
        parts = np.split(padded, world)
        parts[-1] = parts[-1][: len(parts[-1]) - (len(padded) - len(vector))]
        groups.append(_segments(parts, "g", path))
    weights = stage12(groups, shapes, None, world)
    offsets = {"a": (0, 0), "b": (0, 15), "c": (0, 22), "d": (1, 0)}
    for name, (group, start) in offsets.items():
        shape = {**shapes[0], **shapes[1]}[name]
        want = flat[group][start : start + int(np.prod(shape))].reshape(shape)
        assert np.array_equal(_gathered(path, weights[name], shape), want)
    with pytest.raises(ReconstructionError):
        stage12(groups, [{"a": (3, 5)}, {"d": (9,)}], None, world)


def test_stage3_takes_the_same_offset_of_every_rank(tmp_path: Path) -> None:
    shapes = {"a": (3, 3), "b": (4,), "c": (1,)}
    world, path = 3, tmp_path / "optim.bin"
    full = {
        n: np.random.default_rng(1).random(int(np.prod(s))).astype(np.float32)
        for n, s in shapes.items()
    }
    ranks = []
    for rank in range(world):
        parts = []
        for vector in full.values():
            size = -(-len(vector) // world)
            part = np.zeros(size, np.float32)
            piece = vector[rank * size : (rank + 1) * size]
            part[: len(piece)] = piece
            parts.append(part)
        flat = np.concatenate(parts)
        ranks.append(_segments(np.split(flat, [4]), "r", path))  # two flat groups per rank
    weights = stage3(ranks, shapes)
    for name, shape in shapes.items():
        assert np.array_equal(_gathered(path, weights[name], shape), full[name].reshape(shape))
    with pytest.raises(ReconstructionError):
        stage3(ranks, {"a": (3, 3)})
