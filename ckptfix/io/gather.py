"""Materialising a strided view as row-major bytes, in bounded chunks (numpy, no torch).

The view's storage span is read once; blocks of whole rows are copied out of it one at a
time, so a tensor that expands 4 bytes into 16 GiB streams through a buffer of at most
CHUNK bytes. The element address range is recomputed here from shape, strides and offset
and checked against the span, whatever the descriptor claims: nothing outside the span
read for it ever reaches an output.
"""

from __future__ import annotations

import itertools
from collections.abc import Callable, Iterator, Sequence
from typing import Any

from ckptfix.core.dtypes import DTYPES
from ckptfix.core.errors import CorruptFileError
from ckptfix.core.tensor import Piece, TensorInfo
from ckptfix.io.source import (
    ByteSource,
    LocalFile,
    descriptor,
    past_end,
    preadv_exact,
    read_into,
)

CHUNK = 16 * 2**20


Sources = Callable[[str], ByteSource]  # a piece's source label -> its bytes


def tensor_chunks(
    sources: Sources | ByteSource, tensor: TensorInfo, chunk: int = CHUNK
) -> Iterator[bytes]:
    """The tensor's bytes in row-major order, in chunks of at most `chunk` bytes (a chunk
    never splits an element, nor a block of a block-quantized dtype: it is cut to a multiple
    of the dtype's unit, so a block can be decoded chunk by chunk)."""
    source_of = _source_of(sources)
    unit = DTYPES[tensor.dtype].unit
    chunk = max(chunk - chunk % unit, unit)
    pieces = tensor.pieces
    if tensor.nbytes == 0:
        return
    if pieces[0].view is not None:
        yield from _gather(source_of(pieces[0].source), tensor, pieces[0], chunk)
    elif len(pieces) == 1 and pieces[0].count == 1:
        yield from _read_chunks(source_of(pieces[0].source), pieces[0].offset, tensor.nbytes, chunk)
    else:
        yield from _assemble(source_of, tensor, chunk)


# Pieces whose runs average less than this are gathered in memory (16 MiB windows, one read
# per run) rather than copied run by run: each kernel copy costs several system calls, which
# for the 2 KiB rows of a chunk cut along its last dimension (a tensor-parallel column shard,
# Megatron's linear_proj and linear_fc2) took 5 times as long as `cp` of the whole folder.
GATHER_BELOW = 64 * 2**10


def fragmented(tensor: TensorInfo) -> bool:
    """Whether a tensor's pieces average runs shorter than GATHER_BELOW bytes."""
    if tensor.spread is None:
        return False
    runs = sum(piece.count for piece in tensor.spread)
    return runs > 1 and tensor.nbytes < runs * GATHER_BELOW


def tensor_into(sources: Sources | ByteSource, tensor: TensorInfo, out: memoryview) -> None:
    """Fill `out` (writable, `tensor.nbytes` long) with the tensor's row-major bytes: each run
    read straight into its place where the source is a local file (one copy, from the
    kernel), through bounded chunks otherwise, for a strided view, and for runs too short to
    read one by one (gathered in windows, as the writers gather them)."""
    source_of = _source_of(sources)
    if tensor.nbytes == 0:
        return
    if tensor.pieces[0].view is not None or fragmented(tensor):
        at = 0
        for chunk in tensor_chunks(source_of, tensor):
            out[at : at + len(chunk)] = chunk
            at += len(chunk)
        return
    for piece in tensor.pieces:
        source = source_of(piece.source)
        with descriptor(source) as fd:  # held for the piece's runs: the pool keeps it open
            for offset, at, length in piece.runs():
                _read_into(source, fd, offset, out[at : at + length])


def _read_into(source: ByteSource, fd: int | None, offset: int, target: memoryview) -> None:
    if fd is None:
        for start in range(0, len(target), CHUNK):
            size = min(CHUNK, len(target) - start)
            target[start : start + size] = source.read_at(offset + start, size)
        return
    if offset + len(target) > source.size:
        raise past_end(source.label, offset + len(target), source.size)
    preadv_exact(fd, offset, [target], source.label)  # short only if the file changed


def tensor_bytes(sources: Sources | ByteSource, tensor: TensorInfo) -> bytes:
    """The whole tensor's row-major bytes (for callers that need it in memory at once)."""
    return b"".join(tensor_chunks(sources, tensor))


def _source_of(sources: Sources | ByteSource) -> Sources:
    # callable(), not isinstance(ByteSource): a runtime Protocol check costs about 18 µs,
    # which is most of the time spent per tensor when hashing 100,000 small ones.
    if callable(sources):
        return sources
    single = sources
    return lambda label: single


def _read_chunks(source: ByteSource, offset: int, size: int, chunk: int) -> Iterator[bytes]:
    while size:
        data = source.read_at(offset, min(size, chunk))
        offset += len(data)
        size -= len(data)
        yield data


