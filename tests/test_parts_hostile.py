"""`--part I/N` and `--commit` against what a hostile review tried (hostile25): parts of two
checkpoints behind one path, planted links, forged or special records, a shard swapped
after its check, failures and signals in the middle of a commit. Each refused with one line,
nothing the user did not name touched, every part's shards kept for a later commit."""

from __future__ import annotations

import errno
import json
import os
import signal
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tests.builders import Factory, Spec
from tests.helpers import cli, one_error_line, tree_snapshot
from tests.optional import needs

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


@pytest.mark.parametrize("failure", ["disk-full", pytest.param("sigint", marks=pytest.mark.slow)])
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


def _commit_line(source: Path, tmp_path: Path) -> str:
    line = one_error_line("convert", source, "-o", tmp_path / "out", *SHARD, "--commit")
    assert not (tmp_path / "out").exists()
    return line


def test_a_record_of_no_parts_is_refused_and_nothing_removed(tmp_path: Path) -> None:
    source, parts = _three_parts(tmp_path)
    record = json.loads((parts / ".ckptfix-part-1-of-3.json").read_bytes())
    for name in (".ckptfix-part-2-of-3.json", ".ckptfix-part-3-of-3.json"):
        (parts / name).unlink()
    record.update(count=0, part=0, shards=[])
    (parts / ".ckptfix-part-1-of-3.json").write_text(json.dumps(record))
    before = tree_snapshot(parts)
    line = _commit_line(source, tmp_path)
    assert line.startswith(f"error: {parts}/.ckptfix-part-1-of-3.json: is not a part record")
    assert "part 0 of 0" in line and tree_snapshot(parts) == before


@pytest.mark.parametrize(
    "value",
    [
        "1e999",
        *(
            pytest.param(value, marks=pytest.mark.slow)  # make test-fast: one of them
            for value in ["Infinity", "1e400", "[" * 100_000 + "]" * 100_000, "true", "-1"]
        ),
    ],
)
def test_a_malformed_record_value_is_one_line(value: str, tmp_path: Path) -> None:
    source, parts = _three_parts(tmp_path)
    path = parts / ".ckptfix-part-2-of-3.json"
    path.write_text(path.read_text().replace('"part": 2', f'"part": {value}'))
    line = _commit_line(source, tmp_path)
    assert line.startswith(f"error: {path}: is not a part record ckptfix wrote")


def test_a_record_that_is_not_the_part_its_name_says_is_refused(tmp_path: Path) -> None:
    source, parts = _three_parts(tmp_path)
    (parts / ".ckptfix-part-2-of-3.json").rename(parts / ".ckptfix-part-1-of-9.json")
    line = _commit_line(source, tmp_path)
    assert line.startswith(
        f"error: {parts}/.ckptfix-part-1-of-9.json: says it is part 2 of 3, not the part"
    )


@pytest.mark.parametrize(
    "kind",
    ["link", *(pytest.param(k, marks=pytest.mark.slow) for k in ["fifo", "folder", "large"])],
)
def test_a_record_that_is_not_a_small_regular_file_is_refused(kind: str, tmp_path: Path) -> None:
    source, parts = _three_parts(tmp_path)
    path = parts / ".ckptfix-part-2-of-3.json"
    path.unlink()
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "folder":
        path.mkdir()
    elif kind == "link":
        (tmp_path / "passwd").write_text("root:x:0:0")
        path.symlink_to(tmp_path / "passwd")
    else:
        with path.open("wb") as handle:
            handle.truncate(64 * 2**20 + 1)  # sparse: no disk
    line = _commit_line(source, tmp_path)
    assert line.startswith(f"error: {path}: ")
    assert ("larger than a part record" if kind == "large" else "cannot be read") in line


def test_a_stray_record_beside_a_complete_split_is_ignored(tmp_path: Path) -> None:
    source, _ = _three_parts(tmp_path)
    _run("convert", source, "-o", tmp_path / "whole", *SHARD)
    _run("convert", source, "-o", tmp_path / "out", *SHARD, "--part", "1/2")
    _run("convert", source, "-o", tmp_path / "out", *SHARD, "--commit")
    assert tree_snapshot(tmp_path / "out") == tree_snapshot(tmp_path / "whole")


