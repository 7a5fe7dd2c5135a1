"""PyTorch zip checkpoints (what `torch.save` writes since 1.6), read without torch.

The archive's directory is checked before anything is read: one top-level folder, no
duplicate entries, no encryption, and nothing compressed among the entries we read
(torch writes every entry stored). `data.pkl` is read from its exact byte range and
checked against its CRC; storages become byte ranges in the file. No tensor data is read.
"""

from __future__ import annotations

import struct
import zipfile
import zlib
from collections import Counter

from ckptfix.core.dtypes import DTYPES
from ckptfix.core.errors import CkptfixError, CorruptFileError, UnsupportedFormatError
from ckptfix.core.findings import Finding
from ckptfix.formats import sniff
from ckptfix.formats.base import FORMATS, FileRead, ReadOptions
from ckptfix.formats.pickle_scan import MAX_PICKLE_BYTES
from ckptfix.formats.pickled import pickle_checks, pickle_file
from ckptfix.formats.tensor_dict import PickleCheckpoint, Storage
from ckptfix.formats.unpickler import (
    REEXPORT,
    Allowlist,
    StorageRef,
    unpickle,
)
from ckptfix.io.source import ByteSource, open_stream

MAX_ENTRIES = 4_000_000  # a 1,000,000-tensor checkpoint has about as many storages
_LOCAL_HEADER = struct.Struct("<4sHHHHHIIIHH")
_ZIP_ERRORS = (
    zipfile.BadZipFile,
    OSError,
    ValueError,
    EOFError,
    struct.error,
    NotImplementedError,
    OverflowError,
)


def _bad(display: str, rule: str, what: str) -> CorruptFileError:
    return CorruptFileError(display, rule, what, REEXPORT)


def _open_archive(source: ByteSource, display: str) -> list[zipfile.ZipInfo]:
    try:
        with open_stream(source) as stream, zipfile.ZipFile(stream) as archive:
            return archive.infolist()
    except CkptfixError:  # a short read's own error line (a ValueError too), as it is
        raise
    except _ZIP_ERRORS as exc:
        raise _bad(display, "bad-zip", f"zip archive cannot be read: {exc}") from exc


def _check_directory(infos: list[zipfile.ZipInfo], display: str) -> str:
    """Validate the central directory; return the archive's top-level folder."""
    if len(infos) > MAX_ENTRIES:
        raise _bad(
            display, "zip-too-many-entries", f"zip has {len(infos)} entries, over {MAX_ENTRIES}"
        )
    counts = Counter(info.filename for info in infos)
    duplicated = sorted(name for name, count in counts.items() if count > 1)
    if duplicated:
        raise _bad(
            display,
            "zip-duplicate-entry",
            f"zip holds duplicate entries: {', '.join(duplicated[:3])}",
        )
    roots = {info.filename.split("/", 1)[0] for info in infos}
    if len(roots) != 1 or any("/" not in info.filename for info in infos):
        raise _bad(display, "zip-layout", "zip does not have exactly one top-level folder")
    root = roots.pop()
    if any(n.startswith((f"{root}/code/", f"{root}/constants.pkl")) for n in counts):
        raise UnsupportedFormatError(
            display,
            "file is a TorchScript archive, not a checkpoint",
            "export its state_dict() with torch.save instead",
        )
    pickles = [n for n in counts if n.endswith(".pkl")]
    if pickles != [f"{root}/data.pkl"]:
        raise _bad(display, "zip-layout", f"expected one {root}/data.pkl, found {pickles[:3]}")
    return root


