"""Output files: created exclusively, written whole, fsynced; the free-space check before
anything is created; OS errors turned into one line for the user."""

from __future__ import annotations

import errno
import json
import os
from collections.abc import Iterable, Mapping
from operator import attrgetter
from typing import Any

from ckptfix.core.dtypes import DTYPES
from ckptfix.core.errors import (
    CkptfixError,
    CorruptFileError,
    PlanError,
    VerificationError,
    WriteError,
    WritePermissionError,
)
from ckptfix.core.sizes import format_size
from ckptfix.io.descriptors import OUT_OF_DESCRIPTORS, out_of_descriptors, with_room
from ckptfix.plan.alias_record import DROPPED_KEY
from ckptfix.plan.select import OutTensor
from ckptfix.plan.shards import ShardPlan
from ckptfix.platform import system
from ckptfix.write.copy import write_all

_NAME, _DTYPE, _STORED = attrgetter("name"), attrgetter("dtype"), attrgetter("source.dtype")
_QUANTIZED = frozenset(name for name, dtype in DTYPES.items() if dtype.quantized)


def create_file(path: str) -> int:
    # 0o666 and the process umask: the permissions any ordinary tool would give the file.
    return system().create(path, 0o666)


def open_output(path: str) -> tuple[int, int]:
    """A new output file, created (see create_file): a descriptor to read it back, and
    one to write it; room is made for them among the sources' idle descriptors if need be."""
    fd = with_room(lambda: create_file(path))
    try:
        return with_room(lambda: system().open_read(path)), fd
    except BaseException:
        os.close(fd)
        raise


def check_names(tensors: Iterable[OutTensor]) -> None:
    """Refuse, before anything is written, a tensor name that is not Unicode text (a lone
    surrogate, which a pickle can carry): no safetensors header or JSON index can hold it."""
    tensors = list(tensors)
    if "".join(map(_NAME, tensors)).isascii():
        return  # every name (the usual case, checked in one pass)
    for tensor in tensors:
        if tensor.name.isascii():
            continue
        try:
            tensor.name.encode("utf-8")
        except UnicodeEncodeError:
            raise CorruptFileError(
                tensor.source.file,
                "bad-tensor-name",
                f"tensor name {tensor.name!r} is not valid Unicode (a lone surrogate), which "
                "no safetensors header or index can hold",
                "rename the tensor where the checkpoint is made",
            ) from None


def check_quantized(tensors: Iterable[OutTensor], out: str) -> None:
    """Refuse, before anything is written, a block-quantized tensor (GGUF) kept as it is:
    neither safetensors nor torch has its dtype, and its values exist only decoded; and
    one to be decoded that the gguf package cannot decode."""
    tensors = list(tensors)
    if _QUANTIZED.isdisjoint(map(_DTYPE, tensors)):  # each dtype looked up in one pass in C
        if not _QUANTIZED.isdisjoint(map(_STORED, tensors)):
            decoded = [t.source for t in tensors if t.source.dtype in _QUANTIZED]
            from ckptfix.write.dequantize import check_dequantizable

            check_dequantizable({t.dtype for t in decoded}, decoded[0].file)
        return
    kept = [tensor for tensor in tensors if tensor.dtype in _QUANTIZED]
    dtypes = ", ".join(sorted({tensor.dtype for tensor in kept}))
    raise PlanError(
        kept[0].source.file,
        f"{len(kept)} tensor(s) such as {kept[0].name!r} are block-quantized ({dtypes}), which "
        "safetensors and torch have no dtype for",
        "decode them with --dequantize bf16, fp16 or fp32, or keep the model as GGUF "
        "(`ckptfix reshard` splits and merges it)",
        rule="quantized-tensor",
    )


def check_free_space(folder: str, needed: int, out: str) -> None:
    """Refuse up front a read-only or too-full file system, before anything is created."""
    available, read_only = system().disk_space(folder)
    if read_only:
        raise WriteError(
            out, f"cannot write: {os.strerror(errno.EROFS)}", "check the folder's permissions"
        )
    margin = max(64 * 2**20, needed // 100)
    if needed + margin > available:
        raise WriteError(
            out,
            f"not enough free space: the output needs {format_size(needed)} "
            f"(+{format_size(margin)} margin) but {format_size(available)} is free",
            "free some space or choose another -o folder",
        )


def index_bytes(plan: ShardPlan, index_metadata: Mapping[str, Any]) -> bytes:
    """The index document of a plan: its metadata with `total_size`, the weight map."""
    document = {
        "metadata": {**index_metadata, "total_size": plan.total_size},
        "weight_map": plan.weight_map,
    }
    return (json.dumps(document, indent=2, sort_keys=True, ensure_ascii=False) + "\n").encode()


def write_index(
    path: str, plan: ShardPlan, index_metadata: Mapping[str, Any], display: str | None = None
) -> int:
    """Write the index, then read it back: it must give every name the plan places and the
    record of the names it drops (what a loader and a hash find through it)."""
    data = index_bytes(plan, index_metadata)
    write_whole(path, data)
    with open(path, "rb") as handle:
        written = json.loads(handle.read(len(data) + 1))
    names = (written.get("weight_map"), written.get("metadata", {}).get(DROPPED_KEY))
    if names != (plan.weight_map, index_metadata.get(DROPPED_KEY)):
        raise VerificationError(
            display or path,
            "written index does not name every tensor as planned",
            "check the disk and run again",
        )
    return len(data)


def write_whole(path: str, data: bytes) -> int:
    """A new file holding `data`, fsynced; its size."""
    fd = create_file(path)
    try:
        write_all(fd, data, 0)
        system().sync(fd)
    finally:
        os.close(fd)
    return len(data)


def wrap_os_error(exc: OSError, out: str) -> CkptfixError:
    """Turn an OSError from writing into a one-line error for the user."""
    if exc.errno == errno.ENOSPC:
        return WriteError(
            out,
            "no space left on device; nothing was written",
            "free some space or choose another -o folder",
        )
    if exc.errno in (errno.EACCES, errno.EPERM):
        return WritePermissionError(
            out, f"cannot write: {exc.strerror}", "check the folder's permissions"
        )
    if exc.errno == errno.EROFS:
        return WriteError(out, f"cannot write: {exc.strerror}", "check the folder's permissions")
    if exc.errno in OUT_OF_DESCRIPTORS:
        return out_of_descriptors(out)
    where = exc.filename or out
    return WriteError(str(where), f"write failed: {exc.strerror}", "check the disk and run again")
