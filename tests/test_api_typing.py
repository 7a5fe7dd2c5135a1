"""The typed surface: a user's script type-checks under `mypy --strict` against ckptfix's
own annotations (py.typed, shipped in the wheel), and a wrong call is an error there."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

pytestmark = pytest.mark.slow

USER = """
from __future__ import annotations

from typing import Any

import numpy as np
import numpy.typing as npt
import torch

import ckptfix


def roundtrip(path: str, out: str) -> int:
    tensors: dict[str, torch.Tensor] = {"w": torch.zeros(2, 3)}
    saved: ckptfix.SaveResult = ckptfix.save(
        tensors, out, max_shard="5GB", metadata={"a": "b"}, shared="clone", config={"x": 1}
    )
    sizes: dict[str, int] = saved.files
    aliases: dict[str, str] = saved.aliases
    with ckptfix.open(path, key=None, zero_weights="module") as reader:
        names: list[str] = reader.keys()
        metadata: dict[str, str] = reader.metadata
        spec: ckptfix.TensorSpec = reader.info(names[0])
        shape: tuple[int, ...] = spec.shape
        array: npt.NDArray[Any] = reader.get("w")
        tensor: torch.Tensor = reader.get("w", framework="pt")
        for name, each in reader.iter(framework="pt"):
            each.add_(1)
        for name, values in reader.iter(["w"]):
            values.sum()
    with ckptfix.Writer(out, max_shard=10**9, metadata={"merged": "yes"}) as writer:
        writer.add("w", np.zeros(3))
        writer.add("t", tensor)
    written: ckptfix.SaveResult = writer.close()
    ckptfix.convert(path, out, ckptfix.ConvertOptions(to="torch", dtype="bf16", max_shard="2GB"))
    report: ckptfix.Report = ckptfix.inspect(path, max_shard="5GB")
    try:
        ckptfix.reshard(path, out, ckptfix.ReshardOptions(max_shard=10))
    except FileNotFoundError as missing:
        print(missing.filename)
    except ckptfix.CkptfixError as error:
        code: str | None = error.code
        rule: str = error.label
    return len(sizes) + len(aliases) + len(metadata) + len(shape) + array.size + written.nbytes
"""

WRONG = """
import ckptfix


def wrong(path: str) -> int:
    ckptfix.save({}, path, shared="share")
    with ckptfix.open(path) as reader:
        count: int = reader.get("w", framework="pt")
    ckptfix.convert(path, path, ckptfix.ConvertOptions(dtype="bf17"))
    return count
"""


def test_a_users_script_type_checks_and_a_wrong_one_does_not(tmp_path: Path) -> None:
    pytest.importorskip("mypy", reason="mypy (the dev extra) is not installed")
    (tmp_path / "user.py").write_text(USER)
    (tmp_path / "wrong.py").write_text(WRONG)
    done = subprocess.run(
        [
            *(sys.executable, "-m", "mypy", "--strict", "--cache-dir", str(tmp_path / "cache")),
            *("user.py", "wrong.py"),
        ],
        cwd=tmp_path,  # no configuration of this repository applies
        env={**os.environ, "PYTHONPATH": str(ROOT)},  # found as an installed package is
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    errors = [line for line in done.stdout.splitlines() if ": error:" in line]
    assert errors == [
        'wrong.py:6: error: Argument "shared" to "save" has incompatible type '
        "\"Literal['share']\"; expected \"Literal['dedupe', 'clone']\"  [arg-type]",
        'wrong.py:8: error: Incompatible types in assignment (expression has type "Tensor", '
        'variable has type "int")  [assignment]',
        'wrong.py:9: error: Argument "dtype" to "ConvertOptions" has incompatible type '
        "\"Literal['bf17']\"; expected \"Literal['keep', 'bf16', 'fp16', 'fp32']\"  [arg-type]",
    ], done.stdout


def test_the_wheel_ships_py_typed(tmp_path: Path) -> None:
    source = tmp_path / "source"
    source.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(ROOT / name, source / name)
    shutil.copytree(
        ROOT / "ckptfix", source / "ckptfix", ignore=shutil.ignore_patterns("__pycache__")
    )
    done = subprocess.run(
        [
            *(sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation"),
            *("--quiet", "-w", str(tmp_path / "wheel"), str(source)),
        ],
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    assert done.returncode == 0, done.stderr
    [wheel] = (tmp_path / "wheel").glob("ckptfix-*.whl")
    with zipfile.ZipFile(wheel) as archive:
        assert "ckptfix/py.typed" in archive.namelist()
