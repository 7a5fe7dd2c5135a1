"""`convert --to torch`: what torch.load (plain and mmap), transformers and zipfile read back
from the streamed writer, ties kept as shared storage, bounded memory for huge tensors (ZIP64
included), and the faults every writer must survive: a full disk, a source that changes,
bytes that read back different, signals."""

from __future__ import annotations

import errno
import io
import json
import os
import shutil
import signal
import struct
import subprocess
import sys
import time
import zipfile
from collections import OrderedDict
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfix
from ckptfix.core.errors import VerificationError, WriteError
from ckptfix.formats.safetensors import HeaderEntry, encode_header
from ckptfix.ops.rewrite import DROPPED_KEY, ConvertOptions, convert
from ckptfix.plan.shards import PlannedShard, with_shared
from ckptfix.platform import system
from ckptfix.write import copy as copying
from tests import training_fixtures as fixtures
from tests.builders import Factory, Spec, random_tensor, tiny_gpt2
from tests.helpers import (
    cli,
    fail_nth,
    loads_with_same_logits,
    measured,
    read_tensors,
    torch_bytes,
)

if TYPE_CHECKING:
    import torch

MiB = 2**20
dcp_saved = fixtures.dcp_saved  # a session fixture shared with the training tests


def loaded_shards(out: Path, *, mmap: bool = False) -> dict[str, torch.Tensor]:
    """Every tensor of a --to torch output, as torch.load(weights_only=True) reads each file
    the index (or the single file) names; the index must list every name, aliases included."""
    import torch

    index = out / "pytorch_model.bin.index.json"
    if index.exists():
        weight_map = json.loads(index.read_text())["weight_map"]
        files = sorted(set(weight_map.values()))
    else:
        weight_map, files = None, ["pytorch_model.bin"]
    tensors: dict[str, torch.Tensor] = {}
    for file in files:
        with zipfile.ZipFile(out / file) as archive:
            assert archive.testzip() is None, file
        part = torch.load(out / file, weights_only=True, mmap=mmap)
        assert weight_map is None or all(weight_map[name] == file for name in part)
        assert not set(part) & set(tensors)
        tensors.update(part)
    assert weight_map is None or set(weight_map) == set(tensors)
    return tensors


def alias_key(tensor: torch.Tensor) -> tuple[object, ...]:
    """What makes two tensors exact aliases: one storage, one view of it."""
    storage = tensor.untyped_storage()._cdata
    return (storage, tensor.storage_offset(), tuple(tensor.shape), tensor.stride(), tensor.dtype)


def assert_round_trip(state: OrderedDict[str, torch.Tensor], out: Path, *, mmap: bool) -> None:
    """Every name as in the source (dtype, shape, bytes), in source order; exact aliases
    share one storage, nothing else shares one."""
    loaded = loaded_shards(out, mmap=mmap)
    assert sorted(loaded) == sorted(state)
    for name, tensor in state.items():
        assert loaded[name].dtype == tensor.dtype, name
        assert tuple(loaded[name].shape) == tuple(tensor.shape), name
        assert torch_bytes(loaded[name]) == torch_bytes(tensor), name
    for first in state:
        for second in state:
            if first >= second or not loaded[first].untyped_storage().nbytes():
                continue
            tied = alias_key(state[first]) == alias_key(state[second])
            shared = (
                loaded[first].untyped_storage().data_ptr()
                == loaded[second].untyped_storage().data_ptr()
            )
            assert tied == shared, (first, second)


# --- round trips ---------------------------------------------------------------------------

DTYPES = ["float32", "bfloat16", "float16", "int64", "int32", "uint8", "bool", "float64"]
KINDS = ["new", "new", "alias", "detached", "rows", "t", "expand"]
tensor_specs = st.lists(
    st.tuples(
        st.sampled_from(DTYPES), st.lists(st.integers(0, 5), max_size=3), st.sampled_from(KINDS)
    ),
    min_size=1,
    max_size=10,
)