def test_two_incomplete_splits_say_how_to_go_on(tmp_path: Path) -> None:
    source = _model(tmp_path)
    _run("convert", source, "-o", tmp_path / "out", *SHARD, "--part", "1/2")
    _run("convert", source, "-o", tmp_path / "out", *SHARD, "--part", "1/3")
    line = _commit_line(source, tmp_path)
    assert "split 2 and 3 ways are both there, and neither is complete" in line
    _run("convert", source, "-o", tmp_path / "out", *SHARD, "--part", "2/2")
    _run("convert", source, "-o", tmp_path / "out", *SHARD, "--commit")


@pytest.mark.parametrize(
    "value",
    [
        "²/3",
        "١/٣",
        *(
            pytest.param(v, marks=pytest.mark.slow)
            for v in ["1/³", "0/0", "1/100001", " 1/2", "1/2/3"]
        ),
    ],
)
def test_part_takes_ascii_digits_only(value: str, tmp_path: Path) -> None:
    run = cli("convert", _model(tmp_path), "-o", tmp_path / "out", *SHARD, "--part", value)
    assert run.code == 2, run.stderr
    [line] = run.error_lines
    assert line.startswith(f"error: --part: {value!r} is not I/N")
    assert not (tmp_path / ".ckptfix-parts-out").exists()


def test_parts_of_an_out_with_a_long_name(tmp_path: Path) -> None:
    source, out = _model(tmp_path), tmp_path / ("o" * 250)
    _run("convert", source, "-o", tmp_path / "whole", *SHARD)
    for part in (1, 2):
        _run("convert", source, "-o", out, *SHARD, "--part", f"{part}/2")
    [parts] = [p for p in tmp_path.iterdir() if p.name.startswith(".ckptfix-parts-")]
    assert len(parts.name) <= 255
    _run("convert", source, "-o", out, *SHARD, "--commit")
    assert tree_snapshot(out) == tree_snapshot(tmp_path / "whole") and not parts.exists()


def test_a_folder_where_a_shard_of_the_part_goes_is_one_line(tmp_path: Path) -> None:
    source, parts = _three_parts(tmp_path)
    shard = sorted(parts.glob("*.safetensors"))[-1]
    shard.unlink()
    shard.mkdir()
    line = one_error_line("convert", source, "-o", tmp_path / "out", *SHARD, "--part", "3/3")
    assert line.startswith("error: ") and "(rule write-failed;" in line
    assert shard.is_dir()


