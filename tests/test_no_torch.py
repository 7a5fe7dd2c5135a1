"""inspect of safetensors never imports torch, and numpy only when values are read."""

from __future__ import annotations

import subprocess
import sys

from tests.builders import Factory, Spec

PROBE = """
import sys, ckptfix
report = ckptfix.inspect(sys.argv[1], hash={hash})
assert report.tensor_count == 2, report
print(",".join(sorted(m for m in ("torch", "numpy", "safetensors") if m in sys.modules)))
"""


def _modules_after(path: str, *, hash: bool) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(hash=hash), path],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def test_inspect_imports_neither_torch_nor_numpy(factory: Factory) -> None:
    path = factory.safetensors("m.safetensors", [Spec("a"), Spec("b")])
    assert _modules_after(str(path), hash=False) == ""
    assert _modules_after(str(path), hash=True) == ""


def test_cli_does_not_import_torch(factory: Factory) -> None:
    path = factory.safetensors("m.safetensors", [Spec("a"), Spec("b")])
    code = (
        "import sys; from ckptfix.cli.app import main; sys.argv = ['ckptfix', 'inspect', "
        f"{str(path)!r}, '--json', '--scan-values']\n"
        "try:\n    main()\nexcept SystemExit as exit:\n"
        "    assert exit.code == 0\n    assert 'torch' not in sys.modules\n"
        "    print('ok', file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.stderr.strip() == "ok"
