"""ckptfix: find and fix what is wrong with model checkpoints.

Importing the package is cheap: the functions and classes below are imported on first use,
so `python -m ckptfix` can take charge of signals before typer, rich or numpy load.
"""

from __future__ import annotations

import importlib
import sys
import types

__version__ = "0.1.0"

TYPE_CHECKING = False  # not typing's: importing typing would slow down every start
if TYPE_CHECKING:
    from typing import Any

    from ckptfix.catalog import TensorInfo
    from ckptfix.errors import (
        CkptfixError,
        CorruptFileError,
        InputNotFoundError,
        UnsafePickleError,
        UsageError,
    )
    from ckptfix.findings import Finding, Severity
    from ckptfix.inspect import inspect
    from ckptfix.report import FileSummary, Report
    from ckptfix.rewrite import RewriteResult, convert, dedupe, reshard

_EXPORTS = {
    "CkptfixError": "ckptfix.errors",
    "CorruptFileError": "ckptfix.errors",
    "FileSummary": "ckptfix.report",
    "Finding": "ckptfix.findings",
    "InputNotFoundError": "ckptfix.errors",
    "Report": "ckptfix.report",
    "RewriteResult": "ckptfix.rewrite",
    "Severity": "ckptfix.findings",
    "TensorInfo": "ckptfix.catalog",
    "UnsafePickleError": "ckptfix.errors",
    "UsageError": "ckptfix.errors",
    "convert": "ckptfix.rewrite",
    "dedupe": "ckptfix.rewrite",
    "inspect": "ckptfix.inspect",
    "reshard": "ckptfix.rewrite",
}

__all__ = [
    "CkptfixError",
    "CorruptFileError",
    "FileSummary",
    "Finding",
    "InputNotFoundError",
    "Report",
    "RewriteResult",
    "Severity",
    "TensorInfo",
    "UnsafePickleError",
    "UsageError",
    "__version__",
    "convert",
    "dedupe",
    "inspect",
    "reshard",
]


def __getattr__(name: str) -> Any:
    """The exports above on first use; submodules (`ckptfix.sizes`) as a plain import would."""
    module = _EXPORTS.get(name)
    if module is not None:
        value = getattr(importlib.import_module(module), name)
        globals()[name] = value
        return value
    try:
        return importlib.import_module(f"{__name__}.{name}")
    except ModuleNotFoundError as exc:
        if exc.name != f"{__name__}.{name}":
            raise
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}") from None


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})


class _Package(types.ModuleType):
    """Importing the `ckptfix.inspect` module sets the package's `inspect` attribute to that
    module; the function of that name stays what `ckptfix.inspect` means."""

    def __setattr__(self, name: str, value: object) -> None:
        if name in _EXPORTS and isinstance(value, types.ModuleType):
            return
        super().__setattr__(name, value)


sys.modules[__name__].__class__ = _Package
