"""How each finding is repaired: the command that does it, or why no command can.

`REPAIREDBY_FIX` are the codes `ckptfix fix` repairs when the shards make them recoverable
(plan.repair decides for the checkpoint at hand, and says so in each finding's `fix`); a
file-level finding (`corrupt-file`, `lfs-pointer`, `unsafe-pickle`, ...) is repaired too
when its file belongs to a weight family that fix takes out of the checkpoint. `FIXES` is
what a finding's `fix` says when fix does not repair it: another command (SRC stands for
the checkpoint's path), or `none:` and why.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from ckptfix.core.codes import BY_FIX, RECORDS
from ckptfix.core.findings import Finding

REPAIREDBY_FIX = frozenset(
    {
        "index-missing-file",  # when another shard of the family holds the tensors
        "index-missing-tensor",  # likewise
        "duplicate-name",  # when the index says which copy is current
        "index-unlisted-tensor",
        "index-total-size",
        "orphan-file",
        "mixed-formats",
        "missing-format-metadata",
        "shadowed-shards",
        "shard-numbering",  # with an index, or with every part of the numbering present
    }
)

# Warnings about what a tensor is, not about damage: fix cannot change them, does not refuse
# a checkpoint for them, and leaves them in the result (reported as left as they are).
LEFT_AS_IS = frozenset({"huge-numel", "oversized-tensor"})

# code -> the repair its record (core.codes) names.
FIXES: dict[str, str] = {code: record.repair for code, record in RECORDS.items()}


def fix_action(code: str) -> str | None:
    """What `ckptfix fix` does about a finding of `code` in general (None when it does not
    repair it): for a checkpoint it has not planned, such as one it refuses for another
    finding."""
    text = FIXES.get(code, "")
    return text.removeprefix(BY_FIX) if text.startswith(BY_FIX) else None


def default_fix(code: str, path: str = "SRC", preset: str | None = None) -> str:
    """What repairs a finding of `code` when nothing more is known, for the checkpoint at
    `path`: the finding's own `preset` fix when its loader gave one, else its code's."""
    text = preset if preset is not None else FIXES.get(code, "none: see the message")
    return text.replace("SRC", shlex.quote(path)) if path != "SRC" else text


@dataclass(frozen=True)
class Annotated:
    """Findings with their `fix`, and how many of them `ckptfix fix` would repair now (0
    while it refuses the checkpoint, for the codes in `refused`)."""

    findings: list[Finding] = field(default_factory=list)
    repairable: int = 0
    refused: tuple[str, ...] = ()
