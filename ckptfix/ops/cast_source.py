"""A tensor as a rewrite writes it in another dtype, as a ByteSource: what `hash`, `diff` and
manifest checks read for the tensors a training layout casts on the way out (a DeepSpeed
checkpoint's non-fp32 buffers become F32, as `zero_to_fp32.py` writes them). So the digest
of a training checkpoint is the digest of its conversion.

The cast bytes are built on first read, from the tensor's own bytes in bounded chunks, by
the cast `convert` uses (`write.cast`); only such buffers are cast, and they are small.
"""

from __future__ import annotations

from ckptfix.core.dtypes import DTYPES
from ckptfix.core.tensor import TensorInfo
from ckptfix.io.gather import Sources, tensor_chunks
from ckptfix.io.source import past_end


class CastSource:
    """The row-major bytes of `tensor` cast to `target`."""

    def __init__(self, tensor: TensorInfo, target: str, sources: Sources) -> None:
        self.tensor = tensor
        self.target = target
        self._sources = sources
        self._size = tensor.numel * DTYPES[target].bits // 8
        self._data: bytes | None = None

    @property
    def label(self) -> str:
        return f"{self.tensor.file} ({self.tensor.name} as {self.target})"

    @property
    def size(self) -> int:
        return self._size

    def _cast(self) -> bytes:
        if self._data is None:
            from ckptfix.write.cast import cast_bytes

            chunks = tensor_chunks(self._sources, self.tensor)
            self._data = b"".join(cast_bytes(c, self.tensor.dtype, self.target) for c in chunks)
        return self._data

    def read_at(self, offset: int, size: int) -> bytes:
        if offset < 0 or size < 0 or offset + size > self._size:
            raise past_end(self.label, offset + size, self._size)
        return self._cast()[offset : offset + size]

    def change_token(self) -> tuple[object, ...]:
        return tuple(self._sources(label).change_token() for label in self.tensor.sources)

    def identity(self) -> tuple[object, ...]:
        return tuple(self._sources(label).identity() for label in self.tensor.sources)


def cast_tensor(tensor: TensorInfo, target: str, sources: Sources) -> tuple[TensorInfo, CastSource]:
    """The tensor as written in `target`, and the source its bytes come from."""
    source = CastSource(tensor, target, sources)
    cast = TensorInfo(
        tensor.name, target, tensor.shape, source.size, source.label, (0, source.size)
    )
    return cast, source
