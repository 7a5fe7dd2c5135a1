"""The digest definition (docs/hash.md, "How the digest is defined") and the parallel engine that
reads and hashes tensors.

    content = SHA-256( u64 len(dtype) ‖ dtype ‖ u64 rank ‖ u64 dim… ‖ row-major bytes )
    digest  = SHA-256( u64 len(name) ‖ name ‖ content )
    model   = SHA-256( digest of each tensor, in the byte order of the UTF-8 names )

u64 is unsigned 64-bit little-endian; dtype is the safetensors name (`BF16`), name the
tensor's UTF-8 name. The content digest does not depend on the name, so one read serves
every name that stands for the same bytes (tied weights, stripped prefixes).

Reading goes through `io.gather.tensor_chunks` (any layout: ranges, strided views, tensors
over several files), except for small tensors that are one plain range, which are read many
at a time (`_Batch`). hashlib and os.pread release the GIL, so two threads (this one and a
helper) hash two tensors at once; each holds one chunk at a time, so memory does not grow
with the model.
"""

from __future__ import annotations

import hashlib
import itertools
import struct
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from operator import itemgetter
from typing import Any

from ckptfix.core.errors import CorruptFileError
from ckptfix.core.signals import current as current_signals
from ckptfix.core.tensor import TensorInfo
from ckptfix.io.gather import Sources, tensor_chunks
from ckptfix.io.source import is_local

ALGORITHM = "sha256"
# 1 MiB chunks: each is hashed while it is still in the CPU cache. Measured on the 2.2 GB
# bench file (page cache, 2 threads): 3.5 GB/s at 0.25-1 MiB, 3.2 at 4 MiB, 2.8 at 8 MiB;
# larger chunks also cost more memory.
CHUNK = 2**20
# A remote source (no file descriptor) is read in 16 MiB chunks instead: each chunk is one
# ranged request, and 1 MiB requests one after another are bound by the round trip.
REMOTE_CHUNK = 16 * 2**20
SMALL = 2**16  # bytes: tensors smaller than this are read in batches (see _Batch)
WORKERS = 2
_U64 = 2**64

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)
LayoutKey = tuple[object, ...]


def name_bytes(name: str) -> bytes:
    """A tensor name as hashed: UTF-8. Every reader refuses a lone surrogate (a JSON escape
    or a pickle can carry one); "surrogatepass" keeps the digest defined for any str."""
    return name.encode("utf-8", "surrogatepass")


def content_header(dtype: str, shape: Sequence[int]) -> bytes:
    """What the content digest hashes before the tensor's bytes."""
    if any(dim < 0 or dim >= _U64 for dim in shape):
        raise CorruptFileError(None, "bad-shape", f"shape {list(shape)} has a dimension past 2^64")
    encoded = dtype.encode("ascii")
    return (
        struct.pack("<Q", len(encoded))
        + encoded
        + struct.pack(f"<{len(shape) + 1}Q", len(shape), *shape)
    )


def tensor_digest(name: str, content: bytes) -> bytes:
    """The digest of one named tensor from its content digest."""
    encoded = name_bytes(name)
    return hashlib.sha256(struct.pack("<Q", len(encoded)) + encoded + content).digest()


def model_digest(digests: dict[str, bytes]) -> bytes:
    """The model digest: tensor digests (name -> digest) in the byte order of the names."""
    hasher = hashlib.sha256()
    # Code point order, which is the order of the UTF-8 bytes (pairs sorted, not looked up).
    for _, digest in sorted(digests.items(), key=itemgetter(0)):
        hasher.update(digest)
    return hasher.digest()


def layout_key(tensor: TensorInfo) -> LayoutKey:
    """Equal for two names that read the same bytes as the same tensor (aliases of one
    storage in a pickle, a name the alias record maps to another): hashed once. Made of the
    fields `pieces` is derived from, which is cheaper than building the pieces."""
    return (
        tensor.dtype,
        tensor.shape,
        tensor.file,
        tensor.byte_range,
        tensor.contiguous,
        tensor.strides,
        tensor.spread,
    )


def hash_content(
    sources: Sources, tensor: TensorInfo, stop: threading.Event, advance: Callable[[int], None]
) -> bytes:
    """The content digest of one tensor; `advance` gets the size of each chunk hashed.
    Gives up (returning b"") once `stop` is set."""
    hasher = hashlib.sha256(content_header(tensor.dtype, tensor.shape))
    for chunk in tensor_chunks(sources, tensor, chunk_size(sources, tensor)):
        if stop.is_set():
            return b""
        hasher.update(chunk)
        advance(len(chunk))
    return hasher.digest()


def chunk_size(sources: Sources, tensor: TensorInfo) -> int:
    """CHUNK for a tensor in local files, REMOTE_CHUNK for one read over the network."""
    pieces = tensor.pieces
    remote = bool(pieces) and not is_local(sources(pieces[0].source))
    return REMOTE_CHUNK if remote and tensor.nbytes > CHUNK else CHUNK


class Meter:
    """Bytes done across threads, reported to a progress callback."""

    def __init__(self, total: int, progress: Progress | None) -> None:
        self.total = total
        self.done = 0
        self._progress = progress
        self._lock = threading.Lock()

    def add(self, count: int) -> None:
        if self._progress is None:
            return
        with self._lock:
            self.done += count
            self._progress(self.done, self.total)


