"""`convert --dtype` and config.json: transformers builds the model in the dtype config.json
names (`torch_dtype` before 5.0, `dtype` since), so a cast that left it at "float32" would be
loaded back as float32. The value is replaced where it stands and every other byte is kept:
key order, spacing, comments a tool may rely on byte for byte, nested configs.

The JSON is walked token by token (strings and structure), never re-serialised."""

from __future__ import annotations

import json
import re
from collections.abc import Iterator
from dataclasses import dataclass

DTYPE_KEYS = ("torch_dtype", "dtype")
# What transformers writes for a floating dtype; "auto" and anything else are left alone.
FLOAT_NAMES = ("float16", "bfloat16", "float32", "float64")
# torch's names for the cast targets (`convert --dtype`).
TARGET_NAMES = {"BF16": "bfloat16", "F16": "float16", "F32": "float32"}

# In JSON a quote only ever opens or closes a string, so these tokens, found left to right,
# are exactly its strings and punctuation (numbers, true, false and null are skipped).
_TOKEN = re.compile(r'"(?:[^"\\]|\\.)*"|[{}\[\]:,]', re.DOTALL)


@dataclass(frozen=True)
class ConfigEdit:
    """One value replaced in a config file: `key` is its path ("text_config.dtype")."""

    file: str
    key: str
    old: str
    new: str

    def to_dict(self) -> dict[str, str]:
        return {"file": self.file, "key": self.key, "old": self.old, "new": self.new}


@dataclass
class _Scope:
    is_object: bool
    key: str | None = None
    expects_key: bool = True


def _dtype_values(text: str) -> Iterator[tuple[re.Match[str], str]]:
    """(string token, key path) for each string value under a dtype key, at any depth."""
    stack: list[_Scope] = []
    for token in _TOKEN.finditer(text):
        piece = token.group()
        scope = stack[-1] if stack else None
        if piece in "{[":
            stack.append(_Scope(piece == "{"))
        elif piece in "}]":
            stack.pop()
        elif piece == ",":
            if scope is not None:
                scope.expects_key, scope.key = scope.is_object, None
        elif piece == ":":
            if scope is not None:
                scope.expects_key = False
        elif scope is not None and scope.is_object and scope.expects_key:
            scope.key = json.loads(piece)
        elif scope is not None and scope.is_object and scope.key in DTYPE_KEYS:
            yield token, ".".join(str(s.key) for s in stack if s.is_object)


def retype(text: str, target: str, file: str = "config.json") -> tuple[str, tuple[ConfigEdit, ...]]:
    """`text` with every floating dtype value under a dtype key set to `target` (a torch
    name such as "bfloat16"), and what was changed. `text` must be valid JSON."""
    json.loads(text)  # the token walk is exact only for valid JSON
    edits, pieces, start = [], [], 0
    for token, key in _dtype_values(text):
        old = json.loads(token.group())
        if old not in FLOAT_NAMES or old == target:
            continue
        edits.append(ConfigEdit(file, key, old, target))
        pieces += [text[start : token.start()], json.dumps(target)]
        start = token.end()
    return "".join(pieces) + text[start:], tuple(edits)
