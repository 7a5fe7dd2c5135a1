"""ckptfix: find and fix what is wrong with model checkpoints."""

from __future__ import annotations

__version__ = "0.1.0"

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