def _entry_start(
    source: ByteSource, info: zipfile.ZipInfo, file_size: int, display: str, kind: str
) -> int:
    """Where a stored entry's bytes start, from its local header, which must agree with the
    central directory (name, method) and is not taken on trust."""
    if info.flag_bits & 0x1:
        raise _bad(display, "zip-encrypted", f"zip entry {info.filename!r} is encrypted")
    if info.compress_type != zipfile.ZIP_STORED or info.compress_size != info.file_size:
        raise _bad(
            display,
            f"compressed-{kind}",
            f"zip entry {info.filename!r} is compressed (method {info.compress_type}); "
            "torch writes every entry stored",
        )
    if info.header_offset + _LOCAL_HEADER.size > file_size:
        raise _bad(display, "bad-zip", f"local header of {info.filename!r} is past the end")
    header = source.read_at(info.header_offset, _LOCAL_HEADER.size)
    magic, _, flags, method, *_, name_length, extra_length = _LOCAL_HEADER.unpack(header)
    raw_name = source.read_at(info.header_offset + _LOCAL_HEADER.size, name_length)
    name = raw_name.decode("utf-8" if flags & 0x800 else "cp437", "replace")
    if magic != b"PK\x03\x04" or method != 0 or flags & 0x1 or name != info.orig_filename:
        raise _bad(
            display, "bad-zip", f"local header of {info.filename!r} disagrees with the directory"
        )
    start: int = info.header_offset + _LOCAL_HEADER.size + name_length + extra_length
    if start + info.file_size > file_size:
        raise CorruptFileError(
            display,
            "truncated",
            f"zip entry {info.filename!r} runs past the end of the file",
            "re-download the file",
        )
    return start


def _read_pickle(source: ByteSource, info: zipfile.ZipInfo, file_size: int, display: str) -> bytes:
    if info.file_size > MAX_PICKLE_BYTES:
        raise _bad(
            display,
            "pickle-too-large",
            f"data.pkl is {info.file_size} bytes, over {MAX_PICKLE_BYTES}",
        )
    start = _entry_start(source, info, file_size, display, "pickle")
    data = source.read_at(start, info.file_size)
    if zlib.crc32(data) != info.CRC:
        raise _bad(display, "bad-zip", "data.pkl does not match its CRC (a damaged download?)")
    return data


def read_zip(source: ByteSource, allowed: Allowlist) -> PickleCheckpoint:
    """The unpickled object of a torch zip file, with its storages located (`allowed`: the
    reader's allowlist, made by `benign.reader_allowlist`)."""
    display, file_size = source.label, source.size
    infos = _open_archive(source, display)
    root = _check_directory(infos, display)
    entries = {info.filename: info for info in infos}
    data = _read_pickle(source, entries[f"{root}/data.pkl"], file_size, display)
    storages: dict[str, Storage] = {}
    refs: dict[str, StorageRef] = {}

    def resolve(key: str, dtype: str | None, numel: int) -> StorageRef:
        nbytes = storage_nbytes(dtype, numel)
        if key in refs:
            if refs[key].nbytes != nbytes:
                raise _bad(
                    display, "storage-mismatch", f"storage {key!r} is referenced with two sizes"
                )
            return refs[key]
        info = entries.get(f"{root}/data/{key}")
        if info is None:
            raise _bad(display, "missing-storage", f"storage {key!r} has no data/{key} entry")
        if info.file_size != nbytes:
            raise _bad(
                display,
                "storage-size",
                f"storage {key!r} should hold {nbytes} bytes but its entry has {info.file_size}",
            )
        begin = _entry_start(source, info, file_size, display, "storage")
        storages[key] = Storage(key, dtype, nbytes, begin)
        refs[key] = StorageRef(key, dtype, nbytes)
        return refs[key]

    obj = unpickle(data, display, resolve, allowed)
    return PickleCheckpoint(obj, storages, "torch-zip")


def storage_nbytes(dtype: str | None, numel: int) -> int:
    return numel if dtype is None else numel * DTYPES[dtype].bits // 8


class TorchZipFormat:
    """What `torch.save` writes since 1.6 (`.bin .pt .pth .ckpt`): a zip with data.pkl."""

    name = "torch-zip"
    description = "a zip archive (PyTorch checkpoint)"

    def sniff(self, head: bytes) -> bool:
        return sniff.torch_zip(head)

    def read(self, source: ByteSource, options: ReadOptions) -> FileRead:
        from ckptfix.formats.benign import PLAIN_ALLOWLIST

        return pickle_file(read_zip(source, PLAIN_ALLOWLIST), source, self.name, options)

    def checks(self, file: FileRead) -> list[Finding]:
        return pickle_checks(file)


TORCH_ZIP = FORMATS.register(TorchZipFormat())
