"""`ckptfix.save`: tensors in memory to shards named, split and indexed as huggingface_hub's
save_torch_state_dict does, written without copying the model, verified, published at OUT
as one step (or not at all)."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import ckptfix
from tests.builders import random_tensor, views_state_dict
from tests.helpers import cli, load_safetensors_folder, torch_bytes, tree_snapshot

if TYPE_CHECKING:
    import torch


def _hub_state() -> dict[str, torch.Tensor]:
    """What huggingface_hub saves without loss: tied names, a transposed tensor, several
    dtypes, tensors larger than a shard, a scalar and an empty tensor."""
    import torch

    embed = random_tensor(torch.float32, (64, 16), 1)
    state = {
        "model.embed_tokens.weight": embed,
        "model.layers.0.w": random_tensor(torch.bfloat16, (32, 48), 2),
        "model.layers.0.t": random_tensor(torch.float32, (24, 40), 3).t(),
        "model.layers.1.w": random_tensor(torch.float16, (8, 8), 4),
        "big": random_tensor(torch.float32, (100, 50), 5),
        "model.norm.scale": torch.tensor(2.5),
        "empty": torch.empty(0, 3),
        "lm_head.weight": embed,
    }
    state.update({f"small.{i}": random_tensor(torch.int32, (7,), 10 + i) for i in range(12)})
    return state


def _headers(folder: Path) -> dict[str, tuple[list[str], dict[str, str]]]:
    from safetensors import safe_open

    found = {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(str(path), "pt") as handle:
            found[path.name] = (sorted(handle.keys()), handle.metadata() or {})
    return found


def _hub_save(state: dict[str, Any], folder: Path, **options: Any) -> None:
    from huggingface_hub import save_torch_state_dict

    folder.mkdir()
    save_torch_state_dict(dict(state), str(folder), **options)


@pytest.mark.slow
@pytest.mark.parametrize("max_shard", [10**9, 6000, "20KB", 1])
def test_names_shards_and_index_are_huggingface_hubs(tmp_path: Path, max_shard: int | str) -> None:
    state = _hub_state()
    metadata = {"origin": "unit test"}
    _hub_save(state, tmp_path / "hub", max_shard_size=max_shard, metadata=dict(metadata))
    result = ckptfix.save(state, tmp_path / "ours", max_shard=max_shard, metadata=metadata)
    ours, hub = _headers(tmp_path / "ours"), _headers(tmp_path / "hub")
    assert sorted(ours) == sorted(hub)  # the same files
    # huggingface_hub records each dropped name as a metadata entry of its own; ckptfix
    # writes the record the CLI writes
    assert result.aliases == {"model.embed_tokens.weight": "lm_head.weight"}
    record = {"model.embed_tokens.weight": "lm_head.weight"}
    for name, (names, header) in hub.items():
        assert ours[name][0] == names, name  # each file holds the same tensors
        if result.index is None:
            assert header == {**metadata, **record, "format": "pt"}
            assert ours[name][1] == {
                **metadata,
                "format": "pt",
                "ckptfix.dropped": json.dumps(record),
            }
        else:
            assert ours[name][1] == header == {"format": "pt"}
    if result.index is not None:
        index = json.loads((tmp_path / "ours" / result.index).read_text())
        hub_index = json.loads((tmp_path / "hub" / result.index).read_text())
        assert index["weight_map"] == hub_index["weight_map"]
        assert index["metadata"] == {
            "total_size": hub_index["metadata"]["total_size"],
            "origin": "unit test",
            "ckptfix.dropped": record,
        }
    written = load_safetensors_folder(tmp_path / "ours")
    for name, tensor in load_safetensors_folder(tmp_path / "hub").items():
        assert torch_bytes(written[name]) == torch_bytes(tensor), name


def test_shards_split_in_the_mappings_order(tmp_path: Path) -> None:
    import numpy as np

    sizes = [400, 400, 900, 100, 300, 50, 1200, 10]  # bytes; max 1000
    state = {f"t{i}": np.zeros(size, dtype=np.uint8) for i, size in enumerate(sizes)}
    result = ckptfix.save(state, tmp_path / "out", max_shard=1000)
    index = json.loads((tmp_path / "out" / "model.safetensors.index.json").read_text())
    by_file: dict[str, list[str]] = {}
    for name, file in index["weight_map"].items():
        by_file.setdefault(file, []).append(name)
    # as huggingface_hub splits: the 1200-byte tensor gets a shard of its own before the
    # shard that was open; the index's total is the bytes written
    assert [sorted(names) for _, names in sorted(by_file.items())] == [
        ["t0", "t1"],
        ["t2", "t3"],
        ["t6"],
        ["t4", "t5", "t7"],
    ]
    assert index["metadata"]["total_size"] == sum(sizes)
    assert result.files["model.safetensors.index.json"] > 0


@pytest.mark.slow
def test_what_huggingface_hub_refuses_is_written_whole(tmp_path: Path) -> None:
    """Views of one buffer (overlapping, transposed, strided) make huggingface_hub refuse
    the whole state dict; ckptfix writes each view whole, and exact aliases once."""
    state = views_state_dict()
    with pytest.raises(RuntimeError):
        _hub_save(state, tmp_path / "hub")
    overlapping = {name: state[name] for name in ("rows", "overlap")}
    with pytest.raises(RuntimeError, match="None is covering the entire storage"):
        _hub_save(overlapping, tmp_path / "hub-overlapping")
    result = ckptfix.save(state, tmp_path / "ours")
    assert result.aliases == {"lm_head": "embed"}
    written = load_safetensors_folder(tmp_path / "ours")
    assert sorted(written) == sorted(set(state) - {"lm_head"})
    for name, tensor in state.items():
        got = written[result.aliases.get(name, name)]
        assert (got.dtype, got.shape, torch_bytes(got)) == (
            tensor.dtype,
            tensor.shape,
            torch_bytes(tensor),
        ), name


def test_clone_writes_every_name_whole(tmp_path: Path) -> None:
    state = views_state_dict()
    result = ckptfix.save(state, tmp_path / "out", shared="clone")
    assert result.aliases == {}
    written = load_safetensors_folder(tmp_path / "out")
    assert sorted(written) == sorted(state)
    assert torch_bytes(written["lm_head"]) == torch_bytes(state["embed"])


def test_numpy_arrays_of_any_layout_and_byte_order(tmp_path: Path) -> None:
    import numpy as np
    from safetensors.numpy import load_file

    base = np.arange(60, dtype=np.float64).reshape(6, 10)
    state = {
        "big_endian": np.arange(12, dtype=">i4").reshape(3, 4),
        "fortran": np.asfortranarray(base),
        "strided": base[::2, ::3],
        "reversed": base[::-1],
        "flags": np.array([True, False, True]),
        "half": np.linspace(0, 1, 7, dtype=np.float16),
        "broadcast": np.broadcast_to(np.arange(5, dtype=np.uint16), (4, 5)),
        "complex": (base[0] + 1j * base[1]).astype(np.complex64),
    }
    ckptfix.save(state, tmp_path / "out")
    written = load_file(str(tmp_path / "out" / "model.safetensors"))
    for name, array in state.items():
        assert written[name].dtype.newbyteorder("=") == array.dtype.newbyteorder("="), name
        assert np.array_equal(written[name], array), name


def test_a_tie_config_declares_keeps_the_embedding(tmp_path: Path) -> None:
    import torch

    embed = torch.randn(12, 4)
    state = {"lm_head.weight": embed, "model.embed_tokens.weight": embed, "x": torch.ones(2)}
    config = {"model_type": "llama", "architectures": ["LlamaForCausalLM"]}
    tied = ckptfix.save(state, tmp_path / "tied", config={**config, "tie_word_embeddings": True})
    # huggingface_hub would keep lm_head.weight, the first in sorted order; transformers
    # writes (and reads best) the embedding
    assert tied.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
    assert json.loads((tmp_path / "tied" / "config.json").read_text())["tie_word_embeddings"]
    # untied (llama's default): the loader reads the head on its own, so it is written
    untied = ckptfix.save(state, tmp_path / "untied", config=config)
    assert untied.aliases == {}
    assert sorted(load_safetensors_folder(tmp_path / "untied")) == sorted(state)
    (tmp_path / "config.json").write_text(json.dumps({**config, "tie_word_embeddings": True}))
    from_file = ckptfix.save(state, tmp_path / "from_file", config=tmp_path / "config.json")
    assert from_file.aliases == tied.aliases
    assert (tmp_path / "from_file" / "config.json").read_bytes() == (
        tmp_path / "config.json"
    ).read_bytes()


def test_the_cli_reads_what_save_writes(tmp_path: Path) -> None:
    import torch

    state = _hub_state()
    torch.save(state, tmp_path / "state.pt")
    ckptfix.save(state, tmp_path / "out", max_shard=6000)
    assert cli("inspect", tmp_path / "out", "--fail-on", "warning").code == 0
    # the alias record stands for the dropped name: the same tensors as the torch file
    run = cli("diff", tmp_path / "state.pt", tmp_path / "out")
    assert run.code == 0, run.stdout


def test_an_existing_folder_is_never_overwritten(tmp_path: Path) -> None:
    import numpy as np

    out = tmp_path / "out"
    out.mkdir()
    (out / "notes.txt").write_text("mine")
    with pytest.raises(ValueError, match="output folder exists and is not empty"):
        ckptfix.save({"a": np.ones(3)}, out)
    assert tree_snapshot(out) == {"notes.txt": b"mine"}
    empty = tmp_path / "empty"
    empty.mkdir()
    ckptfix.save({"a": np.ones(3)}, empty)  # an empty folder is taken
    assert sorted(os.listdir(empty)) == ["model.safetensors"]


def _nothing_left(tmp_path: Path, out: Path) -> None:
    assert not out.exists()
    assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".ckptfix")] == []


@pytest.mark.parametrize(
    "failure",
    [OSError(errno.ENOSPC, "No space left on device"), KeyboardInterrupt()],
    ids=["disk-full", "ctrl-c"],
)
def test_a_failed_write_leaves_nothing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, failure: BaseException
) -> None:
    import numpy as np

    from ckptfix.write import sink

    calls = []
    real = sink.write_all

    def failing(fd: int, data: Any, offset: int) -> None:
        calls.append(offset)
        if len(calls) == 3:
            raise failure
        real(fd, data, offset)

    monkeypatch.setattr(sink, "write_all", failing)
    state = {f"t{i}": np.full(1000, i, dtype=np.float32) for i in range(4)}
    expected = ckptfix.WriteError if isinstance(failure, OSError) else KeyboardInterrupt
    with pytest.raises(expected) as caught:
        ckptfix.save(state, tmp_path / "out", max_shard=5000)
    if isinstance(failure, OSError):
        assert "no space left on device; nothing was written" in str(caught.value)
    _nothing_left(tmp_path, tmp_path / "out")


@pytest.mark.slow
def test_a_failed_write_stops_its_checks_before_closing_their_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A write that fails while a worker still reads the shard back: the worker finishes
    (or is cancelled) before the descriptor it reads is closed, never reads a closed one."""
    import threading
    import time

    import numpy as np

    from ckptfix.write import sink

    monkeypatch.setattr(sink, "VERIFY_BATCH", 1)  # a check handed out after every tensor
    started, seen = threading.Event(), []
    real_verify, real_write = sink.LocalSink._verify, sink.write_all

    def slow_verify(self: Any, reader: int, *args: Any) -> None:
        started.set()
        time.sleep(0.3)
        try:
            os.fstat(reader)
            seen.append("open")
        except OSError as exc:
            seen.append(errno.errorcode[exc.errno or 0])
        real_verify(self, reader, *args)

    writes = []

    def failing(fd: int, data: Any, offset: int) -> None:
        writes.append(offset)
        if len(writes) == 3:  # the header, the first tensor (its check handed out), then
            assert started.wait(10)  # this one fails while that check runs
            raise OSError(errno.EIO, "Input/output error")
        real_write(fd, data, offset)

    monkeypatch.setattr(sink.LocalSink, "_verify", slow_verify)
    monkeypatch.setattr(sink, "write_all", failing)
    state = {f"t{i}": np.full(1000, i, dtype=np.float32) for i in range(3)}
    with pytest.raises(ckptfix.WriteError, match="Input/output error"):
        ckptfix.save(state, tmp_path / "out")
    assert seen == ["open"]
    _nothing_left(tmp_path, tmp_path / "out")


