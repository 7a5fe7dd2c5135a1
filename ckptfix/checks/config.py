"""Findings from config.json compared with the stored tensors."""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from operator import attrgetter, methodcaller
from typing import Any

from ckptfix.checks import values
from ckptfix.checks.tie_defaults import UNTIED_BY_DEFAULT
from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.findings import Finding, finding
from ckptfix.core.tensor import TensorInfo

_EMBEDDING_SUFFIXES = (
    "embed_tokens.weight",
    "wte.weight",
    "word_embeddings.weight",
    "embed_in.weight",
    "tok_embeddings.weight",
    "shared.weight",
)
_HEAD_NAMES = ("lm_head.weight", "embed_out.weight")


def _tie_setting(config: Mapping[str, Any]) -> tuple[bool, bool, str]:
    """(tie, explicit, model type) as transformers reads it: a composite model (Llava) ties
    by its text config, and a key left unset takes its config class's default, which is
    False for llama, mistral, qwen2 and many more, True otherwise."""
    text = config.get("text_config")
    scope = text if isinstance(text, Mapping) else config
    model_type = str(scope.get("model_type") or config.get("model_type") or "")
    if "tie_word_embeddings" in scope:
        return bool(scope["tie_word_embeddings"]), True, model_type
    return model_type not in UNTIED_BY_DEFAULT, False, model_type


def declared_ties(config: Mapping[str, Any], names: Sequence[str]) -> dict[str, str]:
    """{head: embedding} when config.json ties them (explicitly or by its model type's
    default) and both are stored: transformers fills the head from the embedding."""
    return tie_decision(config, names)[0]


def tie_decision(
    config: Mapping[str, Any], names: Sequence[str]
) -> tuple[dict[str, str], frozenset[str]]:
    """What transformers makes of a head and an embedding both named: ({head: embedding})
    when config.json ties them (the head need not be stored), or the head alone when it
    does not (the head is read on its own, and must be stored)."""
    embedding = min((n for n in names if n.endswith(_EMBEDDING_SUFFIXES)), default=None)
    head = min((n for n in names if n.endswith(_HEAD_NAMES)), default=None)
    if embedding is None or head is None:
        return {}, frozenset()
    if _tie_setting(config)[0]:
        return {head: embedding}, frozenset()
    return {}, frozenset({head})


# The architectures whose head transformers names `lm_head.weight` (GPT-NeoX: embed_out).
_HEADED = ("ForCausalLM", "LMHeadModel", "ForConditionalGeneration")


def implied_head(config: Mapping[str, Any], names: Sequence[str]) -> dict[str, str]:
    """{head: embedding} for a head that is not stored because config.json ties it to the
    stored embedding (what transformers' save_pretrained leaves out): the head a loader
    fills from the embedding. Only for a language model's head (config.json's
    `architectures`), under the name transformers gives it."""
    embedding = min((n for n in names if n.endswith(_EMBEDDING_SUFFIXES)), default=None)
    architectures = config.get("architectures")
    if (
        embedding is None
        or any(n.endswith(_HEAD_NAMES) for n in names)
        or not isinstance(architectures, list)
        or not any(isinstance(a, str) and a.endswith(_HEADED) for a in architectures)
        or not _tie_setting(config)[0]
    ):
        return {}
    head = "embed_out.weight" if embedding.endswith("embed_in.weight") else "lm_head.weight"
    return {head: embedding}


def tied_config_findings(
    config: Mapping[str, Any],
    config_path: str,
    tensors: Sequence[TensorInfo],
    same_bytes: Callable[[str, str], bool | None],
) -> list[Finding]:
    """Compare `tie_word_embeddings` with the stored names.

    `same_bytes(a, b)` says whether two tensors hold equal bytes, or None when not compared.
    """
    names = list(map(attrgetter("name"), tensors))
    embedding = min(filter(methodcaller("endswith", _EMBEDDING_SUFFIXES), names), default=None)
    if embedding is None:
        return []
    head = min(filter(methodcaller("endswith", _HEAD_NAMES), names), default=None)
    tie, explicit, model_type = _tie_setting(config)
    said = (
        "sets tie_word_embeddings=" + ("true" if tie else "false")
        if explicit
        else f"leaves tie_word_embeddings unset (transformers defaults to {str(tie).lower()} "
        f"for model_type {model_type or 'unset'})"
    )
    if not tie and head is None:
        return [
            finding(
                "tied-config-mismatch",
                f"config.json {said} but no output head (lm_head.weight) is "
                f"stored, only {embedding!r}; the head would be randomly initialised (set it to true, "
                "or store the head)",
                file=config_path,
                tensors=[embedding],
            )
        ]
    if tie and head is not None:
        compared = same_bytes(embedding, head)
        if compared is True:
            return []
        differs = (
            "holds different bytes"
            if compared is False
            else "may differ (run with --hash to compare)"
        )
        return [
            finding(
                "tied-config-mismatch",
                f"config.json {said}, but {head!r} is stored separately from {embedding!r} and "
                f"{differs}; transformers will overwrite it with the embedding (set "
                "tie_word_embeddings=false to keep it)",
                file=config_path,
                tensors=[embedding, head],
            )
        ]
    return []


def config_findings(checkpoint: Checkpoint, *, hashed: bool) -> list[Finding]:
    """`tie_word_embeddings` against the stored names (and, with --hash, their bytes)."""
    assert checkpoint.config is not None and checkpoint.config.config is not None
    tensors = checkpoint.model_tensors

    def same_bytes(first: str, second: str) -> bool | None:
        # Asked at most once: two scans, not a dict of every name (the last of a name wins,
        # as in a loader's state dict).
        a = next(tensor for tensor in reversed(tensors) if tensor.name == first)
        b = next(tensor for tensor in reversed(tensors) if tensor.name == second)
        if a.storage is not None and (a.file, a.storage, a.byte_range, a.strides) == (
            b.file,
            b.storage,
            b.byte_range,
            b.strides,
        ):
            return True  # aliases of one storage: tied in the file itself
        if not hashed:
            return None
        if (a.dtype, a.shape) != (b.dtype, b.shape):
            return False
        source = checkpoint.source
        return values.digest(source, a) == values.digest(source, b)

    config = checkpoint.config
    return tied_config_findings(config.config or {}, config.label, tensors, same_bytes)
