"""Legacy (pre-1.6, non-zip) PyTorch checkpoints, read without torch.

Layout: five pickles back to back (magic number, protocol version, system info, the
checkpoint object, the list of storage keys), then for each key an int64 element count
and the storage's raw bytes. Each pickle's end is found by walking its opcodes on a window
of the file that grows only as needed, so the storages after them are never loaded.
"""

from __future__ import annotations

import struct
from typing import Any

from ckptfix.core.errors import CorruptFileError
from ckptfix.core.findings import Finding
from ckptfix.formats import sniff
from ckptfix.formats.base import FORMATS, FileRead, ReadOptions
from ckptfix.formats.pickle_scan import (
    MAX_PICKLE_BYTES,
    PickleRejected,
    PickleTruncated,
    ScanResult,
    scan,
)
from ckptfix.formats.pickled import pickle_checks, pickle_file
from ckptfix.formats.tensor_dict import PickleCheckpoint, Storage
from ckptfix.formats.torch_zip import storage_nbytes
from ckptfix.formats.unpickler import REEXPORT, Resolver, StorageRef, unpickle
from ckptfix.io.source import ByteSource

LEGACY_MAGIC = 0x1950A86A20F9469CFC6C
LEGACY_PROTOCOL = 1001
_FIRST_WINDOW = 2**16
_TRUNCATED_FIX = "re-download the file"


class _Pickles:
    """Reads the pickles of a legacy file one after another."""

    def __init__(self, source: ByteSource, resolve: Resolver) -> None:
        self.source = source
        self.size = source.size
        self.display = source.label
        self.resolve = resolve
        self.position = 0

    def _window(self, what: str) -> tuple[bytes, ScanResult]:
        """The bytes of the next pickle: a window grown (×4) until the walk finds STOP."""
        window = _FIRST_WINDOW
        while True:
            window = min(window, self.size - self.position, MAX_PICKLE_BYTES)
            data = self.source.read_at(self.position, window)
            try:
                walk = scan(data)
                return data[: walk.end], walk
            except PickleTruncated as exc:
                if window >= min(self.size - self.position, MAX_PICKLE_BYTES):
                    raise self._error(what, exc) from exc
                window *= 4
            except PickleRejected as exc:
                raise self._error(what, exc) from exc

    def _error(self, what: str, exc: PickleRejected) -> CorruptFileError:
        if isinstance(exc, PickleTruncated) and self.size - self.position > MAX_PICKLE_BYTES:
            return CorruptFileError(
                self.display,
                "pickle-too-large",
                f"{what} pickle is over {MAX_PICKLE_BYTES} bytes",
                REEXPORT,
            )
        return CorruptFileError(self.display, exc.rule, f"{what} pickle: {exc.what}", REEXPORT)

    def next(self, what: str) -> Any:
        data, walk = self._window(what)
        self.position += len(data)
        from ckptfix.formats.benign import PLAIN_ALLOWLIST

        return unpickle(data, self.display, self.resolve, PLAIN_ALLOWLIST, walk=walk)


def _header(pickles: _Pickles, display: str) -> None:
    if pickles.next("magic number") != LEGACY_MAGIC:
        raise CorruptFileError(display, "bad-magic", "pickle is not a PyTorch checkpoint", REEXPORT)
    if pickles.next("protocol version") != LEGACY_PROTOCOL:
        raise CorruptFileError(display, "bad-protocol", "unknown legacy protocol version", REEXPORT)
    info = pickles.next("system info")
    if not isinstance(info, dict) or info.get("little_endian") is not True:
        raise CorruptFileError(
            display, "big-endian", "only little-endian checkpoints are read", REEXPORT
        )


def _storage_keys(pickles: _Pickles, display: str) -> list[str]:
    keys = pickles.next("storage list")
    if (
        not isinstance(keys, list)
        or not all(type(k) is str for k in keys)
        or len(set(keys)) != len(keys)
    ):
        raise CorruptFileError(
            display, "bad-storage-list", "storage key list is malformed", REEXPORT
        )
    return keys


def _locate(
    source: ByteSource, keys: list[str], pending: dict[str, tuple[str | None, int]], start: int
) -> tuple[dict[str, Storage], int]:
    """Each storage: an int64 element count, then its bytes. Returns them and the end."""
    storages: dict[str, Storage] = {}
    position, display = start, source.label
    for key in keys:
        if position + 8 > source.size:
            raise CorruptFileError(
                display, "truncated", f"file ends before storage {key!r}", _TRUNCATED_FIX
            )
        (numel,) = struct.unpack("<q", source.read_at(position, 8))
        dtype, expected = pending.get(key, (None, -1))
        if key not in pending or numel != expected:
            raise CorruptFileError(
                display,
                "storage-size",
                f"storage {key!r} has {numel} elements, expected {expected}",
                REEXPORT,
            )
        nbytes = storage_nbytes(dtype, numel)
        storages[key] = Storage(key, dtype, nbytes, position + 8)
        position += 8 + nbytes
    return storages, position


def read_legacy(source: ByteSource) -> PickleCheckpoint:
    """The unpickled object of a legacy torch file, with its storages located."""
    pending: dict[str, tuple[str | None, int]] = {}
    display, size = source.label, source.size

    def resolve(key: str, dtype: str | None, numel: int) -> StorageRef:
        if key in pending and pending[key] != (dtype, numel):
            raise CorruptFileError(
                display,
                "storage-mismatch",
                f"storage {key!r} is referenced with two sizes",
                REEXPORT,
            )
        pending[key] = (dtype, numel)
        return StorageRef(key, dtype, storage_nbytes(dtype, numel))

    pickles = _Pickles(source, resolve)
    _header(pickles, display)
    obj = pickles.next("checkpoint")
    keys = _storage_keys(pickles, display)
    storages, end = _locate(source, keys, pending, pickles.position)
    if end > size:
        raise CorruptFileError(
            display,
            "truncated",
            f"storages need {end} bytes but the file has {size}",
            _TRUNCATED_FIX,
        )
    if end < size:
        raise CorruptFileError(
            display,
            "trailing-bytes",
            f"file has {size - end} bytes after the last storage",
            REEXPORT,
        )
    missing = sorted(set(pending) - set(storages))
    if missing:
        raise CorruptFileError(
            display, "missing-storage", f"storage {missing[0]!r} is used but not stored", REEXPORT
        )
    return PickleCheckpoint(obj, storages, "torch-legacy")


class TorchLegacyFormat:
    """The pickle format torch wrote before 1.6: pickles back to back, then the storages."""

    name = "torch-legacy"
    description = "a pickle (legacy PyTorch checkpoint)"

    def sniff(self, head: bytes) -> bool:
        return sniff.torch_legacy(head)

    def read(self, source: ByteSource, options: ReadOptions) -> FileRead:
        return pickle_file(read_legacy(source), source, self.name, options)

    def checks(self, file: FileRead) -> list[Finding]:
        return pickle_checks(file)


TORCH_LEGACY = FORMATS.register(TorchLegacyFormat())