@pytest.mark.parametrize("read_only", [False, True])
def test_a_part_checks_the_free_space_first(
    read_only: bool, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptfix.platform import system

    source = _model(tmp_path)
    monkeypatch.setattr(type(system()), "disk_space", lambda self, folder: (1000, read_only))
    line = one_error_line("convert", source, "-o", tmp_path / "out", *SHARD, "--part", "1/2")
    what = "cannot write: Read-only file system" if read_only else "not enough free space"
    assert line.startswith(f"error: {tmp_path / 'out'}: {what}")
    assert not (tmp_path / ".ckptfix-parts-out").exists()


def test_a_part_whose_folder_a_commit_removed_meanwhile_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import shutil

    from ckptfix.ops import rewrite_parts

    source, parts = _three_parts(tmp_path)
    ensure = rewrite_parts.ensure_parts_folder

    def committed_meanwhile(folder: str, shown: str) -> None:
        ensure(folder, shown)
        shutil.rmtree(folder)  # as a --commit that published the parts does

    monkeypatch.setattr(rewrite_parts, "ensure_parts_folder", committed_meanwhile)
    line = one_error_line("convert", source, "-o", tmp_path / "out", *SHARD, "--part", "2/3")
    assert "internal error" not in line and "(rule write-failed;" in line
    assert not parts.exists()


_STOPPED_PART = """
import os, signal, sys, time
import ckptfix.write.parts as parts
write = parts.write_shards
def stopped(*args):
    os.kill(os.getpid(), signal.SIG{name})  # as Slurm preempting the job
    time.sleep(0.2)
    return write(*args)
parts.write_shards = stopped
sys.argv = ["ckptfix", *sys.argv[1:]]
from ckptfix.cli.entry import main
main()
"""


@pytest.mark.slow
@pytest.mark.parametrize("name", ["TERM", "INT"])
def test_a_stopped_part_leaves_no_scratch_folder(name: str, tmp_path: Path) -> None:
    import subprocess
    import sys

    source, parts = _three_parts(tmp_path)
    (parts / ".ckptfix-part-2-of-3.json").unlink()
    before = sorted(p.name for p in parts.iterdir())
    args = ["convert", str(source), "-o", str(tmp_path / "out"), *SHARD, "--part", "2/3"]
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parent.parent)}
    done = subprocess.run(
        [sys.executable, "-c", _STOPPED_PART.format(name=name), *args],
        env=env, capture_output=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 128 + getattr(signal, f"SIG{name}"), done.stderr
    assert sorted(p.name for p in parts.iterdir()) == before


@pytest.fixture
def s3(monkeypatch: pytest.MonkeyPatch) -> Iterator[Any]:
    """A client of moto's S3 with bucket `bkt`, ckptfix pointed at it (in this process)."""
    from tests.store_helpers import moto_here

    with moto_here(monkeypatch.setenv) as client:
        yield client


@pytest.mark.slow
@needs("moto")
def test_an_s3_record_of_no_parts_deletes_nothing(s3: Any, tmp_path: Path) -> None:
    from tests.store_helpers import objects

    source = _model(tmp_path)
    for part in (1, 2, 3):
        _run("convert", source, "-o", "s3://bkt/out", *SHARD, "--part", f"{part}/3")
    record = json.loads(
        s3.get_object(Bucket="bkt", Key="out/.ckptfix-part-1-of-3.json")["Body"].read()
    )
    for part in (2, 3):
        s3.delete_object(Bucket="bkt", Key=f"out/.ckptfix-part-{part}-of-3.json")
    record.update(count=0, part=0, shards=[])
    s3.put_object(Bucket="bkt", Key="out/.ckptfix-part-1-of-3.json", Body=json.dumps(record))
    before = objects(s3, "bkt", "out")
    line = one_error_line("convert", source, "-o", "s3://bkt/out", *SHARD, "--commit")
    assert line.startswith("error: s3://bkt/out/.ckptfix-part-1-of-3.json: is not a part record")
    assert objects(s3, "bkt", "out") == before


@pytest.mark.slow
@needs("moto")
def test_parts_of_two_s3_sources_behind_one_url_are_refused(s3: Any, tmp_path: Path) -> None:
    first, second = _model(tmp_path / "a"), _model(tmp_path / "b")
    shard = second / "model-00002-of-00002.safetensors"
    data = bytearray(shard.read_bytes())
    data[-1] ^= 1  # other values: another ETag
    shard.write_bytes(bytes(data))
    out = tmp_path / "out"
    _run("reshard", first, "-o", "s3://bkt/src")
    _run("convert", "s3://bkt/src", "-o", out, *SHARD, "--part", "1/2")
    _run("reshard", second, "-o", "s3://bkt/src", "--force")
    _run("convert", "s3://bkt/src", "-o", out, *SHARD, "--part", "2/2")
    line = one_error_line("convert", "s3://bkt/src", "-o", out, *SHARD, "--commit")
    assert "part 1 of 2 was written for another plan" in line and not out.exists()


def test_a_shard_another_commit_took_meanwhile_is_one_line(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptfix.ops import rewrite_parts

    source, parts = _three_parts(tmp_path)
    shard = sorted(parts.glob("*.safetensors"))[-1]
    before = tree_snapshot(parts)
    publish = rewrite_parts._publish_local

    def taken_first(*args: Any) -> Any:  # by another --commit of the same parts
        shard.rename(tmp_path / shard.name)
        return publish(*args)

    monkeypatch.setattr(rewrite_parts, "_publish_local", taken_first)
    line = _commit_line(source, tmp_path)
    assert line.startswith(f"error: {parts}: a shard left the folder of parts while --commit")
    (tmp_path / shard.name).rename(shard)
    assert tree_snapshot(parts) == before