def state_from(specs: list[tuple[str, list[int], str]]) -> OrderedDict[str, torch.Tensor]:
    """New tensors of any dtype and shape (0-d and empty ones included), and aliases (the
    same object, or a detached one on the same storage) and views of earlier ones."""
    state: OrderedDict[str, torch.Tensor] = OrderedDict()
    bases: list[torch.Tensor] = []
    for number, (dtype, shape, kind) in enumerate(specs):
        if kind == "new" or not bases:
            bases.append(random_tensor(dtype, tuple(shape), number))
            state[f"t{number}"] = bases[-1]
            continue
        base = bases[number % len(bases)]
        state[f"t{number}"] = {
            "alias": base,
            "detached": base.detach(),
            "rows": base[1:] if base.dim() else base,
            "t": base.t() if base.dim() <= 2 else base.transpose(0, 2),
            "expand": base.unsqueeze(0).expand(2, *base.shape),
        }[kind]
    return state


@pytest.mark.slow
@settings(
    max_examples=30, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(tensor_specs, st.sampled_from([None, 1, 200]), st.booleans())
def test_random_state_dicts_round_trip(
    tmp_path: Path, specs: list[tuple[str, list[int], str]], max_shard: int | None, mmap: bool
) -> None:
    import torch

    state = state_from(specs)
    source = tmp_path / "random.bin"
    torch.save(state, source)
    out = tmp_path / "out"
    shutil.rmtree(out, ignore_errors=True)
    limit = ["--max-shard", str(max_shard)] if max_shard else []
    run = cli("convert", source, "-o", out, "--to", "torch", *limit)
    assert run.code == 0, run.stderr
    assert_round_trip(state, out, mmap=mmap)
    read = read_tensors(out)  # and as ckptfix reads it back
    assert {name: data for name, (_, _, data) in read.items()} == {
        name: torch_bytes(tensor) for name, tensor in state.items()
    }
    assert not [f for f in ckptfix.inspect(out).findings if f.severity.value == "error"]


def test_views_ties_and_every_kind_of_tensor(tmp_path: Path) -> None:
    import torch

    from tests.builders import views_state_dict

    state = views_state_dict()
    source = tmp_path / "views.bin"
    torch.save(state, source)
    for limit in ("5GB", "300"):
        out = tmp_path / f"out-{limit}"
        run = cli("convert", source, "-o", out, "--to", "torch", "--max-shard", limit)
        assert run.code == 0, run.stderr
        for mmap in (False, True):
            assert_round_trip(state, out, mmap=mmap)
        assert cli("diff", source, out).code == 0  # same names, same bytes, as ckptfix sees them


def without_serialization_id(data: bytes) -> tuple[bytes, bytes, bytes]:
    """An archive's bytes up to the serialization id's first half, the id's second half, and
    the central directory with the id's CRC blanked (the one record whose bytes depend on
    C++'s std::hash in torch's writer)."""
    with zipfile.ZipFile(io.BytesIO(data)) as archive:
        info = archive.getinfo("archive/.data/serialization_id")
        identity = archive.read(info)
    start = data.index(identity, info.header_offset)
    central = data.rindex(b"PK\x01\x02")
    directory = data[data.index(b"PK\x01\x02", start) :]
    blanked = directory[: central - len(data) + len(directory) + 16] + b"\0" * 4
    blanked += directory[central - len(data) + len(directory) + 20 :]
    return data[:start], identity[20:], blanked


def test_bytes_are_torch_saves(tmp_path: Path) -> None:
    """Contiguous tensors and a tie (two tensor objects on one storage, as state_dict()
    gives them): the file is what torch.save writes for the same state dict."""
    import torch

    matrix = random_tensor(torch.float32, (3, 4), 1)
    state = OrderedDict(
        embed=matrix,
        head=matrix.detach(),
        half=random_tensor(torch.bfloat16, (5,), 2),
        empty=torch.empty(0, 3),
        step=torch.tensor(7),
        flags=torch.tensor([True, False]),
        counts=torch.arange(300, dtype=torch.int32).to(torch.uint16),
    )
    source = tmp_path / "state.bin"
    torch.save(state, source)
    run = cli("convert", source, "-o", tmp_path / "out", "--to", "torch")
    assert run.code == 0, run.stderr
    buffer = io.BytesIO()
    torch.save(state, buffer)
    ours = (tmp_path / "out" / "pytorch_model.bin").read_bytes()
    assert without_serialization_id(ours) == without_serialization_id(buffer.getvalue())


def test_a_cast_and_gathered_views_stream_through_chunks(tmp_path: Path) -> None:
    import torch

    base = random_tensor(torch.float32, (64, 48), 3).clamp(-1e30, 1e30).nan_to_num()
    state = OrderedDict(w=base, t=base.t(), e=base[0:1].expand(5, 48), i=torch.arange(6))
    source = tmp_path / "state.bin"
    torch.save(state, source)
    run = cli("convert", source, "-o", tmp_path / "out", "--to", "torch", "--dtype", "bf16")
    assert run.code == 0, run.stderr
    loaded = loaded_shards(tmp_path / "out")
    for name in ("w", "t", "e"):
        assert loaded[name].dtype == torch.bfloat16
        assert torch.equal(loaded[name], state[name].bfloat16()), name
    assert torch.equal(loaded["i"], state["i"])


@pytest.mark.slow
def test_thousands_of_small_tensors_read_back_in_batches(factory: Factory, tmp_path: Path) -> None:
    """More storages than one read-back job takes (descriptors written by several jobs), in
    two shards; `diff` finds the output identical to its source."""
    from ckptfix.write.torch import READ_BACK_BATCH

    count = 2 * READ_BACK_BATCH + 300
    specs = [Spec(f"layer.{i}", ["F32", "BF16", "U8"][i % 3], (i % 5, 2)) for i in range(count)]
    source = factory.safetensors("many.safetensors", specs)
    out = tmp_path / "out"
    run = cli("convert", source, "-o", out, "--to", "torch", "--max-shard", "20KB")
    assert run.code == 0, run.stderr
    assert len(list(out.glob("*.bin"))) == 2
    assert read_tensors(out) == read_tensors(source)
    assert len(loaded_shards(out)) == count
    assert cli("diff", source, out).code == 0


def test_no_verify_still_writes_every_crc(tmp_path: Path) -> None:
    import torch

    state = OrderedDict(a=random_tensor(torch.float32, (100, 10), 1), b=torch.ones(3).t())
    source = tmp_path / "state.bin"
    torch.save(state, source)
    run = cli("convert", source, "-o", tmp_path / "out", "--to", "torch", "--no-verify")
    assert run.code == 0, run.stderr
    assert "not verified (--no-verify)" in run.stdout
    assert_round_trip(state, tmp_path / "out", mmap=False)


# --- ties: the plan, the index, the loaders -----------------------------------------------


def tied_source(tmp_path: Path) -> tuple[Path, OrderedDict[str, torch.Tensor]]:
    import torch

    embed = random_tensor(torch.float32, (6, 4), 1)
    state = OrderedDict(
        [
            ("module.embed", embed),
            ("module.body", random_tensor(torch.float32, (8, 8), 2)),
            ("module.head", embed.detach()),
        ]
    )
    source = tmp_path / "tied.bin"
    torch.save(state, source)
    return source, state


def test_the_plan_says_ties_are_shared_not_dropped(tmp_path: Path) -> None:
    source, _ = tied_source(tmp_path)
    run = cli("convert", source, "-o", tmp_path / "o", "--to", "torch", "--dry-run", "--json")
    plan = run.json()["plan"]
    assert plan["shared"] == {"module.head": "module.embed"}
    assert plan["dropped"] == {} and plan["dropped_bytes"] == 0
    assert plan["shards"][0]["tensors"] == ["module.embed", "module.body", "module.head"]
    assert plan["total_size"] == (6 * 4 + 8 * 8) * 4  # the tie's bytes once
    human = cli("convert", source, "-o", tmp_path / "o", "--to", "torch", "--dry-run")
    assert "shared storage (stored once, loaded as tied tensors): module.head → module.embed" in (
        human.stdout
    )
    assert "dropped" not in human.stdout
    safetensors = cli("convert", source, "-o", tmp_path / "o", "--dry-run", "--json")
    assert safetensors.json()["plan"]["dropped"] == {"module.head": "module.embed"}
    assert safetensors.json()["plan"]["shared"] == {}


def test_keep_last_and_strip_prefix_keep_source_order(tmp_path: Path) -> None:
    import torch

    source, state = tied_source(tmp_path)
    out = tmp_path / "out"
    run = cli(
        "convert", source, "-o", out, "--to", "torch", "--keep", "last", "--strip-prefix",
        "auto", "--max-shard", "200", "--json",
    )  # fmt: skip
    assert run.code == 0, run.stderr
    assert run.json()["plan"]["shared"] == {"embed": "head"}
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    assert DROPPED_KEY not in index["metadata"]
    assert index["metadata"]["total_size"] == (6 * 4 + 8 * 8) * 4
    assert index["weight_map"]["embed"] == index["weight_map"]["head"]
    first = torch.load(out / index["weight_map"]["head"], weights_only=True)
    assert list(first) == ["embed", "head"]  # source order, whichever name is kept
    assert first["embed"].untyped_storage().data_ptr() == first["head"].untyped_storage().data_ptr()
    assert torch.equal(first["head"], state["module.head"])
    findings = ckptfix.inspect(out).findings  # the index's total_size counts the tie once
    assert [f.code for f in findings] == ["shared-storage"]


def test_with_shared_lists_aliases_in_their_kept_tensors_shard() -> None:
    shards = (PlannedShard("a.bin", ("x", "y"), 8), PlannedShard("b.bin", ("z",), 4))
    shared = {"w": "z", "v": "x"}
    got = with_shared(shards, ["v", "w", "x", "y", "z"], shared)
    assert [shard.tensors for shard in got] == [("v", "x", "y"), ("w", "z")]
    assert [shard.nbytes for shard in got] == [8, 4]
    missed = with_shared(shards, ["x"], shared)  # names the order misses go last
    assert [shard.tensors for shard in missed] == [("x", "v", "y"), ("w", "z")]


@pytest.mark.slow
@pytest.mark.parametrize("max_shard", ["5GB", "100KB"])
def test_tiny_gpt2_loads_with_identical_logits(tmp_path: Path, max_shard: str) -> None:
    import torch
    from transformers import GPT2LMHeadModel

    model = tiny_gpt2()
    source = tmp_path / "gpt2"
    model.config.save_pretrained(source)
    torch.save(model.state_dict(), source / "pytorch_model.bin")
    out = tmp_path / "out"
    run = cli("convert", source, "-o", out, "--to", "torch", "--max-shard", max_shard)
    assert run.code == 0, run.stderr
    loads_with_same_logits(GPT2LMHeadModel, out, model)
    state = loaded_shards(out, mmap=True)
    assert set(state) == set(model.state_dict())
    assert state["lm_head.weight"].data_ptr() == state["transformer.wte.weight"].data_ptr()
    assert not [f for f in ckptfix.inspect(out).findings if f.code != "shared-storage"]


@pytest.mark.slow
def test_a_dcp_folder_converts_from_its_pieces(tmp_path: Path, dcp_saved: Path) -> None:
    import torch

    reference = torch.load(dcp_saved / "reference.pt", weights_only=True)
    run = cli("convert", dcp_saved / "torch_save", "-o", tmp_path / "out", "--to", "torch")
    assert run.code == 0, run.stderr
    loaded = loaded_shards(tmp_path / "out")
    assert sorted(loaded) == sorted(reference)
    for name, tensor in reference.items():
        assert torch_bytes(loaded[name]) == torch_bytes(tensor), name


def test_a_dtype_torch_lacks_is_refused_before_writing(factory: Factory, tmp_path: Path) -> None:
    source = factory.safetensors("m.safetensors", [Spec("a"), Spec("packed", "F4", (4, 2))])
    for extra in ([], ["--dry-run"]):
        out = tmp_path / "out"
        run = cli("convert", source, "-o", out, "--to", "torch", *extra)
        assert run.code == 1
        assert run.error_lines == [
            f"error: {out}: torch has no dtype for F4 (1 tensor(s), e.g. 'packed'), so a .bin "
            "cannot hold them (rule cannot-plan; convert to safetensors instead, or --exclude those tensors)"
        ]
        assert not out.exists()
    assert cli("convert", source, "-o", out, "--to", "torch", "--exclude", "packed").code == 0


# --- memory and ZIP64 ----------------------------------------------------------------------


def sparse_checkpoint(path: Path, huge: int) -> Path:
    """safetensors with a small tensor, one of `huge` bytes that is a hole, another small
    one: the writer's memory is measured with no disk to speak of."""
    small = struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)
    entries = [
        HeaderEntry("before", "F32", (4,), 0, 16),
        HeaderEntry("huge", "U8", (huge,), 16, 16 + huge),
        HeaderEntry("after", "F32", (4,), 16 + huge, 32 + huge),
    ]
    header = encode_header(entries, {"format": "pt"})
    with open(path, "wb") as handle:
        handle.write(header + small)
        handle.seek(len(header) + 16 + huge)
        handle.write(small[::-1])
    return path