def run_parallel(count: int, work: Callable[[int, threading.Event], None], workers: int) -> None:
    """`work(i, stop)` for every i < count on `workers` threads, this one included (so a
    signal reaches the work at once). The first failure, in any thread, sets `stop`, waits
    for the others and is raised here."""
    lock = threading.Lock()
    stop = threading.Event()
    position = iter(range(count))
    failures: list[BaseException] = []

    def loop() -> None:
        while not stop.is_set():
            with lock:
                index = next(position, None)
            if index is None:
                return
            try:
                work(index, stop)
            except BaseException as exc:  # raised in the calling thread below
                failures.append(exc)
                stop.set()

    helpers = [
        threading.Thread(target=loop, name=f"ckptfix-hash-{number}", daemon=True)
        for number in range(1, min(workers, count))
    ]
    for helper in helpers:
        helper.start()
    try:
        loop()
        _wait(helpers)
    finally:
        stop.set()  # a no-op after a normal end; after an interruption, the helpers stop
        for helper in helpers:
            helper.join()
    if failures:
        raise failures[0]


def _wait(helpers: list[threading.Thread]) -> None:
    """Join the helpers, answering a signal kept meanwhile (core.signals defers one that
    arrives outside ckptfix's own frames, as in a join)."""
    signals = current_signals()
    for helper in helpers:
        while helper.is_alive():
            helper.join(0.05)
            if signals is not None:
                signals.raise_deferred()


@dataclass(frozen=True)
class _Batch:
    """Small tensors, each one plain byte range of one source, within one span of at most
    CHUNK bytes: read with one call instead of one per tensor (a header of 1,000,000 tiny
    tensors would otherwise spend most of its time in per-read overhead)."""

    source: str
    begin: int
    end: int
    members: tuple[tuple[int, TensorInfo], ...]  # (offset in the source, tensor)


def small_range(tensor: TensorInfo) -> int | None:
    """The tensor's offset in its file when it is small and one plain range there (the
    one-piece case of TensorInfo.pieces, decided without building the Piece, which costs
    microseconds a tensor)."""
    if not 0 < tensor.nbytes < SMALL or tensor.spread is not None:
        return None  # an empty tensor reads nothing: its offset may lie anywhere, even past EOF
    if tensor.contiguous or tensor.strides is None:
        return tensor.byte_range[0]
    return None


def _jobs(tensors: Sequence[TensorInfo]) -> list[TensorInfo | _Batch]:
    """Each large or gathered tensor on its own; small plain ones in batches."""
    jobs: list[TensorInfo | _Batch] = []
    small: list[tuple[str, int, TensorInfo]] = []
    for tensor in tensors:
        offset = small_range(tensor)
        if offset is None:
            jobs.append(tensor)
        else:
            small.append((tensor.file, offset, tensor))
    small.sort(key=lambda item: (item[0], item[1]))
    for source, group in itertools.groupby(small, key=lambda item: item[0]):
        members: list[tuple[int, TensorInfo]] = []
        for _, offset, tensor in group:
            if members and offset + tensor.nbytes - members[0][0] > CHUNK:
                jobs.append(_batch(source, members))
                members = []
            members.append((offset, tensor))
        jobs.append(_batch(source, members))
    return jobs


def _batch(source: str, members: list[tuple[int, TensorInfo]]) -> _Batch:
    end = max(offset + tensor.nbytes for offset, tensor in members)
    return _Batch(source, members[0][0], end, tuple(members))


def _hash_batch(sources: Sources, batch: _Batch, found: dict[LayoutKey, bytes]) -> int:
    data = memoryview(sources(batch.source).read_at(batch.begin, batch.end - batch.begin))
    started: dict[tuple[str, tuple[int, ...]], Any] = {}  # the header hashed once per layout
    for offset, tensor in batch.members:
        layout = (tensor.dtype, tensor.shape)
        if layout not in started:
            started[layout] = hashlib.sha256(content_header(*layout))
        hasher = started[layout].copy()
        hasher.update(data[offset - batch.begin : offset - batch.begin + tensor.nbytes])
        found[layout_key(tensor)] = hasher.digest()
    return sum(tensor.nbytes for _, tensor in batch.members)


def content_digests(
    tensors: Sequence[TensorInfo],
    sources: Sources,
    *,
    workers: int = WORKERS,
    progress: Progress | None = None,
) -> dict[LayoutKey, bytes]:
    """The content digest of each distinct tensor (by layout_key)."""
    unique: dict[LayoutKey, TensorInfo] = {}
    for tensor in tensors:
        unique.setdefault(layout_key(tensor), tensor)
    jobs = _jobs(list(unique.values()))
    found: dict[LayoutKey, bytes] = {}  # filled from both threads: one key per tensor
    meter = Meter(sum(tensor.nbytes for tensor in unique.values()), progress)

    def work(index: int, stop: threading.Event) -> None:
        job = jobs[index]
        if isinstance(job, _Batch):
            meter.add(_hash_batch(sources, job, found))
        else:
            found[layout_key(job)] = hash_content(sources, job, stop, meter.add)

    run_parallel(len(jobs), work, workers)
    return found
