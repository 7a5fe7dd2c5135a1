"""The fixed choices of the library's options, as types a caller's type checker sees."""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import Any, Literal

from ckptfix.core.errors import UsageError
from ckptfix.core.sizes import parse_size

Framework = Literal["numpy", "pt"]  # what get() and iter() return: numpy arrays or torch tensors
Shared = Literal["dedupe", "clone"]  # tensors that share memory: written once, or each alone
ZeroWeights = Literal["master", "module"]  # DeepSpeed: fp32 master weights, or the module copy
Size = int | str  # bytes, or "5GB" / "500MiB" as the CLI takes them
ConfigLike = Mapping[str, Any] | str | os.PathLike[str]  # a config dict or its file

FRAMEWORKS = ("numpy", "pt")


def shard_size(value: Size, option: str = "max_shard") -> int:
    """`max_shard` in bytes: an int, or a size the CLI accepts ("5GB", "500MiB")."""
    if isinstance(value, bool) or not isinstance(value, int | str):
        raise UsageError(option, f"{value!r} is not a size", 'pass bytes or a size such as "5GB"')
    if isinstance(value, str):
        return parse_size(value, option)
    if value < 1:
        raise UsageError(option, f"size {value} must be at least one byte", "pass a positive size")
    return value


def choice(value: object, allowed: tuple[str, ...], option: str) -> str:
    """A string option that must be one of `allowed` (a typo is a ValueError at once)."""
    if value not in allowed:
        listed = ", ".join(repr(item) for item in allowed)
        raise UsageError(option, f"unknown choice {value!r}", f"use one of {listed}")
    return str(value)
