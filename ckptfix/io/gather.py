"""Materialising a strided view as row-major bytes, in bounded chunks (numpy, no torch).

The view's storage span is read once; blocks of whole rows are copied out of it one at a
time, so a tensor that expands 4 bytes into 16 GiB streams through a buffer of at most
CHUNK bytes. The element address range is recomputed here from shape, strides and offset
and checked against the span, whatever the descriptor claims: nothing outside the span
read for it ever reaches an output.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from ckptfix.core.dtypes import DTYPES
from ckptfix.core.errors import CorruptFileError
from ckptfix.core.tensor import TensorInfo
from ckptfix.io.source import ByteSource

CHUNK = 16 * 2**20


def tensor_chunks(source: ByteSource, tensor: TensorInfo, chunk: int = CHUNK) -> Iterator[bytes]:
    """The tensor's elements in row-major order, in pieces of at most `chunk` bytes (a
    piece never splits an element)."""
    if tensor.nbytes == 0:
        return
    if tensor.contiguous or tensor.strides is None:
        yield from _read_chunks(source, tensor.byte_range[0], tensor.nbytes, chunk)
        return
    yield from _gather(source, tensor, chunk)


def tensor_bytes(source: ByteSource, tensor: TensorInfo) -> bytes:
    """The whole tensor's row-major bytes (for callers that need it in memory at once)."""
    return b"".join(tensor_chunks(source, tensor))


def _read_chunks(source: ByteSource, offset: int, size: int, chunk: int) -> Iterator[bytes]:
    while size:
        data = source.read_at(offset, min(size, chunk))
        offset += len(data)
        size -= len(data)
        yield data


def _checked_layout(tensor: TensorInfo) -> tuple[list[int], list[int], int]:
    """Shape and byte strides without size-1 dimensions, and the span the view needs;
    refuses a view whose elements fall outside its byte range."""
    itemsize = DTYPES[tensor.dtype].bits // 8
    assert tensor.strides is not None
    pairs = [(d, s) for d, s in zip(tensor.shape, tensor.strides, strict=True) if d != 1]
    shape = [d for d, _ in pairs]
    strides = [s * itemsize for _, s in pairs]
    low = sum((d - 1) * s for d, s in pairs if s < 0) * itemsize
    high = sum((d - 1) * s for d, s in pairs if s > 0) * itemsize + itemsize
    begin, end = tensor.byte_range
    if low < 0 or high > end - begin:
        raise CorruptFileError(
            tensor.file,
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


def _gather(source: ByteSource, tensor: TensorInfo, chunk: int) -> Iterator[bytes]:
    import numpy as np

    itemsize = DTYPES[tensor.dtype].bits // 8
    shape, strides, span = _checked_layout(tensor)
    # Read, not mapped: a source truncated by someone else while we work must be an error
    # (a short read), never SIGBUS on a mapped page past the new end of the file.
    stored = np.frombuffer(source.read_at(tensor.byte_range[0], span), dtype=np.uint8)
    view = np.lib.stride_tricks.as_strided(
        stored, shape=[*shape, itemsize], strides=[*strides, 1], writeable=False
    )
    yield from _blocks(view, shape, itemsize, chunk)


def _blocks(array: Any, shape: list[int], itemsize: int, chunk: int) -> Iterator[bytes]:
    import numpy as np

    k, rows = _row_blocks(shape, itemsize, chunk)
    if k == 0:
        yield np.ascontiguousarray(array).tobytes()
        return
    for index in np.ndindex(*shape[: k - 1]):
        outer = array[index]
        for start in range(0, shape[k - 1], rows):
            yield np.ascontiguousarray(outer[start : start + rows]).tobytes()
