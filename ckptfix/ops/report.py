"""The inspect report: what was read, what was found; serialises to the JSON docs/inspect.md documents ("JSON output")."""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property
from typing import TYPE_CHECKING, Any

from ckptfix.core.findings import Finding, Severity, error_line
from ckptfix.core.fixes import Annotated
from ckptfix.core.memory import paused_gc
from ckptfix.core.tensor import TensorInfo, bytes_by_dtype, parameter_count

if TYPE_CHECKING:
    from ckptfix.ops.manifest import ManifestCheck

SCHEMA_VERSION = 1
FAIL_ON_LEVELS = ("error", "warning", "info", "never")


@dataclass(frozen=True)
class FileSummary:
    """One file of a report: its path, format, size and tensor count."""

    path: str
    format: str
    bytes: int
    tensor_count: int
    # safetensors header metadata, kept for the write commands (not part of the JSON)
    metadata: dict[str, str] | None = field(default=None, compare=False, repr=False)

    def to_dict(self) -> dict[str, object]:
        return {
            "path": self.path,
            "format": self.format,
            "bytes": self.bytes,
            "tensor_count": self.tensor_count,
        }


@dataclass(frozen=True)
class Report:
    """What `inspect` found in one checkpoint: its files, tensors and findings."""

    path: str
    format: str
    files: tuple[FileSummary, ...]
    tensors: tuple[TensorInfo, ...]
    findings: tuple[Finding, ...]
    manifest: ManifestCheck | None = None  # with `inspect --manifest` (ops.manifest)
    # A training checkpoint's layout (DCP, DeepSpeed): the JSON's "layout" object.
    layout: dict[str, object] | None = None
    # A folder: the checkpoint its loader would load (the JSON's "checkpoint" object); the
    # tensors and totals are that checkpoint's.
    checkpoint: dict[str, object] | None = None
    # Read from a URL: requests made and bytes fetched (the JSON's "remote" object).
    remote: dict[str, int] | None = None
    # How many findings `ckptfix fix` would repair (0 while it refuses the checkpoint for
    # the codes in `fix_refused`); inspect's summary line says so (not part of the JSON,
    # where each finding's `fix` says it).
    repairable: int = 0
    fix_refused: tuple[str, ...] = ()
    # What gives the findings their `fix`, `repairable` and `fix_refused` (the repair plan
    # `ckptfix fix` would make: ops.inspect.report_of), called only where the report is
    # shown (`with_fixes`): a rewrite or a hash that shows none never plans a repair.
    annotator: Callable[[Sequence[Finding]], Annotated] | None = field(
        default=None, compare=False, repr=False
    )

    def with_fixes(self) -> Report:
        """The report with each finding's `fix` and the counts of what `ckptfix fix` would
        repair, computed once."""
        if self.annotator is None:
            return self
        return self._with_fixes

    @cached_property
    def _with_fixes(self) -> Report:
        assert self.annotator is not None
        annotated = self.annotator(self.findings)
        return replace(
            self,
            findings=tuple(annotated.findings),
            repairable=annotated.repairable,
            fix_refused=annotated.refused,
            annotator=None,
        )

    @property
    def tensor_count(self) -> int:
        return len(self.tensors)

    @property
    def parameter_count(self) -> int:
        return self._totals[0]

    @property
    def total_bytes(self) -> int:
        return self._totals[1]

    @property
    def dtypes(self) -> dict[str, int]:
        return dict(self._totals[2])

    @cached_property
    def _totals(self) -> tuple[int, int, dict[str, int]]:
        """Parameters, bytes, and bytes by dtype (largest first), in one pass over the
        tensors, once: the summary, the JSON and the verdict each ask."""
        by_dtype = bytes_by_dtype(self.tensors)
        parameters = parameter_count(self.tensors)
        ordered = dict(sorted(by_dtype.items(), key=lambda item: (-item[1], item[0])))
        return parameters, sum(by_dtype.values()), ordered

    def count(self, severity: Severity) -> int:
        return sum(1 for item in self.findings if item.severity is severity)

    def count_code(self, code: str) -> int:
        return sum(1 for item in self.findings if item.code == code)

    def exit_code(self, fail_on: str = "error") -> int:
        """0 when no finding is at or above `fail_on`, else 1 (docs/inspect.md, "Exit codes")."""
        if fail_on == "never":
            return 0
        threshold = Severity(fail_on).rank
        return 1 if any(item.severity.rank >= threshold for item in self.findings) else 0

    def error_lines(self) -> list[str]:
        """One `error: <file>: <what> (rule <rule>; <fix>)` line per error finding."""
        return [error_line(item) for item in self.findings if item.severity is Severity.ERROR]

    def to_dict(self) -> dict[str, object]:
        with paused_gc():  # one dict per tensor: 1,000,000 of them for the largest headers
            return self.with_fixes()._document(_tensor_dicts(self.tensors))

    def json_chunks(self, batch: int = 10_000) -> Iterator[bytes]:
        """`json_bytes(self.to_dict())`, byte for byte, in pieces: the tensor list is
        encoded a batch at a time, so memory holds one batch of it."""
        from ckptfix.core.text import json_bytes

        if not self.tensors:
            yield json_bytes(self.to_dict())
            return
        marker = "\x00ckptfix-tensors\x00"
        whole = json_bytes(self.with_fixes()._document([marker]))
        head, tail = whole.split(b"    " + json_bytes(marker), 1)
        yield head
        for start in range(0, len(self.tensors), batch):
            with paused_gc():
                items = _tensor_dicts(self.tensors[start : start + batch])
            # One encoding per batch: the list's items without its brackets, two levels
            # further in (the document's "tensors" list is one level in).
            listed = json_bytes(items)[len(b"[\n") : -len(b"\n]")]
            yield (b",\n  " if start else b"  ") + listed.replace(b"\n", b"\n  ")
        yield tail

    def _document(self, tensors: list[Any]) -> dict[str, object]:
        document = {
            "schema_version": SCHEMA_VERSION,
            "path": self.path,
            "format": self.format,
            "files": [item.to_dict() for item in self.files],
            "tensor_count": self.tensor_count,
            "parameter_count": self.parameter_count,
            "total_bytes": self.total_bytes,
            "dtypes": self.dtypes,
            "tensors": tensors,
            "findings": [item.to_dict() for item in self.findings],
        }
        if self.layout is not None:
            document["layout"] = self.layout
        if self.checkpoint is not None:
            document["checkpoint"] = self.checkpoint
        if self.manifest is not None:
            document["manifest"] = self.manifest.to_dict()
        if self.remote is not None:
            document["remote"] = self.remote
        return document


def _tensor_dicts(tensors: Sequence[TensorInfo]) -> list[dict[str, object]]:
    # Inlined rather than a TensorInfo method: this list can hold 1,000,000 entries.
    return [
        {
            "name": t.name,
            "dtype": t.dtype,
            "shape": list(t.shape),
            "nbytes": t.nbytes,
            "file": t.file,
            "contiguous": t.contiguous,
            "storage": t.storage,
        }
        for t in tensors
    ]
