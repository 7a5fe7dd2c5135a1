"""Our header encoder writes byte-for-byte what the reference writer writes."""

from __future__ import annotations

from pathlib import Path

from ckptfix.formats.safetensors import HeaderEntry, encode_header

ENTRIES = [
    HeaderEntry("c", "F64", (1,), 0, 8),
    HeaderEntry("a", "F32", (2,), 8, 16),
    HeaderEntry("b", "U8", (3,), 16, 19),
]
GOLDEN = (
    (208).to_bytes(8, "little") + b'{"__metadata__":{"format":"pt","z":"1"},'
    b'"c":{"dtype":"F64","shape":[1],"data_offsets":[0,8]},'
    b'"a":{"dtype":"F32","shape":[2],"data_offsets":[8,16]},'
    b'"b":{"dtype":"U8","shape":[3],"data_offsets":[16,19]}}' + b" " * 7
)


def test_golden_header_bytes() -> None:
    assert encode_header(ENTRIES, {"format": "pt", "z": "1"}) == GOLDEN


def test_matches_reference_writer(tmp_path: Path) -> None:
    # One metadata key: the reference writer orders metadata keys by hash, not stably.
    import torch
    from safetensors.torch import save_file

    path = tmp_path / "ref.safetensors"
    save_file(
        {
            "b": torch.zeros(3, dtype=torch.uint8),
            "a": torch.zeros(2),
            "c": torch.zeros(1, dtype=torch.float64),
        },
        str(path),
        metadata={"format": "pt"},
    )
    ours = encode_header(ENTRIES, {"format": "pt"})
    assert path.read_bytes()[: len(ours)] == ours
