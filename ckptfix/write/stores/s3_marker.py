"""What a run leaves under an S3 output prefix while it writes, so that the next run can
tell its uploads from anyone else's: the run's marker (`MARKER`, put once before its first
upload) and one small record per multipart upload it starts (`record_name`, under
`RECORDS`, put before any part is sent). A record is deleted once its upload is completed
or aborted; the marker, and any record left, once the output is published.

S3 lists an upload's key and id but nothing that says who started it, so a later run aborts
only the uploads a record vouches for — never one under a sub-prefix or of another tool at
the same name. A record's key is a digest of the upload's object name and id: the next run
lists the records (one request per 1,000) and matches them against the uploads S3 lists,
without reading any of them, and each record costs one small request whatever the number
started before it. Every process of a run (the tasks of `--executor ray` share the prefix)
puts its own records: none overwrites another's. An upload started and not yet recorded when
its run was killed is reported and left (the safe side)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

MARKER = ".ckptfix-writing"
RECORDS = MARKER + ".d/"
RECORDS_MAX = 100_000  # records a later run lists before it gives up (a hostile prefix)
MARKER_MAX = 4 * 2**20  # an older ckptfix's marker (every upload in one object), read at most
_NOTE = "ckptfix writes an output here; safe to delete when no ckptfix run is writing"


def is_marker(name: str) -> bool:
    """The marker or one of the records: a run's, never an object of the output."""
    return name == MARKER or name.startswith(RECORDS)


def record_name(name: str, upload_id: str) -> str:
    """The record of the upload `upload_id` of object `name` (relative to the prefix)."""
    digest = hashlib.sha256(f"{name}\0{upload_id}".encode("utf-8", "surrogatepass"))
    return RECORDS + digest.hexdigest()


@dataclass(frozen=True)
class RunMarker:
    """A run's marker and records: its id, and what each says (for a person who finds one;
    the next run reads neither)."""

    run: str

    def data(self) -> bytes:
        document = {"note": _NOTE, "run": self.run, "records": RECORDS}
        return json.dumps(document, indent=1).encode() + b"\n"

    def record(self, name: str, upload_id: str) -> bytes:
        document = {"run": self.run, "object": name, "upload": upload_id}
        return json.dumps(document).encode() + b"\n"


def recorded(data: bytes) -> set[tuple[str, str]]:
    """The (object name, upload id) pairs an older ckptfix's marker records (it kept them
    all in the marker); none for one that is not of that form (this version's, or another
    tool's object of that name)."""
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
