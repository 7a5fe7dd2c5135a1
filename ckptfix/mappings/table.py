"""The shape of a mapping table: rows of data, one table per model family (see the family
modules beside this one). A row names a Megatron tensor (or alternatives, as different layer
specs name it), the Hugging Face tensor(s) it becomes, how (`split`), the target shape in
symbols of the config, and the config flag that decides whether the row exists at all.

Splits: `same` (renamed), `vocab` (the padding rows Megatron-LM adds to the vocabulary cut
off), `qkv` (the query-group-interleaved `linear_qkv` split into q, k and v), `swiglu`
(`linear_fc1` = [gate; up] split in two). Shape symbols: H hidden size, Q heads × head_dim,
KV key-value heads × head_dim, D head_dim, F intermediate size, M expert intermediate size,
E experts, V vocabulary size. `{layer}` and `{expert}` in names run over the config's layers
and experts.
"""

from __future__ import annotations

from dataclasses import dataclass

SPLITS = ("same", "vocab", "qkv", "swiglu")


@dataclass(frozen=True)
class Row:
    megatron: tuple[str, ...]  # alternative names of the source, the first present is used
    hf: tuple[str, ...]  # the target(s)
    split: str = "same"
    shape: tuple[str, ...] = ()  # same/vocab: the target's; swiglu: each half's; qkv: trailing
    when: str | None = None  # a config flag (or `untied`): the row exists only when it is true


@dataclass(frozen=True)
class Table:
    """One family: the Hugging Face model types it covers, the architecture written into a
    generated config.json, the config keys a generated config takes from the training
    arguments, and its rows."""

    model_type: str
    architecture: str
    rows: tuple[Row, ...]
    config_keys: tuple[str, ...]
    moe: bool = False


def row(
    megatron: str | tuple[str, ...],
    hf: str | tuple[str, ...],
    split: str = "same",
    shape: tuple[str, ...] = (),
    when: str | None = None,
) -> Row:
    """A row, with single names given as plain strings."""
    sources = (megatron,) if isinstance(megatron, str) else megatron
    targets = (hf,) if isinstance(hf, str) else hf
    assert split in SPLITS, split
    return Row(sources, targets, split, shape, when)
