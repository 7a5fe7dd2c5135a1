"""torch's HuggingFaceStorageWriter saved per rank (`save_distributed=True`): a folder of
`shard-{rank}-model-{k}-of-{n}.safetensors` files, each a safetensors file holding its rank's
pieces, with `DCP_SHARDING_INFO` in the header's `__metadata__` (JSON: name ->
`{"saved_offsets": [...]}`) saying where each piece sits in its tensor.

There is no `.metadata`: as torch's HuggingFaceStorageReader does, each tensor's shape is
the farthest extent of its pieces, and its pieces are placed by their offsets (layouts.chunks).
Unlike that reader, the pieces must tile the tensor exactly (`chunk-gap`, `chunk-overlap`),
agree on dtype and rank, and every header's sharding info must name exactly its tensors with
offsets of the right length (`corrupt-file`, rule `dcp-sharding-info`). A rank file missing
from the end of the rank numbers cannot be told from the headers (nothing records the
world size or the global shapes).
"""

from __future__ import annotations

import os
from collections import Counter, defaultdict
from dataclasses import dataclass, replace

from ckptfix.core.checkpoint import Checkpoint, FileRecord
from ckptfix.core.dtypes import DTYPES, numel_of
from ckptfix.core.errors import CkptfixError, CorruptFileError
from ckptfix.core.findings import Finding, finding
from ckptfix.core.tensor import Piece, TensorInfo
from ckptfix.core.training import TrainingLayout
from ckptfix.formats.base import FORMATS, FileRead, ReadOptions
from ckptfix.formats.hf_sharding import SHARD_NAME, bad_info, sharding_info
from ckptfix.io.folder import LOCAL, Folder
from ckptfix.io.source import ByteSource
from ckptfix.layouts.chunks import (
    MAX_PIECES,
    MAX_PIECES_PER_CHUNK,
    Placed,
    TooManyChunks,
    chunk_pieces,
    first_overlap,
    pieces_needed,
)
from ckptfix.layouts.zero_counts import missing_ranks

FORMAT = "dcp"
FRAMEWORK = "hf-storage"
_ONE_SAVE = "keep the rank files of one save only; copy them again from the training run's output"


def is_hf_shard_folder(names: list[str]) -> bool:
    return any(SHARD_NAME.match(name) for name in names)


@dataclass
class _Piece:
    path: str
    offsets: tuple[int, ...]
    tensor: TensorInfo


class _Assembler:
    """Collects each tensor's pieces over the rank files and builds whole tensors."""

    def __init__(self, root: str) -> None:
        self.root = root
        self.pieces: dict[str, list[_Piece]] = defaultdict(list)
        self.findings: list[Finding] = []
        self.count = 0

    def add(self, read: FileRead, offsets: dict[str, tuple[int, ...]]) -> None:
        for tensor in read.tensors:
            self.pieces[tensor.name].append(_Piece(read.label, offsets[tensor.name], tensor))

    def _problem(self, code: str, name: str, what: str, files: list[str]) -> None:
        shown = ", ".join(sorted({os.path.basename(f) for f in files}))
        self.findings.append(
            finding(
                code,
                f"{what} (rank files {shown}); the tensor cannot be assembled "
                "(copy the rank files again, or save the checkpoint again)",
                file=sorted(files)[0],
                tensors=[name],
            )
        )

    def tensor(self, name: str) -> TensorInfo | None:
        pieces = self.pieces[name]
        files = [piece.path for piece in pieces]
        first = pieces[0].tensor
        if any(p.tensor.dtype != first.dtype or len(p.offsets) != len(first.shape) for p in pieces):
            what = f"the pieces of {name!r} disagree on dtype or number of dimensions"
            self._problem("corrupt-file", name, what, files)
            return None
        if DTYPES[first.dtype].bits % 8:
            what = f"{name!r} is {first.dtype}, which is not split in pieces of whole bytes"
            self._problem("chunk-out-of-range", name, what, files)
            return None
        shape = tuple(
            max(p.offsets[d] + p.tensor.shape[d] for p in pieces) for d in range(len(first.shape))
        )
        boxes = [Placed(p.path, p.tensor.byte_range[0], p.offsets, p.tensor.shape) for p in pieces]
        if not self._tiles(name, shape, boxes, first.dtype):
            return None
        itemsize = DTYPES[first.dtype].bits // 8
        placed = [box for box in boxes if numel_of(box.sizes)]
        return _whole(name, first.dtype, shape, placed, itemsize, files[0])

    def _tiles(self, name: str, shape: tuple[int, ...], boxes: list[Placed], dtype: str) -> bool:
        files = [box.source for box in boxes]
        try:
            pair = first_overlap(boxes)
        except TooManyChunks:
            pair = (boxes[0], boxes[1])
        if pair is not None:
            a, b = pair
            what = f"pieces at {list(a.offsets)} and {list(b.offsets)} of {name!r} overlap"
            self._problem("chunk-overlap", name, what, [a.source, b.source])
            return False
        covered = sum(numel_of(box.sizes) for box in boxes)
        if covered != numel_of(shape):
            what = f"the pieces of {name!r} cover {covered:,} of its {numel_of(shape):,} elements"
            self._problem("chunk-gap", name, what, files)
            return False
        needed = [pieces_needed(shape, box.sizes) for box in boxes]
        self.count += sum(needed)
        if max(needed) > MAX_PIECES_PER_CHUNK or self.count > MAX_PIECES:
            what = f"the pieces of {name!r} are cut too finely to assemble"
            self._problem("chunk-out-of-range", name, what, files)
            return False
        return True


