"""Every operating-system primitive ckptfix uses, behind one object: `system()`.

The rest of ckptfix never asks which system it runs on; it asks `system()` to read at an
offset, open a file without following a link, work in a folder by the names of its entries,
lock an output folder, swap two folders, copy or clone bytes, and which signals stop a
command. Each implementation keeps the same promises (nothing the user did not name is
touched, atomic swaps, no link followed out of a folder, bounded memory) with the tools its
system has, and says where they are weaker:

| implementation | module | for |
|---|---|---|
| `Platform` | `portable` | what every system's Python offers; the base of the others |
| `Posix` | `posix` | pread, O_NOFOLLOW and the `*at` calls, flock, SEEK_DATA |
| `Linux` | `linux` | renameat2, copy_file_range, sendfile, FICLONE(RANGE), FIEMAP |
| `Darwin` | `darwin` | renamex_np, fclonefileat, fcopyfile, F_FULLFSYNC |
| `Windows` | `windows` | ReadFile/WriteFile at an offset, CreateFileW, LockFileEx, ReFS clones, `\\\\?\\` paths, Ctrl-Break |

The choice is made once, from `sys.platform`, here and nowhere else: no environment variable,
option or file changes it. The tests' portable mode (tests/conftest.py, `--platform
portable`) replaces it through `_use_for_tests`, which no module of ckptfix calls
(tests/test_platform.py checks that).
"""

from __future__ import annotations

import os
import sys

from ckptfix.platform.portable import Platform


def _choose(name: str) -> Platform:
    if name.startswith("linux"):
        from ckptfix.platform.linux import Linux

        return Linux()
    if name == "darwin":
        from ckptfix.platform.darwin import Darwin

        return Darwin()
    if name == "win32":
        from ckptfix.platform.windows import Windows

        return Windows()
    if os.name == "posix":  # the BSDs, Cygwin: POSIX without Linux's or macOS's extras
        from ckptfix.platform.posix import Posix

        return Posix()
    return Platform()


_chosen = _choose(sys.platform)


def system() -> Platform:
    """The operating system's primitives (see the module's docstring)."""
    return _chosen


def _use_for_tests(name: str) -> Platform:
    """Run on another implementation from now on: "portable" (the portable fallbacks, on
    the system the tests run on) or the system's own ("native"). For the test harness only."""
    global _chosen
    _chosen = Platform() if name == "portable" else _choose(sys.platform)
    return _chosen
