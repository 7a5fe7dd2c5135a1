"""Tensor descriptors: what a checkpoint holds, without its data."""

from __future__ import annotations

from dataclasses import dataclass

from ckptfix.core.dtypes import DTYPES


# Not frozen: a frozen dataclass costs ~4 µs per instance to build, which is most of the
# time spent on a 100,000-tensor folder. Treat instances as immutable all the same.
@dataclass(slots=True)
class TensorInfo:
    """One named tensor: dtype, shape and where its bytes lie in its file."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    file: str
    byte_range: tuple[int, int]
    contiguous: bool = True
    storage: str | None = None
    # Pickled tensors only: element strides and the storage's first byte in the file. For
    # a non-contiguous view, byte_range is the span of storage it reads, not its bytes.
    strides: tuple[int, ...] | None = None

    @property
    def numel(self) -> int:
        # Exact: nbytes was validated as numel * bits / 8. O(1), unlike a product of dims.
        return self.nbytes * 8 // DTYPES[self.dtype].bits