def test_the_checks_run_while_the_disk_catches_up(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A sync waits for the disk; the read-back checks go on meanwhile (on a pool shared
    with the syncs, two waiting syncs held both workers and the checks waited for them)."""
    import threading

    import numpy as np

    from ckptfix.platform import system
    from ckptfix.write import sink

    monkeypatch.setattr(sink, "VERIFY_BATCH", 1)  # a check and a sync after every tensor
    monkeypatch.setattr(sink, "SYNC_EVERY", 1)
    state = {f"t{i}": np.full(1000, i, dtype=np.float32) for i in range(4)}
    checked, all_checked, waited = [], threading.Event(), []
    platform = system()
    real_verify, real_sync = sink.LocalSink._verify, platform.sync_data

    def counting_verify(self: Any, *args: Any) -> None:
        real_verify(self, *args)
        checked.append(1)
        if len(checked) == len(state):
            all_checked.set()

    def slow_disk(fd: int) -> None:  # the disk is done once every tensor has been checked
        waited.append(all_checked.wait(2))
        real_sync(fd)

    monkeypatch.setattr(sink.LocalSink, "_verify", counting_verify)
    monkeypatch.setattr(platform, "sync_data", slow_disk)
    ckptfix.save(state, tmp_path / "out")
    assert waited and all(waited)  # no sync waited in vain for a check stuck behind it


def test_what_reads_back_different_is_never_published(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    import numpy as np

    from ckptfix.write import sink

    real = sink._write_part

    def corrupting(fd: int, offset: int, part: Any) -> None:
        real(fd, offset, part)
        if part.nbytes:
            os.pwrite(fd, b"\xff", offset + part.nbytes - 1)  # the disk "loses" a byte

    monkeypatch.setattr(sink, "_write_part", corrupting)
    with pytest.raises(ckptfix.VerificationError, match="read back different"):
        ckptfix.save({"a": np.zeros(64, dtype=np.float32)}, tmp_path / "out")
    _nothing_left(tmp_path, tmp_path / "out")


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ({"a": [1.0, 2.0]}, "'a' is a list, not a torch tensor or numpy array"),
        ({1: "x"}, "key 1 is not a string"),
        ({"__metadata__": "zeros"}, "'__metadata__' is reserved by safetensors"),
        ({"meta": "meta"}, "'meta' is a meta tensor"),
        ({"objects": "objects"}, "has numpy dtype object"),
    ],
)
def test_what_cannot_be_written_is_a_value_error(
    tmp_path: Path, tensors: dict[Any, Any], message: str
) -> None:
    import numpy as np
    import torch

    values = {
        "zeros": np.zeros(2),
        "meta": torch.empty(3, device="meta"),
        "objects": np.array([object()]),
    }
    given = {
        name: values.get(value, value) if isinstance(value, str) else value
        for name, value in tensors.items()
    }
    with pytest.raises(ValueError, match=message):
        ckptfix.save(given, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_metadata_must_be_strings(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="must map strings to strings"):
        ckptfix.save({}, tmp_path / "out", metadata={"epoch": 3})  # type: ignore[dict-item]
    with pytest.raises(ValueError, match=r"'ckptfix\.dropped' is written by ckptfix"):
        ckptfix.save({}, tmp_path / "out", metadata={"ckptfix.dropped": "{}"})


MEMORY = """
import sys, torch, ckptfix
def peak():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
size = int(sys.argv[2])
state = {f"layer{i}": torch.full((size // 16,), float(i)) for i in range(4)}
state["transposed"] = torch.ones(size // 4096, 256).t()  # written in bounded chunks
state["tied"] = state["layer0"]
ckptfix.save({"warm": torch.ones(4)}, sys.argv[1] + "-warm")  # every module imported
with open("/proc/self/clear_refs", "w") as refs:
    refs.write("5")  # the peak from here on
before = peak()
ckptfix.save(state, sys.argv[1], max_shard=size // 3)
print(peak() - before)
"""


@pytest.mark.slow
def test_the_model_is_never_copied(tmp_path: Path) -> None:
    """640 MiB of tensors, a transposed one and a shared pair among them: the write adds at
    most 64 MiB to the process (its buffers), however large the tensors."""
    size = 512 * 2**20
    done = subprocess.run(
        [sys.executable, "-c", MEMORY, str(tmp_path / "out"), str(size)],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) <= 64 * 2**20, int(done.stdout) / 2**20
    assert len(list((tmp_path / "out").glob("*.safetensors"))) == 5  # 128 MiB each


HUGE = """
import sys, torch, ckptfix
count = 2**31 + 24
tensor = torch.full((1,), 7, dtype=torch.uint8).expand(count)  # one byte of memory
ckptfix.save({"huge": tensor, "after": torch.arange(3)}, sys.argv[1])
with open("/proc/self/status") as status:
    print(next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM")))
"""


@pytest.mark.slow
def test_a_tensor_past_2_31_elements_under_a_memory_bound(tmp_path: Path) -> None:
    import numpy as np
    from safetensors import safe_open

    done = subprocess.run(
        [sys.executable, "-c", HUGE, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    assert int(done.stdout) < 1024 * 2**20  # torch itself is most of it; never 2 GiB
    path = tmp_path / "out" / "model.safetensors"
    with safe_open(str(path), "np") as handle:
        assert handle.get_slice("huge").get_shape() == [2**31 + 24]
        assert handle.get_tensor("after").tolist() == [0, 1, 2]
    with ckptfix.open(path) as reader:
        assert reader.info("huge").nbytes == 2**31 + 24
    data = np.memmap(path, dtype=np.uint8, mode="r")
    start = path.stat().st_size - (2**31 + 24) - 24  # the data section: huge, then 3 int64
    step = 64 * 2**20
    for offset in range(start, start + 2**31 + 24, step):
        block = data[offset : min(offset + step, start + 2**31 + 24)]
        assert (block == 7).all(), offset


def test_any_torch_layout_is_written_row_major(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Permuted, sliced and expanded tensors of up to four dimensions, cut into blocks of a
    few rows (a 64-byte block here, to cross many block edges), equal their own
    `.contiguous()` bytes."""
    import torch

    from ckptfix.api import arrays

    monkeypatch.setattr(arrays, "BLOCK", 64)
    base = random_tensor(torch.float32, (6, 5, 4, 3), 7)
    state = {
        "permuted": base.permute(3, 1, 0, 2),
        "reversed_dims": base.permute(3, 2, 1, 0),
        "sliced": base[1:5, ::2, 1:],
        "transposed_slice": base[2, :, 0].t()[1:],
        "expanded": base[:1, :, :1].expand(4, 5, 3, 3),
        "bf16_t": base.to(torch.bfloat16)[0].permute(2, 0, 1),
        "bool_t": (base > 0)[..., 0, 0].t(),
        "scalar": base[1, 2, 3, 0],
    }
    ckptfix.save(state, tmp_path / "out", shared="clone")
    written = load_safetensors_folder(tmp_path / "out")
    for name, tensor in state.items():
        assert written[name].shape == tensor.shape, name
        assert torch_bytes(written[name]) == torch_bytes(tensor), name
