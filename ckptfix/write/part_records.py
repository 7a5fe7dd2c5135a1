"""The records a slice of a split run leaves for its publisher (write.parts), and how
`--commit` reads and chooses them: each record file read on its own (a local one never
through a link, a regular file of bounded size), checked field by field, its shards dropped
at once when it is of another plan; then the one complete split of this plan chosen.

Every record file is hostile: a FIFO, a link to /dev/zero, a huge file, a number too large
for a float, JSON nested 100,000 deep, a count of 0 or a content that disagrees with its
name are each a one-line error naming the file, in bounded time and memory."""

from __future__ import annotations

import json
import os
import re
from collections.abc import Callable, Iterable, Iterator
from dataclasses import asdict, dataclass
from functools import partial
from typing import Any

from ckptfix.core.errors import VerificationError
from ckptfix.platform import system

MAX_PARTS = 100_000  # the largest N of --part I/N
RECORD = re.compile(r"\.ckptfix-part-([1-9][0-9]{0,5})-of-([1-9][0-9]{0,5})\.json")
MAX_RECORD = 64 * 2**20  # bytes: a record lists its shards, a few hundred bytes each
MAX_RECORDS = 2 * MAX_PARTS  # record files a commit considers (an earlier split's too)


def record_name(part: int, count: int) -> str:
    return f".ckptfix-part-{part}-of-{count}.json"


@dataclass(frozen=True)
class ShardRecord:
    """One written shard: its name, size, checksum (algorithm, value), and for a local file
    its modification time (which the publisher checks, rather than reading it again)."""

    file: str
    size: int
    checksum: tuple[str, str]
    mtime_ns: int = 0
    kept: bool = False  # --resume: already in the store as planned, not sent again


@dataclass(frozen=True)
class PartRecord:
    """What slice `part` of `count` of the plan `digest` wrote."""

    digest: str
    part: int
    count: int
    shards: tuple[ShardRecord, ...]
    sent: int = 0  # object bytes the part sent to a store (its kept shards' not counted)
    requests: int = 0  # requests it made to the store

    @property
    def name(self) -> str:
        return record_name(self.part, self.count)

    def to_json(self) -> bytes:
        document = {"ckptfix_part": 1, **asdict(self)}
        return (json.dumps(document, indent=1, sort_keys=True) + "\n").encode()

    @classmethod
    def from_json(cls, data: bytes, where: str, digest: str | None = None) -> PartRecord:
        """A record as a part wrote it; anything else (a malformed value of any kind, a
        part outside 1..count, a count over MAX_PARTS) is a one-line error naming `where`.
        With `digest`, a record of another plan is read without its shards."""
        try:
            document = json.loads(data)
            shards = _field(document, "shards", list)
            ours = digest is None or _field(document, "digest", str) == digest
            shards = tuple(map(_shard, shards)) if ours else ()
            record = cls(_field(document, "digest", str), _count(document, "part"),
                         _count(document, "count"), shards, _size(document.get("sent", 0)),
                         _size(document.get("requests", 0)))  # fmt: skip
        except (ValueError, KeyError, TypeError, IndexError, OverflowError, RecursionError):
            raise VerificationError(
                where, "is not a part record ckptfix wrote", "run that part again"
            ) from None
        if not 1 <= record.part <= record.count <= MAX_PARTS:
            raise VerificationError(
                where,
                f"is not a part record ckptfix wrote (part {record.part} of {record.count}: "
                f"parts go from 1 to N, N at most {MAX_PARTS:,})",
                "run that part again",
            )
        return record


def _field(document: Any, key: str, kind: type) -> Any:
    value = document[key]
    if not isinstance(value, kind) or isinstance(value, bool):
        raise TypeError(key)
    return value


def _size(value: Any) -> int:
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise ValueError(value)
    return value


def _count(document: Any, key: str) -> int:
    return _size(_field(document, key, int))


def _shard(item: Any) -> ShardRecord:
    algorithm, value = _field(item, "checksum", list)
    if not isinstance(algorithm, str) or not isinstance(value, str):
        raise TypeError("checksum")
    return ShardRecord(_field(item, "file", str), _size(item["size"]), (algorithm, value),
                       _size(item["mtime_ns"]), item.get("kept") is True)  # fmt: skip


