"""Fixtures: a Factory writing into tmp_path, tmpfs mounts. The builders themselves live in
tests/builders.py and the CLI runner and readers in tests/helpers.py."""

from __future__ import annotations

import os
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from tests.builders import Factory
from tests.loop_mounts import loop_mount


@pytest.fixture
def factory(tmp_path: Path) -> Factory:
    return Factory(tmp_path)


@pytest.fixture
def mount(tmp_path: Path) -> Iterator[Callable[[str], Path]]:
    """Mount a tmpfs with the given options (read-only, tiny) under tmp_path; skips where
    mounting is not allowed."""
    mounted: list[Path] = []

    def make(options: str) -> Path:
        point = tmp_path / f"mnt{len(mounted)}"
        point.mkdir()
        done = subprocess.run(
            ["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(point)],
            capture_output=True,
            check=False,
        )
        if done.returncode != 0:
            pytest.skip(f"cannot mount a tmpfs here: {done.stderr.decode().strip()}")
        mounted.append(point)
        return point

    yield make
    for point in mounted:
        subprocess.run(["umount", str(point)], check=False)


@pytest.fixture(scope="module", params=["xfs", "btrfs"])
def filesystem(
    request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[Path]:
    """A fresh filesystem with reflinks, XFS then btrfs, loop-mounted for a test module
    (tests/loop_mounts.py; skips where this machine cannot)."""
    with loop_mount(request.param, tmp_path_factory.mktemp(request.param)) as point:
        yield point


os.environ.setdefault("NO_COLOR", "1")
# The machine is offline but for package registries: no test may reach the Hub (a lookup
# would only time out). Set before anything imports huggingface_hub, which reads it once.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
