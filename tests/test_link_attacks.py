"""The link-attack corpus (tests/link_attacks.py) against every write command: a repaired or
rewritten output, or one error line; in either case nothing outside what the command may
change is changed (-o: only OUT; --in-place: only the model folder), the secret a link
points to is never copied into a regular file, and no staging folder is left behind."""

from __future__ import annotations

import os
import stat
from pathlib import Path

import pytest

from tests.builders import Factory
from tests.helpers import cli
from tests.link_attacks import LINK_ATTACKS, SECRET, LinkAttack

COMMANDS = {
    "fix -o": ["fix", "{m}", "-o", "{out}"],
    "fix --in-place": ["fix", "{m}", "--in-place"],
    "reshard -o": ["reshard", "{m}", "-o", "{out}"],
    "reshard --in-place": ["reshard", "{m}", "--in-place"],
    "convert --dtype -o": ["convert", "{m}", "-o", "{out}", "--dtype", "bf16"],
    "dedupe -o": ["dedupe", "{m}", "-o", "{out}"],
}


def _entries(root: Path, skip: Path) -> dict[str, tuple[int, int, bytes]]:
    """Every entry under root but `skip`, links not followed: type and mode, inode, bytes."""
    found = {}
    for folder, subfolders, files in os.walk(root):
        subfolders[:] = [name for name in subfolders if Path(folder) / name != skip]
        for name in [*subfolders, *files]:
            path = Path(folder) / name
            info = path.lstat()
            if stat.S_ISLNK(info.st_mode):
                content = os.readlink(path).encode()
            else:
                content = path.read_bytes() if stat.S_ISREG(info.st_mode) else b""
            found[str(path.relative_to(root))] = (info.st_mode, info.st_ino, content)
    return found


def _holding_the_secret(root: Path) -> list[str]:
    return [
        str(Path(folder) / name)
        for folder, _, files in os.walk(root)
        for name in files
        if not (Path(folder) / name).is_symlink() and SECRET in (Path(folder) / name).read_bytes()
    ]


@pytest.mark.parametrize("command", sorted(COMMANDS))
@pytest.mark.parametrize("attack", LINK_ATTACKS, ids=lambda attack: attack.id)
def test_no_link_reaches_outside(factory: Factory, attack: LinkAttack, command: str) -> None:
    model = attack.build(factory)
    out = factory.root / "out"
    written = model if "--in-place" in command else out
    before = _entries(factory.root, skip=written)
    args = [part.format(m=model, out=out) for part in COMMANDS[command]]
    run = cli(*args)
    assert run.code in (0, 1, 2), run.stderr
    assert "Traceback" not in run.stderr and "internal error" not in run.stderr
    if run.code:
        assert len(run.error_lines) == 1, run.stderr
    assert _entries(factory.root, skip=written) == before
    if written.exists():
        assert _holding_the_secret(written) == []
    assert not list(factory.root.glob(".ckptfix-*"))
