"""Tensors in memory, both ways: the bytes ckptfix reads made into numpy arrays or torch
tensors, and a caller's torch tensors or numpy arrays seen as raw bytes to write.

A tensor to write is never copied whole: a C-contiguous one is written straight from its
memory (`MemoryTensor.chunks` yields views of it), any other one (a transposed view, an
expanded tensor, a big-endian array) in row blocks of at most CHUNK bytes. Its storage is
identified as huggingface_hub identifies it (torch's untyped storage, numpy's base array), so
that shared tensors are found and shards split the same way.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from ckptfix.core.dtypes import DTYPES, TORCH_DTYPES, TORCH_NAMES
from ckptfix.core.errors import UsageError
from ckptfix.core.tensor import TensorInfo
from ckptfix.io.gather import row_blocks

if TYPE_CHECKING:
    import numpy as np
    import numpy.typing as npt

CHUNK = 8 * 2**20  # bytes moved (written, gathered, compared) at a time
BLOCK = 4 * 2**20  # bytes of a non-contiguous tensor made contiguous at a time

# The safetensors dtypes numpy has (little-endian); bf16 and the fp8s it has not.
NUMPY_DTYPES = {
    "BOOL": "bool",
    "U8": "u1",
    "I8": "i1",
    "I16": "<i2",
    "U16": "<u2",
    "F16": "<f2",
    "I32": "<i4",
    "U32": "<u4",
    "F32": "<f4",
    "F64": "<f8",
    "I64": "<i8",
    "U64": "<u8",
    "C64": "<c8",
}
# Dtypes of numpy arrays made by ml_dtypes (jax's bf16 and fp8), by their numpy name.
_NAMED = {"bfloat16": "BF16", "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}
_RAW_TORCH = {1: "uint8", 2: "int16", 4: "int32", 8: "int64"}  # same-width raw views


def check_framework(tensor: TensorInfo, framework: str) -> None:
    """Refuse a tensor the framework has no dtype for (numpy: bf16, fp8), naming the one
    that has it; torch is needed for framework="pt". A block-quantized GGUF tensor (Q4_K,
    ...) has a dtype in neither: its values exist only decoded."""
    if DTYPES[tensor.dtype].quantized:
        what = (
            f"tensor {tensor.name!r} is block-quantized ({tensor.dtype}), which neither numpy "
            "nor torch has a dtype for"
        )
        fix = "decode the file with `ckptfix convert --dequantize bf16|fp16|fp32`, then open that"
        raise UsageError(tensor.file, what, fix, rule="quantized-tensor")
    if framework == "pt":
        try:
            import torch  # noqa: F401 - only whether it can be
        except ImportError as exc:
            raise UsageError(
                "framework", 'framework="pt" needs torch', "pip install torch"
            ) from exc
        if tensor.dtype not in TORCH_NAMES:
            raise _no_dtype(tensor, "torch", "convert the checkpoint first")
    elif tensor.dtype not in NUMPY_DTYPES:
        raise _no_dtype(tensor, "numpy", 'read it with framework="pt" (a torch tensor)')


def _no_dtype(tensor: TensorInfo, framework: str, fix: str) -> UsageError:
    what = f"tensor {tensor.name!r} is {tensor.dtype}, which {framework} has no dtype for"
    return UsageError("framework", what, fix)


def from_bytes(data: npt.NDArray[np.uint8], tensor: TensorInfo, framework: str) -> Any:
    """A tensor's row-major bytes (a fresh uint8 array) as a numpy array or torch tensor of
    its dtype and shape, sharing that memory (see check_framework first)."""
    if framework != "pt":
        return data.view(NUMPY_DTYPES[tensor.dtype]).reshape(tensor.shape)
    import torch

    dtype = getattr(torch, TORCH_NAMES[tensor.dtype])
    if not data.size:  # torch views no empty buffer as another dtype
        return torch.empty(tensor.shape, dtype=dtype)
    return torch.from_numpy(data).view(dtype).reshape(tensor.shape)


@dataclass(frozen=True)
class Storage:
    """Where a tensor's elements live: the storage (address and size) and the tensor's place
    in it. Equal `alias` keys mean the same elements under two names."""

    address: int
    nbytes: int
    start: int  # address of the tensor's first element
    strides: tuple[int, ...]  # in bytes

    def complete(self, tensor_bytes: int) -> bool:
        """Whether the tensor covers its whole storage (huggingface_hub's `_is_complete`)."""
        return self.start == self.address and tensor_bytes == self.nbytes


@dataclass(frozen=True)
class MemoryTensor:
    """A caller's tensor to write: its dtype, shape and bytes, seen through a numpy array
    (for a torch tensor, a raw same-width integer view of it, kept in `tensor` too: torch
    makes its blocks contiguous), and its storage."""

    name: str
    dtype: str  # safetensors name
    shape: tuple[int, ...]
    nbytes: int
    array: Any  # numpy.ndarray, never copied
    storage: Storage | None  # None for a tensor of no bytes, which shares nothing
    tensor: Any = None  # the raw torch view, for a torch tensor

    @property
    def alias_key(self) -> tuple[object, ...] | None:
        """Equal for two names of exactly the same elements (storage, start, shape, strides)."""
        if self.storage is None:
            return None
        s = self.storage
        return (s.address, s.nbytes, s.start, self.shape, s.strides, self.dtype)

    @property
    def direct(self) -> bool:
        """Written straight from memory: C-contiguous, little-endian."""
        return bool(self.array.flags.c_contiguous) and self.array.dtype.byteorder != ">"

    def chunks(self, chunk: int = CHUNK) -> Iterator[memoryview]:
        """The tensor's row-major little-endian bytes, at most `chunk` at a time (at least
        one element): views of its own memory where it is contiguous, blocks of whole rows
        made contiguous otherwise (of at most BLOCK bytes, whatever `chunk` asks)."""
        if self.nbytes == 0:
            return
        if self.direct:
            flat = _bytes_of(self.array)
            for begin in range(0, self.nbytes, chunk):
                yield flat[begin : begin + chunk]
            return
        keys = row_blocks(self.shape, self.array.itemsize, min(chunk, BLOCK))
        if self.tensor is not None:
            yield from _torch_blocks(self.tensor, keys, min(chunk, BLOCK))
            return
        for key in keys:
            yield _bytes_of(_numpy_block(self.array[key]))


def _numpy_block(block: Any) -> Any:
    import numpy as np

    block = np.ascontiguousarray(block)
    if block.dtype.byteorder == ">":
        block = block.astype(block.dtype.newbyteorder("<"))
    return block


def _torch_blocks(
    tensor: Any, keys: Iterator[tuple[int | slice, ...]], size: int
) -> Iterator[memoryview]:
    """Blocks of a torch tensor made row-major in two buffers reused for every block (new
    ones for each would leave memory to the allocator's arenas). A block of a transposed
    tensor is first copied in its memory's own order, then transposed whole: torch's tiled
    transpose kernel takes only a whole matrix, and copying a transposed block element by
    element in row-major order is about four times slower."""
    import torch

    staged, ready = torch.empty(size, dtype=torch.uint8), torch.empty(size, dtype=torch.uint8)
    for key in keys:
        block = tensor[key]
        count = block.numel() * block.element_size()
        into = ready[:count].view(block.dtype).view(block.shape)
        order = sorted(range(block.dim()), key=lambda dim: -block.stride(dim))
        if order == list(range(block.dim())):
            into.copy_(block)
        else:
            memory_order = staged[:count].view(block.dtype).view([block.shape[d] for d in order])
            memory_order.copy_(block.permute(order))
            into.copy_(memory_order.permute([order.index(d) for d in range(block.dim())]))
        yield ready[:count].numpy().data


def _bytes_of(array: Any) -> memoryview:
    """A C-contiguous numpy array's bytes, without a copy."""
    import numpy as np

    return memoryview(array.reshape(-1).view(np.uint8))


def as_memory(name: object, value: object) -> MemoryTensor:
    """A torch tensor or numpy array to write, without copying it; anything else (a list, a
    GPU or sparse tensor, an object array) is refused with a ValueError naming it."""
    if not isinstance(name, str):
        raise UsageError("tensors", f"key {name!r} is not a string", "name every tensor by a str")
    if type(value).__module__.startswith("torch") or _is_torch(value):
        return _from_torch(name, value)
    if type(value).__module__ == "numpy" and hasattr(value, "dtype"):
        return _from_numpy(name, value)
    raise UsageError(
        "tensors",
        f"{name!r} is a {type(value).__name__}, not a torch tensor or numpy array",
        "pass torch tensors or numpy arrays",
    )


def _is_torch(value: object) -> bool:
    """A torch tensor (nn.Parameter and other subclasses too), without importing torch."""
    return any(
        cls.__module__ == "torch" and cls.__name__ == "Tensor" for cls in type(value).__mro__
    )


def _from_torch(name: str, value: Any) -> MemoryTensor:
    import torch

    if not isinstance(value, torch.Tensor):
        raise UsageError("tensors", f"{name!r} is a {type(value).__name__}", "pass tensors")
    tensor = value.detach()
    dtype = TORCH_DTYPES.get(str(tensor.dtype).removeprefix("torch."))
    if tensor.layout != torch.strided or tensor.device.type != "cpu" or dtype is None:
        what = f"{tensor.layout}, {tensor.dtype}" if dtype else str(tensor.dtype)
        raise UsageError(
            "tensors",
            f"{name!r} is a {tensor.device.type} tensor ({what}), which cannot be written as is",
            "pass a dense CPU tensor of a safetensors dtype (e.g. tensor.cpu())",
        )
    # Conjugate and negative views hold their elements unresolved: resolved (a copy).
    tensor = tensor.resolve_conj().resolve_neg()
    itemsize = tensor.element_size()
    nbytes = tensor.numel() * itemsize
    storage = None
    if nbytes:
        untyped = tensor.untyped_storage()
        strides = tuple(step * itemsize for step in tensor.stride())
        storage = Storage(untyped.data_ptr(), untyped.nbytes(), tensor.data_ptr(), strides)
    raw = tensor.view(getattr(torch, _RAW_TORCH[itemsize]))
    return MemoryTensor(name, dtype, tuple(tensor.shape), nbytes, raw.numpy(), storage, raw)


def _from_numpy(name: str, array: Any) -> MemoryTensor:
    dtype = _numpy_dtype(array.dtype)
    if dtype is None:
        raise UsageError(
            "tensors",
            f"{name!r} has numpy dtype {array.dtype}, which safetensors cannot hold",
            "convert it to a numeric dtype",
        )
    nbytes = int(array.nbytes)
    storage = None
    if nbytes:
        root = array
        while getattr(root, "base", None) is not None and hasattr(root.base, "__array_interface__"):
            root = root.base
        address = int(root.__array_interface__["data"][0])
        start = int(array.__array_interface__["data"][0])
        size = int(getattr(root, "nbytes", nbytes))
        storage = Storage(address, size, start, tuple(int(s) for s in array.strides))
    return MemoryTensor(name, dtype, tuple(int(d) for d in array.shape), nbytes, array, storage)


def _numpy_dtype(dtype: Any) -> str | None:
    """The safetensors name of a numpy dtype, whatever its byte order."""
    import numpy as np

    named = _NAMED.get(dtype.name)
    if named is not None:
        return named
    if dtype.fields is not None or dtype.subdtype is not None:
        return None
    by_numpy = {np.dtype(text).str: name for name, text in NUMPY_DTYPES.items()}
    return by_numpy.get(dtype.newbyteorder("<").str)