def assert_sparse_output(out: Path, huge: int) -> None:
    import torch

    state = torch.load(out / "pytorch_model.bin", weights_only=True, mmap=True)
    assert list(state) == ["before", "huge", "after"]
    assert state["huge"].shape == (huge,) and int(state["huge"][-4096:].sum()) == 0
    assert torch.equal(state["before"], torch.tensor([1.0, 2.0, 3.0, 4.0]))
    assert torch_bytes(state["after"]) == struct.pack("<4f", 1.0, 2.0, 3.0, 4.0)[::-1]


@pytest.mark.slow
def test_one_gib_tensor_in_bounded_memory(tmp_path: Path) -> None:
    huge = 2**30
    source = sparse_checkpoint(tmp_path / "big.safetensors", huge)
    out = tmp_path / "out"
    run = measured("convert", source, "-o", out, "--to", "torch", timeout=300)
    assert run.code == 0, run.stderr
    assert run.peak_rss < 250 * MiB, run.peak_rss / MiB  # through torch.save: over 2 GiB
    assert_sparse_output(out, huge)


@pytest.mark.slow
def test_past_4_gib_the_archive_is_zip64_and_torch_reads_it(tmp_path: Path) -> None:
    """A 4.3 GB tensor (the issue's: 12.8 GB of RSS through torch.save) and one after it that
    starts past 4 GiB: ZIP64 sizes and offsets, read by torch, zipfile and ckptfix."""
    huge = 2**32 + 100
    source = sparse_checkpoint(tmp_path / "big.safetensors", huge)
    out = tmp_path / "out"
    run = measured("convert", source, "-o", out, "--to", "torch", timeout=600)
    assert run.code == 0, run.stderr
    assert run.peak_rss < 250 * MiB, run.peak_rss / MiB
    with zipfile.ZipFile(out / "pytorch_model.bin") as archive:
        infos = {info.filename: info for info in archive.infolist()}
    assert infos["archive/data/1"].file_size == huge
    assert infos["archive/data/2"].header_offset > 2**32
    assert_sparse_output(out, huge)
    assert "huge-numel" in [f.code for f in ckptfix.inspect(out).findings]