def read_records(
    found: Iterable[tuple[str, Callable[[], bytes]]], digest: str, out: str
) -> Iterator[PartRecord]:
    """The records `found` (name, read: its bytes), parsed one at a time as they are read;
    one of another plan keeps no shards (all a commit says of it is which part it is).
    A record whose content is not the part its name says is an error naming it."""
    for count, (name, read) in enumerate(found):
        if count == MAX_RECORDS:
            raise VerificationError(
                out, f"holds more than {MAX_RECORDS:,} part records",
                "remove the records of earlier runs (.ckptfix-part-*.json), then --commit",
            )  # fmt: skip
        where = f"{out}/{name}"
        record = PartRecord.from_json(read(), where, digest)
        if record.name != name:
            raise VerificationError(
                where,
                f"says it is part {record.part} of {record.count}, not the part its name says",
                "run that part again",
            )
        yield record


def local_records(folder: str, shown: str) -> Iterator[tuple[str, Callable[[], bytes]]]:
    """The record files of a local parts folder, each read (when asked) never through a
    link, only if a regular file, and only up to MAX_RECORD bytes (a larger one is an
    error naming it)."""
    try:
        names = sorted(entry.name for entry in os.scandir(folder) if RECORD.fullmatch(entry.name))
    except FileNotFoundError:
        return
    for name in names:
        yield name, partial(_read_local, os.path.join(folder, name), f"{shown}/{name}")


def _read_local(path: str, shown: str) -> bytes:
    try:
        fd = system().open_regular(path, follow=False)
    except OSError as exc:
        raise VerificationError(
            shown, f"cannot be read as a part record ({exc.strerror})",
            "remove it or run its part again, then --commit",
        ) from None  # fmt: skip
    try:
        pieces, at = [], 0
        while at <= MAX_RECORD:  # one byte more than a record may hold: a larger one is seen
            piece = system().pread(fd, min(2**20, MAX_RECORD + 1 - at), at)
            if not piece:
                break
            pieces.append(piece)
            at += len(piece)
        if at > MAX_RECORD:
            raise too_large(shown)
        return b"".join(pieces)
    finally:
        os.close(fd)


def too_large(shown: str) -> VerificationError:
    return VerificationError(
        shown, f"is larger than a part record ckptfix writes ({MAX_RECORD:,} bytes at most)",
        "remove it or run its part again, then --commit",
    )  # fmt: skip


def chosen_records(records: Iterable[PartRecord], digest: str, out: str) -> list[PartRecord]:
    """The records of one complete split of the plan `digest`: every part of 1..N there,
    each for this plan. Records of another split beside a complete one are ignored; when no
    split is complete, the missing or mismatched part is an error naming it."""
    by_count: dict[int, dict[int, PartRecord]] = {}
    for record in records:
        by_count.setdefault(record.count, {})[record.part] = record
    ours = sorted(
        count
        for count, parts in by_count.items()
        if any(record.digest == digest for record in parts.values())
    )
    complete = [c for c in ours if _complete(by_count[c], c, digest)]
    if complete:
        return [by_count[complete[0]][part] for part in range(1, complete[0] + 1)]
    counts = ours or sorted(by_count)[:1]  # none of this plan: say so of the first
    if not counts:
        raise VerificationError(
            out, "no part was written for this plan (no .ckptfix-part-I-of-N.json)",
            "run the same command with --part I/N for each part, then --commit",
        )  # fmt: skip
    if len(counts) > 1:
        raise VerificationError(
            out, f"parts of runs split {counts[0]} and {counts[1]} ways are both there, and "
            "neither is complete",
            f"complete one split (--part I/{counts[0]} or I/{counts[1]}), or remove the "
            f"records of the other (.ckptfix-part-*-of-N.json), then --commit",
        )  # fmt: skip
    _refuse_incomplete(by_count[counts[0]], counts[0], digest, out)
    raise AssertionError("an incomplete split was not refused")  # pragma: no cover


def _complete(parts: dict[int, PartRecord], count: int, digest: str) -> bool:
    return len(parts) == count and all(record.digest == digest for record in parts.values())


def _refuse_incomplete(parts: dict[int, PartRecord], count: int, digest: str, out: str) -> None:
    for part in range(1, count + 1):
        record = parts.get(part)
        if record is None:
            raise VerificationError(
                f"{out}/{record_name(part, count)}", f"part {part} of {count} is missing",
                f"run the same command with --part {part}/{count}, then --commit again",
            )  # fmt: skip
        if record.digest != digest:
            raise VerificationError(
                f"{out}/{record.name}",
                f"part {part} of {count} was written for another plan (other source or options)",
                f"run the same command with --part {part}/{count}, then --commit again",
            )
