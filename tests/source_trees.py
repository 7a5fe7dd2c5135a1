"""Python sources parsed once per process: the tests of the code's shape (test_code_shape,
test_codes, test_optional_deps) each walk every module of the package or of the suite, and
parsing them is most of what that costs."""

from __future__ import annotations

import ast
from functools import cache


@cache
def parsed(source: str) -> ast.Module:
    """The syntax tree of `source` (shared: never change it)."""
    return ast.parse(source)
