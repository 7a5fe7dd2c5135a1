"""inspect of safetensors never imports torch, and numpy only when values are read; and
collecting the test suite does not import torch either."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from tests.builders import Factory, Spec

PROBE = """
import sys, ckptfix
report = ckptfix.inspect(sys.argv[1], hash_values={hashed})
assert report.tensor_count == 2, report
print(",".join(sorted(m for m in ("torch", "numpy", "safetensors") if m in sys.modules)))
"""


def _modules_after(path: str, *, hashed: bool) -> str:
    done = subprocess.run(
        [sys.executable, "-c", PROBE.format(hashed=hashed), path],
        capture_output=True,
        text=True,
        check=True,
    )
    return done.stdout.strip()


def test_inspect_imports_neither_torch_nor_numpy(factory: Factory) -> None:
    path = factory.safetensors("m.safetensors", [Spec("a"), Spec("b")])
    assert _modules_after(str(path), hashed=False) == ""
    assert _modules_after(str(path), hashed=True) == ""


@pytest.mark.slow
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


@pytest.mark.slow
def test_inspect_does_not_import_the_writers(factory: Factory) -> None:
    """`ckptfix inspect` loads only what reading needs: no writer, planner or staging code."""
    path = factory.safetensors("m.safetensors", [Spec("a"), Spec("b")])
    code = (
        "import sys; from ckptfix.cli.entry import main; sys.argv = ['ckptfix', 'inspect', "
        f"{str(path)!r}]\n"
        "try:\n    main()\nexcept SystemExit:\n"
        "    loaded = sorted(m for m in sys.modules if m.startswith(('ckptfix.write', "
        "'ckptfix.plan', 'ckptfix.ops.rewrite', 'ckptfix.ops.source')))\n"
        "    print(loaded, file=sys.stderr)"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert done.stderr.strip().splitlines()[-1] == "[]"


# Collects with pytest in a fresh process and reports, once collection is over, how many
# tests it found and whether anything imported torch on the way.
_COLLECT_PROBE = """
import sys
import pytest

class Probe:
    def pytest_collection_finish(self, session):
        print("PROBE", len(session.items), "torch" in sys.modules)

sys.exit(pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", *sys.argv[1:]], [Probe()]))
"""
ROOT = Path(__file__).resolve().parent.parent


def _collect(where: Path, *args: str, plugins: bool = True) -> tuple[int, bool]:
    """(tests collected, torch imported) for `pytest --collect-only *args` run in `where`;
    without `plugins`, installed pytest plugins are not loaded (a faster start)."""
    env = {**os.environ}
    if not plugins:
        env["PYTEST_DISABLE_PLUGIN_AUTOLOAD"] = "1"
    done = subprocess.run(
        [sys.executable, "-c", _COLLECT_PROBE, *args],
        cwd=where,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stdout + done.stderr
    probe = [line.split() for line in done.stdout.splitlines() if line.startswith("PROBE ")]
    assert len(probe) == 1, done.stdout
    return int(probe[0][1]), probe[0][2] == "True"


@pytest.mark.slow  # collects all of the suite in a fresh process: over a second
def test_collecting_the_suite_does_not_import_torch() -> None:
    """torch belongs in the tests and fixtures that use it: imported at module level it
    costs every run seconds, and tests that prove ckptfix works without torch would pass
    with torch already loaded."""
    count, torch_imported = _collect(ROOT, "tests")
    assert count >= 900  # the whole suite was collected
    assert not torch_imported


@pytest.mark.slow  # two pytest runs in fresh processes: over a second
def test_the_collection_probe_sees_a_torch_import(tmp_path: Path) -> None:
    """The check above can fail: a test module importing torch at its top is caught. (A
    stand-in module named torch, found first on the path, and no plugins keep this fast.)"""
    args = ("-c", os.devnull, "--rootdir", str(tmp_path))
    (tmp_path / "test_plain.py").write_text("def test_plain() -> None:\n    assert True\n")
    assert _collect(tmp_path, *args, plugins=False) == (1, False)
    (tmp_path / "torch.py").write_text("def ones(n: int) -> list[int]:\n    return [1] * n\n")
    (tmp_path / "test_top_level_torch.py").write_text(
        "import torch\n\n\ndef test_uses_torch() -> None:\n    assert torch.ones(1) == [1]\n"
    )
    assert _collect(tmp_path, *args, plugins=False) == (2, True)
