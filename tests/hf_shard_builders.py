"""Small per-rank HuggingFaceStorageWriter folders written by hand, without torch: each rank
file a safetensors file whose header's `DCP_SHARDING_INFO` places its pieces, with any claim
(rank number, offsets, shapes) set by hand, for the malformed-input tests. Real ones, written
by torch itself, are in tests/training_writers.py.

The model (by default): `embed.weight` F32 (5, 3), split by rows over two ranks (3 + 2), and
`norm.weight` F32 (3,), whole on rank 1.
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from tests.builders import Factory
from tests.cases import Case

RANK_FILE = "shard-{rank:05d}-model-00001-of-00001.safetensors"


@dataclass(frozen=True)
class RankPiece:
    """One piece a rank file holds: its name, shape and offsets in the whole tensor, and
    its F32 values (seeded by default)."""

    name: str
    shape: tuple[int, ...]
    offsets: tuple[int, ...]
    values: Sequence[float] | None = None


def _count(shape: Sequence[int]) -> int:
    count = 1
    for dim in shape:
        count *= dim
    return count


def rank_file(path: Path, pieces: Sequence[RankPiece]) -> Path:
    """One rank's safetensors file, laid out as torch's writer lays it out."""
    header: dict[str, object] = {}
    info: dict[str, object] = {}
    blobs, offset = [], 0
    for piece in pieces:
        numel = _count(piece.shape)
        values = piece.values if piece.values is not None else [float(i) for i in range(numel)]
        blob = struct.pack(f"<{numel}f", *values)
        header[piece.name] = {
            "dtype": "F32",
            "shape": list(piece.shape),
            "data_offsets": [offset, offset + len(blob)],
        }
        info[piece.name] = {"saved_offsets": list(piece.offsets)}
        blobs.append(blob)
        offset += len(blob)
    metadata = {"DCP_VERSION": "1.0", "format": "pt", "DCP_SHARDING_INFO": json.dumps(info)}
    body = json.dumps({"__metadata__": metadata, **header}).encode()
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(struct.pack("<Q", len(body)) + body + b"".join(blobs))
    return path


# rank -> its pieces: the default model, split as FSDP splits it
DEFAULT_RANKS: Mapping[int, Sequence[RankPiece]] = {
    1: (
        RankPiece("embed.weight", (3, 3), (0, 0)),
        RankPiece("norm.weight", (3,), (0,)),
    ),
    2: (RankPiece("embed.weight", (2, 3), (3, 0), [float(9 + i) for i in range(6)]),),
}


def rank_folder(root: Path, ranks: Mapping[int, Sequence[RankPiece]] = DEFAULT_RANKS) -> Path:
    """`root` holding one rank file per entry of `ranks` (numbered as given)."""
    root.mkdir(parents=True, exist_ok=True)
    for rank, pieces in ranks.items():
        rank_file(root / RANK_FILE.format(rank=rank), pieces)
    return root


def _case(ranks: Mapping[int, Sequence[RankPiece]]) -> Callable[[Factory], Path]:
    return lambda factory: rank_folder(factory.root / "ranks", ranks)


# The per-rank set attacks in the bad-input corpus (tests/test_bad_inputs.py).
HF_SHARD_CASES = [
    # rank 2 missing between 1 and 3 (many missing ranks: tests/test_hf_shard_sets.py)
    Case("rank-set-gap", _case({1: DEFAULT_RANKS[1], 3: DEFAULT_RANKS[2]}), "missing-rank-file", "missing-rank-file"),
    # zero-element pieces placed past 2^64: a shape no safetensors file can hold
    Case("rank-set-shape-past-2-64", _case({**DEFAULT_RANKS, 3: (RankPiece("empty", (3, 0), (2**70, 0)),)}), "bad-shape"),
]  # fmt: skip
