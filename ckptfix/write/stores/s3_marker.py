"""The marker a run puts under an S3 output prefix (`MARKER`) before its first upload and
deletes once the output is published. It names the run and records every multipart upload
the run starts (its object name and upload id, put again after each CreateMultipartUpload):
S3 lists an upload's key and id but nothing that says who started it, so a later run aborts
only the uploads a marker records — never one under a sub-prefix or of another tool at the
same name. An upload started and not yet recorded when its run was killed is reported and
left (the safe side)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

MARKER = ".ckptfix-writing"
MARKER_MAX = 4 * 2**20  # a marker larger than this records nothing ckptfix wrote
_NOTE = "ckptfix writes an output here; safe to delete when no ckptfix run is writing"


@dataclass
class RunMarker:
    """This run's marker: its id and the uploads it started."""

    run: str
    uploads: list[tuple[str, str]] = field(default_factory=list)

    def data(self) -> bytes:
        document = {"note": _NOTE, "run": self.run, "uploads": [list(u) for u in self.uploads]}
        return json.dumps(document, indent=1).encode() + b"\n"


def recorded(data: bytes) -> set[tuple[str, str]]:
    """The (object name, upload id) pairs a marker records; none for one that is not a
    marker of this form (an older ckptfix's, or another tool's object of that name)."""
    try:
        document = json.loads(data)
    except ValueError:
        return set()
    uploads = document.get("uploads") if isinstance(document, dict) else None
    if not isinstance(uploads, list):
        return set()
    return {
        (item[0], item[1])
        for item in uploads
        if isinstance(item, list) and len(item) == 2 and all(isinstance(v, str) for v in item)
    }
