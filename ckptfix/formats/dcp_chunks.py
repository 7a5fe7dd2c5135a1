"""Where a DCP chunk's row-major bytes are in its rank file, checked against `.metadata`.

TORCH_SAVE (the default): each chunk is a whole `torch.save` zip at its `_StorageInfo`
range; it is read by `torch_zip.read_zip` on a window of the rank file (its pickle goes
through the same walk and allowlist as any torch file), and its storage offsets, relative
to the window, are shifted back into the file. SAFETENSORS: the rank file ends with a
safetensors part whose `__metadata__` names each tensor's chunk offsets (DCP_SHARDING_INFO);
the header is the truth, checked against `.metadata`.
"""

from __future__ import annotations

from ckptfix.core.dtypes import DTYPES, numel_of
from ckptfix.core.errors import CkptfixError, CorruptFileError, UnsupportedFormatError
from ckptfix.core.tensor import TensorInfo
from ckptfix.formats.benign import reader_allowlist
from ckptfix.formats.dcp import Chunk, StorageItem, TensorEntry
from ckptfix.formats.safetensors import read_header
from ckptfix.formats.strict_json import loads
from ckptfix.formats.tensor_dict import check_view
from ckptfix.formats.torch_zip import read_zip
from ckptfix.formats.unpickler import TensorRef
from ckptfix.io.source import ByteSource
from ckptfix.io.window import Window

ZIP_MAGIC = b"PK\x03\x04"
SHARDING_KEY = "DCP_SHARDING_INFO"
TORCH_SAVE, SAFETENSORS = "torch_save", "safetensors"
_FIX = "save the checkpoint again"
CHUNK_ALLOWLIST = reader_allowlist("dcp-chunk")


def chunk_nbytes(entry: TensorEntry, chunk: Chunk) -> int:
    return numel_of(chunk.sizes) * DTYPES[entry.dtype].bits // 8


def _where(entry: TensorEntry, chunk: Chunk, item: StorageItem) -> str:
    return f"chunk {list(chunk.offsets)} of {entry.fqn!r} (bytes {item.offset}-{item.offset + item.length})"


def _bad(source: ByteSource, where: str, what: str) -> CorruptFileError:
    return CorruptFileError(source.label, "dcp-chunk", f"{where}: {what}", _FIX)


def in_chunk(exc: CkptfixError, where: str) -> CkptfixError:
    """The same error (same class, code and rule) with the chunk it is about in front."""
    exc.what = f"{where}: {exc.what}"
    exc.args = (exc.line(),)
    return exc


class ChunkReader:
    """Locates chunks in one rank file; a safetensors part is parsed once."""

    def __init__(self, source: ByteSource) -> None:
        self.source = source
        self._parts: dict[int, tuple[dict[str, TensorInfo], dict[str, object]]] = {}
        self.formats: set[str] = set()

    def locate(self, entry: TensorEntry, chunk: Chunk, item: StorageItem) -> int:
        """The file offset of the chunk's row-major bytes (its length is chunk_nbytes)."""
        where = _where(entry, chunk, item)
        if item.transforms:
            raise UnsupportedFormatError(
                self.source.label,
                f"{where} is stored through {', '.join(item.transforms)} (compressed); "
                "compressed chunks cannot be streamed as byte ranges",
                "save without the ZStandard extension, or convert with torch's dcp_to_torch_save",
            )
        try:
            head = self.source.read_at(item.offset, min(4, item.length))
            if head == ZIP_MAGIC:
                self.formats.add(TORCH_SAVE)
                return self._in_zip(entry, chunk, item, where)
            self.formats.add(SAFETENSORS)
            return self._in_safetensors(entry, chunk, item, where)
        except CkptfixError as exc:
            if where in exc.what:
                raise
            raise in_chunk(exc, where) from exc.__cause__

    def _in_zip(self, entry: TensorEntry, chunk: Chunk, item: StorageItem, where: str) -> int:
        window = Window(self.source, item.offset, item.length)
        saved = read_zip(window, CHUNK_ALLOWLIST)
        if not isinstance(saved.obj, TensorRef):
            raise _bad(self.source, where, "the saved object is not a tensor")
        view = check_view(self.source.label, entry.fqn, saved.obj, saved.storages)
        if view.dtype != entry.dtype or view.shape != chunk.sizes:
            raise _bad(
                self.source,
                where,
                f"holds a {view.dtype} tensor of shape {list(view.shape)}, but .metadata "
                f"says {entry.dtype} {list(chunk.sizes)}",
            )
        if not view.contiguous:
            raise UnsupportedFormatError(
                self.source.label,
                f"{where} is saved as a strided view (strides {list(view.stride)})",
                "save contiguous shards (.contiguous() before saving)",
            )
        return item.offset + view.storage.begin + view.span[0]

    def _part(self, offset: int) -> tuple[dict[str, TensorInfo], dict[str, object]]:
        if offset not in self._parts:
            header = read_header(Window(self.source, offset, self.source.size - offset))
            try:
                sharding = loads((header.metadata or {}).get(SHARDING_KEY, "{}"))
            except ValueError:
                sharding = None
            if not isinstance(sharding, dict):
                raise CorruptFileError(
                    self.source.label, "dcp-chunk", f"{SHARDING_KEY} is not a JSON object", _FIX
                )
            self._parts[offset] = ({t.name: t for t in header.tensors}, sharding)
        return self._parts[offset]

    def _in_safetensors(
        self, entry: TensorEntry, chunk: Chunk, item: StorageItem, where: str
    ) -> int:
        tensors, sharding = self._part(item.offset)
        stored = tensors.get(entry.fqn)
        if stored is None:
            raise _bad(self.source, where, "its safetensors part has no tensor of that name")
        info = sharding.get(entry.fqn)
        saved = info.get("saved_offsets") if isinstance(info, dict) else None
        if saved != list(chunk.offsets):
            raise _bad(self.source, where, f"{SHARDING_KEY} gives offsets {saved}")
        if stored.dtype != entry.dtype or stored.shape != chunk.sizes:
            raise _bad(
                self.source,
                where,
                f"holds {stored.dtype} {list(stored.shape)}, but .metadata says "
                f"{entry.dtype} {list(chunk.sizes)}",
            )
        return item.offset + stored.byte_range[0]
