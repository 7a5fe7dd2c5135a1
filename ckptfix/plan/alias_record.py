"""The `ckptfix.dropped` record: the names a rewrite wrote once, as another name.

A rewrite that drops exact aliases (tied weights) to safetensors records `dropped -> kept`
in the header's `__metadata__` (a JSON string) or, for a sharded output, in the index's
metadata (an object). Each dropped name stands for the kept tensor's bytes: the checkpoint
declares it as surely as a stored name. Hashes and diffs count it (ops.tensorset), and a
rewrite of such a checkpoint keeps it: as an alias again, a name on the kept tensor's
storage in a `.bin`, or its own copy with --clone (ops.source, plan.select).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from ckptfix.core.errors import CorruptFileError
from ckptfix.formats.strict_json import loads

DROPPED_KEY = "ckptfix.dropped"
FIX = "remove the record from the metadata, or correct it"  # the fix a rewrite gives


def read_record(
    metadata: Mapping[str, str], index_metadata: Mapping[str, Any], path: str, fix: str = FIX
) -> dict[str, str]:
    """The record from the header metadata and the index metadata (both, when a resharded
    file carries one and its index the other)."""
    record: dict[str, str] = {}
    if DROPPED_KEY in metadata:
        try:
            parsed = loads(metadata[DROPPED_KEY])
        except ValueError as exc:
            raise bad_record(path, "is not JSON", fix) from exc
        record.update(_string_map(parsed, path, fix))
    if DROPPED_KEY in index_metadata:
        record.update(_string_map(index_metadata[DROPPED_KEY], path, fix))
    return record


def check_record(
    aliases: Mapping[str, str], stored: Mapping[str, object], path: str, fix: str = FIX
) -> None:
    """Every dropped name must be absent and every kept name stored: otherwise the record
    does not describe these files."""
    clash = [dropped for dropped in aliases if dropped in stored]
    if clash:
        raise bad_record(path, f"names {clash[0]!r} as dropped, but it is stored", fix)
    missing = [kept for kept in aliases.values() if kept not in stored]
    if missing:
        raise bad_record(path, f"maps names to {missing[0]!r}, which is not stored", fix)


def without_record(metadata: Mapping[str, Any]) -> dict[str, Any]:
    """Metadata less the record (a rewrite writes its own, for the names it drops)."""
    return {key: value for key, value in metadata.items() if key != DROPPED_KEY}


def _string_map(value: object, path: str, fix: str) -> dict[str, str]:
    if not isinstance(value, dict) or not all(
        _is_name(k) and _is_name(v) for k, v in value.items()
    ):
        raise bad_record(path, "is not an object of names", fix)
    return dict(value)


def _is_name(value: object) -> bool:
    """A string that is Unicode text (a JSON escape can make a lone surrogate)."""
    if not isinstance(value, str):
        return False
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


def bad_record(path: str, what: str, fix: str = FIX) -> CorruptFileError:
    return CorruptFileError(path, "alias-record", f"the {DROPPED_KEY} record {what}", fix)
