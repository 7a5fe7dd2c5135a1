"""ckptfix: find and fix what is wrong with model checkpoints."""

from __future__ import annotations

__version__ = "0.1.0"

from ckptfix.catalog import TensorInfo
from ckptfix.errors import (
    CkptfixError,
    CorruptFileError,
    InputNotFoundError,
    UsageError,
)
from ckptfix.findings import Finding, Severity
from ckptfix.inspect import inspect
from ckptfix.report import FileSummary, Report

__all__ = [
    "CkptfixError",
    "CorruptFileError",
    "FileSummary",
    "Finding",
    "InputNotFoundError",
    "Report",
    "Severity",
    "TensorInfo",
    "UsageError",
    "__version__",
    "inspect",
]
