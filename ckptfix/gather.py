"""Materialising a strided view as row-major bytes, one tensor at a time (numpy, no torch)."""

from __future__ import annotations

import mmap
import os

from ckptfix.catalog import TensorInfo
from ckptfix.dtypes import DTYPES

_UNSIGNED = {1: "u1", 2: "<u2", 4: "<u4", 8: "<u8"}


def tensor_bytes(fd: int, tensor: TensorInfo) -> bytes:
    """The tensor's elements in row-major order, read from its storage span in the file.

    Only the span is mapped (resident pages count towards RSS), and the result is one
    tensor's bytes, so peak memory stays near the size of the largest tensor.
    """
    import numpy as np

    begin, end = tensor.byte_range
    if tensor.nbytes == 0:
        return b""
    if tensor.contiguous or tensor.strides is None:
        return _read_exact(fd, begin, tensor.nbytes)
    itemsize = DTYPES[tensor.dtype].bits // 8
    base = begin - begin % mmap.ALLOCATIONGRANULARITY
    mapped = mmap.mmap(fd, end - base, access=mmap.ACCESS_READ, offset=base)
    try:
        flat = np.frombuffer(
            mapped,
            dtype=np.dtype(_UNSIGNED[itemsize]),
            offset=begin - base,
            count=(end - begin) // itemsize,
        )
        view = np.lib.stride_tricks.as_strided(
            flat,
            shape=tensor.shape,
            strides=[s * itemsize for s in tensor.strides],
            writeable=False,
        )
        data = np.ascontiguousarray(view).tobytes()
        del view, flat
    finally:
        mapped.close()
    return data


def _read_exact(fd: int, offset: int, size: int) -> bytes:
    """pread in a loop: one call returns at most about 2 GiB on Linux."""
    parts = []
    while size:
        chunk = os.pread(fd, min(size, 1 << 30), offset)
        if not chunk:
            raise OSError(f"file ended at byte {offset}")
        parts.append(chunk)
        offset += len(chunk)
        size -= len(chunk)
    return b"".join(parts)
