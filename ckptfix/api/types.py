"""The fixed choices of the library's own options, as types a caller's type checker sees
(those it shares with the CLI are in core.choices)."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from ckptfix.core.errors import UsageError

Framework = Literal["numpy", "pt"]  # what get() and iter() return: numpy arrays or torch tensors
Shared = Literal["dedupe", "clone"]  # tensors that share memory: written once, or each alone
Size = int | str  # bytes, or "5GB" / "500MiB" as the CLI takes them
ConfigLike = Mapping[str, Any] | str | os.PathLike[str]  # a config dict or its file

FRAMEWORKS = ("numpy", "pt")


def choice(value: object, allowed: tuple[str, ...], option: str) -> str:
    """A string option that must be one of `allowed` (a typo is a ValueError at once)."""
    if value not in allowed:
        listed = ", ".join(repr(item) for item in allowed)
        raise UsageError(option, f"unknown choice {value!r}", f"use one of {listed}")
    return str(value)