# --- faults --------------------------------------------------------------------------------


@pytest.fixture
def torch_source(tmp_path: Path) -> Path:
    """About 8 MB: contiguous tensors (kernel copies), a transposed one (gathered) and a tie."""
    import torch

    generator = torch.Generator().manual_seed(0)
    state = {f"w{i}": torch.randn(256, 1024, generator=generator) for i in range(6)}
    state.update(t=state["w0"].t(), tied=state["w1"].detach())
    path = tmp_path / "src" / "pytorch_model.bin"
    path.parent.mkdir()
    torch.save(state, path)
    return path


def to_torch(source: Path, out: Path, max_shard: int = 3 * 10**6) -> object:
    return convert(source, out, ConvertOptions(max_shard, to="torch"))


@pytest.mark.parametrize(("call", "nth"), [("copy_range", 3), ("pwrite", 9)])
def test_injected_enospc_leaves_nothing(
    torch_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, call: str, nth: int
) -> None:
    fail_nth(monkeypatch, system(), call, nth, errno.ENOSPC)
    out = tmp_path / "out"
    with pytest.raises(WriteError) as caught:
        to_torch(torch_source, out)
    assert caught.value.line() == (
        f"error: {out}: no space left on device; nothing was written "
        "(rule write-failed; free some space or choose another -o folder)"
    )
    assert not out.exists()
    assert not list(tmp_path.glob(".ckptfix-*"))


