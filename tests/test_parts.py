"""`--part I/N` and `--commit` (ops.rewrite_parts, write.parts) in this process, on local
folders: slices of a plan written by parts in any order, published by the commit exactly as
one run writes; a missing, stale, changed or forged part refused with one line and nothing
published; the options that cannot be split refused as usage errors."""

from __future__ import annotations

import itertools
import json
import os
from pathlib import Path

import pytest

from ckptfix.write.parts import part_of_sizes
from tests.builders import Factory, Spec
from tests.helpers import cli, one_error_line, tree_snapshot

SHARD = ("--max-shard", "20KB")


def _model(root: Path) -> Path:
    """Tensors of 4-16 KiB, rewritten into shards of 20 KB: several shards a part."""
    specs = [Spec(f"t.{i}", "F32", (32, 32 * (1 + i % 4))) for i in range(12)]
    return Factory(root).sharded("m", [specs[:6], specs[6:]])


def _run(*args: object) -> None:
    done = cli(*map(str, args))
    assert done.code == 0, done.stderr


@pytest.mark.parametrize("count", [1, 2, 3, 7, 12, 20])
def test_every_shard_is_in_exactly_one_part(count: int) -> None:
    sizes = [5, 100, 1, 1, 50, 7, 300, 2, 2, 2, 40, 9]
    parts = [part_of_sizes(sizes, part, count) for part in range(1, count + 1)]
    assert sorted(itertools.chain.from_iterable(parts)) == list(range(len(sizes)))
    for chosen in filter(None, parts):  # consecutive shards
        assert chosen == list(range(chosen[0], chosen[0] + len(chosen)))
    # about equal bytes: a part holds its share, and at most one shard's bytes more
    assert max(sum(sizes[i] for i in chosen) for chosen in parts) <= sum(sizes) / count + 300


def test_parts_then_commit_is_the_one_run_output(tmp_path: Path) -> None:
    source = _model(tmp_path)
    _run("convert", source, "-o", tmp_path / "whole", *SHARD)
    for part in (2, 3, 1, 2):
        _run("convert", source, "-o", tmp_path / "out", *SHARD, "--part", f"{part}/3")
    assert not (tmp_path / "out").exists()
    parts = tmp_path / ".ckptfix-parts-out"
    record = json.loads((parts / ".ckptfix-part-2-of-3.json").read_bytes())
    assert record["part"] == 2 and record["count"] == 3 and record["shards"]
    assert all(shard["checksum"][0] == "sha256" for shard in record["shards"])
    _run("convert", source, "-o", tmp_path / "out", *SHARD, "--commit")
    assert tree_snapshot(tmp_path / "out") == tree_snapshot(tmp_path / "whole")
    assert len(list((tmp_path / "whole").iterdir())) >= 5 and not parts.exists()


def _three_parts(tmp_path: Path) -> tuple[Path, Path]:
    source = _model(tmp_path)
    for part in (1, 2, 3):
        _run("convert", source, "-o", tmp_path / "out", *SHARD, "--part", f"{part}/3")
    return source, tmp_path / ".ckptfix-parts-out"


def test_commit_refuses_a_shard_changed_after_its_part(tmp_path: Path) -> None:
    source, parts = _three_parts(tmp_path)
    shard = sorted(parts.glob("*.safetensors"))[-1]
    with shard.open("r+b") as handle:
        handle.seek(-1, 2)
        handle.write(b"\1")
    line = one_error_line("convert", source, "-o", tmp_path / "out", *SHARD, "--commit")
    assert line == (
        f"error: {parts / shard.name}: is missing or changed since its part wrote it "
        "(rule verification-failed; run its part again, then --commit)"
    )
    assert not (tmp_path / "out").exists()


def test_commit_reads_back_every_shard(tmp_path: Path) -> None:
    """The commit hashes every byte of every part's shards, and says how many it read."""
    source, parts = _three_parts(tmp_path)
    shards = sum(path.stat().st_size for path in parts.glob("*.safetensors"))
    done = cli("convert", source, "-o", tmp_path / "out", *SHARD, "--commit", "--json")
    assert done.code == 0, done.stderr
    assert done.json()["commit"] == {
        "parts": 3, "shards": len(list((tmp_path / "out").glob("*.safetensors"))),
        "bytes_read": shards, "by": "sha256 read back",
    }  # fmt: skip
    assert shards > 0


def test_commit_says_what_it_read(tmp_path: Path) -> None:
    source, parts = _three_parts(tmp_path)
    shards = sum(path.stat().st_size for path in parts.glob("*.safetensors"))
    done = cli("convert", source, "-o", tmp_path / "out", *SHARD, "--commit")
    assert done.code == 0, done.stderr
    assert f"every shard read back and its SHA-256 compared ({shards:,} bytes" in done.stdout


