"""`ckptfix fix` as data: what each finding needs, which weight files are kept as they are,
renamed, rewritten or taken out, and the index to write. `plan.repair_plan.plan_repair`
builds it from a Checkpoint (no I/O); the CLI renders it; `ops.fix` executes it.

Nothing is ever deleted: a file taken out of the checkpoint is moved into ASIDE inside the
model folder with `--in-place` (and simply not copied with `-o`); so is the original of a
file rewritten without the stale copies it held, and an index that is written anew. A file
rewritten only to add `"format": "pt"` to its header keeps every tensor byte and is replaced.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ckptfix.core.errors import CkptfixError

# The folder inside the model folder that holds what `fix --in-place` takes out. Loaders
# read only the top level of a model folder (transformers, diffusers, peft, vLLM, ...), and
# ckptfix neither reads it as part of the checkpoint nor copies it with -o.
ASIDE = "ckptfix-aside"


@dataclass(frozen=True)
class Refusal:
    """A finding fix cannot repair. While one stands, fix writes nothing."""

    code: str
    file: str | None
    what: str
    fix: str  # the way out
    tensors: tuple[str, ...] = ()
    rule: str | None = None  # the validation rule broken (a corrupt file), when there is one

    @property
    def label(self) -> str:
        """What its error line names: the rule broken, else the finding code."""
        return self.rule or self.code

    def to_dict(self) -> dict[str, object]:
        return {
            "code": self.code,
            "rule": self.label,
            "file": self.file,
            "tensors": list(self.tensors),
            "message": self.what,
            "fix": self.fix,
        }


def read_refusal(label: str, error: CkptfixError | None) -> Refusal:
    """A weight file that could not be read: nothing can be rebuilt from it."""
    code = (error.code if error is not None else None) or "corrupt-file"
    what = error.what if error is not None else "file could not be read"
    fix = (error.fix if error is not None else None) or "download it again"
    rule = error.rule if error is not None else None
    fix += ", then run `ckptfix fix` again"
    return Refusal(code, label, what, fix, rule=rule)


@dataclass(frozen=True)
class KeptFile:
    """A weight file of the repaired checkpoint: the file it comes from, its name there, the
    tensors it keeps (in file order) and why it is rewritten, if it is."""

    source: str  # relative to the folder (a single file: its own name)
    target: str
    tensors: tuple[str, ...]
    nbytes: int
    dropped: tuple[str, ...] = ()  # stale copies left out: the index keeps another copy
    add_format: bool = False

    @property
    def rewritten(self) -> bool:
        return self.add_format or bool(self.dropped)

    @property
    def how(self) -> str:
        if self.rewritten:
            return "rewritten"
        return "renamed" if self.target != self.source else "kept"

    def to_dict(self) -> dict[str, object]:
        return {
            "source": self.source,
            "file": self.target,
            "how": self.how,
            "tensors": len(self.tensors),
            "bytes": self.nbytes,
            "dropped": list(self.dropped),
            "add_format": self.add_format,
        }


@dataclass(frozen=True)
class IndexPlan:
    """The index of a repaired family, from the shard headers."""

    file: str
    weight_map: dict[str, str]
    metadata: dict[str, Any]  # with total_size
    write: bool  # False: the index in the folder already says exactly this

    def to_dict(self) -> dict[str, object]:
        return {
            "file": self.file,
            "write": self.write,
            "tensors": len(self.weight_map),
            "total_size": self.metadata.get("total_size"),
        }


@dataclass(frozen=True)
class Move:
    """A file taken out of the checkpoint: `aside` is its path inside ASIDE (--in-place)."""

    source: str
    aside: str
    reason: str
    stale: tuple[str, ...] = field(default=(), compare=False)  # copies kept in other files

    def to_dict(self) -> dict[str, object]:
        return {"source": self.source, "aside": f"{ASIDE}/{self.aside}", "reason": self.reason}


@dataclass(frozen=True)
class FamilyPlan:
    """One weight family of the repaired checkpoint."""

    family: str  # its label, e.g. model*.safetensors
    key: str  # layouts.huggingface.family_key
    files: tuple[KeptFile, ...]
    index: IndexPlan | None = None

    def to_dict(self) -> dict[str, object]:
        return {
            "family": self.family,
            "files": [item.to_dict() for item in self.files],
            "index": self.index.to_dict() if self.index is not None else None,
        }


@dataclass(frozen=True)
class FindingAction:
    """A finding of the source and what fix does about it: `repair`, `refuse` (fix writes
    nothing while it stands) or `keep` (info, left as it is)."""

    code: str
    severity: str
    file: str | None
    message: str
    verdict: str
    action: str

    def to_dict(self) -> dict[str, object]:
        return {
            "code": self.code,
            "severity": self.severity,
            "file": self.file,
            "verdict": self.verdict,
            "action": self.action,
        }


@dataclass(frozen=True)
class RepairPlan:
    """Everything `ckptfix fix` would do to a checkpoint, or why it cannot."""

    path: str
    single_file: bool
    families: tuple[FamilyPlan, ...] = ()
    moves: tuple[Move, ...] = ()
    refusals: tuple[Refusal, ...] = ()
    findings: tuple[FindingAction, ...] = ()
    # Warnings the repaired checkpoint still has, which no repair changes (the sizes of
    # tensors: core.fixes.LEFT_AS_IS).
    remaining: tuple[FindingAction, ...] = ()
    # The folder's other entries (ops.fix fills these in): copied or carried as they are,
    # and those -o leaves out with the reason.
    copied: tuple[str, ...] = ()
    left_out: dict[str, str] = field(default_factory=dict)
    # Whether the result was checked (plan.repair_result): not when planning already refused.
    checked: bool = False

    @property
    def refused(self) -> bool:
        return bool(self.refusals)

    @property
    def kept_files(self) -> tuple[KeptFile, ...]:
        return tuple(item for family in self.families for item in family.files)

    @property
    def indexes(self) -> tuple[IndexPlan, ...]:
        return tuple(family.index for family in self.families if family.index is not None)

    @property
    def changes(self) -> bool:
        """Whether the checkpoint's files change at all (else --in-place writes nothing)."""
        return (
            bool(self.moves)
            or any(item.how != "kept" for item in self.kept_files)
            or any(index.write for index in self.indexes)
        )

    def count(self, verdict: str) -> int:
        return sum(1 for item in self.findings if item.verdict == verdict)

    def to_dict(self) -> dict[str, object]:
        return {
            "refused": self.refused,
            "refusals": [item.to_dict() for item in self.refusals],
            "findings": [item.to_dict() for item in self.findings],
            "remaining": [item.to_dict() for item in self.remaining],
            "families": [family.to_dict() for family in self.families],
            "moved": [move.to_dict() for move in self.moves],
            "copied_files": list(self.copied),
            "left_out": dict(self.left_out),
            "aside": ASIDE,
        }
