"""`convert --to torch -o URL`: a pytorch_model*.bin shard as one stream of bytes in file
order, for an object store's upload (write.store_output).

The torch writer (write.torch) places every record of the archive before it writes one, so
all offsets and sizes are known; it then fills the file out of order only because each
storage's CRC-32 comes from a worker reading it back. Streamed, the CRC is computed as the
storage's bytes pass and its data descriptor follows them (the zip format's data-descriptor
flag is set in every local header, so nothing before the data depends on it); the
serialization id and the central directory, which need every CRC, come last. The bytes are
those the torch writer writes for the same shard, and the store compares the checksum of
what it holds with the one computed while they were sent.
"""

from __future__ import annotations

import zlib
from collections.abc import Callable, Iterable, Iterator, Mapping

from ckptfix.formats.pickle_writer import state_dict_pickle
from ckptfix.formats.torch_zip_writer import (
    central_directory,
    place,
    serialization_id,
    small_records,
    torch_records,
)
from ckptfix.plan.select import OutTensor
from ckptfix.plan.shards import PlannedShard
from ckptfix.write.torch import shard_entries

Chunks = Callable[[OutTensor], Iterable[bytes | memoryview]]


def torch_stream(
    shard: PlannedShard, tensors: Mapping[str, OutTensor], shared: Mapping[str, str], of: Chunks
) -> tuple[int, Callable[[], Iterator[bytes | memoryview]]]:
    """(size of the shard's file, a function that yields its bytes in order); `of(tensor)`
    yields a storage's bytes (gathered or cast, in bounded chunks)."""
    entries, storages = shard_entries(shard, tensors, shared)
    pickle = state_dict_pickle(entries)
    records = torch_records(len(pickle), [(key, t.nbytes) for key, t in storages.items()])
    placed = place(records)
    zeros = [0] * len(placed)  # the directory's size does not depend on the CRCs
    size = placed[-1].end + sum(len(piece) for piece in central_directory(placed, zeros))
    contents = small_records(pickle)

    def chunks() -> Iterator[bytes | memoryview]:
        crcs = []
        for entry, (name, _) in zip(placed[:-1], records[:-1], strict=True):
            yield entry.local_header()
            small = contents.get(name)
            crc = 0
            for piece in [small] if small is not None else of(storages[name[len("data/") :]]):
                crc = zlib.crc32(piece, crc)
                yield piece
            yield entry.descriptor(crc)
            crcs.append(crc)
        last, ident = placed[-1], serialization_id(placed[:-1], crcs)
        yield last.local_header() + ident + last.descriptor(zlib.crc32(ident))
        yield from central_directory(placed, [*crcs, zlib.crc32(ident)])

    return size, chunks
