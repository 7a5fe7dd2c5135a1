"""Strict JSON for headers and indexes: a fast path (orjson) used only when it provably
equals the strict parse (json with hooks), which refuses what serde refuses and more
(duplicate keys, NaN, `-0`) and names the rule it applies."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from typing import Any

import orjson

from ckptfix.core.errors import CorruptFileError, Rejected

_REEXPORT = "re-download or re-export the file"


class _Negative:
    """A negative JSON integer: kept apart so `-0` cannot pass as a valid 0."""

    def __init__(self, text: str) -> None:
        self.text = text

    def __repr__(self) -> str:
        return self.text


class _JsonRejected(Rejected):
    """The document breaks a rule of strict JSON; `rule` names it."""


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


def _spaced_colon(raw: bytes) -> bool:
    """Whether whitespace stands before a colon. Each pair is looked for only when its
    blank occurs at all (a one-byte search runs at memory speed, a two-byte one several
    times slower), and a space only when one occurs before the padding at the end."""
    for pair in _SPACED_COLONS[1:]:
        if pair[:1] in raw and pair in raw:
            return True
    first = raw.find(b" ")
    padding = first != -1 and raw.count(b" ", first) == len(raw) - first
    return first != -1 and not padding and b" :" in raw


def _fast_json(raw: bytes) -> dict[str, Any] | None:
    """orjson's parse when it provably equals the strict parse below, else None.

    orjson is several times faster than json, refuses NaN, bad UTF-8 and integers past
    64 bits by itself, but keeps the last of duplicate keys. Duplicates are ruled out by
    counting: with no backslash in the text (so every quote delimits a string) and no space
    before a colon, each key ends in `":`; a count that differs from the keys parsed means
    a duplicate or something unusual, and the strict parser decides.
    """
    if not _plain(raw):
        return None
    try:
        parsed = orjson.loads(raw)
    except orjson.JSONDecodeError:
        return None
    if type(parsed) is not dict:
        return None
    keys = _keys(parsed)
    return parsed if keys is not None and keys == raw.count(b'":') else None


def _plain(raw: bytes) -> bool:
    """No backslash, no whitespace before a colon, no `-0`, no integer past 64 bits: what
    orjson's parse needs to be provably the strict one (see _fast_json)."""
    return not (
        b"\\" in raw
        or _spaced_colon(raw)
        or _NEGATIVE_ZERO_BYTES.search(raw)
        or _LONG_DIGIT_RUN in raw.translate(_DIGITS_ONLY)
    )


def _keys(parsed: dict[str, Any]) -> int | None:
    """The keys of an object of objects (its own and its values'), or None when a value
    is no object (the strict parser then names the rule)."""
    if set(map(type, parsed.values())) - {dict}:
        return None
    return len(parsed) + sum(map(len, parsed.values()))


# A large object is parsed a part of about this many bytes at a time (see Parts).
PART_SIZE = 2**20
_MEMBER_END = b'},"'  # an object's member ending (in `{"a":{..},"b":..}`), or not: see Parts


class NotParts(Exception):
    """A part of an object did not parse as an object of objects: parse it whole."""


class Parts:
    """The members of a large JSON object of objects (a safetensors header), parsed a part
    of about PART_SIZE bytes at a time, so that the parsed object is never whole in memory
    (nor orjson's own copy of it, which takes more).

    A part ends at a `},"` past PART_SIZE bytes outside any string: without a backslash
    every quote delimits a string, so an even number of quotes before it says so. One inside
    a nested object (which a valid header does not have) leaves the part unbalanced: it
    does not parse, and iterating raises NotParts. When every part parses, the parts are
    the object's members in order; `complete` then tells whether their keys account for
    every key in the text (a key given twice within a part is counted once; across parts
    the caller must look).
    """

    def __init__(self, raw: bytes, end: int, size: int = PART_SIZE) -> None:
        self.raw, self.end, self.size, self.keys = raw, end, size, 0

    def __iter__(self) -> Iterator[dict[str, Any]]:
        raw, position = self.raw, 1
        while position < self.end:
            cut = self._cut(position)
            stop = self.end if cut == -1 else cut + 1
            try:
                part = orjson.loads(b"{" + raw[position:stop] + b"}")
            except orjson.JSONDecodeError:
                raise NotParts from None
            keys = _keys(part)
            if keys is None:
                raise NotParts
            self.keys += keys
            yield part
            position = stop + 1

    def _cut(self, position: int) -> int:
        """Where the part from `position` ends: the first `},"` past `size` bytes with an
        even number of quotes before it (outside any string), or -1 (the rest is one part)."""
        raw, end = self.raw, self.end
        cut = raw.find(_MEMBER_END, position + self.size, end)
        quotes = raw.count(b'"', position, cut) if cut != -1 else 0
        while cut != -1 and quotes % 2:  # inside a name: the next one
            following = raw.find(_MEMBER_END, cut + 1, end)
            if following != -1:
                quotes += raw.count(b'"', cut, following)
            cut = following
        return cut

    def complete(self) -> bool:
        return self.keys == self.raw.count(b'":')


def object_parts(raw: bytes, size: int = PART_SIZE) -> Parts | None:
    """The Parts of an object of at least two parts of `size` bytes, when the fast path
    applies to its text (see _fast_json) and it is `{...}` followed by nothing but spaces
    (the padding); None otherwise."""
    end = raw.rfind(b"}")
    if (
        len(raw) < 2 * size
        or raw[:1] != b"{"
        or raw.count(b" ", end + 1) != len(raw) - end - 1
        or not _plain(raw)
    ):
        return None
    return Parts(raw, end, size)


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
