"""Makes the packages named in CKPTFIX_TEST_HIDDEN (comma-separated top-level names) look
uninstalled to this interpreter and every process started with this folder on PYTHONPATH:
`import torch` raises ModuleNotFoundError and importlib.util.find_spec("torch") is None, as
when the package is absent. tests/test_optional_deps.py runs the suite this way to prove
that a test needing an optional package skips, naming it, instead of failing."""

from __future__ import annotations

import os
import sys
from collections.abc import Sequence
from importlib.machinery import ModuleSpec
from types import ModuleType
from typing import Any

HIDDEN = frozenset(filter(None, os.environ.get("CKPTFIX_TEST_HIDDEN", "").split(",")))


class _Without:
    """A finder of sys.meta_path that finds nothing of the hidden packages."""

    def __init__(self, finder: Any) -> None:
        self._finder = finder

    def find_spec(
        self, name: str, path: Sequence[str] | None = None, target: ModuleType | None = None
    ) -> ModuleSpec | None:
        if name.partition(".")[0] in HIDDEN:
            return None
        found: ModuleSpec | None = self._finder.find_spec(name, path, target)
        return found

    def __getattr__(self, name: str) -> Any:  # invalidate_caches, find_distributions...
        return getattr(self._finder, name)


if HIDDEN:
    sys.meta_path[:] = [_Without(finder) for finder in sys.meta_path]
