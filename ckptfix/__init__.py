"""ckptfix: find and fix what is wrong with model checkpoints.

Importing the package is cheap: the functions and classes below are imported on first use,
so `python -m ckptfix` can take charge of signals before typer, rich or numpy load. Until it
has, a Ctrl-C is Python's (a traceback), so this module imports nothing at all, not even
`__future__` or `importlib` (about 1 ms of a fresh process, measured: see cli/entry.py).
"""

__version__ = "0.1.0"

TYPE_CHECKING = False  # not typing's: importing typing would slow down every start
if TYPE_CHECKING:
    from typing import Any

    from ckptfix.api.output import SaveResult
    from ckptfix.api.reader import Reader, TensorSpec, open  # noqa: A004 - ckptfix.open
    from ckptfix.api.save import save
    from ckptfix.api.writer import Writer
    from ckptfix.core.errors import (
        CkptfixError,
        CorruptFileError,
        InputNotFoundError,
        Interrupted,
        MappingError,
        OpenFilesError,
        OutputConflictError,
        PlanError,
        RemoteError,
        RepairRefusedError,
        UnknownTensorError,
        UnsafePickleError,
        UnsupportedFormatError,
        UsageError,
        VerificationError,
        WriteError,
    )
    from ckptfix.core.findings import Finding, Severity
    from ckptfix.core.tensor import TensorInfo
    from ckptfix.ops.diff import DiffOptions, DiffResult, diff
    from ckptfix.ops.fix import FixOptions, FixResult, fix
    from ckptfix.ops.hash import HashOptions, HashResult, hash_checkpoint
    from ckptfix.ops.inspect import inspect
    from ckptfix.ops.report import FileSummary, Report
    from ckptfix.ops.rewrite import RewriteResult, convert, dedupe, reshard
    from ckptfix.ops.rewrite_options import ConvertOptions, DedupeOptions, ReshardOptions
    from ckptfix.ops.source import InputRefusedError

_EXPORTS = {
    "CkptfixError": "ckptfix.core.errors",
    "ConvertOptions": "ckptfix.ops.rewrite_options",
    "CorruptFileError": "ckptfix.core.errors",
    "DedupeOptions": "ckptfix.ops.rewrite_options",
    "DiffOptions": "ckptfix.ops.diff",
    "DiffResult": "ckptfix.ops.diff",
    "FileSummary": "ckptfix.ops.report",
    "Finding": "ckptfix.core.findings",
    "FixOptions": "ckptfix.ops.fix",
    "FixResult": "ckptfix.ops.fix",
    "HashOptions": "ckptfix.ops.hash",
    "HashResult": "ckptfix.ops.hash",
    "InputNotFoundError": "ckptfix.core.errors",
    "InputRefusedError": "ckptfix.ops.source",
    "Interrupted": "ckptfix.core.errors",
    "MappingError": "ckptfix.core.errors",
    "OpenFilesError": "ckptfix.core.errors",
    "OutputConflictError": "ckptfix.core.errors",
    "PlanError": "ckptfix.core.errors",
    "Reader": "ckptfix.api.reader",
    "RemoteError": "ckptfix.core.errors",
    "RepairRefusedError": "ckptfix.core.errors",
    "Report": "ckptfix.ops.report",
    "ReshardOptions": "ckptfix.ops.rewrite_options",
    "RewriteResult": "ckptfix.ops.rewrite",
    "SaveResult": "ckptfix.api.output",
    "Severity": "ckptfix.core.findings",
    "TensorInfo": "ckptfix.core.tensor",
    "TensorSpec": "ckptfix.api.reader",
    "UnknownTensorError": "ckptfix.core.errors",
    "UnsafePickleError": "ckptfix.core.errors",
    "UnsupportedFormatError": "ckptfix.core.errors",
    "UsageError": "ckptfix.core.errors",
    "VerificationError": "ckptfix.core.errors",
    "WriteError": "ckptfix.core.errors",
    "Writer": "ckptfix.api.writer",
    "convert": "ckptfix.ops.rewrite",
    "dedupe": "ckptfix.ops.rewrite",
    "diff": "ckptfix.ops.diff",
    "fix": "ckptfix.ops.fix",
    "hash_checkpoint": "ckptfix.ops.hash",
    "inspect": "ckptfix.ops.inspect",
    "open": "ckptfix.api.reader",
    "reshard": "ckptfix.ops.rewrite",
    "save": "ckptfix.api.save",
}

__all__ = [
    "CkptfixError",
    "ConvertOptions",
    "CorruptFileError",
    "DedupeOptions",
    "DiffOptions",
    "DiffResult",
    "FileSummary",
    "Finding",
    "FixOptions",
    "FixResult",
    "HashOptions",
    "HashResult",
    "InputNotFoundError",
    "InputRefusedError",
    "Interrupted",
    "MappingError",
    "OpenFilesError",
    "OutputConflictError",
    "PlanError",
    "Reader",
    "RemoteError",
    "RepairRefusedError",
    "Report",
    "ReshardOptions",
    "RewriteResult",
    "SaveResult",
    "Severity",
    "TensorInfo",
    "TensorSpec",
    "UnknownTensorError",
    "UnsafePickleError",
    "UnsupportedFormatError",
    "UsageError",
    "VerificationError",
    "WriteError",
    "Writer",
    "__version__",
    "convert",
    "dedupe",
    "diff",
    "fix",
    "hash_checkpoint",
    "inspect",
    "open",
    "reshard",
    "save",
]


def __getattr__(name: str) -> "Any":
    """The exports above on first use; submodules (`ckptfix.core.sizes`) as a plain import would."""
    import importlib

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
