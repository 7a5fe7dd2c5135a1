"""The bound on open descriptors (io.descriptors): files past the pool's capacity are closed
while idle and reopened when read, a reopened file must be the one first read (replaced,
modified or removed in between is an error, never read silently), a descriptor in use is
never closed, and the soft RLIMIT_NOFILE is raised to the hard limit at the library's entry."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import ckptfix
from ckptfix.core.errors import SourceChangedError
from ckptfix.io.descriptors import POOL
from ckptfix.io.source import LocalFile, descriptor
from ckptfix.ops.rewrite import ReshardOptions
from tests.builders import Factory, Spec, seeded_bytes
from tests.helpers import cli, limit_open_files, measured, read_tensors

CAPACITY = 4


@pytest.fixture
def small_pool(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(POOL, "_capacity", CAPACITY)


def _files(root: Path, count: int) -> list[Path]:
    paths = []
    for number in range(count):
        path = root / f"f{number}"
        path.write_bytes(seeded_bytes(64, number))
        paths.append(path)
    return paths


def _open_among(paths: list[Path]) -> int:
    """How many of `paths` this process has open."""
    wanted = {str(path) for path in paths}
    count = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            count += os.readlink(f"/proc/self/fd/{fd}") in wanted
        except FileNotFoundError:  # the listing's own descriptor, closed by now
            continue
    return count


def test_reads_past_the_capacity_keep_it(tmp_path: Path, small_pool: None) -> None:
    paths = _files(tmp_path, 3 * CAPACITY)
    sources = [LocalFile(str(path)) for path in paths]
    for _ in range(2):  # the second pass reopens every file the first one closed
        for path, source in zip(paths, sources, strict=True):
            assert source.read_at(8, 16) == path.read_bytes()[8:24]
            assert _open_among(paths) <= CAPACITY
    for source in sources:
        source.close()
    assert _open_among(paths) == 0


def _evicted(paths: list[Path]) -> LocalFile:
    """A source of paths[0], read once, then closed by the pool for the others."""
    first = LocalFile(str(paths[0]))
    first.read_at(0, 8)
    for path in paths[1:]:
        LocalFile(str(path)).read_at(0, 8)
    assert _open_among(paths[:1]) == 0
    return first


def _replace(path: Path) -> None:
    staged = path.with_name("staged")
    staged.write_bytes(seeded_bytes(64, "other"))  # same size, other bytes, other inode
    os.replace(staged, path)


def _rewrite(path: Path) -> None:
    with open(path, "r+b") as handle:  # same inode, same size: only the time tells
        handle.write(b"\xff" * 8)
    stat = path.stat()
    os.utime(path, ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))


@pytest.mark.parametrize(
    "change", [_replace, _rewrite, Path.unlink], ids=["replaced", "rewritten", "removed"]
)
def test_a_file_changed_while_closed_is_not_read(
    tmp_path: Path, small_pool: None, change: object
) -> None:
    paths = _files(tmp_path, CAPACITY + 2)
    source = _evicted(paths)
    change(paths[0])  # type: ignore[operator]
    with pytest.raises(SourceChangedError) as caught:
        source.read_at(0, 8)
    assert caught.value.path == str(paths[0])
    assert "changed" in caught.value.what or "replaced" in caught.value.what


def test_an_unchanged_file_is_reopened(tmp_path: Path, small_pool: None) -> None:
    paths = _files(tmp_path, CAPACITY + 2)
    source = _evicted(paths)
    before = source.change_token()
    assert source.read_at(0, 64) == paths[0].read_bytes()
    assert source.change_token() == before


def test_a_descriptor_in_use_is_never_closed(tmp_path: Path, small_pool: None) -> None:
    paths = _files(tmp_path, 3 * CAPACITY)
    held = LocalFile(str(paths[0]))
    with descriptor(held) as fd:
        assert fd is not None
        for path in paths[1:]:
            LocalFile(str(path)).read_at(0, 8)  # the pool is full: others are closed
        assert os.pread(fd, 8, 0) == paths[0].read_bytes()[:8]
    LocalFile(str(paths[1])).read_at(0, 8)  # now it may go
    assert _open_among(paths) <= CAPACITY


def test_a_shard_replaced_during_a_reshard_fails_it(
    factory: Factory, small_pool: None, tmp_path: Path
) -> None:
    """Twelve shards through a pool of four: the one replaced once writing has begun is
    reopened, seen to be another file, and nothing is written."""
    shards = [[Spec(f"w{number}", shape=(4,))] for number in range(3 * CAPACITY)]
    folder = factory.sharded("model", shards)
    victim = folder / f"model-00002-of-{len(shards):05d}.safetensors"
    replaced: list[bool] = []

    def progress(done: int, total: int) -> None:
        if not replaced:
            staged = tmp_path / "staged"
            staged.write_bytes(victim.read_bytes())  # the same bytes: only the identity differs
            os.replace(staged, victim)
            replaced.append(True)

    out = tmp_path / "out"
    with pytest.raises(SourceChangedError) as caught:
        ckptfix.reshard(folder, out, ReshardOptions(max_shard=16, progress=progress))
    assert caught.value.path == str(victim)
    assert not out.exists()
    assert not list(tmp_path.glob(".ckptfix-*"))


@pytest.mark.slow
def test_the_library_raises_the_soft_limit_to_the_hard_one(factory: Factory) -> None:
    path = factory.safetensors("model.safetensors")
    code = (
        "import resource, sys, ckptfix; ckptfix.inspect(sys.argv[1]); "
        "print(*resource.getrlimit(resource.RLIMIT_NOFILE))"
    )
    hard = 4096

    def limit() -> None:
        import resource

        resource.setrlimit(resource.RLIMIT_NOFILE, (256, hard))

    done = subprocess.run(
        [sys.executable, "-c", code, str(path)],
        capture_output=True,
        text=True,
        preexec_fn=limit,
        check=True,
    )
    assert done.stdout.split() == [str(hard), str(hard)]


@pytest.mark.slow
def test_many_files_are_read_under_a_low_limit(factory: Factory) -> None:
    """The library under soft = hard = 64 descriptors reads a folder of 100 shards."""
    shards = [[Spec(f"w{number}", shape=(2,))] for number in range(100)]
    folder = factory.sharded("model", shards)
    code = "import sys, ckptfix; print(len(ckptfix.inspect(sys.argv[1]).tensors))"
    done = subprocess.run(
        [sys.executable, "-c", code, str(folder)],
        capture_output=True,
        text=True,
        preexec_fn=limit_open_files(64),
        check=False,
    )
    assert (done.returncode, done.stdout.strip()) == (0, "100"), done.stderr[-2000:]
    assert len(read_tensors(folder)) == 100


def _one_per_shard(factory: Factory) -> Path:
    """40 shards of one tensor each, without "format" (so fix rewrites every one)."""
    folder = factory.sharded("model", [[Spec(f"w{number}", shape=(2,))] for number in range(40)])
    for number, shard in enumerate(sorted(folder.glob("*.safetensors"))):
        factory.safetensors(
            f"model/{shard.name}", [Spec(f"w{number}", shape=(2,))], with_format=False
        )
    return folder


@pytest.mark.slow
@pytest.mark.parametrize("to", ["safetensors", "torch"])
def test_writes_under_a_very_low_limit(factory: Factory, to: str) -> None:
    """Soft = hard = 32: the writers failed to open their outputs or read them back ("write
    failed: Too many open files ... check the disk", or "written file does not read back:
    ... [Errno 24]", a bug); the sources' idle descriptors now make room."""
    out = factory.root / "out"
    args = ["convert", _one_per_shard(factory), "-o", out, "--to", to, "--max-shard", "12"]
    run = measured(*args, open_files=32)
    assert run.code == 0, run.stderr
    assert len(read_tensors(out)) == 40
    assert not list(factory.root.glob(".ckptfix-*"))


@pytest.mark.slow
@pytest.mark.parametrize("command", ["reshard", "fix"])
@pytest.mark.parametrize("limit", [12, 16])
def test_a_limit_too_low_for_a_write_is_one_line_and_no_residue(
    factory: Factory, command: str, limit: int
) -> None:
    """Soft = hard = 16: the line named a staging file with "check the disk", and the
    staging folder, whose removal needed descriptors too, was left behind. Whether a run
    fits in so few descriptors depends on its threads' timing (the pool lends idle ones
    out): at 16 it may succeed; when it does not, the one line names OUT (it named whichever
    source or shard was being opened), and at 12 a module imported late was an internal
    error."""
    model = _one_per_shard(factory)
    out = factory.root / "out"
    args = ["-o", out, *(["--max-shard", "12"] * (command == "reshard"))]
    run = measured(command, model, *args, open_files=limit)
    if run.code == 0:
        assert limit == 16 and cli("inspect", out).code == 0
        return
    assert run.code == 1, run.stderr
    said = (
        f"too many open files: the process may open {limit}, fewer than this run needs at "
        "once; nothing was written (rule open-files-limit; raise the limit (e.g. "
        "`ulimit -n 1024`), then run again)"
    )
    assert run.error_lines in ([f"error: {out}: {said}"], [f"error: {said}"])
    assert not out.exists() and not list(factory.root.glob(".ckptfix-*"))
