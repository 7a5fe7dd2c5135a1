"""One entry point that reads any weight file into descriptors, by its first bytes."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass

from ckptfix.catalog import TensorInfo
from ckptfix.errors import CorruptFileError, LfsPointerError, UnsupportedFormatError
from ckptfix.formats import safetensors, tensor_dict, torch_legacy, torch_zip
from ckptfix.sizes import format_size
from ckptfix.sniff import SNIFF_BYTES, FileFormat, describe, sniff

_LFS_SIZE = re.compile(rb"^size (\d+)\s*$", re.MULTILINE)
_LFS_OID = re.compile(rb"^oid sha256:([0-9a-f]{64})\s*$", re.MULTILINE)


@dataclass(frozen=True)
class WeightFile:
    """A weight file read into descriptors (tensor data untouched)."""

    path: str
    format: FileFormat
    size: int
    tensors: tuple[TensorInfo, ...]
    metadata: dict[str, str] | None = None
    empty_names: int = 0
    # Pickles: where the tensor dict sat, what was left around it, storage sizes by key.
    nested_key: str | None = None
    other_entries: tuple[str, ...] = ()
    other_bytes: int = 0
    storages: dict[str, int] | None = None


def _lfs_error(head: bytes, display: str) -> LfsPointerError:
    size = _LFS_SIZE.search(head)
    oid = _LFS_OID.search(head)
    target = f" to a {format_size(int(size[1]))} object" if size else ""
    ident = f" (oid sha256:{oid[1][:12].decode()}…)" if oid else ""
    return LfsPointerError(
        display,
        "lfs-pointer",
        f"file is a Git LFS pointer{target}{ident}, not the weights",
        "run `git lfs pull`, or download the file itself",
    )


def read_torch_file(path: str, display: str, fmt: FileFormat, key: str = "auto") -> WeightFile:
    """A PyTorch zip or legacy file, read without executing it (see formats.unpickler)."""
    try:
        if fmt is FileFormat.TORCH_ZIP:
            checkpoint = torch_zip.read_zip(path, display)
        else:
            checkpoint = torch_legacy.read_legacy(path, display)
    except OSError as exc:
        raise CorruptFileError(
            display, "unreadable", f"cannot read the file: {exc.strerror}", "check its permissions"
        ) from exc
    found = tensor_dict.find_tensor_dict(checkpoint.obj, key, display)
    views = tensor_dict.check_views(display, found.tensors, checkpoint.storages)
    tensors = [
        TensorInfo(
            name=view.name,
            dtype=view.dtype,
            shape=view.shape,
            nbytes=view.numel * view.itemsize,
            file=display,
            byte_range=(view.storage.begin + view.span[0], view.storage.begin + view.span[1]),
            contiguous=view.contiguous,
            storage=view.storage.key,
            strides=view.stride,
        )
        for view in views
    ]
    return WeightFile(
        path=display,
        format=fmt,
        size=os.path.getsize(path),
        tensors=tuple(tensors),
        nested_key=found.key,
        other_entries=found.other_entries,
        other_bytes=found.other_bytes,
        storages={key: storage.nbytes for key, storage in checkpoint.storages.items()},
    )


def read_weight_file(path: str, display: str, key: str = "auto") -> WeightFile:
    """Read a weight file's descriptors; raises a CkptfixError naming the file and problem."""
    try:
        with open(path, "rb") as handle:
            head = handle.read(1024)
            size = os.fstat(handle.fileno()).st_size
    except OSError as exc:
        raise CorruptFileError(
            display, "unreadable", f"cannot read the file: {exc.strerror}", "check its permissions"
        ) from exc
    fmt = sniff(head[:SNIFF_BYTES])
    if head[257:262] == b"ustar":  # POSIX tar: how torch saved checkpoints before 0.4
        raise UnsupportedFormatError(
            display,
            "file is a tar archive (the PyTorch checkpoint format before 0.4), not read",
            "load and re-save it with torch.save in a trusted environment",
        )
    if fmt is FileFormat.LFS_POINTER:
        raise _lfs_error(head, display)
    if fmt is FileFormat.SAFETENSORS or (
        fmt is FileFormat.UNKNOWN and display.endswith(".safetensors")
    ):
        # An unrecognised file named .safetensors gets the full reader, whose rules say
        # precisely what is wrong (too small, absurd header length, ...).
        try:
            header = safetensors.read_header(path, display)
        except OSError as exc:
            raise CorruptFileError(
                display,
                "unreadable",
                f"cannot read the file: {exc.strerror}",
                "check its permissions",
            ) from exc
        return WeightFile(
            path=display,
            format=FileFormat.SAFETENSORS,
            size=size,
            tensors=header.tensors,
            metadata=header.metadata,
            empty_names=header.empty_names,
        )
    if display.endswith(".safetensors"):
        raise CorruptFileError(
            display,
            "not-safetensors",
            f"file is named .safetensors but is {describe(fmt)}",
            "rename it to what it is, or convert it with `ckptfix convert`",
        )
    if fmt in (FileFormat.TORCH_ZIP, FileFormat.TORCH_LEGACY):
        return read_torch_file(path, display, fmt, key)
    raise CorruptFileError(
        display,
        "unknown-format",
        "file is not a recognised checkpoint format (safetensors, PyTorch zip or pickle)",
        "check that this is a weight file",
    )
