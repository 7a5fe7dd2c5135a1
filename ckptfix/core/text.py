"""How text that others control is written out: names of files, folders, tensors and tags,
metadata values, paths and URLs come from the checkpoint or from whoever named it, and may
hold anything a file name or a JSON string can (docs/security.md, "What is escaped in the output").

- `shown`: for every line a person or a CI log reads (the text output, `error:` lines, the
  hook, GitHub workflow commands, JUnit): control characters, Unicode format characters
  and bytes that are not UTF-8 become visible escapes, and the forms in which the GitHub
  Actions runner reads a workflow command from a line are made inert.
- `checksum_name`: a name in a line of `hash` or `diff`, escaped as GNU sha256sum escapes
  a file name, on top of `shown`'s escapes.
- `json_bytes`: every JSON document (reports, manifests, CI formats, error documents).
- `redact`: credentials in URLs, wherever a URL becomes a label.

Pure functions: nothing here knows the terminal.
"""

from __future__ import annotations

import re
from typing import Any

# Characters that move the cursor, ring, retitle or recolour a terminal, reorder or hide
# text, or end a line: C0, DEL and C1 controls; format characters (Unicode category Cf:
# bidirectional overrides, zero-width characters, tag characters) and the line and
# paragraph separators; lone surrogates (Python's form of a byte that is not UTF-8 in a file
# name); the noncharacters XML cannot hold. tests/test_text.py checks the Cf, Zl and Zp
# classes against the running Python's Unicode database.
_CONTROLS_BUT_LINES = "\x00-\x09\x0b\x0c\x0e-\x1f\x7f-\x9f"
_OTHERS = (
    "\xad\u0600-\u0605\u061c\u06dd\u070f\u0890\u0891\u08e2\u180e\u200b-\u200f"
    "\u2028-\u202e\u2060-\u2064\u2066-\u206f\ud800-\udfff\ufeff\ufff9-\ufffb\ufffe\uffff"
    "\U000110bd\U000110cd\U00013430-\U0001343f\U0001bca0-\U0001bca3\U0001d173-\U0001d17a"
    "\U000e0001\U000e0020-\U000e007f"
)
_HIDDEN = re.compile(f"[\n\r{_CONTROLS_BUT_LINES}{_OTHERS}]")
_HIDDEN_BUT_LINES = re.compile(f"[{_CONTROLS_BUT_LINES}{_OTHERS}]")
_SHORT = {"\n": "\\n", "\r": "\\r", "\t": "\\t"}
# The runner's legacy parser reads `##[command ...]data` anywhere in a line; the current one
# reads `::command ...::data` at the start of a line, after blanks (actions/runner,
# ActionCommand.TryParse and TryParseV2).
_LEGACY_COMMAND = "##["
_INERT_LEGACY = "##\\x5b"


def _escape(match: re.Match[str]) -> str:
    char = match.group()
    code = ord(char)
    if char in _SHORT:
        return _SHORT[char]
    if 0xDC80 <= code <= 0xDCFF:  # a byte that is not UTF-8, kept by surrogateescape
        return f"\\x{code - 0xDC00:02x}"
    if code <= 0xFF:
        return f"\\x{code:02x}"
    return f"\\u{code:04x}" if code <= 0xFFFF else f"\\U{code:08x}"


def shown(text: str) -> str:
    """`text` as one printable line: `\\n`, `\\r`, `\\t`, `\\x1b`, `\\u202e`; a byte that is
    not UTF-8 as `\\xff`; `##[` as `##\\x5b`; and `::` at its start (after blanks) as
    `\\x3a:`. Printable text, backslashes included, is left as it is."""
    return _inert_start(_HIDDEN.sub(_escape, text).replace(_LEGACY_COMMAND, _INERT_LEGACY))


def _inert_start(line: str) -> str:
    body = line.lstrip()
    if body.startswith("::"):
        return line[: len(line) - len(body)] + "\\x3a" + body[1:]
    return line


def inert_lines(text: str) -> str:
    """`text` with `::` at the start of any of its lines made inert as `shown` makes it: for
    output that something else breaks into lines (a console wrapping long lines to a
    terminal's width, which may start a line in the middle of a name)."""
    if "::" not in text:
        return text
    return "\n".join(map(_inert_start, text.split("\n")))


def checksum_name(text: str) -> tuple[bool, str]:
    """A name as GNU coreutils' sha256sum writes it in a line (coreutils 9.x): `\\`, LF and
    CR as `\\\\`, `\\n` and `\\r`, and True when any was escaped (the line then starts with
    `\\`, which tells a reader to unescape it). Other characters `shown` escapes are escaped
    first, as it escapes them (sha256sum would print them raw, to the terminal): so the
    line reads back, by sha256sum's rules, as the name `shown` shows."""
    visible = _HIDDEN_BUT_LINES.sub(_escape, text).replace(_LEGACY_COMMAND, _INERT_LEGACY)
    escaped = visible.replace("\\", "\\\\").replace("\n", "\\n").replace("\r", "\\r")
    return escaped != visible, escaped


