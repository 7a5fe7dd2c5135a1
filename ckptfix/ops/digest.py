"""The digest definition (README, "How the digest is defined") and the parallel engine that
reads and hashes tensors.

    content = SHA-256( u64 len(dtype) ‖ dtype ‖ u64 rank ‖ u64 dim… ‖ row-major bytes )
    digest  = SHA-256( u64 len(name) ‖ name ‖ content )
    model   = SHA-256( digest of each tensor, in the byte order of the UTF-8 names )

u64 is unsigned 64-bit little-endian; dtype is the safetensors name (`BF16`), name the
tensor's UTF-8 name. The content digest does not depend on the name, so one read serves
every name that stands for the same bytes (tied weights, stripped prefixes).

Reading goes through `io.gather.tensor_chunks` (any layout: ranges, strided views, tensors
over several files). hashlib and os.pread release the GIL, so two threads (this one and a
helper) hash two tensors at once; each holds one chunk at a time, so memory does not grow
with the model.
"""

from __future__ import annotations

import hashlib
import struct
import threading
from collections.abc import Callable, Sequence

from ckptfix.core.errors import CorruptFileError
from ckptfix.core.signals import current as current_signals
from ckptfix.core.tensor import Piece, TensorInfo
from ckptfix.io.gather import Sources, tensor_chunks

ALGORITHM = "sha256"
# 1 MiB chunks: each is hashed while it is still in the CPU cache. Measured on the 2.2 GB
# bench file (page cache, 2 threads): 3.5 GB/s at 0.25-1 MiB, 3.2 at 4 MiB, 2.8 at 8 MiB;
# larger chunks also cost more memory.
CHUNK = 2**20
WORKERS = 2
_U64 = 2**64

Progress = Callable[[int, int], None]  # (bytes done, bytes in all)
LayoutKey = tuple[str, tuple[int, ...], tuple[Piece, ...]]


def name_bytes(name: str) -> bytes:
    """A tensor name as hashed: UTF-8 (a lone surrogate, which JSON escapes and pickles can
    carry, is encoded as Python's "surrogatepass" does)."""
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
    for name in sorted(digests, key=name_bytes):
        hasher.update(digests[name])
    return hasher.digest()


def layout_key(tensor: TensorInfo) -> LayoutKey:
    """Equal for two names that read the same bytes as the same tensor (aliases of one
    storage in a pickle, a name the alias record maps to another): hashed once."""
    return (tensor.dtype, tensor.shape, tensor.pieces)


def hash_content(
    sources: Sources, tensor: TensorInfo, stop: threading.Event, advance: Callable[[int], None]
) -> bytes:
    """The content digest of one tensor; `advance` gets the size of each chunk hashed.
    Gives up (returning b"") once `stop` is set."""
    hasher = hashlib.sha256(content_header(tensor.dtype, tensor.shape))
    for chunk in tensor_chunks(sources, tensor, CHUNK):
        if stop.is_set():
            return b""
        hasher.update(chunk)
        advance(len(chunk))
    return hasher.digest()


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


def content_digests(
    tensors: Sequence[TensorInfo],
    sources: Sources,
    *,
    workers: int = WORKERS,
    progress: Progress | None = None,
) -> dict[LayoutKey, bytes]:
    """The content digest of each distinct tensor (by layout_key), read in the given order."""
    unique: dict[LayoutKey, TensorInfo] = {}
    for tensor in tensors:
        unique.setdefault(layout_key(tensor), tensor)
    keys = list(unique)
    found: list[bytes] = [b""] * len(keys)
    meter = Meter(sum(tensor.nbytes for tensor in unique.values()), progress)

    def work(index: int, stop: threading.Event) -> None:
        found[index] = hash_content(sources, unique[keys[index]], stop, meter.add)

    run_parallel(len(keys), work, workers)
    return dict(zip(keys, found, strict=True))
