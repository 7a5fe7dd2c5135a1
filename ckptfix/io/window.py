"""A window of a byte source as a byte source of its own: a record stored inside a larger
file (a `torch.save` zip inside a DCP rank file, a safetensors part after it) read with the
readers written for whole files. Offsets inside the window are relative to its start; add
`start` to point back into the file, which is what the writer copies from."""

from __future__ import annotations

from ckptfix.io.source import ByteSource, past_end


class Window:
    """Bytes [start, start + size) of `base`, under the base's label (errors name the file)."""

    def __init__(self, base: ByteSource, start: int, size: int) -> None:
        if start < 0 or size < 0 or start + size > base.size:
            raise past_end(base.label, start + size, base.size)
        self.base = base
        self.start = start
        self._size = size

    @property
    def label(self) -> str:
        return self.base.label

    @property
    def size(self) -> int:
        return self._size

    def read_at(self, offset: int, size: int) -> bytes:
        if offset < 0 or size < 0 or offset + size > self._size:
            raise past_end(self.base.label, self.start + offset + size, self.start + self._size)
        return self.base.read_at(self.start + offset, size)

    def change_token(self) -> tuple[object, ...]:
        return self.base.change_token()

    def identity(self) -> tuple[object, ...]:
        return (*self.base.identity(), self.start, self._size)
