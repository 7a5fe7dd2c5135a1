"""The writers' fast paths against the slow ones, bitwise.

Runs of a local file are read straight into their places (`preadv` into a reused window);
any other source is read once and copied into place by a strided numpy copy, the path every
read took before. Tensors cut into column blocks as tensor-parallel ranks save them (1 to 4
ranks, odd widths, 1-, 2- and 4-byte elements) must gather to the same bytes both ways,
through any window size, and write and verify to them. Verification reads into each thread's
reused buffers: a single byte wrong anywhere, a partial last chunk included, is still found.
"""

from __future__ import annotations

import contextlib
import itertools
import os
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from ckptfix.core.errors import VerificationError
from ckptfix.core.tensor import Piece, TensorInfo, tiling_problem
from ckptfix.formats.safetensors import read_header
from ckptfix.io import gather
from ckptfix.io.gather import Window, tensor_bytes, tensor_chunks, windows_into
from ckptfix.io.source import LocalFile
from ckptfix.plan.select import OutTensor
from ckptfix.plan.shards import plan_shards
from ckptfix.write import safetensors as writer
from ckptfix.write.copy import COMPARE_CHUNK, source_equal
from tests.helpers import MemorySource

PROPERTY = settings(
    max_examples=50,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
DTYPES = {1: "U8", 2: "BF16", 4: "F32"}


def _column_shards(
    root: Path, matrix: np.ndarray, ranks: int, pads: list[int]
) -> tuple[TensorInfo, dict[str, bytes]]:
    """The matrix (rows × ranks·width elements of `matrix.itemsize` bytes) as `ranks` column
    blocks, each saved row-major after `pads[r]` bytes of its own file; the tensor made of
    them (rank r's rows: one piece of 2 KiB-like runs) and each file's bytes."""
    rows, cols = matrix.shape[0], matrix.shape[1] // ranks
    item, pieces, files = matrix.shape[2], [], {}
    for rank in range(ranks):
        path = str(root / f"rank{rank}.bin")
        block = np.ascontiguousarray(matrix[:, rank * cols : (rank + 1) * cols]).tobytes()
        files[path] = b"\xee" * pads[rank] + block
        width = cols * item
        step = ranks * width
        pieces.append(Piece(path, pads[rank], width, rank * width, rows, width, step))
        Path(path).write_bytes(files[path])
    nbytes = matrix.size
    tensor = TensorInfo(
        "m", DTYPES[item], (rows, ranks * cols), nbytes, pieces[0].source, (0, 0),
        spread=tuple(pieces),
    )  # fmt: skip
    return tensor, files


def _shards(root: Path, data: st.DataObject) -> tuple[TensorInfo, dict[str, bytes], bytes]:
    root.mkdir(exist_ok=True)
    rows, width = data.draw(st.integers(1, 40)), data.draw(st.integers(1, 23))
    ranks, item = data.draw(st.integers(1, 4)), data.draw(st.sampled_from([1, 2, 4]))
    pads = data.draw(st.lists(st.integers(0, 9), min_size=ranks, max_size=ranks))
    seed = data.draw(st.integers(0, 2**32 - 1))
    matrix = np.random.default_rng(seed).integers(0, 256, (rows, ranks * width, item), np.uint8)
    tensor, files = _column_shards(root, matrix, ranks, pads)
    assert tiling_problem(tensor) is None
    return tensor, files, matrix.tobytes()


@contextlib.contextmanager
def _thresholds(direct: int, most: int, kept: int) -> Iterator[None]:
    """Runs read straight into place from `direct` bytes on, `most` of them per window, the
    views of `kept` runs kept by a Window."""
    saved = gather.DIRECT_RUN, gather.MAX_VIEWS, gather.KEPT_VIEWS
    gather.DIRECT_RUN, gather.MAX_VIEWS, gather.KEPT_VIEWS = direct, most, kept
    try:
        yield
    finally:
        gather.DIRECT_RUN, gather.MAX_VIEWS, gather.KEPT_VIEWS = saved


@pytest.mark.slow
@PROPERTY
@given(st.data())
def test_runs_read_into_place_equal_the_strided_copy(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    """Two tensors gathered through one reused Window, the first again after the second
    (the views it keeps must be the right ones), every run straight into place or not."""
    root = tmp_path_factory.mktemp("ranks")
    (one, files, truth), (two, more, other) = _shards(root, data), _shards(root / "b", data)
    window = Window(data.draw(st.integers(1, max(one.nbytes, two.nbytes) + 9)))
    chunk = data.draw(st.integers(1, one.nbytes + 9))
    memory = {path: MemorySource(data, path) for path, data in files.items()}
    local = {path: LocalFile(path) for path in [*files, *more]}
    direct = data.draw(st.sampled_from([1, 8, gather.DIRECT_RUN, 10**9]))
    try:
        most = data.draw(st.sampled_from([2, 3, gather.MAX_VIEWS]))
        with _thresholds(direct, most, data.draw(st.sampled_from([1, 50, gather.KEPT_VIEWS]))):
            slow = tensor_bytes(memory.__getitem__, one)
            fast = b"".join(tensor_chunks(local.__getitem__, one, chunk))
            reused = [
                b"".join(bytes(view) for view in windows_into(local.__getitem__, tensor, window))
                for tensor in (one, two, one)
            ]
        assert slow == truth
        assert fast == truth
        assert reused == [truth, other, truth]
    finally:
        for source in local.values():
            source.close()


def _write(
    root: Path, tensor: TensorInfo, sources: Callable[[str], object]
) -> tuple[Path, tuple[int, int]]:
    out = root / "out"
    out.mkdir()
    plan = plan_shards([("m", tensor.nbytes)], 10**9)
    job = writer.ShardJob(
        {"m": OutTensor.same(tensor)},
        [{}],
        {},
        sources,
        str(out),
        str(out),  # type: ignore[arg-type]
    )
    writer.write_shards(plan, job)
    path = out / "model.safetensors"
    return path, read_header(path).tensors[0].byte_range


@pytest.mark.slow
@PROPERTY
@given(st.data())
def test_gathered_tensors_write_and_verify_as_the_slow_path_gathers_them(
    tmp_path_factory: pytest.TempPathFactory, data: st.DataObject
) -> None:
    root = tmp_path_factory.mktemp("write")
    tensor, files, truth = _shards(root, data)
    local = {path: LocalFile(path) for path in files}
    try:
        path, (begin, end) = _write(root, tensor, local.__getitem__)
    finally:
        for source in local.values():
            source.close()
    slow = tensor_bytes({p: MemorySource(d, p) for p, d in files.items()}.__getitem__, tensor)
    assert path.read_bytes()[begin:end] == slow == truth


def _damage_before_verifying(monkeypatch: pytest.MonkeyPatch, where: int) -> None:
    """Each tensor's byte `where` flipped once the part of it that holds it is written,
    before that part's verification is queued."""
    real = writer.ShardWriter.verify_later

    def verify_later(
        self: writer.ShardWriter, reader: int, display: str, placed: list[writer.Part]
    ) -> None:
        for part in placed:
            byte = where % self.job.tensors[part.name].nbytes
            if part.begin <= byte < part.end:
                at = part.offset + byte
                os.pwrite(self.fd, bytes([os.pread(reader, 1, at)[0] ^ 0x10]), at)
        real(self, reader, display, placed)

    monkeypatch.setattr(writer.ShardWriter, "verify_later", verify_later)


PART = 2**20 + 7  # a streamed tensor is copied and verified in parts of this many bytes


@pytest.mark.parametrize("where", [0, COMPARE_CHUNK - 1, COMPARE_CHUNK, PART - 1, PART, -1])
@pytest.mark.parametrize("kind", ["gathered", "streamed"])
def test_one_wrong_byte_is_found_by_the_verification(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, where: int, kind: str
) -> None:
    """The writer's bytes damaged right after they are written (one byte: the first, either
    side of a verification buffer's end or of a part's, the last): the read-back must say
    so."""
    monkeypatch.setattr(writer, "VERIFY_EVERY", PART)
    matrix = np.random.default_rng(5).integers(0, 256, (3001, 2000, 1), np.uint8)
    tensor, files = _column_shards(tmp_path, matrix, 2, [3, 5])  # 6 MB: several buffers
    if kind == "streamed":  # one rank file's block, as a plain range
        piece, size = tensor.pieces[0], tensor.nbytes // 2
        span = (piece.offset, piece.offset + size)
        tensor = TensorInfo("m", "U8", (size,), size, piece.source, span)
    assert OutTensor.same(tensor).streamed is (kind == "streamed")
    _damage_before_verifying(monkeypatch, where)
    local = {path: LocalFile(path) for path in files}
    try:
        with pytest.raises(VerificationError, match="reads back different from its source"):
            _write(tmp_path, tensor, local.__getitem__)
    finally:
        for source in local.values():
            source.close()


@pytest.mark.parametrize("where", [None, 0, COMPARE_CHUNK - 1, COMPARE_CHUNK, 2 * COMPARE_CHUNK])
def test_source_equal_finds_one_byte_anywhere(tmp_path: Path, where: int | None) -> None:
    """Ranges of 2 buffers and a bit compared in the thread's reused buffers: equal, or one
    byte apart at the start, either side of a buffer's end or the last byte."""
    data = np.random.default_rng(1).integers(0, 256, 2 * COMPARE_CHUNK + 7, np.uint8).tobytes()
    (tmp_path / "source").write_bytes(b"pad" + data)
    copy = bytearray(data)
    if where is not None:
        copy[min(where, len(copy) - 1)] ^= 1
    (tmp_path / "written").write_bytes(bytes(copy))
    fd = os.open(tmp_path / "written", os.O_RDONLY)
    try:
        with LocalFile(str(tmp_path / "source")) as source:
            assert source_equal(source, 3, fd, 0, len(data)) is (where is None)
            assert source_equal(source, 3, fd, 0, 5) is (where != 0)  # a short range
    finally:
        os.close(fd)


def test_a_window_keeps_few_views_however_many_shapes_it_sees() -> None:
    """Views are kept for the shapes of window seen last, never more than KEPT_VIEWS (a
    window's runs are at most MAX_VIEWS, fewer than that)."""
    window = Window(2**16)
    with _thresholds(gather.DIRECT_RUN, 500, 1000):
        for step in range(132, 1024, 8):
            views = window.views(3, step, 60, 2**16 // step - 1)
            assert [view.obj for view in views[:1]] == [window.buffer]
            assert len(views) == 2**16 // step - 1 and 0 < window.kept <= 1000


def test_a_large_streamed_tensor_is_copied_and_verified_in_parts(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Parts of VERIFY_EVERY bytes, each verified as soon as it is copied: the file is the
    source's bytes, and every part was handed to verification, in order, once."""
    monkeypatch.setattr(writer, "VERIFY_EVERY", PART)
    data = np.random.default_rng(3).integers(0, 256, 3 * PART + 11, np.uint8).tobytes()
    (tmp_path / "src").write_bytes(b"pad" + data)
    tensor = TensorInfo(
        "m", "U8", (len(data),), len(data), str(tmp_path / "src"), (3, 3 + len(data))
    )
    handed: list[tuple[int, int]] = []
    real = writer.ShardWriter.verify_later

    def verify_later(self: writer.ShardWriter, *args: object) -> None:
        placed = args[2]
        assert isinstance(placed, list)
        handed.extend((part.begin, part.end) for part in placed)
        real(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(writer.ShardWriter, "verify_later", verify_later)
    with LocalFile(str(tmp_path / "src")) as source:
        path, (begin, end) = _write(tmp_path, tensor, lambda _: source)
    assert path.read_bytes()[begin:end] == data
    bounds = [*range(0, len(data), PART), len(data)]
    assert handed == list(itertools.pairwise(bounds))