def _assemble(source_of: Sources, tensor: TensorInfo, chunk: int) -> Iterator[bytes]:
    """Pieces from several ranges or files, a window of the tensor at a time: each window is
    filled from the runs that overlap it (the pieces tile the tensor; see tiling_problem)."""
    for start in range(0, tensor.nbytes, chunk):
        window = bytearray(min(chunk, tensor.nbytes - start))
        _fill(source_of, tensor, start, memoryview(window))
        yield window  # type: ignore[misc]  # a bytearray: bytes-like, and never reused


# Runs of at least DIRECT_RUN bytes, at most MAX_VIEWS of them in a window, are read straight
# into their places (a view each); shorter or more runs (a column shard a few elements wide)
# are read in one go and copied into place by numpy, cheaper than a Python view per run.
DIRECT_RUN = 512
MAX_VIEWS = 4096
KEPT_VIEWS = 4 * MAX_VIEWS  # views a Window keeps at most (about 200 bytes each)


class Window:
    """A buffer that tensors made of runs are gathered into, window by window, reused on one
    thread. The views a window's runs are read into are made once for each shape of window
    (every window of a tensor but its last has the same, and so do the same tensor's other
    layers), not once per run."""

    def __init__(self, size: int) -> None:
        self.buffer = bytearray(size)
        self.view = memoryview(self.buffer)
        self._views: dict[tuple[int, int, int, int], list[memoryview]] = {}
        self._count = 0  # views in _views

    @property
    def kept(self) -> int:
        """How many views the window keeps."""
        return sum(map(len, self._views.values()))

    def views(self, at: int, step: int, length: int, count: int) -> list[memoryview]:
        key = (at, step, length, count)
        found = self._views.get(key)
        if found is None:
            found = _views(self.view, at, step, length, count)
            if self._count + len(found) > KEPT_VIEWS:  # many shapes of window: start again
                self._views.clear()
                self._count = 0
            self._views[key] = found
            self._count += len(found)
        return found


def _views(window: memoryview, at: int, step: int, length: int, count: int) -> list[memoryview]:
    """`count` views of `length` bytes, `step` apart from byte `at` of the window."""
    if step == length:  # the runs are one range in the window too
        return [window[at : at + count * length]]
    return [window[begin : begin + length] for begin in range(at, at + count * step, step)]


def windows_into(
    sources: Sources | ByteSource, tensor: TensorInfo, window: Window
) -> Iterator[memoryview]:
    """The row-major bytes of a tensor made of runs (not a strided view), window by window
    in `window`'s buffer, which is reused: each holds until the next is asked for (for a
    writer that writes it at once, and a verifier that compares it at once). A window holds
    whole rows where the tensor's runs repeat at one step, so its runs fall where the
    previous window's did."""
    source_of, size = _source_of(sources), _whole_rows(tensor, len(window.buffer))
    for start in range(0, tensor.nbytes, size):
        view = window.view[: min(size, tensor.nbytes - start)]
        _fill(source_of, tensor, start, view, window)
        yield view


def _whole_rows(tensor: TensorInfo, size: int) -> int:
    """The most bytes up to `size` that are whole steps of the tensor's repeated runs (when
    they repeat at one step no longer than `size`), else `size`."""
    steps = {piece.tensor_step for piece in tensor.pieces if piece.count > 1}
    step = steps.pop() if len(steps) == 1 else 0
    return size // step * step if 0 < step <= size else size


def _fill(
    source_of: Sources,
    tensor: TensorInfo,
    start: int,
    window: memoryview,
    kept: Window | None = None,
) -> None:
    """Tensor bytes [start, start + len(window)) into `window` (with the views `kept` keeps,
    when it is that Window's). Every byte of it must come from a run: the layouts refuse
    pieces that overlap, and the bytes placed are counted, so a gap cannot leave a reused
    window's old bytes (or zeros) in place unnoticed."""
    placed = 0
    for piece in tensor.pieces:
        source = source_of(piece.source)
        rows = _rows_into(window, start, piece, source, kept)
        placed += len(rows) * piece.length
        for offset, at, length in _runs_within(piece, start, start + len(window), rows):
            read_into(source, offset, window[at - start : at - start + length])
            placed += length
    if placed != len(window):
        raise CorruptFileError(
            tensor.file,
            "chunk-gap",
            f"the pieces of {tensor.name!r} give {placed} of bytes {start}-"
            f"{start + len(window)}, not each byte once",
            "re-export the checkpoint",
        )


_NONE = range(0)


