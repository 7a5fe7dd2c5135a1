"""The tests' portable mode in the fresh processes they start (tests/conftest.py puts this
folder first on PYTHONPATH and sets CKPTFIX_TEST_PLATFORM only in that mode): once
`ckptfix.platform` is imported, `_use_for_tests("portable")` replaces its choice. Nothing is
imported here but what the interpreter's start-up has already loaded, and ckptfix is not
imported early: a finder waits for it. ckptfix itself never reads the variable.
"""

import os
import sys

if os.environ.get("CKPTFIX_TEST_PLATFORM") == "portable":

    class _SwitchOnImport:
        """A meta path finder that lets the others find `ckptfix.platform`, then switches it
        once it has run."""

        @classmethod
        def find_spec(cls, name, path, target=None):  # type: ignore[no-untyped-def]
            if name != "ckptfix.platform":
                return None
            for finder in sys.meta_path:
                if finder is cls or not hasattr(finder, "find_spec"):
                    continue
                spec = finder.find_spec(name, path, target)
                if spec is not None and spec.loader is not None:
                    run = spec.loader.exec_module

                    def exec_module(module, run=run):  # type: ignore[no-untyped-def]
                        run(module)
                        module._use_for_tests("portable")

                    spec.loader.exec_module = exec_module  # type: ignore[method-assign]
                    return spec
            return None

    sys.meta_path.insert(0, _SwitchOnImport)