@pytest.mark.parametrize("how", ["same-size", "link", "longer"])
def test_commit_refuses_a_shard_changed_with_its_time_set_back(how: str, tmp_path: Path) -> None:
    """Its modification time is what its part recorded, its bytes are not (a byte changed
    in the middle; a link to another file of the same bytes; bytes added): the commit
    refuses it, and publishes nothing."""
    source, parts = _three_parts(tmp_path)
    shard = sorted(parts.glob("*.safetensors"))[1]
    status = shard.stat()
    if how == "same-size":
        with shard.open("r+b") as handle:
            handle.seek(status.st_size // 2)
            byte = handle.read(1)
            handle.seek(status.st_size // 2)
            handle.write(bytes([byte[0] ^ 1]))
    elif how == "longer":
        with shard.open("ab") as handle:
            handle.write(b"\0" * 4096)
    else:
        other = tmp_path / "other.safetensors"
        other.write_bytes(shard.read_bytes())
        shard.unlink()
        shard.symlink_to(other)
        os.utime(other, ns=(status.st_atime_ns, status.st_mtime_ns))
    os.utime(shard, ns=(status.st_atime_ns, status.st_mtime_ns))
    assert os.stat(shard).st_mtime_ns == status.st_mtime_ns
    before = tree_snapshot(parts)
    done = cli("convert", source, "-o", tmp_path / "out", *SHARD, "--commit")
    assert done.code == 1 and done.error_lines == [
        f"error: {parts / shard.name}: is missing or changed since its part wrote it "
        "(rule verification-failed; run its part again, then --commit)"
    ]
    assert not (tmp_path / "out").exists() and tree_snapshot(parts) == before


def test_commit_refuses_a_forged_record(tmp_path: Path) -> None:
    source, parts = _three_parts(tmp_path)
    (parts / ".ckptfix-part-2-of-3.json").write_text('{"digest": 1}')
    line = one_error_line("convert", source, "-o", tmp_path / "out", *SHARD, "--commit")
    assert line.startswith(f"error: {parts}/.ckptfix-part-2-of-3.json: is not a part record")
    assert not (tmp_path / "out").exists()


def test_commit_refuses_parts_of_another_plan(tmp_path: Path) -> None:
    source, parts = _three_parts(tmp_path)
    line = one_error_line(
        "convert", source, "-o", tmp_path / "out", *SHARD, "--dtype", "bf16", "--commit"
    )
    assert line.startswith(
        f"error: {parts}/.ckptfix-part-1-of-3.json: part 1 of 3 was written for another plan"
    )
    assert not (tmp_path / "out").exists()


def test_commit_without_parts(tmp_path: Path) -> None:
    line = one_error_line("convert", _model(tmp_path), "-o", tmp_path / "out", *SHARD, "--commit")
    assert "no part was written for this plan" in line


def test_commit_keeps_the_output_rules(tmp_path: Path) -> None:
    source, _ = _three_parts(tmp_path)
    Factory(tmp_path).sharded("out", [[Spec("x")]])
    before = tree_snapshot(tmp_path / "out")
    done = cli("convert", source, "-o", tmp_path / "out", *SHARD, "--commit")
    assert done.code == 2 and "--force" in done.error_lines[-1]
    assert tree_snapshot(tmp_path / "out") == before
    _run("convert", source, "-o", tmp_path / "out", *SHARD, "--commit", "--force")
    _run("convert", source, "-o", tmp_path / "whole", *SHARD)
    assert tree_snapshot(tmp_path / "out") == tree_snapshot(tmp_path / "whole")


def test_a_folder_of_the_users_is_never_taken_for_the_parts(tmp_path: Path) -> None:
    """Of the name the parts folder would have, but not made by ckptfix: neither written
    into by a part nor deleted by a commit."""
    source, theirs = _model(tmp_path), tmp_path / ".ckptfix-parts-out"
    theirs.mkdir()
    (theirs / "notes.txt").write_text("mine")
    for flag in ("--part", "--commit"):
        args = [flag, "1/2"] if flag == "--part" else [flag]
        done = cli("convert", source, "-o", tmp_path / "out", *SHARD, *args)
        assert done.code == 2 and done.error_lines == [
            f"error: {theirs}: exists and is not a folder of parts ckptfix made (no marker in "
            "it) (rule usage; move it away, or write to another OUT)"
        ]
    assert [p.name for p in theirs.iterdir()] == ["notes.txt"]


def test_no_parts_to_the_hub(tmp_path: Path) -> None:
    done = cli("convert", _model(tmp_path), "-o", "hf://someone/model", *SHARD, "--part", "1/2")
    assert done.code == 2
    assert done.error_lines == [
        "error: --part: an hf:// output is uploaded and committed by one process (rule usage; "
        "write to a folder or s3:// with parts, or run without --part and --executor ray)"
    ]


@pytest.mark.parametrize(
    "extra",
    [
        ("--part", "0/3"),
        ("--part", "4/3"),
        ("--part", "x"),
        ("--part", "1/2", "--commit"),
        ("--part", "1/2", "--executor", "ray"),
        ("--part", "1/2", "--to", "torch"),
        ("--part", "1/2", "--max-shard", "10GB"),  # one file, no index: nothing to split
    ],
)
def test_options_a_part_cannot_take(extra: tuple[str, ...], tmp_path: Path) -> None:
    done = cli("convert", _model(tmp_path), "-o", tmp_path / "out", *extra)
    assert done.code == 2, done.stderr
    [line] = done.error_lines
    assert line.startswith("error: ") and "Traceback" not in done.stderr
    assert sorted(p.name for p in tmp_path.iterdir()) == ["m"]  # nothing written
