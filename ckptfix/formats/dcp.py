"""torch.distributed.checkpoint: the `.metadata` pickle, read with inert stubs for exactly
the globals it names, into plain validated records (tensors, chunks, where each chunk is
stored). Nothing else of a DCP folder is a pickle we unpickle: chunks are `torch.save` zips
read by `torch_zip.read_zip` on a window of their rank file, or safetensors parts."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ckptfix.core.dtypes import DTYPES
from ckptfix.core.errors import CorruptFileError
from ckptfix.core.findings import Finding
from ckptfix.core.text import plain_file_name
from ckptfix.formats.base import FORMATS, FileRead, ReadOptions
from ckptfix.formats.benign import reader_allowlist
from ckptfix.formats.pickle_scan import MAX_PICKLE_BYTES, PickleRejected
from ckptfix.formats.training_pickles import stubs
from ckptfix.formats.unpickler import Allowlist, DtypeMark, StorageRef, Stub, brief, unpickle
from ckptfix.io.source import ByteSource

METADATA = ".metadata"
_META = "torch.distributed.checkpoint.metadata"
_FS = "torch.distributed.checkpoint.filesystem"
_CLASSES = stubs(
    _META,
    (
        "Metadata",
        "TensorStorageMetadata",
        "ChunkStorageMetadata",
        "TensorProperties",
        "BytesStorageMetadata",
        "MetadataIndex",
        "StorageMeta",
        "_MEM_FORMAT_ENCODING",
    ),
)
_CLASSES.update(stubs(_FS, ("_StorageInfo",)))
# Its storage references are refused (`_refuse_storages`): `.metadata` holds no tensor data.
METADATA_ALLOWLIST: Allowlist = reader_allowlist("dcp-metadata", _CLASSES)
_FIX = "save the checkpoint again, or copy .metadata from the training run's output"


def _is(value: object, name: str) -> bool:
    module = _FS if name == "_StorageInfo" else _META
    return isinstance(value, _CLASSES[(module, name)])


@dataclass(frozen=True)
class Chunk:
    """One saved shard of a tensor: a row-major block at `offsets` of size `sizes`."""

    offsets: tuple[int, ...]
    sizes: tuple[int, ...]


@dataclass(frozen=True)
class TensorEntry:
    fqn: str
    dtype: str
    size: tuple[int, ...]
    chunks: tuple[Chunk, ...]


@dataclass(frozen=True)
class StorageItem:
    """Where one chunk (or one non-tensor item) is stored: bytes [offset, offset + length)
    of the rank file `file`, transformed by `transforms` (e.g. zstd) when there are any."""

    file: str
    offset: int
    length: int
    transforms: tuple[str, ...] = ()


ItemKey = tuple[str, tuple[int, ...] | None]  # (fqn, chunk offsets); None for non-tensors


@dataclass(frozen=True)
class DcpMetadata:
    tensors: dict[str, TensorEntry]  # in the order they were saved
    byte_items: tuple[str, ...]  # non-tensor items (pickled objects we never read)
    paths: dict[str, tuple[str, ...]]  # fqn -> its key path in the saved app state
    storage: dict[ItemKey, StorageItem]
    version: str | None


def _bad(path: str, what: str) -> CorruptFileError:
    return CorruptFileError(path, "dcp-metadata", what, _FIX)


def _state(value: object, name: str, path: str, where: str) -> Stub:
    if not _is(value, name):
        raise _bad(path, f"{where} is {brief(value)}, not a {name}")
    assert isinstance(value, Stub)
    return value


def _dims(value: object, path: str, where: str) -> tuple[int, ...]:
    if type(value) is not tuple or not all(type(d) is int and d >= 0 for d in value):
        raise _bad(path, f"{where} is {brief(value)}, not a list of sizes")
    return value


def _properties(value: object, path: str, fqn: str) -> str:
    """The dtype of TensorProperties: BUILD with (dtype, layout, requires_grad, memory
    format, pin_memory), or a dict of those fields in older versions."""
    state = _state(value, "TensorProperties", path, f"properties of {fqn!r}").state
    if isinstance(state, tuple) and len(state) >= 2:
        dtype, layout = state[0], state[1]
    elif isinstance(state, dict):
        dtype, layout = state.get("dtype"), state.get("layout")
    else:
        raise _bad(path, f"properties of {fqn!r} are {brief(state)}")
    if not isinstance(dtype, DtypeMark) or DTYPES[dtype.dtype].bits % 8:
        raise _bad(path, f"dtype of {fqn!r} is {brief(dtype)}")
    if layout not in (None, "torch.strided"):
        raise _bad(path, f"{fqn!r} has layout {brief(layout)}; only dense tensors are supported")
    return dtype.dtype


def _tensor(fqn: str, value: Stub, path: str) -> TensorEntry:
    size = _dims(value.field("size"), path, f"size of {fqn!r}")
    chunks = value.field("chunks")
    if type(chunks) is not list:
        raise _bad(path, f"chunks of {fqn!r} are {brief(chunks)}")
    parsed = []
    for chunk in chunks:
        stub = _state(chunk, "ChunkStorageMetadata", path, f"a chunk of {fqn!r}")
        offsets = _dims(stub.field("offsets"), path, f"chunk offsets of {fqn!r}")
        sizes = _dims(stub.field("sizes"), path, f"chunk sizes of {fqn!r}")
        if len(offsets) != len(size) or len(sizes) != len(size):
            raise _bad(path, f"a chunk of {fqn!r} has {len(offsets)} dimensions, not {len(size)}")
        parsed.append(Chunk(offsets, sizes))
    dtype = _properties(value.field("properties"), path, fqn)
    return TensorEntry(fqn, dtype, size, tuple(parsed))


def _entries(value: object, path: str) -> tuple[dict[str, TensorEntry], tuple[str, ...]]:
    if not isinstance(value, dict):
        raise _bad(path, f"state_dict_metadata is {brief(value)}")
    tensors: dict[str, TensorEntry] = {}
    others = []
    for fqn, entry in value.items():
        if type(fqn) is not str:
            raise _bad(path, f"an item is named {brief(fqn)}")
        if _is(entry, "BytesStorageMetadata"):
            others.append(fqn)
        else:
            stub = _state(entry, "TensorStorageMetadata", path, f"item {fqn!r}")
            tensors[fqn] = _tensor(fqn, stub, path)
    return tensors, tuple(others)


def _item(key: object, info: object, path: str) -> tuple[ItemKey, StorageItem]:
    index = _state(key, "MetadataIndex", path, "a storage key")
    fqn, offset = index.field("fqn"), index.field("offset")
    if type(fqn) is not str:
        raise _bad(path, f"a storage key names {brief(fqn)}")
    dims = None if offset is None else _dims(offset, path, f"storage offsets of {fqn!r}")
    stored = _state(info, "_StorageInfo", path, f"storage of {fqn!r}")
    file, begin, length = (stored.field(k) for k in ("relative_path", "offset", "length"))
    if not plain_file_name(file):
        raise CorruptFileError(
            path, "path-traversal", f"item {fqn!r} is stored in {brief(file)}, outside the folder"
        )
    if type(begin) is not int or type(length) is not int or begin < 0 or length < 0:
        raise _bad(path, f"item {fqn!r} is stored at {brief(begin)}+{brief(length)}")
    transforms = stored.field("transform_descriptors") or ()
    if not isinstance(transforms, list | tuple) or not all(type(t) is str for t in transforms):
        raise _bad(path, f"transforms of {fqn!r} are {brief(transforms)}")
    return (fqn, dims), StorageItem(str(file), begin, length, tuple(map(str, transforms)))


def _storage(value: object, path: str) -> dict[ItemKey, StorageItem]:
    if not isinstance(value, dict):
        raise _bad(path, f"storage_data is {brief(value)}")
    storage: dict[ItemKey, StorageItem] = {}
    for key, info in value.items():
        item_key, item = _item(key, info, path)
        if item_key in storage:
            raise _bad(path, f"item {item_key[0]!r} at {item_key[1]} is stored twice")
        storage[item_key] = item
    return storage


def _paths(value: object, path: str) -> dict[str, tuple[str, ...]]:
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise _bad(path, f"planner_data is {brief(value)}")
    paths = {}
    for fqn, keys in value.items():
        if type(fqn) is not str or type(keys) not in (tuple, list):
            raise _bad(path, f"planner_data has {brief(fqn)} -> {brief(keys)}")
        if not keys or not all(type(k) in (str, int) for k in keys):
            raise _bad(path, f"the key path of {fqn!r} is {brief(keys)}")
        paths[fqn] = tuple(str(k) for k in keys)
    return paths


def _refuse_storages(key: str, dtype: str | None, numel: int) -> StorageRef:
    raise PickleRejected("bad-storage-ref", ".metadata refers to tensor storage; it holds none")


def read_metadata(source: ByteSource, allowed: Allowlist = METADATA_ALLOWLIST) -> DcpMetadata:
    """Read and validate `.metadata`; a CorruptFileError or UnsafePickleError names the rule.
    `allowed`: a writer's own extra stubs (Megatron keeps its save plans there)."""
    path = source.label
    if source.size > MAX_PICKLE_BYTES:
        raise _bad(path, f"file is {source.size} bytes, over {MAX_PICKLE_BYTES}")
    obj: Any = unpickle(source.read_at(0, source.size), path, _refuse_storages, allowed)
    top = _state(obj, "Metadata", path, "the file")
    tensors, others = _entries(top.field("state_dict_metadata"), path)
    version = top.field("version")
    return DcpMetadata(
        tensors=tensors,
        byte_items=others,
        paths=_paths(top.field("planner_data"), path),
        storage=_storage(top.field("storage_data"), path),
        version=version if type(version) is str else None,
    )


class DcpFormat:
    """The files of a DCP folder. Never sniffed: they are read as part of their folder
    (`layouts.dcp`); registered so that checks and reports know the name."""

    name = "dcp"
    description = "a torch.distributed.checkpoint file"

    def sniff(self, head: bytes) -> bool:
        return False

    def read(self, source: ByteSource, options: ReadOptions) -> FileRead:
        raise CorruptFileError(
            source.label,
            "dcp-part",
            "file is one part of a torch.distributed.checkpoint folder",
            "pass the folder that holds .metadata",
        )

    def checks(self, file: FileRead) -> list[Finding]:
        return []


DCP = FORMATS.register(DcpFormat())
