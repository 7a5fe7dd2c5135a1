"""Tensor descriptors: what a checkpoint holds, without its data."""

from __future__ import annotations

from dataclasses import dataclass

from ckptfix.dtypes import numel_of


@dataclass(frozen=True)
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

    @property
    def numel(self) -> int:
        return numel_of(self.shape)

    def to_dict(self) -> dict[str, object]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "nbytes": self.nbytes,
            "file": self.file,
            "contiguous": self.contiguous,
            "storage": self.storage,
        }
