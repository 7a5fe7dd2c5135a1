"""Several inspect reports as one JSON array of their `--json` documents."""

from __future__ import annotations

from collections.abc import Iterator, Sequence

from ckptfix.ops.report import Report


def json_list_chunks(reports: Sequence[Report]) -> Iterator[bytes]:
    """`json_bytes([r.to_dict() for r in reports])` (core.text), byte for byte, in
    pieces: each document is streamed by `Report.json_chunks` and indented one level."""
    yield b"["
    for number, report in enumerate(reports):
        yield b",\n  " if number else b"\n  "
        # JSON strings hold no raw newline, so every newline in a chunk is the encoder's.
        for chunk in report.json_chunks():
            yield chunk.replace(b"\n", b"\n  ")
    yield b"\n]" if reports else b"]"
