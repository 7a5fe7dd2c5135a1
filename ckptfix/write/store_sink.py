"""A `Sink` (write.sink) whose files go to an object store (write.stores): the same seam the
library's writers and the CLI's rewrites write through, for s3://, gs:// and hf:// outputs.

Each shard streams into `ObjectStore.begin(name, size)`: its header, then each part's chunks,
as the parts make them (a tensor read from local or remote sources in bounded chunks, cast if
asked), so memory stays at the upload's parts in flight. The store checks each object's
checksum once it is complete. Small files (the index, config.json) are kept until `commit`,
which puts them, the index last, then deletes what the earlier checkpoint held and the new one
does not (`stale`). So nothing a loader takes as complete is there before the index:

- A sharded output's shards are completed one by one under their final names; until the index
  exists they are no checkpoint. An earlier index under the prefix that lists a name about to
  be replaced is deleted before that shard is sent (`--force`): the old index never points at
  a new shard. If the run then fails, the prefix holds no index at all.
- A single-file output is completed only in `commit`: S3's completion of a multipart upload is
  atomic, so the file is either the old one or the whole new one.

ckptfix.Writer learns its shards' names last: with `renames`, each shard is completed under
the provisional name the Writer gives it (a name no loader reads, and no index lists it), and
`rename` gives it its final name by the store's server-side copy, checked against the
SHA-256 computed as it streamed; the index still comes last, in `commit`.

--resume: a shard whose object already exists with the planned size is hashed here (the
bytes are produced, not sent) and kept if the store's checksum for it is the same.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import shutil
import tempfile
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field

from ckptfix.core.errors import UsageError, VerificationError
from ckptfix.core.signals import Signals
from ckptfix.layouts.names import parse_weight_name
from ckptfix.write.results import Progress, WrittenFile
from ckptfix.write.sink import CHUNK, Part, ShardHeader
from ckptfix.write.stores.base import ObjectStore, ObjectUpload, StoredObject, StoreOptions

READBACK = 16 * 2**20  # bytes read back at a time by --verify-readback
INDEX_MAX = 64 * 2**20  # an earlier index larger than this is taken to list every name
_EVERY: frozenset[str] = frozenset({"\x00every"})  # no object is named so (names are checked)


def is_index(name: str) -> bool:
    return name.endswith(".index.json")


def _entry_point(name: str) -> bool:
    """What a loader opens first, at the prefix's top level: an index, or a weight file
    that is no shard of one (model.safetensors, pytorch_model.bin)."""
    if "/" in name:
        return False
    parsed = parse_weight_name(name)
    return is_index(name) or (parsed is not None and parsed.part is None)


@dataclass
class StoreState:
    """What a sink knows of the prefix before it writes: the objects there, and what this run
    did about them."""

    existing: Mapping[str, StoredObject] = field(default_factory=dict)
    kept: list[str] = field(default_factory=list)  # --resume: objects not sent again
    bytes_kept: int = 0
    removed_first: list[str] = field(default_factory=list)  # earlier indexes, before a shard
    removed: list[str] = field(default_factory=list)  # stale objects, after the index


class StoreSink:
    """See the module docstring. `single_file`: the output is one file with no index, whose
    completion is its publication. `signals` are checked between chunks (a SIGINT or SIGTERM
    kept while other code ran stops the upload there). `renames`: the shards are written
    under provisional names and take their final ones by `rename` (ckptfix.Writer), each
    hashed while it streams so that the store's copy is checked; a discarded sink deletes
    what it wrote."""

    def __init__(
        self,
        store: ObjectStore,
        options: StoreOptions,
        state: StoreState | None = None,
        *,
        single_file: bool = False,
        signals: Signals | None = None,
        renames: bool = False,
    ) -> None:
        self.store = store
        self.options = options
        self.state = state or StoreState()
        self.single_file = single_file
        self.signals = signals or Signals()
        self.progress: Progress | None = None
        self.total = 0
        self.done = 0
        self.files: dict[str, bytes] = {}
        self.open: list[ObjectUpload] = []
        self.deferred: list[tuple[str, int, ObjectUpload]] = []
        self.written: list[str] = []
        self.renames = renames
        self.digests: dict[str, str] = {}  # each shard's SHA-256 (hex), for `rename`
        self.stored: dict[str, StoredObject] = {}  # each shard as the store completed or kept it
        self._scratch: str | None = None
        self.closed = False
        self._cleared = False  # the earlier checkpoint's entry points are deleted
        self._listed: frozenset[str] | None = None  # the names its indexes list

    @property
    def out(self) -> str:
        return self.store.display

    def write_shard(self, name: str, header: ShardHeader, parts: Sequence[Part]) -> WrittenFile:
        size = len(header.data) + sum(part.nbytes for part in parts)
        digest = hashlib.sha256()

        def chunks() -> Iterable[bytes | memoryview]:
            yield header.data
            for part in parts:
                yield from part.chunks(CHUNK)

        def hashed() -> Iterable[bytes | memoryview]:
            for chunk in chunks():
                digest.update(chunk)
                yield chunk

        written = self.write_stream(name, size, hashed if self.renames else chunks, counted=True)
        if self.renames:
            self.digests[name] = digest.hexdigest()
        return written

    def write_stream(
        self,
        name: str,
        size: int,
        chunks: Callable[[], Iterable[bytes | memoryview]],
        *,
        counted: bool = False,
    ) -> WrittenFile:
        """Send an object of `size` bytes made by `chunks()` (called again for --resume's
        check); `counted`: its bytes advance the progress."""
        if self.options.resume and self._kept(name, size, chunks):
            self._advance(size if counted else 0)
            return WrittenFile(name, size)
        if self._resume_only and name in self.state.existing:
            self._refuse(name, "is not what this run writes there (its size or checksum differs)")
        self.before_replacing(name)
        upload = self.store.begin(name, size)
        self.open.append(upload)
        for chunk in chunks():
            self.signals.raise_deferred()
            upload.send(chunk)
            self._advance(len(chunk) if counted else 0)
        upload.flush()  # every part sent, while a signal may still stop the write
        self.signals.raise_deferred()
        if self.single_file:
            self.deferred.append((name, size, upload))
        else:
            self._complete(name, size, upload)
        return WrittenFile(name, size)

    def _advance(self, count: int) -> None:
        self.done += count
        if self.progress is not None and count:
            self.progress(min(self.done, self.total), self.total)

    def _complete(self, name: str, size: int, upload: ObjectUpload) -> None:
        stored = upload.complete()
        self.stored[name] = stored
        self.open.remove(upload)
        self.written.append(name)
        if self.options.verify_readback:
            self._read_back(stored, size)

    def _kept(
        self, name: str, size: int, chunks: Callable[[], Iterable[bytes | memoryview]]
    ) -> bool:
        """Whether the object already there is exactly this one (size, then checksum)."""
        listed = self.state.existing.get(name)
        if listed is None or listed.size != size:
            return False
        stored = self.store.stat(name)
        if stored is None or stored.size != size or stored.checksum is None:
            return False
        hasher = self.store.hasher(size)
        for chunk in chunks():
            self.signals.raise_deferred()
            hasher.update(chunk)
        if hasher.value() != stored.checksum:
            return False
        if self.options.verify_readback and not self._reads_back(stored, size):
            return False  # the store's checksum is not its bytes': sent again
        self.stored[name] = stored
        self.state.kept.append(name)
        self.state.bytes_kept += size
        return True

    @property
    def _resume_only(self) -> bool:
        return self.options.resume and not self.options.force

    def _refuse(self, name: str, what: str) -> None:
        raise UsageError(
            f"{self.out}/{name}",
            f"{what}: --resume without --force keeps what matches and replaces nothing",
            "pass --force to replace the checkpoint there, or choose another prefix",
        )

    def check_resume(self, planned: Iterable[str]) -> None:
        """--resume without --force, before anything is sent: every object under the prefix
        must be one this run writes (an earlier, killed run's of the same output)."""
        if not self._resume_only:
            return
        others = sorted(set(self.state.existing) - set(planned))
        if others:
            self._refuse(others[0], "is not part of this run's output")

    def _same_small(self, name: str, data: bytes) -> bool:
        """Whether the object already there holds exactly `data`, read back: a small file's
        checksum is not always reported (the Hub keeps config.json in git, with no LFS
        SHA-256), and its bytes cost no more to read than a checksum to trust."""
        stored = self.store.stat(name)
        if stored is None or stored.size != len(data):
            return False
        return len(data) == 0 or self.store.read(name, 0, len(data)) == data

    def before_replacing(self, name: str) -> None:
        """Before the first object that the earlier checkpoint holds, or its index lists, is
        written (a shard, config.json, a tokenizer file, the single file), the earlier
        checkpoint's entry points go: its indexes and single weight files. A loader then
        never takes the old index with a new shard, or new files with old ones, for one
        checkpoint. (--resume alone replaces nothing, and so deletes nothing here.)"""
        if self._cleared or self._resume_only:
            return
        if name not in self.state.existing and not self._old_index_lists(name):
            return
        self._cleared = True
        entries = sorted(n for n in self.state.existing if _entry_point(n))
        if entries:
            self.store.delete(entries)
            self.state.removed_first.extend(entries)

    def _old_index_lists(self, name: str) -> bool:
        if self._listed is None:
            self._listed = self._read_old_indexes()
        return self._listed is _EVERY or name in self._listed

    def _read_old_indexes(self) -> frozenset[str]:
        """The names the earlier indexes list (`_EVERY` for one that is not an index that
        can be read: it may list any name)."""
        found: set[str] = set()
        for item in self.state.existing.values():
            if not (_entry_point(item.name) and is_index(item.name)):
                continue
            if not 0 < item.size <= INDEX_MAX:
                return _EVERY
            try:
                document = json.loads(self.store.read(item.name, 0, item.size))
            except ValueError:
                return _EVERY
            weight_map = document.get("weight_map") if isinstance(document, dict) else None
            if not isinstance(weight_map, dict):
                return _EVERY
            found.update(str(value) for value in weight_map.values())
        return frozenset(found)

    def _reads_back(self, stored: StoredObject, size: int) -> bool:
        """Whether the object's bytes, read back, have the checksum the store reports."""
        hasher = self.store.hasher(size)
        for start in range(0, size, READBACK):
            self.signals.raise_deferred()
            hasher.update(self.store.read(stored.name, start, min(start + READBACK, size)))
        return hasher.value() == stored.checksum

    def _read_back(self, stored: StoredObject, size: int) -> None:
        if not self._reads_back(stored, size):
            raise VerificationError(
                f"{self.out}/{stored.name}",
                "reads back different from what was sent",
                "check the store and the endpoint, then run again",
            )

    def write_file(self, name: str, data: bytes) -> WrittenFile:
        self.files[name] = data
        return WrittenFile(name, len(data))

    def rename(self, old: str, new: str) -> None:
        """A shard written under a provisional name takes its final one (`renames`)."""
        if not self.renames:
            raise ValueError("this sink names its shards as it writes them")
        self.signals.raise_deferred()
        self.store.rename(old, new, self.digests.pop(old))
        self.written[self.written.index(old)] = new

    def scratch(self) -> str:
        if self._scratch is None:
            self._scratch = tempfile.mkdtemp(prefix="ckptfix-store-")
        return self._scratch

    def commit(self, stale: Sequence[str] = ()) -> None:
        """Complete a single file, then put the small files (the index last) and delete
        `stale`. SIGINT and SIGTERM wait meanwhile: the output is then published whole."""
        self.signals.raise_deferred()
        for name in self.files if self._resume_only else ():
            if name in self.state.existing and not self._same_small(name, self.files[name]):
                self._refuse(name, "holds other bytes than this run writes there")
        with self.signals.held():
            ordered = sorted(self.files, key=lambda name: (is_index(name), name))
            for name in ordered:
                self.before_replacing(name)
            files = {name: self.files[name] for name in ordered}
            if self.deferred and files and not getattr(self.store, "one_commit", False):
                # the side files first: the single file's completion is the publication
                self.store.publish(files, [], message="ckptfix")
                files = {}
            for name, size, upload in self.deferred:
                self._complete(name, size, upload)
            self.store.publish(files, list(stale), message="ckptfix")
            self.written.extend(ordered)
            self.state.removed.extend(stale)
            self.signals.committed = True
        self._drop_scratch()
        self.closed = True

    def discard(self) -> None:
        """Abort every upload under way; nothing more is published. Safe more than once."""
        if self.closed:
            return
        self.closed = True
        for upload in [*self.open]:
            with contextlib.suppress(Exception):  # already failing: the first error stands
                upload.abort()
        if self.renames:  # a Writer's shards: no run can resume them; the index never came
            with contextlib.suppress(Exception):
                self.store.delete(self.written)
        self._drop_scratch()

    def _drop_scratch(self) -> None:
        if self._scratch is not None:
            shutil.rmtree(self._scratch, ignore_errors=True)
            self._scratch = None
