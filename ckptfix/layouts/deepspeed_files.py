"""Helpers of the DeepSpeed layout: descriptors of pickled views and of tensors made of
pieces, and a reader that records each file's error instead of raising it."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import replace
from typing import TypeVar

from ckptfix.core.checkpoint import FileRecord
from ckptfix.core.errors import CkptfixError
from ckptfix.core.tensor import Piece, TensorInfo
from ckptfix.formats.base import FileRead
from ckptfix.formats.tensor_dict import View
from ckptfix.formats.zero import FORMAT
from ckptfix.io.source import LocalFile
from ckptfix.layouts.slices import tensor_of
from ckptfix.layouts.zero_weights import Segment

T = TypeVar("T")


def view_tensor(name: str, view: View, label: str) -> TensorInfo:
    """A pickled tensor as a descriptor, as formats.pickled does for torch files."""
    return TensorInfo(
        name=name,
        dtype=view.dtype,
        shape=view.shape,
        nbytes=view.numel * view.itemsize,
        file=label,
        byte_range=(view.storage.begin + view.span[0], view.storage.begin + view.span[1]),
        contiguous=view.contiguous,
        storage=view.storage.key,
        strides=view.stride,
    )


def segment(view: View, label: str) -> Segment:
    return Segment(label, view.storage.begin + view.span[0], view.numel, view.itemsize)


def spread_tensor(name: str, dtype: str, shape: tuple[int, ...], pieces: list[Piece]) -> TensorInfo:
    return replace(tensor_of(name, dtype, shape, pieces, ""), storage=f"zero:{name}")


class Reader:
    """Reads each file once; an error is recorded on its FileRecord, not raised."""

    def __init__(self) -> None:
        self.records: dict[str, FileRecord] = {}
        self.sources: dict[str, LocalFile] = {}

    def read(self, path: str, parse: Callable[[LocalFile], T]) -> T | None:
        source = LocalFile(path)
        self.sources[path] = source
        try:
            size = source.size
            parsed = parse(source)
        except CkptfixError as exc:
            if exc.code is None:
                raise
            size = os.path.getsize(path) if os.path.isfile(path) else 0
            self.records[path] = FileRecord(path, FORMAT, size, error=exc)
            return None
        self.records[path] = FileRecord(path, FORMAT, size, read=FileRead(path, FORMAT, size, ()))
        return parsed
