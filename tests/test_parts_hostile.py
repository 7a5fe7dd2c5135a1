"""`--part I/N` and `--commit` against what a hostile review tried (hostile25): parts of two
checkpoints behind one path, planted links, forged or special records, a shard swapped
after its check, failures and signals in the middle of a commit. Each refused with one line,
nothing the user did not name touched, every part's shards kept for a later commit."""

from __future__ import annotations

import errno
import os
import signal
from pathlib import Path
from typing import Any

import pytest

from tests.builders import Factory, Spec
from tests.helpers import cli, one_error_line, tree_snapshot

SHARD = ("--max-shard", "20KB")


def _model(root: Path, name: str = "m") -> Path:
    specs = [Spec(f"t.{i}", "F32", (32, 32 * (1 + i % 4))) for i in range(12)]
    return Factory(root).sharded(name, [specs[:6], specs[6:]])


def _run(*args: object) -> None:
    done = cli(*map(str, args))
    assert done.code == 0, done.stderr


def test_parts_of_two_checkpoints_behind_one_path_are_refused(tmp_path: Path) -> None:
    first, second = _model(tmp_path / "a"), _model(tmp_path / "b")
    latest, out = tmp_path / "latest", tmp_path / "out"
    latest.symlink_to(first)
    _run("convert", latest, "-o", out, *SHARD, "--part", "1/2")
    latest.unlink()
    latest.symlink_to(second)
    _run("convert", latest, "-o", out, *SHARD, "--part", "2/2")
    parts = tmp_path / ".ckptfix-parts-out"
    before = tree_snapshot(parts)
    line = one_error_line("convert", latest, "-o", out, *SHARD, "--commit")
    assert line.startswith(
        f"error: {parts}/.ckptfix-part-1-of-2.json: part 1 of 2 was written for another plan"
    )
    assert not out.exists() and tree_snapshot(parts) == before


def test_one_file_spelled_two_ways_is_one_plan(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    source = _model(tmp_path)
    _run("convert", source, "-o", tmp_path / "whole", *SHARD)
    _run("convert", source, "-o", tmp_path / "out", *SHARD, "--part", "1/2")
    monkeypatch.chdir(tmp_path)
    _run("convert", "m", "-o", "out", *SHARD, "--part", "2/2")
    monkeypatch.chdir(source)
    _run("convert", ".", "-o", tmp_path / "out", *SHARD, "--commit")
    assert tree_snapshot(tmp_path / "out") == tree_snapshot(tmp_path / "whole")


def test_a_link_planted_where_the_record_is_written_is_not_followed(tmp_path: Path) -> None:
    source = _model(tmp_path)
    _run("convert", source, "-o", tmp_path / "out", *SHARD, "--part", "1/2")
    victim = tmp_path / "victim.txt"
    victim.write_text("the user's")
    parts = tmp_path / ".ckptfix-parts-out"
    # the names an earlier version wrote the record to first (this process's id: cli runs here)
    for name in (".ckptfix-part-2-of-2.json", ".ckptfix-part-1-of-2.json"):
        (parts / f"{name}.{os.getpid()}.tmp").symlink_to(victim)
    _run("convert", source, "-o", tmp_path / "out", *SHARD, "--part", "2/2")
    assert victim.read_text() == "the user's"
    assert not [p for p in parts.iterdir() if p.name.endswith(".tmp") and not p.is_symlink()]


def _three_parts(tmp_path: Path) -> tuple[Path, Path]:
    source = _model(tmp_path)
    for part in (1, 2, 3):
        _run("convert", source, "-o", tmp_path / "out", *SHARD, "--part", f"{part}/3")
    return source, tmp_path / ".ckptfix-parts-out"


def test_a_shard_swapped_after_the_records_are_checked_is_refused(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptfix.ops import rewrite_parts

    source, parts = _three_parts(tmp_path)
    shard = sorted(parts.glob("*.safetensors"))[1]
    publish = rewrite_parts._publish_local

    def swapped_first(*args: Any) -> Any:  # another writer, in the window before the swap
        data = bytearray(shard.read_bytes())
        data[-1] ^= 1
        scratch = parts / "swap.tmp"
        scratch.write_bytes(bytes(data))
        os.replace(scratch, shard)
        return publish(*args)

    monkeypatch.setattr(rewrite_parts, "_publish_local", swapped_first)
    line = one_error_line("convert", source, "-o", tmp_path / "out", *SHARD, "--commit")
    assert line.startswith(f"error: {shard}: is missing or changed since its part wrote it")
    assert not (tmp_path / "out").exists()
    assert shard.exists()  # put back, where its part's re-run replaces it


@pytest.mark.parametrize("failure", ["disk-full", "sigint"])
def test_a_commit_stopped_after_the_moves_puts_every_shard_back(
    failure: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptfix.ops import rewrite_parts

    source, parts = _three_parts(tmp_path)
    before = tree_snapshot(parts)
    index = rewrite_parts._with_index

    def stopped(*args: Any) -> Any:
        if failure == "sigint":
            os.kill(os.getpid(), signal.SIGINT)
        else:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return index(*args)

    monkeypatch.setattr(rewrite_parts, "_with_index", stopped)
    run = cli("convert", source, "-o", tmp_path / "out", *SHARD, "--commit")
    assert run.code == (130 if failure == "sigint" else 1), run.stderr
    [line] = run.error_lines
    assert "internal error" not in line and "Traceback" not in run.stderr
    assert tree_snapshot(parts) == before and not (tmp_path / "out").exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".ckptfix-")] == [parts.name]
    monkeypatch.setattr(rewrite_parts, "_with_index", index)
    _run("convert", source, "-o", tmp_path / "out", *SHARD, "--commit")
    assert not parts.exists() and (tmp_path / "out" / "model.safetensors.index.json").exists()
