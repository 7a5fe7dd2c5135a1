"""How each finding is repaired: the command that does it, or why no command can.

`REPAIRED_BY_FIX` are the codes `ckptfix fix` repairs when the shards make them recoverable
(plan.repair decides for the checkpoint at hand, and says so in each finding's `fix`); a
file-level finding (`corrupt-file`, `lfs-pointer`, `unsafe-pickle`, ...) is repaired too
when its file belongs to a weight family that fix takes out of the checkpoint. `FIXES` is
what a finding's `fix` says when fix does not repair it: another command (SRC stands for
the checkpoint's path), or `none:` and why.
"""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field

from ckptfix.core.findings import Finding

REPAIRED_BY_FIX = frozenset(
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

_CONVERT = "ckptfix convert SRC -o OUT"

FIXES: dict[str, str] = {
    "corrupt-file": "none: the file cannot be read, so nothing can be rebuilt from it; download it again",
    "lfs-pointer": "none: the file is a pointer, not the weights; run `git lfs pull`, or download the file itself",
    "unsafe-pickle": "none: never load it; get the weights from a source you trust, as safetensors",
    "unsupported-format": "none: ckptfix does not read it; export the weights as safetensors",
    "index-missing-file": "none: no shard holds these tensors; download the missing shard",
    "index-missing-tensor": "none: no shard holds these tensors; download the shard that holds them",
    "duplicate-name": "none: no index says which copy is current; move the stale file out of the folder",
    "no-weights": "none: there is nothing to repair; check the path, or download the weights",
    "index-unlisted-tensor": "ckptfix fix SRC -o OUT (or --in-place): regenerate the index",
    "index-total-size": "ckptfix fix SRC -o OUT (or --in-place): regenerate the index",
    "orphan-file": "ckptfix fix SRC -o OUT (or --in-place): take the stale file out, or index it",
    "mixed-formats": "ckptfix fix SRC -o OUT (or --in-place): take the other families out",
    "shard-numbering": "ckptfix fix SRC -o OUT (or --in-place): renumber and index the shards, "
    "when none is missing",
    "shadowed-shards": "ckptfix fix SRC -o OUT (or --in-place): take the stale single file out",
    "missing-format-metadata": 'ckptfix fix SRC -o OUT (or --in-place): add "format": "pt" to the header',
    "shared-storage": _CONVERT,
    "non-contiguous": _CONVERT,
    "wasted-storage": _CONVERT,
    "oversized-tensor": "none: a tensor is as large as it is; raise --max-shard where no hard "
    "limit applies",
    "huge-numel": "none: a tensor is as large as it is; make sure its consumers use 64-bit sizes",
    "duplicate-content": "ckptfix dedupe SRC -o OUT --by-content",
    "non-finite": "none: the values are NaN or Inf as saved, and ckptfix never changes values",
    "tied-config-mismatch": "none: the weights cannot tell which is right; make config.json's "
    "tie_word_embeddings agree with the stored head",
    "several-checkpoints": "none: the checkpoints are separate; fix one at a time "
    "(ckptfix fix FILE -o OUT)",
    "empty-name": "none: nothing says what the tensor was called; rename it where the "
    "checkpoint is made",
    "manifest-mismatch": "none: this is not the checkpoint the manifest describes; fetch that one",
    "manifest-missing-tensor": "none: this is not the checkpoint the manifest describes; fetch "
    "that one",
    "manifest-extra-tensor": "none: this is not the checkpoint the manifest describes; fetch "
    "that one",
    "manifest-unverified": "none: repair the errors that stopped the check, then check again",
    "nested-checkpoint": f"{_CONVERT} (takes the tensor dictionary out)",
    "wrapper-prefix": f"{_CONVERT} --strip-prefix auto",
    "dtype-mix": f"{_CONVERT} --dtype bf16 (if one dtype is wanted)",
    "missing-rank-file": "none: copy the missing rank file from where the run saved it",
    "truncated-rank-file": "none: copy the rank file again from where the run saved it",
    "chunk-gap": "none: the save is incomplete; use another save of the run",
    "chunk-overlap": "none: the save is inconsistent; use another save of the run",
    "chunk-out-of-range": "none: the save is inconsistent; use another save of the run",
    "tag-missing": "none: point `latest` at a tag folder that exists",
    "tensor-piece": "none: the file is one rank's part; pass the folder that holds every rank's files",
    "training-state": f"{_CONVERT} (leaves it out)",
    "other-weights": f"{_CONVERT} --zero-weights universal (or master: reads the other copy)",
    "split-set": "none: the parts do not make one model as they are; download the missing or "
    "mismatched part(s) again, every part from one upload",
    "zero-filled": "none: the bytes were never written; download the file again",
}


_BY_FIX = "ckptfix fix SRC -o OUT (or --in-place): "


def fix_action(code: str) -> str | None:
    """What `ckptfix fix` does about a finding of `code` in general (None when it does not
    repair it): for a checkpoint it has not planned, such as one it refuses for another
    finding."""
    text = FIXES.get(code, "")
    return text.removeprefix(_BY_FIX) if text.startswith(_BY_FIX) else None


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
