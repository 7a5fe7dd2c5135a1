"""`ckptfix.Writer`: tensors produced one at a time into shards closed as they fill, named
at close(), published at OUT as one step; nothing at OUT if the program fails or dies."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

import ckptfix
from tests.helpers import load_safetensors_folder, torch_bytes


def _arrays(sizes: list[int]) -> dict[str, Any]:
    import numpy as np

    return {f"t{i}": np.full(size, i, dtype=np.uint8) for i, size in enumerate(sizes)}


def _shards(folder: Path) -> list[list[str]]:
    from safetensors import safe_open

    found = []
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "np") as handle:
            found.append(sorted(handle.keys()))
    return found


def test_shards_close_as_they_fill_and_are_named_at_close(tmp_path: Path) -> None:
    state = _arrays([400, 400, 900, 100, 300, 50, 10])
    with ckptfix.Writer(tmp_path / "out", max_shard=1000, metadata={"merged": "yes"}) as writer:
        for name, array in state.items():
            writer.add(name, array)
    result = writer.close()  # closing again returns what was written
    assert sorted(os.listdir(tmp_path / "out")) == [
        "model-00001-of-00003.safetensors",
        "model-00002-of-00003.safetensors",
        "model-00003-of-00003.safetensors",
        "model.safetensors.index.json",
    ]
    assert _shards(tmp_path / "out") == [["t0", "t1"], ["t2", "t3"], ["t4", "t5", "t6"]]
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    assert index["metadata"] == {"merged": "yes", "total_size": 2160}
    assert result.index == "model.safetensors.index.json"
    assert result.files == {p.name: p.stat().st_size for p in (tmp_path / "out").iterdir()}
    # the same shards, names and index as save() (and huggingface_hub) make of the mapping
    ckptfix.save(state, tmp_path / "saved", max_shard=1000, metadata={"merged": "yes"})
    for name in os.listdir(tmp_path / "saved"):
        assert (tmp_path / "saved" / name).read_bytes() == (tmp_path / "out" / name).read_bytes()


@pytest.mark.parametrize(
    "sizes",
    [[400, 1200, 300, 900, 50], [1500, 200], [200, 1500], [1500], [1500, 1100, 10]],
    ids=["between", "first", "last", "alone", "two"],
)
def test_a_tensor_over_max_shard_is_placed_as_save_places_it(
    tmp_path: Path, sizes: list[int]
) -> None:
    """A tensor larger than max_shard gets a shard of its own, before the one still open
    (huggingface_hub's order, and save()'s): the same files, byte for byte."""
    state = _arrays(sizes)
    with ckptfix.Writer(tmp_path / "out", max_shard=1000, metadata={"m": "1"}) as writer:
        for name, array in state.items():
            writer.add(name, array)
    ckptfix.save(state, tmp_path / "saved", max_shard=1000, metadata={"m": "1"})
    assert sorted(os.listdir(tmp_path / "out")) == sorted(os.listdir(tmp_path / "saved"))
    for name in os.listdir(tmp_path / "saved"):
        assert (tmp_path / "saved" / name).read_bytes() == (tmp_path / "out" / name).read_bytes()


def test_one_shard_is_model_safetensors_with_the_metadata(tmp_path: Path) -> None:
    from safetensors import safe_open

    with ckptfix.Writer(tmp_path / "out", metadata={"merged": "yes"}) as writer:
        writer.add("a", _arrays([8])["t0"])
    assert os.listdir(tmp_path / "out") == ["model.safetensors"]
    with safe_open(str(tmp_path / "out" / "model.safetensors"), "np") as handle:
        assert handle.metadata() == {"format": "pt", "merged": "yes"}


def test_a_tensor_may_change_once_added(tmp_path: Path) -> None:
    import torch

    buffer = torch.zeros(4, 3)
    base = torch.arange(12, dtype=torch.float32).reshape(3, 4)
    with ckptfix.Writer(tmp_path / "out", max_shard=40) as writer:
        for step in range(3):
            buffer.fill_(step)  # one buffer, reused for every tensor (MergeKit's pattern)
            writer.add(f"layer{step}", buffer)
        writer.add("transposed", base.t())
        writer.add("bf16", base.to(torch.bfloat16))
    written = load_safetensors_folder(tmp_path / "out")
    for step in range(3):
        assert torch.equal(written[f"layer{step}"], torch.full((4, 3), float(step)))
    assert torch_bytes(written["transposed"]) == torch_bytes(base.t())
    assert torch.equal(written["bf16"], base.to(torch.bfloat16))


def _nothing_at(out: Path) -> None:
    assert not out.exists()
    assert [p.name for p in out.parent.iterdir() if p.name.startswith(".ckptfix")] == []


def test_an_exception_in_the_with_block_publishes_nothing(tmp_path: Path) -> None:
    with (
        pytest.raises(RuntimeError, match="merge failed"),
        ckptfix.Writer(tmp_path / "out", max_shard=100) as writer,
    ):
        for name, array in _arrays([60, 60, 60]).items():
            writer.add(name, array)
        raise RuntimeError("merge failed")
    _nothing_at(tmp_path / "out")
    with pytest.raises(ValueError, match="the writer is closed"):
        writer.add("late", _arrays([1])["t0"])


def test_abort_publishes_nothing(tmp_path: Path) -> None:
    writer = ckptfix.Writer(tmp_path / "out")
    writer.add("a", _arrays([4])["t0"])
    writer.abort()
    _nothing_at(tmp_path / "out")
    with pytest.raises(ValueError, match="the writer is closed"):
        writer.close()


def test_a_bad_tensor_leaves_the_writer_usable(tmp_path: Path) -> None:
    with ckptfix.Writer(tmp_path / "out") as writer:
        writer.add("a", _arrays([4])["t0"])
        with pytest.raises(ValueError, match="'a' was given twice"):
            writer.add("a", _arrays([4])["t0"])
        with pytest.raises(ValueError, match="not a torch tensor or numpy array"):
            writer.add("b", [1, 2, 3])
        writer.add("b", _arrays([5])["t0"])
    assert _shards(tmp_path / "out") == [["a", "b"]]


def test_a_failed_write_discards_the_writer(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptfix.api import writer as module

    def full(fd: int, data: Any, offset: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    writer = ckptfix.Writer(tmp_path / "out")
    monkeypatch.setattr(module, "write_all", full)
    with pytest.raises(ckptfix.WriteError, match="no space left on device"):
        writer.add("a", _arrays([4])["t0"])
    _nothing_at(tmp_path / "out")
    with pytest.raises(ValueError, match="the writer is closed"):
        writer.add("b", _arrays([4])["t0"])


def test_an_existing_folder_is_refused_before_anything_is_written(tmp_path: Path) -> None:
    (tmp_path / "out").mkdir()
    (tmp_path / "out" / "model.safetensors").write_bytes(b"theirs")
    with pytest.raises(ValueError, match="output folder exists and is not empty"):
        ckptfix.Writer(tmp_path / "out")
    assert (tmp_path / "out" / "model.safetensors").read_bytes() == b"theirs"


DIES = """
import os, sys, numpy, ckptfix
writer = ckptfix.Writer(sys.argv[1], max_shard=100)
for i in range(5):
    writer.add(f"t{i}", numpy.full(60, i, dtype=numpy.uint8))
