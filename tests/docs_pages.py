"""The documentation as the docs tests read it: README.md and the pages of docs/, their
headings (as the anchors GitHub makes of them), their links and their fenced code blocks."""

from __future__ import annotations

import re
import unicodedata
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
DOCS = ROOT / "docs"


def page(name: str) -> str:
    """The text of README.md (`"README.md"`) or of a page of docs/ (`"findings.md"`)."""
    path = ROOT / name if name == "README.md" else DOCS / name
    return path.read_text(encoding="utf-8")


def pages() -> list[Path]:
    """README.md and every page of docs/."""
    return [ROOT / "README.md", *sorted(DOCS.glob("*.md"))]


def section(text: str, heading: str) -> str:
    """The body under a markdown heading (the exact heading line), up to the next heading of
    the same or a higher level. Fails if the heading is not there exactly once."""
    lines = text.splitlines()
    starts = [number for number, line in enumerate(lines) if line.strip() == heading]
    assert len(starts) == 1, f"the page has {len(starts)} headings {heading!r}"
    level = len(heading) - len(heading.lstrip("#"))
    body: list[str] = []
    fenced = False
    for line in lines[starts[0] + 1 :]:
        fenced ^= line.startswith("```")
        hashes = len(line) - len(line.lstrip("#"))
        if not fenced and 0 < hashes <= level and line[hashes : hashes + 1] == " ":
            break
        body.append(line)
    return "\n".join(body)


def slug(heading: str) -> str:
    """The anchor GitHub makes of a heading's text: lower case, every character but letters,
    digits, `-`, `_` and spaces dropped (backticks, dots, commas, parentheses), each space a
    `-`."""
    kept = "".join(
        char
        for char in heading.strip().lower()
        if char in "-_ " or unicodedata.category(char)[0] in "LN"
    )
    return kept.replace(" ", "-")


def prose(text: str) -> list[str]:
    """The lines of a page outside its fenced code blocks."""
    lines = []
    fenced = False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced:
            lines.append(line)
    return lines


def headings(text: str) -> list[str]:
    """The text of every heading outside fenced blocks, in order."""
    return [match[1] for line in prose(text) if (match := re.match(r"#{1,6} (.+)$", line))]


def anchors(text: str) -> set[str]:
    """The anchors of a page's headings; a repeated heading gets `-1`, `-2`, ... as GitHub
    numbers them."""
    seen: dict[str, int] = {}
    result = set()
    for heading in headings(text):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        result.add(base if count == 0 else f"{base}-{count}")
    return result


_LINK = re.compile(r"\]\(([^()\s]+)\)")


def links(text: str) -> list[str]:
    """The targets of a page's markdown links outside fenced blocks (`[text](target)`)."""
    return [target for line in prose(text) for target in _LINK.findall(line)]


@dataclass(frozen=True)
class Block:
    """A fenced code block: its info string (`python`, `sh`, empty) and its lines."""

    info: str
    lines: tuple[str, ...]


def blocks(text: str) -> list[Block]:
    """Every fenced code block of a page, in order."""
    found = []
    current: list[str] | None = None
    info = ""
    for line in text.splitlines():
        if line.startswith("```") and current is None:
            info, current = line[3:].strip(), []
        elif line.startswith("```") and current is not None:
            found.append(Block(info, tuple(current)))
            current = None
        elif current is not None:
            current.append(line)
    return found
