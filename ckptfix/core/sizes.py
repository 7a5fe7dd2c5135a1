"""Byte sizes: strict parsing of `5GB` / `5GiB` / `123` and human formatting."""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation

from ckptfix.core.errors import UsageError

_UNITS: dict[str, int] = {
    "": 1,
    "B": 1,
    "kB": 10**3,  # the SI symbol
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KiB": 2**10,
    "MiB": 2**20,
    "GiB": 2**30,
    "TiB": 2**40,
}
_SIZE_RE = re.compile(r"(?P<number>[0-9]+(?:\.[0-9]+)?)(?P<unit>[A-Za-z]*)")
ACCEPTED = "a byte count, or a number with KB MB GB TB (powers of 1000) or KiB MiB GiB TiB"


def padded(size: int, alignment: int) -> int:
    """`size` rounded up to a multiple of `alignment`."""
    return -(-size // alignment) * alignment


def parse_size(text: str, option: str = "--max-shard") -> int:
    """Parse a size the Hugging Face way: `5GB` = 5*10**9, `5GiB` = 5*2**30, `123` bytes.

    Units are case-sensitive so that `5gb` (bits in some parsers) and `5G` are refused
    rather than guessed at.
    """
    match = _SIZE_RE.fullmatch(text.strip())
    if match is None or match["unit"] not in _UNITS:
        raise UsageError(option, f"invalid size {text!r}", f"use {ACCEPTED}, e.g. 5GB")
    try:
        value = Decimal(match["number"]) * _UNITS[match["unit"]]
    except InvalidOperation as exc:  # pragma: no cover - the regex admits only decimals
        raise UsageError(option, f"invalid size {text!r}", f"use {ACCEPTED}") from exc
    if value != value.to_integral_value():
        raise UsageError(option, f"size {text!r} is not a whole number of bytes", f"use {ACCEPTED}")
    if value < 1:
        raise UsageError(option, f"size {text!r} must be at least one byte", f"use {ACCEPTED}")
    return int(value)


def shard_size(value: int | str, option: str = "max_shard") -> int:
    """A size option of the library in bytes: an int, or text as `parse_size` takes it
    ("5GB", "500MiB"); anything else is a UsageError (a ValueError) naming `option`."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise UsageError(option, f"{value!r} is not a size", 'pass bytes or a size such as "5GB"')
    if isinstance(value, str):
        return parse_size(value, option)
    if value < 1:
        raise UsageError(option, f"size {value} must be at least one byte", "pass a positive size")
    return value


def format_size(num_bytes: int) -> str:
    """`1234567` -> `1.23 MB`: SI units, as the Hub shows sizes."""
    if num_bytes < 1000:
        return f"{num_bytes} B"
    value = float(num_bytes)
    for unit in ("KB", "MB", "GB", "TB", "PB"):
        value /= 1000
        if value < 1000 or unit == "PB":
            return f"{value:.2f} {unit}"
    raise AssertionError("unreachable")  # pragma: no cover


# The Hugging Face default shard size (`save_pretrained(max_shard_size="5GB")`).
DEFAULT_MAX_SHARD_TEXT = "5GB"
DEFAULT_MAX_SHARD = parse_size(DEFAULT_MAX_SHARD_TEXT)
