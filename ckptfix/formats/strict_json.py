"""Strict JSON for headers and indexes: a fast path (orjson) used only when it provably
equals the strict parse (json with hooks), which refuses what serde refuses and more
(duplicate keys, NaN, `-0`) and names the rule it applies."""

from __future__ import annotations

import json
import re
from typing import Any

import orjson

from ckptfix.core.errors import CorruptFileError

_REEXPORT = "re-download or re-export the file"


class _Negative:
    """A negative JSON integer: kept apart so `-0` cannot pass as a valid 0."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


class _JsonRejected(Exception):
    def __init__(self, rule: str, what: str) -> None:
        super().__init__(what)
        self.rule = rule
        self.what = what


def _unicode(text: str) -> None:
    """Refuse a string that a \\u escape made a lone surrogate, as the reference (serde)
    does: no name or metadata value of ours may be text that cannot be written as UTF-8."""
    if not text.isascii():
        try:
            text.encode("utf-8")
        except UnicodeEncodeError:
            raise _JsonRejected(
                "header-not-json",
                f"header is not valid JSON: the string {text[:40]!r} holds a lone surrogate",
            ) from None


def _pairs_hook(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
    for key, value in pairs:
        _unicode(key)
        if type(value) is str:
            _unicode(value)
    result = dict(pairs)
    if len(result) != len(pairs):  # rare: find the culprit only then
        seen: set[str] = set()
        for key, _ in pairs:
            if key in seen:
                raise _JsonRejected("duplicate-key", f"key {key!r} appears twice in the header")
            seen.add(key)
    return result


def _reject_constant(name: str) -> Any:
    raise _JsonRejected("nan-constant", f"header contains the non-JSON constant {name}")


def _parse_int(text: str) -> int | _Negative:
    return _Negative(text) if text.startswith("-") else int(text)


# A JSON number token `-0` (possibly `-0` followed by nothing numeric). Python reads it as
# 0, serde refuses it; only when this pattern occurs do we pay for a per-integer hook.
_NEGATIVE_ZERO = re.compile(r"-0(?![0-9.eE])")
_NEGATIVE_ZERO_BYTES = re.compile(rb"-0(?![0-9.eE])")
# orjson reads integers past 64 bits as floats; the strict parser keeps them exact. A run of
# 20 digits is found by mapping digits to "0" and all else to " " (much faster than a regex).
_DIGITS_ONLY = bytes(ord("0") if chr(i).isdigit() and i < 128 else ord(" ") for i in range(256))
_LONG_DIGIT_RUN = b"0" * 20


# Whitespace before a colon (a run of it always ends in one of these pairs); see _fast_json.
_SPACED_COLONS = (b" :", b"\t:", b"\n:", b"\r:")


def _fast_json(raw: bytes) -> dict[str, Any] | None:
    """orjson's parse when it provably equals the strict parse below, else None.

    orjson is several times faster than json, refuses NaN, bad UTF-8 and integers past
    64 bits by itself, but keeps the last of duplicate keys. Duplicates are ruled out by
    counting: with no backslash in the text (so every quote delimits a string) and no space
    before a colon, each key ends in `":`; a count that differs from the keys parsed means
    a duplicate or something unusual, and the strict parser decides.
    """
    if (
        b"\\" in raw
        or any(pair in raw for pair in _SPACED_COLONS)
        or _NEGATIVE_ZERO_BYTES.search(raw)
        or _LONG_DIGIT_RUN in raw.translate(_DIGITS_ONLY)
    ):
        return None
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if type(parsed) is not dict:
        return None
    keys = len(parsed) + sum(len(value) for value in parsed.values() if type(value) is dict)
    return parsed if keys == raw.count(b'":') else None


def loads(text: str | bytes) -> Any:
    """`json.loads` for text a file gave: nesting too deep for the parser (past about 1,000
    levels it raises RecursionError, which escaped as an internal error) is a ValueError, as
    any other text that is not JSON."""
    try:
        return json.loads(text)
    except RecursionError as exc:
        raise ValueError("JSON nested too deeply") from exc


def parse_header_json(raw: bytes, path: str) -> dict[str, Any]:
    """Decode header bytes as strict JSON with a top-level object."""
    fast = _fast_json(raw)
    return fast if fast is not None else strict_json(raw, path)


def strict_json(raw: bytes, path: str) -> dict[str, Any]:
    """The authoritative parse: every refusal names its rule."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise CorruptFileError(
            path, "header-not-utf8", f"header is not valid UTF-8 at byte {exc.start}", _REEXPORT
        ) from exc
    hooks: dict[str, Any] = {
        "object_pairs_hook": _pairs_hook,
        "parse_constant": _reject_constant,
    }
    if _NEGATIVE_ZERO.search(text):
        hooks["parse_int"] = _parse_int
    try:
        parsed = json.loads(text, **hooks)
    except _JsonRejected as exc:
        raise CorruptFileError(path, exc.rule, exc.what, _REEXPORT) from exc
    except json.JSONDecodeError as exc:
        raise CorruptFileError(
            path,
            "header-not-json",
            f"header is not valid JSON: {exc.msg} at char {exc.pos}",
            _REEXPORT,
        ) from exc
    except (ValueError, RecursionError) as exc:
        raise CorruptFileError(
            path, "header-not-json", f"header is not valid JSON: {str(exc)[:80]}", _REEXPORT
        ) from exc
    if not isinstance(parsed, dict):
        raise CorruptFileError(
            path,
            "header-not-object",
            f"header is a JSON {type(parsed).__name__}, not an object",
            _REEXPORT,
        )
    return parsed
