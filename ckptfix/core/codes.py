"""Every finding code, once: its severity, what it means (the findings table of README.md
and the description of its SARIF rule), how to fix it by hand (the SARIF rule's help) and
what repairs it (a finding's `fix` when nothing more is known: core.fixes, where SRC stands
for the checkpoint's path). CODES (core.findings), FIXES (core.fixes) and the SARIF rules
(reports.rules) are made from it; tests/test_docs.py checks README's table against it.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum


class Severity(str, Enum):
    ERROR = "error"
    WARNING = "warning"
    INFO = "info"

    @property
    def rank(self) -> int:
        return {"error": 3, "warning": 2, "info": 1}[self.value]


@dataclass(frozen=True)
class Code:
    """A finding's code: its severity, its summary and how to fix it by hand."""

    severity: Severity
    summary: str  # when it is reported (README's words: Markdown, no capital, no full stop)
    help: str  # how to fix it by hand: whole sentences
    repair: str  # the command that repairs it, or `none: <why>; <what to do instead>`


_CONVERT = "ckptfix convert SRC -o OUT"
# What a repair by `ckptfix fix` starts with (core.fixes.fix_action reads what follows).
BY_FIX = "ckptfix fix SRC -o OUT (or --in-place): "

# In the order of the SARIF rules.
RECORDS: dict[str, Code] = {
    "corrupt-file": Code(
        Severity.ERROR,
        "a file cannot be parsed or breaks a validation rule, which the message names (see "
        "Validation rules)",
        "The message names the rule broken. Re-download or re-export the file; a truncated download"
        " is the usual cause.",
        "none: the file cannot be read, so nothing can be rebuilt from it; download it again",
    ),
    "lfs-pointer": Code(
        Severity.ERROR,
        "a weight file is a Git LFS pointer, not the weights (the message gives the real size)",
        "Run `git lfs pull` (or `git lfs fetch` + `git lfs checkout`), or download the file itself.",
        "none: the file is a pointer, not the weights; run `git lfs pull`, or download the file "
        "itself",
    ),
    "unsafe-pickle": Code(
        Severity.ERROR,
        "a pickle names globals outside the allowlist (listed with counts); it is not loaded",
        "Do not load the file with torch.load or pickle. If it comes from a trusted source, convert"
        " it to safetensors in an isolated environment.",
        "none: never load it; get the weights from a source you trust, as safetensors",
    ),
    "index-missing-file": Code(
        Severity.ERROR,
        "the index maps tensors to a file that does not exist",
        "Download the missing shard, or regenerate the index from the shards present.",
        "none: no shard holds these tensors; download the missing shard",
    ),
    "index-missing-tensor": Code(
        Severity.ERROR,
        "the index maps tensors to a file that does not hold them",
        "Regenerate the index from the shards (`ckptfix reshard` writes a correct one).",
        "none: no shard holds these tensors; download the shard that holds them",
    ),
    "duplicate-name": Code(
        Severity.ERROR,
        "the same tensor name is stored in two files of one checkpoint",
        "Keep one copy: remove the stale file or rewrite the checkpoint with `ckptfix reshard`.",
        "none: no index says which copy is current; move the stale file out of the folder",
    ),
    "index-unlisted-tensor": Code(
        Severity.WARNING,
        "a shard holds tensors the index does not map to it (loaders never read them)",
        "Regenerate the index from the shards.",
        BY_FIX + "regenerate the index",
    ),
    "index-total-size": Code(
        Severity.WARNING,
        "`metadata.total_size` is not an integer or differs from the bytes the tensors take",
        "The index is stale: regenerate it from the shards.",
        BY_FIX + "regenerate the index",
    ),
    "orphan-file": Code(
        Severity.WARNING,
        "a weight file of the indexed family is not referenced by the index",
        "Delete the file if it is stale, or regenerate the index if it belongs.",
        BY_FIX + "take the stale file out, or index it",
    ),
    "mixed-formats": Code(
        Severity.WARNING,
        "several weight families in one folder; the message lists which files each index covers",
        "Keep one family and move the others out; loaders pick one by their own rules.",
        BY_FIX + "take the other families out",
    ),
    "shared-storage": Code(
        Severity.WARNING,
        "tensors of a pickle share a storage: aliases (tied weights), disjoint or overlapping views"
        " — told apart by byte ranges",
        "Write the checkpoint with `ckptfix convert` or `ckptfix dedupe`, which store each alias "
        "once and each view as its own tensor.",
        _CONVERT,
    ),
    "non-contiguous": Code(
        Severity.WARNING,
        "a tensor's strides are not row-major (transposed, strided slice, expanded)",
        "Convert with `ckptfix convert`, which writes every tensor contiguous.",
        _CONVERT,
    ),
    "wasted-storage": Code(
        Severity.WARNING,
        "a pickle stores more storage bytes than its tensors use (views saved with their whole "
        "buffer)",
        "Convert with `ckptfix convert`, which writes only the bytes each tensor uses.",
        _CONVERT,
    ),
    "oversized-tensor": Code(
        Severity.WARNING,
        "a tensor is larger than `--max-shard`",
        "Raise the limit, or accept that the tensor gets a shard of its own.",
        "none: a tensor is as large as it is; raise --max-shard where no hard limit applies",
    ),
    "huge-numel": Code(
        Severity.WARNING,
        "a tensor has ≥ 2^31 elements or bytes (32-bit size overflow in some readers)",
        "Make sure every consumer uses 64-bit sizes, or split the tensor.",
        "none: a tensor is as large as it is; make sure its consumers use 64-bit sizes",
    ),
    "missing-format-metadata": Code(
        Severity.WARNING,
        'a safetensors header lacks `"format"` (some loaders refuse it)',
        'Rewrite the file with `ckptfix reshard`, which adds "format": "pt".',
        BY_FIX + 'add "format": "pt" to the header',
    ),
    "duplicate-content": Code(
        Severity.WARNING,
        "with `--hash`: separately stored tensors with identical dtype, shape and bytes",
        "Store them once with `ckptfix dedupe --by-content` if they are meant to be tied.",
        "ckptfix dedupe SRC -o OUT --by-content",
    ),
    "non-finite": Code(
        Severity.WARNING,
        "with `--scan-values`: NaN or Inf values (counted)",
        "Check the training run or the conversion that produced the tensor.",
        "none: the values are NaN or Inf as saved, and ckptfix never changes values",
    ),
    "tied-config-mismatch": Code(
        Severity.WARNING,
        "`config.json`'s `tie_word_embeddings` disagrees with the stored keys (e.g. `false` with no"
        " `lm_head.weight`, or `true` with a separate head that differs)",
        "Fix tie_word_embeddings in config.json, or store (or drop) lm_head.weight to match it.",
        "none: the weights cannot tell which is right; make config.json's tie_word_embeddings agree"
        " with the stored head",
    ),
    "several-checkpoints": Code(
        Severity.WARNING,
        "a folder holds several separate loose checkpoint files (`epoch=3.ckpt`, `last.ckpt`): they"
        " are never merged; write commands ask which one",
        "They are not one model: inspect or convert one file at a time, or move the others out.",
        "none: the checkpoints are separate; fix one at a time (ckptfix fix FILE -o OUT)",
    ),
    "shadowed-shards": Code(
        Severity.WARNING,
        "a family's single file and its index both exist (`model.safetensors` and "
        "`model.safetensors.index.json`): the loader reads the single file and never the shards",
        "Delete whichever is stale: the single file, or the index and its shards.",
        BY_FIX + "take the stale single file out",
    ),
    "no-weights": Code(
        Severity.ERROR,
        "a folder holds no weight file and no index",
        "Check the path, or download the weights.",
        "none: there is nothing to repair; check the path, or download the weights",
    ),
    "shard-numbering": Code(
        Severity.WARNING,
        "`-0000N-of-0000M` names without an index, disagreeing on M, or with parts missing",
        "Download the missing shards, or rewrite the checkpoint with `ckptfix reshard`.",
        BY_FIX + "renumber and index the shards, when none is missing",
    ),
    "empty-name": Code(
        Severity.WARNING,
        "a tensor has an empty name",
        "Rename the tensor; many loaders cannot address it.",
        "none: nothing says what the tensor was called; rename it where the checkpoint is made",
    ),
    "unsupported-format": Code(
        Severity.ERROR,
        "a TorchScript archive, or a pickle with no tensor dictionary",
        "Export the weights as a state dict (torch.save(model.state_dict())) or safetensors.",
        "none: ckptfix does not read it; export the weights as safetensors",
    ),
    "manifest-mismatch": Code(
        Severity.ERROR,
        "with `--manifest`: tensors whose bytes, dtype or shape differ from the manifest",
        "The checkpoint is not the one the manifest describes: find which file changed (`ckptfix "
        "diff` against a known-good copy) and restore it.",
        "none: this is not the checkpoint the manifest describes; fetch that one",
    ),
    "manifest-missing-tensor": Code(
        Severity.ERROR,
        "with `--manifest`: tensors the manifest lists that the checkpoint does not hold",
        "Restore the missing shards or tensors, or write a new manifest if the change is intended.",
        "none: this is not the checkpoint the manifest describes; fetch that one",
    ),
    "manifest-extra-tensor": Code(
        Severity.ERROR,
        "with `--manifest`: tensors the checkpoint holds that the manifest does not list",
        "Remove the extra tensors, or write a new manifest if the change is intended.",
        "none: this is not the checkpoint the manifest describes; fetch that one",
    ),
    "manifest-unverified": Code(
        Severity.ERROR,
        "with `--manifest`: errors in the checkpoint stopped the check (they are reported too)",
        "Fix the errors `ckptfix inspect` reports first, then check again.",
        "none: repair the errors that stopped the check, then check again",
    ),
    "nested-checkpoint": Code(
        Severity.INFO,
        "the tensors sit inside a training checkpoint (Lightning `state_dict`, `model`, `ema`, "
        "...); the bytes of optimizer/EMA state left around them are given",
        "Extract the weights with `ckptfix convert --key auto`.",
        f"{_CONVERT} (takes the tensor dictionary out)",
    ),
    "wrapper-prefix": Code(
        Severity.INFO,
        "every name carries `module.` (DDP), `_orig_mod.` (torch.compile), `_forward_module.` or, "
        "in a training checkpoint, `model.` (Lightning)",
        "Remove it with `ckptfix convert --strip-prefix auto`.",
        f"{_CONVERT} --strip-prefix auto",
    ),
    "dtype-mix": Code(
        Severity.INFO,
        "floating tensors of more than one dtype",
        "Check this is intended; `ckptfix convert --dtype` casts them to one.",
        f"{_CONVERT} --dtype bf16 (if one dtype is wanted)",
    ),
    "missing-rank-file": Code(
        Severity.ERROR,
        "a DCP rank file `.metadata` names, a DeepSpeed rank's optimizer or model states file, or a"
        " universal checkpoint's `zero/<param>/fp32.pt`, is missing (the tensors it holds are "
        "listed; when a universal checkpoint beside the partitions still holds the fp32 weights, "
        "the fix is `--zero-weights universal`, else when `module` holds the weights "
        "`--zero-weights module`; a universal weight missing beside whole partitions: "
        "`--zero-weights master`)",
        "Copy every rank file the checkpoint was saved with into the folder.",
        "none: copy the missing rank file from where the run saved it",
    ),
    "truncated-rank-file": Code(
        Severity.ERROR,
        "a DCP rank file is shorter than the chunks `.metadata` places in it",
        "Copy the rank file again; a truncated copy or download is the usual cause.",
        "none: copy the rank file again from where the run saved it",
    ),
    "chunk-gap": Code(
        Severity.ERROR,
        "the chunks of a DCP tensor do not cover all of it (or one has no storage entry)",
        "The checkpoint is incomplete or its metadata was edited: save it again.",
        "none: the save is incomplete; use another save of the run",
    ),
    "chunk-overlap": Code(
        Severity.ERROR,
        "two chunks of a DCP tensor share elements (both rank files named)",
        "The checkpoint's metadata is inconsistent: save it again.",
        "none: the save is inconsistent; use another save of the run",
    ),
    "chunk-out-of-range": Code(
        Severity.ERROR,
        "a DCP chunk lies outside its tensor's shape",
        "The checkpoint's metadata is inconsistent: save it again.",
        "none: the save is inconsistent; use another save of the run",
    ),
    "tag-missing": Code(
        Severity.ERROR,
        "DeepSpeed's `latest` names a tag folder that does not exist (the tags present are listed)",
        "Pass the tag folder itself, or fix `latest` to name one that exists.",
        "none: point `latest` at a tag folder that exists",
    ),
    "tensor-piece": Code(
        Severity.ERROR,
        "a safetensors file is one rank's part of torch's per-rank `HuggingFaceStorageWriter` save "
        "(`DCP_SHARDING_INFO` in its header places its tensors in larger ones): pass the folder of "
        "every rank's files",
        "Pass the folder that holds every rank's shard-*-model-* files; it is read as one model.",
        "none: the file is one rank's part; pass the folder that holds every rank's files",
    ),
    "training-state": Code(
        Severity.INFO,
        "a training checkpoint holds optimizer state and non-tensor items that are not the model: "
        "left out by `convert`, with their bytes",
        "Nothing to fix: `ckptfix convert` writes the model only and reports what it left out.",
        f"{_CONVERT} (leaves it out)",
    ),
    "other-weights": Code(
        Severity.INFO,
        "a DeepSpeed folder holds the fp32 weights twice, ZeRO optimizer partitions and a universal"
        " checkpoint: which was read (`--zero-weights` picks) and where the other is; never a mix",
        "Nothing to fix: the message says which copy was read (the partitions by default); "
        "`--zero-weights universal` or `master` reads the other.",
        f"{_CONVERT} --zero-weights universal (or master: reads the other copy)",
    ),
    "split-set": Code(
        Severity.ERROR,
        "a llama.cpp GGUF split set whose parts do not make one model: a part missing, part names "
        "disagreeing on the count, `split.count`, `split.no` or `split.tensors.count` disagreeing "
        "with the names or the parts, a part renamed so that llama.cpp cannot find the others",
        "Download the missing or mismatched parts again, every part from one upload.",
        "none: the parts do not make one model as they are; download the missing or mismatched "
        "part(s) again, every part from one upload",
    ),
    "zero-filled": Code(
        Severity.WARNING,
        "GGUF tensor data that ends in zero bytes (the last 4 KiB, read cheaply by every inspect) "
        "or, with `--scan-values`, tensors of 4 KiB or more that hold only zero bytes: a "
        "preallocated download that never finished",
        "Download the file again; `ckptfix inspect --scan-values` checks every tensor.",
        "none: the bytes were never written; download the file again",
    ),
}