def _whole(
    name: str, dtype: str, shape: tuple[int, ...], boxes: list[Placed], itemsize: int, file: str
) -> TensorInfo:
    """The tensor its pieces make; one of no elements (no pieces) is named by `file`, the
    first rank file that holds a piece of it."""
    pieces = [piece for box in boxes for piece in chunk_pieces(box, shape, itemsize)]
    first = pieces[0] if pieces else Piece(file, 0, 0)
    single = len(pieces) == 1 and first.count == 1 and first.at == 0
    return TensorInfo(
        name=name,
        dtype=dtype,
        shape=shape,
        nbytes=numel_of(shape) * itemsize,
        file=first.source,
        byte_range=(first.offset, first.offset + first.length),
        spread=None if single else tuple(pieces),
    )


def _read(source: ByteSource, options: ReadOptions) -> tuple[FileRecord, FileRead | None]:
    """One rank file read as safetensors and its sharding info checked; errors recorded."""
    try:
        size = source.size
        read = FORMATS.named("safetensors").read(source, options)
        if sharding_info(read) is None:
            raise bad_info(source.label, "is missing: the file is not part of a per-rank save")
    except CkptfixError as exc:
        if exc.code is None:
            raise
        return FileRecord(source.label, FORMAT, 0, error=exc), None
    plain = FileRead(source.label, FORMAT, size, (), read.metadata)
    return FileRecord(source.label, FORMAT, size, read=plain), read


def load_hf_shards(
    root: str, names: list[str], options: ReadOptions, folder: Folder = LOCAL
) -> Checkpoint:
    """The model of a per-rank HuggingFaceStorageWriter save, each tensor its pieces."""
    files = sorted(name for name in names if SHARD_NAME.match(name))
    sources = {name: folder.open(os.path.join(root, name)) for name in files}
    assembler = _Assembler(root)
    records = []
    for name in files:
        record, read = _read(sources[name], options)
        records.append(record)
        if read is not None:
            assembler.add(read, sharding_info(read) or {})
    tensors = [t for name in assembler.pieces if (t := assembler.tensor(name)) is not None]
    ranks = {int(match.group(1)) for name in files if (match := SHARD_NAME.match(name))}
    holder = next((i for i, r in enumerate(records) if r.read is not None), None)
    if holder is not None:
        read = records[holder].read
        assert read is not None
        records[holder] = replace(records[holder], read=replace(read, tensors=tuple(tensors)))
    layout = TrainingLayout(
        FRAMEWORK,
        world_size=len(ranks),
        serialization="safetensors",
        findings=tuple(_other_saves(root, files) + _rank_gaps(root, ranks) + assembler.findings),
    )
    return Checkpoint(
        path=root,
        kind=FORMAT,
        files=tuple(records),
        sources={source.label: source for source in sources.values()},
        training=layout,
    )


def _other_saves(root: str, files: list[str]) -> list[Finding]:
    """torch's writer names the files of one save `-model-K-of-N` with one N on every rank
    (the highest file index of its fqn_to_index_mapping) and K from 1 to N: a file saying
    another N than the others, or a K past its N, belongs to another save (rule rank-set),
    whose pieces may well tile with these."""
    numbers = {}
    for name in files:
        match = SHARD_NAME.match(name)
        assert match is not None
        numbers[name] = (int(match.group(2)), int(match.group(3)))
    usual = Counter(total for _, total in numbers.values()).most_common(1)[0][0] if files else 0
    found = []
    for name, (index, total) in numbers.items():
        if total != usual:
            what = f"says its save wrote {total} file(s) per rank, but the other rank files say {usual}"
        elif not 1 <= index <= total:
            what = f"is model file {index} of {total}, which no save numbers so"
        else:
            continue
        path = os.path.join(root, name)
        error = CorruptFileError(path, "rank-set", f"{what}: it belongs to another save", _ONE_SAVE)
        found.append(finding(error.code, error.detail(), file=path))
    return found


def _rank_gaps(root: str, ranks: set[int]) -> list[Finding]:
    """Rank numbers run from 1: the ranks below the highest with no file at all, the first
    few by name and the rest counted (a file numbered in the billions costs no more)."""
    highest = max(ranks, default=0)
    listed, count = missing_ranks((rank - 1 for rank in ranks), highest - 1)
    saved = f"ranks {min(ranks)}-{highest} saved files"
    found = [
        finding(
            "missing-rank-file",
            f"no file of rank {rank + 1} ({saved}; copy its shard-*-model-* files from the "
            "training run's output)",
            file=os.path.join(root, f"shard-{rank + 1:05d}-model-*.safetensors"),
        )
        for rank in listed
    ]
    if count > len(listed):
        found.append(
            finding(
                "missing-rank-file",
                f"no file of {count - len(listed):,} more of the ranks below {highest} "
                f"({saved}; copy their shard-*-model-* files from the training run's output)",
                file=root,
            )
        )
    return found
