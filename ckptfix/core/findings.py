"""Findings: what inspect reports, with one fixed severity per code (README, "Findings")."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, field
from enum import Enum


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        return {"error": 3, "warning": 2, "info": 1}[self.value]


CODES: dict[str, Severity] = {
    "corrupt-file": Severity.ERROR,
    "lfs-pointer": Severity.ERROR,
    "unsafe-pickle": Severity.ERROR,
    "index-missing-file": Severity.ERROR,
    "index-missing-tensor": Severity.ERROR,
    "duplicate-name": Severity.ERROR,
    "index-unlisted-tensor": Severity.WARNING,
    "index-total-size": Severity.WARNING,
    "orphan-file": Severity.WARNING,
    "mixed-formats": Severity.WARNING,
    "shared-storage": Severity.WARNING,
    "non-contiguous": Severity.WARNING,
    "wasted-storage": Severity.WARNING,
    "oversized-tensor": Severity.WARNING,
    "huge-numel": Severity.WARNING,
    "missing-format-metadata": Severity.WARNING,
    "duplicate-content": Severity.WARNING,
    "non-finite": Severity.WARNING,
    "tied-config-mismatch": Severity.WARNING,
    # A folder: separate loose checkpoints side by side (never merged), and a single file
    # that its loader reads instead of the shards its index names.
    "several-checkpoints": Severity.WARNING,
    "shadowed-shards": Severity.WARNING,
    # Beyond the first table of codes: shard file names whose N-of-M numbering is inconsistent or
    # that have no index, a folder with no weight file at all, and tensors with an empty name (SECURITY.md: warn on them).
    "no-weights": Severity.ERROR,
    "shard-numbering": Severity.WARNING,
    "empty-name": Severity.WARNING,
    "unsupported-format": Severity.ERROR,  # e.g. TorchScript: refused, not guessed at
    # `inspect --manifest`: the checkpoint is not the one a manifest describes (ops.manifest).
    "manifest-mismatch": Severity.ERROR,
    "manifest-missing-tensor": Severity.ERROR,
    "manifest-extra-tensor": Severity.ERROR,
    "manifest-unverified": Severity.ERROR,
    "nested-checkpoint": Severity.INFO,
    "wrapper-prefix": Severity.INFO,
    "dtype-mix": Severity.INFO,
    # Training checkpoints (torch.distributed.checkpoint, DeepSpeed ZeRO).
    "missing-rank-file": Severity.ERROR,
    "truncated-rank-file": Severity.ERROR,
    "chunk-gap": Severity.ERROR,
    "chunk-overlap": Severity.ERROR,
    "chunk-out-of-range": Severity.ERROR,
    "tag-missing": Severity.ERROR,
    # One rank's file of a per-rank save read alone: pieces of larger tensors, not a model.
    "tensor-piece": Severity.ERROR,
    "training-state": Severity.INFO,
    # DeepSpeed: the fp32 weights held twice (partitions and a universal checkpoint); one read.
    "other-weights": Severity.INFO,
    # GGUF: a llama.cpp split set whose parts do not make one model; tensor data that is
    # all zeros where a download should have written it.
    "split-set": Severity.ERROR,
    "zero-filled": Severity.WARNING,
}


@dataclass(frozen=True)
class Finding:
    """One problem: a code, its severity, the file and tensors involved, a one-line message."""

    code: str
    severity: Severity
    message: str
    file: str | None = None
    tensors: tuple[str, ...] = field(default=())
    # How to repair it: the command that does, or why none can (core.fixes; set for the
    # checkpoint at hand by plan.repair_verdicts when a report is shown: Report.with_fixes).
    fix: str | None = field(default=None, compare=False)

    def to_dict(self) -> dict[str, object]:
        from ckptfix.core.fixes import default_fix

        return {
            "code": self.code,
            "severity": self.severity.value,
            "file": self.file,
            "tensors": list(self.tensors),
            "message": self.message,
            "fix": default_fix(self.code, preset=self.fix),
        }


def finding(
    code: str,
    message: str,
    *,
    file: str | None = None,
    tensors: Iterable[str] = (),
    fix: str | None = None,
) -> Finding:
    """Build a finding; the severity comes from the code so it can never drift. `fix`: how
    to repair this one, when it is not what every finding of its code says (core.fixes; SRC
    stands for the checkpoint's path)."""
    return Finding(code, CODES[code], message, file, tuple(tensors), fix)


def name_list(names: list[str] | tuple[str, ...], limit: int = 3) -> str:
    """`'a', 'b', 'c' and 4 more` for messages that must stay on one line."""
    shown = ", ".join(repr(name) for name in names[:limit])
    extra = len(names) - limit
    return f"{shown} and {extra} more" if extra > 0 else shown


def split_message(message: str) -> tuple[str, str | None, str | None]:
    """A finding's message, `<what> (rule <rule>; <fix>)` or `<what> (<fix>)`, as (what,
    rule, fix): its last parenthesised group, when it ends the message, is the fix."""
    if not message.endswith(")"):
        return message, None, None
    depth = 0
    for index in range(len(message) - 1, -1, -1):
        depth += {")": 1, "(": -1}.get(message[index], 0)
        if depth == 0:
            break
    if depth or index == 0 or message[index - 1] != " ":
        return message, None, None
    what, inner = message[: index - 1], message[index + 1 : -1]
    if inner.startswith("rule "):
        rule, _, fix = inner[len("rule ") :].partition("; ")
        return what, rule, fix or None
    return what, None, inner


def error_line(item: Finding) -> str:
    """A finding as a stderr line naming its rule: `error: <file>: <what> (rule <rule>; <fix>)`."""
    what, rule, fix = split_message(item.message)
    where = f"{item.file}: " if item.file else ""
    return f"error: {where}{what} (rule {rule or item.code}{f'; {fix}' if fix else ''})"
