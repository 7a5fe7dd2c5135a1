"""`ckptfix.open`: any checkpoint ckptfix reads, opened lazily, one tensor at a time.

What `safetensors.safe_open` is to one file, for every input of the CLI: safetensors files
and folders, PyTorch zip and legacy pickles (never executed), torch.distributed.checkpoint
and DeepSpeed ZeRO folders, URLs. Opening loads and checks the checkpoint as a rewrite
does (ops.tensorset: the family a loader would load, refused when it has error findings)
without reading tensor data; `get` reads only the bytes of the tensor asked for, from its
pieces (io.gather). A name the `ckptfix.dropped` record says was written once for another,
and a head config.json ties to the stored embedding (what transformers leaves out), read as
the tensor they stand for.
"""

from __future__ import annotations

import os
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal, get_args, overload

from ckptfix.api.arrays import check_framework, from_bytes
from ckptfix.api.types import FRAMEWORKS, Framework, choice
from ckptfix.checks.config import implied_head
from ckptfix.core.choices import ZeroWeights
from ckptfix.core.errors import UnknownTensorError, UsageError
from ckptfix.core.tensor import TensorInfo
from ckptfix.io.gather import tensor_into
from ckptfix.ops.tensorset import TensorSet, opened
from ckptfix.plan.alias_record import DROPPED_KEY

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt
    import torch


@dataclass(frozen=True)
class TensorSpec:
    """What `info(name)` tells without reading the tensor: dtype (the safetensors name,
    e.g. "BF16"), shape, bytes, and the stored tensor it reads (itself, or the one an alias
    or a tied head stands for)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    stored_as: str


class Reader:
    """An open checkpoint; see `open`. Close it (or use `with`) to release its files."""

    def __init__(self, stack: ExitStack, tensors: TensorSet, implied: dict[str, str]) -> None:
        self._stack = stack
        self._set = tensors
        self._implied = implied  # head -> embedding, from config.json's tie
        self._closed = False
        self.path = tensors.path

    def keys(self) -> list[str]:
        """Every name a loader would find, in the checkpoint's order; aliases last."""
        return [*self._set.tensors, *self._implied]

    def __contains__(self, name: object) -> bool:
        return name in self._set.tensors or name in self._implied

    @property
    def metadata(self) -> dict[str, str]:
        """The checkpoint's string metadata: the index's, then the files' headers'
        (`format` and the like); ckptfix's alias record is `aliases`."""
        index = {k: v for k, v in self._set.index_metadata.items() if isinstance(v, str)}
        merged = {**index, **self._set.metadata}
        merged.pop(DROPPED_KEY, None)
        return merged

    @property
    def aliases(self) -> dict[str, str]:
        """Name -> the stored name whose bytes it reads, for names that are not stored."""
        return {**self._set.aliases, **self._implied}

    def info(self, name: str) -> TensorSpec:
        tensor = self._tensor(name)
        return TensorSpec(name, tensor.dtype, tensor.shape, tensor.nbytes, tensor.name)

    @overload
    def get(self, name: str, *, framework: Literal["numpy"] = ...) -> npt.NDArray[Any]: ...

    @overload
    def get(self, name: str, *, framework: Literal["pt"]) -> torch.Tensor: ...

    def get(self, name: str, *, framework: Framework = "numpy") -> Any:
        """The tensor `name`, read from its pieces and nothing else, as a numpy array or
        (framework="pt") a torch tensor of its own memory. numpy has no bf16 or fp8: such
        a tensor is a ValueError with framework="numpy" (use "pt")."""
        choice(framework, FRAMEWORKS, "framework")
        tensor = self._tensor(name)
        check_framework(tensor, framework)  # before anything is read
        return from_bytes(self._read(tensor), tensor, framework)

    @overload
    def iter(
        self, names: Iterable[str] | None = ..., *, framework: Literal["numpy"] = ...
    ) -> Iterator[tuple[str, npt.NDArray[Any]]]: ...

    @overload
    def iter(
        self, names: Iterable[str] | None = ..., *, framework: Literal["pt"]
    ) -> Iterator[tuple[str, torch.Tensor]]: ...

    def iter(
        self, names: Iterable[str] | None = None, *, framework: Framework = "numpy"
    ) -> Iterator[tuple[str, Any]]:
        """(name, tensor) for `names` (default: every key), one tensor read at a time:
        memory holds the tensor being yielded, never the checkpoint."""
        choice(framework, FRAMEWORKS, "framework")
        for name in self.keys() if names is None else names:
            yield name, self.get(name, framework=framework)

    def close(self) -> None:
        self._closed = True
        self._stack.close()

    def __enter__(self) -> Reader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _tensor(self, name: str) -> TensorInfo:
        if self._closed:
            raise UsageError(self.path, "the checkpoint is closed", "open it again")
        stored = self._set.tensors.get(self._implied.get(name, name))
        if stored is None:
            raise UnknownTensorError(
                self.path, f"holds no tensor named {name!r}", "see keys() for the names"
            )
        return stored

    def _read(self, tensor: TensorInfo) -> np.ndarray[Any, np.dtype[np.uint8]]:
        """The tensor's row-major bytes, read into one new array."""
        import numpy as np

        data = np.empty(tensor.nbytes, dtype=np.uint8)
        tensor_into(self._set.source, tensor, data.data)
        return data


def open(  # noqa: A001 - ckptfix.open, as safetensors.safe_open and io.open
    path: str | os.PathLike[str],
    *,
    key: str | None = None,
    zero_weights: ZeroWeights = "master",
) -> Reader:
    """Open a checkpoint file, folder or URL for reading tensors one at a time.

    `key` picks the part of a torch.distributed.checkpoint app state that holds the model
    (default: found as the CLI finds it); `zero_weights` reads a DeepSpeed checkpoint's fp32
    "master" weights (as zero_to_fp32 makes them), its "module" copy, or the fp32 weights of
    the "universal" checkpoint it holds (as --zero-weights does). A checkpoint with an
    error finding in what would be read is refused with the CLI's error (a ValueError, or
    FileNotFoundError / PermissionError for a path or URL that is missing or not allowed).
    """
    choice(zero_weights, get_args(ZeroWeights), "zero_weights")
    if key is not None and not isinstance(key, str):
        raise UsageError("key", f"{key!r} is not a string", "pass the app state's key")
    stack = ExitStack()
    try:
        tensors = stack.enter_context(opened(path, key=key or "auto", zero_weights=zero_weights))
        implied = _implied_heads(tensors)
    except BaseException:
        stack.close()
        raise
    return Reader(stack, tensors, implied)


def _implied_heads(tensors: TensorSet) -> dict[str, str]:
    checkpoint = tensors.checkpoint
    record = checkpoint.config if checkpoint is not None else None
    if record is None or record.config is None:
        return {}
    return implied_head(record.config, list(tensors.tensors))
