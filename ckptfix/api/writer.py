"""`ckptfix.Writer`: shards from tensors produced one at a time (MergeKit's pattern).

`add(name, tensor)` writes the tensor's bytes at once into the open shard's spool file (so
the caller may free or reuse the tensor as soon as it returns) and checks them; a shard is
closed when the next tensor would take it past `max_shard`: its header is written, then the
spool copied after it in the kernel and verified. The number of shards is known only at
`close()`, so shards are written under temporary names and take their final names
(`model-0000i-of-0000N.safetensors`) there, with the index; then the folder is swapped in
as OUT. Until then nothing is at OUT: an exception in the `with` block, `abort()`, or the
program ending without `close()` removes what was written.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

from ckptfix.api import output
from ckptfix.api.arrays import as_memory
from ckptfix.api.output import SaveResult
from ckptfix.api.types import ConfigLike, Size
from ckptfix.core.errors import UsageError, VerificationError
from ckptfix.core.sizes import shard_size
from ckptfix.io.source import LocalFile
from ckptfix.plan.shards import OutputName, PlannedShard, ShardPlan
from ckptfix.platform import system
from ckptfix.write.copy import write_all
from ckptfix.write.output import index_bytes
from ckptfix.write.sink import FilePart, file_holds, shard_header


@dataclass
class _Entry:
    name: str
    dtype: str
    shape: tuple[int, ...]
    nbytes: int
    offset: int  # in the spool


class _Spool:
    """The open shard's tensor bytes, back to back, until its header can be written."""

    def __init__(self, folder: str, number: int) -> None:
        self.path = os.path.join(folder, f".ckptfix-spool-{number:05d}")
        self.fd = system().create_rw(self.path)  # read back too
        self.entries: list[_Entry] = []
        self.size = 0

    def add(self, tensor: Any) -> None:
        offset = self.size
        for chunk in tensor.chunks():
            write_all(self.fd, chunk, offset)
            offset += len(chunk)
        self.entries.append(
            _Entry(tensor.name, tensor.dtype, tensor.shape, tensor.nbytes, self.size)
        )
        if not file_holds(self.fd, self.size, tensor):
            raise VerificationError(
                self.path,
                f"tensor {tensor.name!r} reads back different from memory",
                "check the disk, and that no other thread changes the tensor, then retry",
            )
        self.size = offset

    def close(self) -> None:
        self.drop()
        os.remove(self.path)

    def drop(self) -> None:
        """Close the file once (the staging folder it is in goes with the output)."""
        fd, self.fd = self.fd, -1
        if fd >= 0:
            os.close(fd)


