"""What each finding code means and how to fix it: the rule texts of SARIF reports."""

from __future__ import annotations

from dataclasses import dataclass

from ckptfix.core.findings import CODES, Severity


@dataclass(frozen=True)
class Rule:
    code: str
    severity: Severity
    summary: str  # one sentence: when the finding is reported
    help: str  # how to fix it


# code -> (when it is reported, how to fix it); every code of CODES has an entry (tested).
_TEXTS: dict[str, tuple[str, str]] = {
    "corrupt-file": (
        "A weight, index or config file cannot be parsed or breaks a validation rule.",
        "The message names the rule broken. Re-download or re-export the file; a truncated "
        "download is the usual cause.",
    ),
    "missing-rank-file": (
        "A training checkpoint's metadata names a rank file that is not in the folder.",
        "Copy every rank file the checkpoint was saved with into the folder.",
    ),
    "truncated-rank-file": (
        "A rank file of a training checkpoint ends before the bytes its metadata points to.",
        "Copy the rank file again; a truncated copy or download is the usual cause.",
    ),
    "chunk-gap": (
        "The chunks saved by the ranks leave part of a tensor uncovered.",
        "The checkpoint is incomplete or its metadata was edited: save it again.",
    ),
    "chunk-overlap": (
        "Two chunks saved by the ranks cover the same part of a tensor.",
        "The checkpoint's metadata is inconsistent: save it again.",
    ),
    "chunk-out-of-range": (
        "A chunk's offsets or sizes reach outside its tensor.",
        "The checkpoint's metadata is inconsistent: save it again.",
    ),
    "tag-missing": (
        "A DeepSpeed folder's `latest` names a tag folder that does not exist.",
        "Pass the tag folder itself, or fix `latest` to name one that exists.",
    ),
    "tensor-piece": (
        "A safetensors file holds one rank's pieces of larger tensors (torch's per-rank HF save).",
        "Pass the folder that holds every rank's shard-*-model-* files; it is read as one model.",
    ),
    "training-state": (
        "A training checkpoint holds optimizer or training state besides the model.",
        "Nothing to fix: `ckptfix convert` writes the model only and reports what it left out.",
    ),
    "other-weights": (
        "A DeepSpeed folder holds the fp32 weights twice (ZeRO partitions and a universal "
        "checkpoint): one is read, never a mix of both.",
        "Nothing to fix: the message says which copy was read (the partitions by default); "
        "`--zero-weights universal` or `master` reads the other.",
    ),
    "split-set": (
        "A llama.cpp GGUF split set whose parts do not make one model: a part missing, "
        "split.* keys disagreeing with the file names or each other, a part renamed.",
        "Download the missing or mismatched parts again, every part from one upload.",
    ),
    "zero-filled": (
        "GGUF tensor data that is all zeros where a download should have written it.",
        "Download the file again; `ckptfix inspect --scan-values` checks every tensor.",
    ),
    "several-checkpoints": (
        "A folder holds several separate checkpoint files (loose files with other names).",
        "They are not one model: inspect or convert one file at a time, or move the others out.",
    ),
    "shadowed-shards": (
        "A family's single file and its shard index both exist; the loader reads the single file.",
        "Delete whichever is stale: the single file, or the index and its shards.",
    ),
    "manifest-mismatch": (
        "Tensors hold other bytes than the manifest (`ckptfix hash --manifest`) records.",
        "The checkpoint is not the one the manifest describes: find which file changed "
        "(`ckptfix diff` against a known-good copy) and restore it.",
    ),
    "manifest-missing-tensor": (
        "The manifest lists tensors the checkpoint does not hold.",
        "Restore the missing shards or tensors, or write a new manifest if the change is intended.",
    ),
    "manifest-extra-tensor": (
        "The checkpoint holds tensors the manifest does not list.",
        "Remove the extra tensors, or write a new manifest if the change is intended.",
    ),
    "manifest-unverified": (
        "Errors in the checkpoint stopped the check against the manifest.",
        "Fix the errors `ckptfix inspect` reports first, then check again.",
    ),
    "lfs-pointer": (
        "A weight file is a Git LFS pointer, not the weights.",
        "Run `git lfs pull` (or `git lfs fetch` + `git lfs checkout`), or download the file itself.",
    ),
    "unsafe-pickle": (
        "A pickle references globals outside the allowlist of tensor-rebuilding functions.",
        "Do not load the file with torch.load or pickle. If it comes from a trusted source, "
        "convert it to safetensors in an isolated environment.",
    ),
    "index-missing-file": (
        "The shard index maps tensors to a file that does not exist.",
        "Download the missing shard, or regenerate the index from the shards present.",
    ),
    "index-missing-tensor": (
        "The shard index maps tensors to a file that does not hold them.",
        "Regenerate the index from the shards (`ckptfix reshard` writes a correct one).",
    ),
    "duplicate-name": (
        "The same tensor name is stored in two files (or twice in one).",
        "Keep one copy: remove the stale file or rewrite the checkpoint with `ckptfix reshard`.",
    ),
    "index-unlisted-tensor": (
        "A shard holds tensors the index does not map to it, so loaders never read them.",
        "Regenerate the index from the shards.",
    ),
    "index-total-size": (
        "The index's metadata.total_size differs from the bytes the tensors take.",
        "The index is stale: regenerate it from the shards.",
    ),
    "orphan-file": (
        "A weight file of the indexed family is not referenced by the index.",
        "Delete the file if it is stale, or regenerate the index if it belongs.",
    ),
    "mixed-formats": (
        "A folder holds several weight families (for example .bin and .safetensors).",
        "Keep one family and move the others out; loaders pick one by their own rules.",
    ),
    "shared-storage": (
        "Tensors share storage: aliases (tied weights) or views of one buffer.",
        "Write the checkpoint with `ckptfix convert` or `ckptfix dedupe`, which store each "
        "alias once and each view as its own tensor.",
    ),
    "non-contiguous": (
        "A tensor's strides are not row-major contiguous (transposed, sliced, expanded).",
        "Convert with `ckptfix convert`, which writes every tensor contiguous.",
    ),
    "wasted-storage": (
        "A pickle stores more storage bytes than its tensors use.",
        "Convert with `ckptfix convert`, which writes only the bytes each tensor uses.",
    ),
    "oversized-tensor": (
        "A tensor is larger than the shard size limit (--max-shard).",
        "Raise the limit, or accept that the tensor gets a shard of its own.",
    ),
    "huge-numel": (
        "A tensor has at least 2^31 elements or bytes, which overflows 32-bit sizes.",
        "Make sure every consumer uses 64-bit sizes, or split the tensor.",
    ),
    "missing-format-metadata": (
        'A safetensors header lacks the "format" metadata entry, which some loaders require.',
        'Rewrite the file with `ckptfix reshard`, which adds "format": "pt".',
    ),
    "duplicate-content": (
        "Separately stored tensors have identical dtype, shape and bytes (with --hash).",
        "Store them once with `ckptfix dedupe --by-content` if they are meant to be tied.",
    ),
    "non-finite": (
        "A tensor holds NaN or Inf values (with --scan-values).",
        "Check the training run or the conversion that produced the tensor.",
    ),
    "tied-config-mismatch": (
        "config.json's tie_word_embeddings disagrees with the stored keys.",
        "Fix tie_word_embeddings in config.json, or store (or drop) lm_head.weight to match it.",
    ),
    "no-weights": (
        "A folder holds no weight file and no shard index.",
        "Check the path, or download the weights.",
    ),
    "shard-numbering": (
        "Shard names numbered N-of-M disagree on M, miss parts, or have no index.",
        "Download the missing shards, or rewrite the checkpoint with `ckptfix reshard`.",
    ),
    "empty-name": (
        "A tensor has an empty name.",
        "Rename the tensor; many loaders cannot address it.",
    ),
    "unsupported-format": (
        "A file is of a kind ckptfix does not read (TorchScript, a pickle without tensors).",
        "Export the weights as a state dict (torch.save(model.state_dict())) or safetensors.",
    ),
    "nested-checkpoint": (
        "The tensors sit inside a training checkpoint with non-tensor entries.",
        "Extract the weights with `ckptfix convert --key auto`.",
    ),
    "wrapper-prefix": (
        "Every tensor name carries a wrapper prefix such as `module.`.",
        "Remove it with `ckptfix convert --strip-prefix auto`.",
    ),
    "dtype-mix": (
        "Floating-point tensors come in more than one dtype.",
        "Check this is intended; `ckptfix convert --dtype` casts them to one.",
    ),
}


def rule(code: str) -> Rule:
    """The rule of a finding code; an unknown code gets a generic text rather than failing."""
    summary, fix = _TEXTS.get(code, (f"ckptfix finding {code}.", "See the finding's message."))
    return Rule(code, CODES.get(code, Severity.WARNING), summary, fix)


def rules() -> list[Rule]:
    """Every rule, in the order of CODES."""
    return [rule(code) for code in CODES]
