"""What a consumer of ckptfix's output does with it, for the tests of hostile names: the
GitHub Actions runner reading workflow commands from a log, sha256sum reading a checksum
line, a terminal acting on control characters. Each written from its own documentation,
independently of ckptfix's escaping (core.text)."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass

# actions/runner ActionCommand.cs: a process's output is read line by line (StreamReader:
# LF, CR or CR LF end a line); TryParseV2 trims leading white space and reads
# `::name props::data`; TryParse (the legacy form) reads `##[name props]data` anywhere in the
# line. Which names are registered does not matter here: `::stop-commands::TOKEN` registers
# TOKEN, so any name can become one.
_LINE_ENDS = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class WorkflowCommand:
    name: str
    properties: dict[str, str]
    data: str
    line: str


def _unescape(text: str, mapping: dict[str, str]) -> str:
    for escaped, char in mapping.items():
        text = text.replace(escaped, char)
    return text


_DATA = {"%0D": "\r", "%0A": "\n", "%25": "%"}
_PROPERTY = {"%0D": "\r", "%0A": "\n", "%3A": ":", "%2C": ",", "%25": "%"}


def _current(line: str) -> WorkflowCommand | None:
    body = line.lstrip()
    if not body.startswith("::"):
        return None
    end = body.find("::", 2)
    if end < 0:
        return None
    name, _, props = body[2:end].partition(" ")
    properties = {}
    for item in props.strip().split(","):
        key, sep, value = item.partition("=")
        if key and sep and value:
            properties[key] = _unescape(value, _PROPERTY)
    return WorkflowCommand(name, properties, _unescape(body[end + 2 :], _DATA), line)


def _legacy(line: str) -> WorkflowCommand | None:
    start = line.find("##[")
    if start < 0:
        return None
    end = line.find("]", start)
    if end < 0:
        return None
    name = line[start + 3 : end].partition(" ")[0]
    return WorkflowCommand(name, {}, line[end + 1 :], line)


def workflow_commands(output: str) -> list[WorkflowCommand]:
    """Every line of `output` the runner would read as a workflow command, in order."""
    found = []
    for line in _LINE_ENDS.split(output):
        command = _current(line) or _legacy(line)
        if command is not None:
            found.append(command)
    return found


def hidden_characters(output: str) -> list[str]:
    """The characters of `output` a terminal or an editor acts on instead of showing, as
    Unicode classes them (controls, format characters, separators, lone surrogates), but
    for the line feeds that end lines."""
    return [
        char
        for char in output
        if char != "\n" and unicodedata.category(char) in ("Cc", "Cf", "Cs", "Zl", "Zp")
    ]


def sha256sum_line(line: str) -> tuple[str, str]:
    """(digest, rest) of one line as coreutils' sha256sum --check reads it (md5sum.c,
    filename_unescape): a line starting with `\\` has its rest unescaped (`\\\\`, `\\n`,
    `\\r`; any other escape makes the line invalid)."""
    escaped = line.startswith("\\")
    body = line[1:] if escaped else line
    digest, sep, rest = body.partition("  ")
    assert sep and re.fullmatch("[0-9a-f]{64}", digest), line
    if not escaped:
        return digest, rest
    out, chars = [], iter(rest)
    for char in chars:
        if char == "\\":
            nxt = next(chars, None)
            assert nxt in ("\\", "n", "r"), f"invalid escape in {line!r}"
            out.append({"\\": "\\", "n": "\n", "r": "\r"}[nxt])
        else:
            out.append(char)
    return digest, "".join(out)


# RFC 3986: a URI reference is made of unreserved characters, percent-encoded octets,
# sub-delimiters and the general delimiters `:/?#[]@` (SARIF's artifactLocation.uri is
# one; the official schema states the format, which jsonschema's draft-04 checker ignores).
_URI_CHARACTERS = re.compile(r"(?:[A-Za-z0-9\-._~!$&'()*+,;=:/?#\[\]@]|%[0-9A-Fa-f]{2})*")


def is_uri_reference(text: str) -> bool:
    """Whether `text` is made only of what RFC 3986 allows in a URI reference."""
    return _URI_CHARACTERS.fullmatch(text) is not None