if sys.argv[2] == "exception":
    raise SystemExit("the program fails without closing the writer")
os.kill(os.getpid(), 9)
"""


@pytest.mark.slow
@pytest.mark.parametrize("how", ["exception", "killed"])
def test_a_program_that_dies_leaves_nothing_at_out(tmp_path: Path, how: str) -> None:
    done = subprocess.run(
        [sys.executable, "-c", DIES, str(tmp_path / "out"), how],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode != 0
    assert not (tmp_path / "out").exists()
    left = [p for p in tmp_path.iterdir() if p.name.startswith(".ckptfix")]
    if how == "exception":
        assert left == []  # removed as the interpreter exits
    else:  # SIGKILL: the staging folder stays beside OUT, marked as ckptfix's
        from ckptfix.write.staging import is_staging_folder

        assert len(left) == 1 and is_staging_folder(str(left[0]))


@pytest.mark.slow
def test_shards_take_their_names_once_checked(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A shard's header is checked behind the writing, by its (temporary) name: a slow check
    still finds the file, and close() publishes only once every check passed."""
    import time

    from ckptfix.write import sink

    real = sink.verify_header
    checked = []

    def slow(path: str, *args: Any) -> None:
        time.sleep(0.2)
        real(path, *args)
        checked.append(os.path.basename(path))

    monkeypatch.setattr(sink, "verify_header", slow)
    with ckptfix.Writer(tmp_path / "out", max_shard=100) as writer:
        for name, array in _arrays([60, 60]).items():
            writer.add(name, array)
    assert checked == [".ckptfix-shard-00001.safetensors", ".ckptfix-shard-00002.safetensors"]
    assert _shards(tmp_path / "out") == [["t0"], ["t1"]]