_SURROGATE = re.compile("[\ud800-\udfff]")


def _unicode(value: Any) -> Any:
    """`value` with each lone surrogate in its strings (a byte of a file name that is not
    UTF-8) written as `shown` writes it (`\\xff`): what JSON can hold."""
    if isinstance(value, str):
        return _SURROGATE.sub(_escape, value)
    if isinstance(value, dict):
        return {_unicode(key): _unicode(item) for key, item in value.items()}
    if isinstance(value, list | tuple):
        return [_unicode(item) for item in value]
    return value


# What orjson writes raw in a string and a terminal or an editor would act on: DEL, C1 and
# the format characters (it escapes C0 itself, and a lone surrogate is never encoded).
_JSON_HIDDEN = re.compile(f"[\x7f-\x9f{_OTHERS}]")


def _json_escape(match: re.Match[str]) -> str:
    code = ord(match.group())
    if code <= 0xFFFF:
        return f"\\u{code:04x}"
    high, low = divmod(code - 0x10000, 0x400)
    return f"\\u{0xD800 + high:04x}\\u{0xDC00 + low:04x}"


def json_bytes(document: object, *, indent: bool = True) -> bytes:
    """`document` as JSON (orjson, two-space indent), the same strings once parsed, written
    so that no character of it acts on a terminal or a CI log: DEL, C1 and format characters
    as `\\u` escapes (orjson escapes C0), the `[` of `##[` as `\\u005b` (no line reads as a
    GitHub workflow command); and a byte of a file name that is not UTF-8, which JSON cannot
    hold, as the text `\\xff`, as everywhere."""
    import orjson

    option = orjson.OPT_INDENT_2 if indent else 0
    try:
        data = orjson.dumps(document, option=option)
    except orjson.JSONEncodeError:  # a lone surrogate, or an integer past 64 bits
        document = _unicode(document)
        try:
            data = orjson.dumps(document, option=option)
        except orjson.JSONEncodeError:  # a dimension a hostile file claims (2**70): exact
            data = _standard_json(document, indent)
    if not data.isascii() or b"\x7f" in data:  # such characters only occur inside strings
        data = _JSON_HIDDEN.sub(_json_escape, data.decode()).encode()
    return data.replace(b"##[", b"##\\u005b") if b"##[" in data else data


def _standard_json(document: object, indent: bool) -> bytes:
    """What orjson writes, by the standard encoder, which writes integers of any size."""
    import json

    separators = (",", ": ") if indent else (",", ":")
    text = json.dumps(
        document, indent=2 if indent else None, separators=separators, ensure_ascii=False
    )
    return text.encode()


# `scheme://userinfo@host...`, and the value of every query (and fragment) parameter: a
# signed or tokened URL carries its secret there under names no list foresees (X-Amz-
# Signature, sig, token, but also jwt, t, code, session, ...).
_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.\-]*://[^\s'\"<>]*")
_USERINFO = re.compile(r"^([^/?#]*)@")
_PARAMETER = re.compile(r"([?&;#])([^=&#;]*)(=?)[^&#;]*")
REDACTED = "***"


def _redact_parameter(match: re.Match[str]) -> str:
    separator, name, equals = match.groups()
    if equals:
        return f"{separator}{name}={REDACTED}"
    return f"{separator}{REDACTED}" if name else separator  # a bare token: all of it


def _redact_url(url: str) -> str:
    scheme, _, rest = url.partition("://")
    rest = _USERINFO.sub(f"{REDACTED}@", rest, count=1)
    cut = min((found for found in (rest.find("?"), rest.find("#")) if found >= 0), default=None)
    if cut is None:
        return f"{scheme}://{rest}"
    return f"{scheme}://{rest[:cut]}{_PARAMETER.sub(_redact_parameter, rest[cut:])}"


def redact(text: str) -> str:
    """`text` with the credentials of every URL in it replaced by `***`: the userinfo
    (`https://***@host/...`) and the value of every query or fragment parameter
    (`?X-Amz-Signature=***&X-Amz-Date=***`, a bare `?TOKEN` as `?***`). What is printed or
    written names a URL only this way; the requests use the URL as given."""
    if "://" not in text:
        return text
    return _URL.sub(lambda match: _redact_url(match.group()), text)


def plain_file_name(name: object) -> bool:
    """A name inside the folder itself: no separators, no `..`, no NUL."""
    return (
        type(name) is str
        and name not in ("", ".", "..")
        and not any(mark in name for mark in ("/", "\\", "\x00"))
    )