def _rows_into(
    window: memoryview, start: int, piece: Piece, source: ByteSource, kept: Window | None
) -> range:
    """Place the runs of `piece` that lie wholly in the window with one read, when they are
    consecutive in the source (a chunk's rows, cut along its last dimension: thousands of
    short runs): of a local file, straight into their places (up to 1,024 runs per system call)
    when they are long enough; else one read and one strided copy. The indices of the runs
    placed."""
    step, length = piece.tensor_step, piece.length
    if piece.count < 2 or piece.source_step != length or step < length:
        return _NONE
    first = max(0, -(-(start - piece.at) // step))
    last = min(piece.count - 1, (start + len(window) - length - piece.at) // step)
    count = last - first + 1
    if count < 2:
        return _NONE
    offset, at = piece.offset + first * length, piece.at + first * step - start
    if isinstance(source, LocalFile) and length >= DIRECT_RUN and count <= MAX_VIEWS:
        views = kept.views(at, step, length, count) if kept else None
        views = views or _views(window, at, step, length, count)
        source.read_into(offset, views, count * length)
        return range(first, last + 1)
    import numpy as np

    data = source.read_at(offset, count * length)
    rows = np.lib.stride_tricks.as_strided(
        np.frombuffer(window, dtype=np.uint8)[at:], shape=(count, length), strides=(step, 1)
    )
    rows[:] = np.frombuffer(data, dtype=np.uint8).reshape(count, length)
    return range(first, last + 1)


def _runs_within(
    piece: Piece, begin: int, end: int, placed: range = _NONE
) -> Iterator[tuple[int, int, int]]:
    """The parts of a piece's runs that land in tensor bytes [begin, end), but for the runs
    `placed` already."""
    first, last = 0, piece.count - 1
    if piece.count > 1 and piece.tensor_step > 0:  # only the runs that can reach the window
        first = max(0, (begin - piece.at - piece.length) // piece.tensor_step)
        last = min(last, (end - 1 - piece.at) // piece.tensor_step)
    before = range(first, min(last + 1, placed.start)) if placed else range(first, last + 1)
    after = range(max(first, placed.stop), last + 1) if placed else _NONE
    for index in itertools.chain(before, after):
        at = piece.at + index * piece.tensor_step
        low, high = max(at, begin), min(at + piece.length, end)
        if low < high:
            yield piece.offset + index * piece.source_step + (low - at), low, high - low


def _checked_layout(tensor: TensorInfo, piece: Piece) -> tuple[list[int], list[int], int]:
    """Shape and byte strides without size-1 dimensions, and the span the view needs;
    refuses a view whose elements fall outside the bytes read for it."""
    itemsize = DTYPES[tensor.dtype].bits // 8
    assert piece.view is not None
    pairs = [(d, s) for d, s in zip(*piece.view, strict=True) if d != 1]
    shape = [d for d, _ in pairs]
    strides = [s * itemsize for _, s in pairs]
    low = sum((d - 1) * s for d, s in pairs if s < 0) * itemsize
    high = sum((d - 1) * s for d, s in pairs if s > 0) * itemsize + itemsize
    if low < 0 or high > piece.length:
        raise CorruptFileError(
            piece.source,
            "view-out-of-bounds",
            f"tensor {tensor.name!r} would read bytes outside its storage",
            "re-export the checkpoint",
        )
    return shape, strides, high


def _row_blocks(shape: list[int], itemsize: int, chunk: int) -> tuple[int, int]:
    """(k, rows): dimensions k.. form one row of at most `chunk` bytes; `rows` rows of
    dimension k-1 are copied per block."""
    row = itemsize
    k = len(shape)
    while k > 0 and row * shape[k - 1] <= chunk:
        row *= shape[k - 1]
        k -= 1
    return k, max(chunk // row, 1)


def _gather(source: ByteSource, tensor: TensorInfo, piece: Piece, chunk: int) -> Iterator[bytes]:
    import numpy as np

    itemsize = DTYPES[tensor.dtype].bits // 8
    shape, strides, span = _checked_layout(tensor, piece)
    # Read, not mapped: a source truncated by someone else while we work must be an error
    # (a short read), never SIGBUS on a mapped page past the new end of the file.
    stored = np.frombuffer(source.read_at(piece.offset, span), dtype=np.uint8)
    view = np.lib.stride_tricks.as_strided(
        stored, shape=[*shape, itemsize], strides=[*strides, 1], writeable=False
    )
    yield from _blocks(view, shape, itemsize, chunk)


def row_blocks(
    shape: Sequence[int], itemsize: int, chunk: int = CHUNK
) -> Iterator[tuple[int | slice, ...]]:
    """Index keys that cut an array of `shape` into blocks of whole rows of at most `chunk`
    bytes (at least one element), in row-major order: `array[key]` for each key, made
    contiguous, gives its bytes a block at a time (numpy here; torch for a caller's tensor,
    whose own copy kernels are faster at transposes)."""
    k, rows = _row_blocks(list(shape), itemsize, chunk)
    if k == 0:
        yield ()
        return
    for index in itertools.product(*(range(dim) for dim in shape[: k - 1])):
        for start in range(0, shape[k - 1], rows):
            yield (*index, slice(start, start + rows))


def _blocks(array: Any, shape: list[int], itemsize: int, chunk: int) -> Iterator[bytes]:
    import numpy as np

    for key in row_blocks(shape, itemsize, chunk):
        yield np.ascontiguousarray(array[key]).tobytes()