def test_a_real_full_disk_leaves_nothing(
    torch_source: Path, mount: Callable[[str], Path], monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptfix.ops import rewrite

    monkeypatch.setattr(rewrite, "check_free_space", lambda *args: None)  # hit the wall
    tiny = mount("size=4m")
    with pytest.raises(WriteError, match="no space left on device"):
        to_torch(torch_source, tiny / "out")
    assert list(tiny.iterdir()) == []


@pytest.mark.parametrize("change", ["grow", "truncate"])
def test_a_source_changing_mid_write_is_an_error(
    torch_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, change: str
) -> None:
    real = copying.copy_range

    def copy_then_change(*args: object, **kwargs: object) -> None:
        real(*args, **kwargs)  # type: ignore[arg-type]
        with open(torch_source, "r+b") as handle:
            if change == "grow":
                handle.seek(0, os.SEEK_END)
                handle.write(b"x")
            else:
                handle.truncate(os.path.getsize(torch_source) // 2)

    monkeypatch.setattr(copying, "copy_range", copy_then_change)
    out = tmp_path / "out"
    with pytest.raises(WriteError, match="changed"):
        to_torch(torch_source, out)
    assert not out.exists()
    assert not list(tmp_path.glob(".ckptfix-*"))


def test_bytes_that_read_back_different_are_caught(
    torch_source: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptfix.write import torch as writer

    real = writer.copy_from

    def copy_then_damage(*args: object) -> None:
        real(*args)  # type: ignore[arg-type]
        dst, dst_offset = args[3], args[4]
        assert isinstance(dst, int) and isinstance(dst_offset, int)
        os.pwrite(dst, b"\xff\xfe", dst_offset + 100)

    monkeypatch.setattr(writer, "copy_from", copy_then_damage)
    out = tmp_path / "out"
    with pytest.raises(VerificationError, match="reads back different from its source"):
        to_torch(torch_source, out)
    assert not out.exists()
    assert not list(tmp_path.glob(".ckptfix-*"))


@pytest.mark.slow
def test_sigterm_at_several_points_leaves_nothing_or_everything(
    torch_source: Path, tmp_path: Path
) -> None:
    import torch

    state = torch.load(torch_source, weights_only=True)
    command = [sys.executable, "-m", "ckptfix", "convert", str(torch_source), "--to", "torch"]
    command += ["--max-shard", "3MB"]
    start = time.perf_counter()
    subprocess.run([*command, "-o", str(tmp_path / "baseline")], check=True, capture_output=True)
    duration = time.perf_counter() - start
    outcomes = set()
    for trial in range(8):
        out = tmp_path / f"out{trial}"
        with subprocess.Popen([*command, "-o", str(out)], stderr=subprocess.PIPE) as process:
            time.sleep(duration * (0.1 + trial / 6))
            process.send_signal(signal.SIGTERM)
            _, stderr = process.communicate()
        assert b"Traceback" not in stderr
        assert not list(tmp_path.glob(".ckptfix-*")), trial
        if out.exists():
            outcomes.add("complete")
            assert_round_trip(OrderedDict(state), out, mmap=False)
        else:
            outcomes.add("absent")
    assert "absent" in outcomes