class Writer:
    """Write tensors one at a time into verified shards at `out` (see the module docstring).

    >>> with ckptfix.Writer("merged/", max_shard="2GB") as writer:
    ...     for name, tensor in produce():
    ...         writer.add(name, tensor)

    Each `add` writes a copy of its tensor (no alias record). Not for use from several
    threads at once.
    """

    def __init__(
        self,
        out: str | os.PathLike[str],
        *,
        max_shard: Size = "5GB",
        metadata: Mapping[str, str] | None = None,
        config: ConfigLike | None = None,
    ) -> None:
        self._max_shard = shard_size(max_shard)
        self._metadata = output.checked_metadata(metadata)
        self._config = output.config_of(config)[1]
        self._sink = output.open_sink(out)
        # The program ends (or drops the writer) without close(): nothing is published.
        self._finalizer = weakref.finalize(self, self._sink.discard)
        self._names: set[str] = set()
        self._shards: list[PlannedShard] = []  # closed, under their temporary names
        self._sizes: dict[tuple[str, ...], int] = {}  # each shard's file size
        self._spool: _Spool | None = None  # the open shard's
        self._held: _Spool | None = None  # a tensor larger than max_shard, alone
        self._spools = 0  # spool files made, for their names
        self._result: SaveResult | None = None

    def add(self, name: str, tensor: Any) -> None:
        """Write `tensor` (a torch tensor or numpy array) as `name`; the shard it fills is
        closed first when the tensor would take it past `max_shard`. A bad name or tensor is
        a ValueError that leaves the writer as it was; a failed write discards it."""
        self._check_open()
        memory = as_memory(name, tensor)
        output.checked_name(memory.name, self._names)
        with self._step():
            if self._held is not None:  # another tensor follows: it is not the only shard
                self._close_shard(self._held, {"format": "pt"})
                self._held = None
            if memory.nbytes > self._max_shard:
                # A shard of its own, placed before the open one as huggingface_hub places
                # it (and save() does); closed once it is known not to be the only shard.
                self._held = self._new_spool()
                self._held.add(memory)
            else:
                spool = self._spool
                if spool is not None and spool.size + memory.nbytes > self._max_shard:
                    self._close_shard(spool, {"format": "pt"})
                    self._spool = None
                self._spool = self._spool or self._new_spool()
                self._spool.add(memory)
            self._names.add(memory.name)

    def close(self) -> SaveResult:
        """Close the last shard, give every shard its final name, write the index (and
        config.json), verify, and publish the folder at OUT. Returns what was written."""
        if self._result is not None:
            return self._result
        self._check_open()
        with self._step():
            last = [s for s in (self._held, self._spool) if s is not None and s.entries]
            last = last or ([] if self._shards else [self._new_spool()])  # one file, if empty
            single = len(self._shards) + len(last) == 1
            for spool in last:
                self._close_shard(spool, {"format": "pt", **(self._metadata if single else {})})
            self._held = self._spool = None
            plan = self._final_names()
            files = {shard.file: self._sizes[shard.tensors] for shard in plan.shards}
            if plan.index_file is not None:
                written = self._sink.write_file(plan.index_file, index_bytes(plan, self._metadata))
                files[written.path] = written.bytes
            if self._config is not None:
                files["config.json"] = self._sink.write_file("config.json", self._config).bytes
            self._sink.commit()
        self._finalizer.detach()
        self._result = SaveResult(self._sink.out, files, {}, plan.index_file)
        return self._result

    def abort(self) -> None:
        """Publish nothing; remove what was written."""
        for spool in (self._spool, self._held):
            if spool is not None:
                spool.drop()
        self._finalizer()

    def __enter__(self) -> Writer:
        return self

    def __exit__(self, kind: type[BaseException] | None, *exc_info: object) -> None:
        if kind is None:
            self.close()
        else:
            self.abort()

    @contextmanager
    def _step(self) -> Iterator[None]:
        """A step of the write; if it fails, the writer is discarded (nothing published)."""
        try:
            with output.writing(self._sink):
                yield
        except BaseException:
            self.abort()
            raise

    def _check_open(self) -> None:
        if not self._finalizer.alive:
            raise UsageError(self._sink.out, "the writer is closed", "make a new Writer")

    def _new_spool(self) -> _Spool:
        self._spools += 1
        return _Spool(self._sink.scratch(), self._spools)

    def _close_shard(self, spool: _Spool, metadata: Mapping[str, str]) -> None:
        """Write a shard's header and its spooled bytes under a temporary name."""
        temporary = f".ckptfix-shard-{len(self._shards) + 1:05d}.safetensors"
        listed = [(e.name, e.dtype, e.shape, e.nbytes) for e in spool.entries]
        header = shard_header(listed, metadata, os.path.join(self._sink.out, temporary))
        source = LocalFile(spool.path)
        try:
            parts = [FilePart(source, e.offset, e.nbytes) for e in spool.entries]
            written = self._sink.write_shard(temporary, header, parts)
        finally:
            source.close()
            spool.close()
        names = tuple(e.name for e in spool.entries)
        self._shards.append(PlannedShard(temporary, names, spool.size))
        self._sizes[names] = written.bytes

    def _final_names(self) -> ShardPlan:
        """Rename the shards `model-0000i-of-0000N.safetensors` (or `model.safetensors`)."""
        name = OutputName()
        count = len(self._shards)
        final = []
        for number, shard in enumerate(self._shards, start=1):
            self._sink.rename(shard.file, name.shard(number, count))
            final.append(PlannedShard(name.shard(number, count), shard.tensors, shard.nbytes))
        index = name.index() if count > 1 else None
        return ShardPlan(self._max_shard, tuple(final), index)
