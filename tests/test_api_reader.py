"""`ckptfix.open`: every format ckptfix reads, one tensor at a time, equal bitwise to what
torch.load(weights_only=True) reads; aliases and declared ties under both names; only the
bytes of the tensor asked for are read; the CLI's refusals."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest

import ckptfix
from tests import training_fixtures as fixtures
from tests.builders import Factory, Spec, every_dtype_state, views_state_dict
from tests.helpers import cli, torch_bytes
from tests.optional import need
from tests.remote_servers import http_server
from tests.training_frameworks import ZERO_CONFIGS

if TYPE_CHECKING:
    import torch

dcp_saved = fixtures.dcp_saved  # training checkpoints written by the frameworks themselves
zero_saved = fixtures.zero_saved


def _same(got: torch.Tensor, want: torch.Tensor) -> bool:
    return (got.dtype, got.shape, torch_bytes(got)) == (want.dtype, want.shape, torch_bytes(want))


def _state() -> dict[str, torch.Tensor]:
    return {**views_state_dict(), **every_dtype_state((3, 5), scalar_seed=50, empty=(0, 2))}


def _zip(path: Path, state: dict[str, Any]) -> Path:
    import torch

    torch.save(state, path)
    return path


def _legacy(path: Path, state: dict[str, Any]) -> Path:
    """The pre-zip format; torch cannot load back the dtypes it writes without a typed
    storage class (uint16-64, fp8), so only those with one."""
    import torch

    untyped = ("U16.", "U32.", "U64.", "F8_")
    state = {name: tensor for name, tensor in state.items() if not name.startswith(untyped)}
    torch.save(state, path, _use_new_zipfile_serialization=False)
    return path


@pytest.mark.parametrize("write", [_zip, _legacy], ids=["torch-zip", "torch-legacy"])
def test_torch_files_read_as_torch_load_reads_them(
    tmp_path: Path, write: Callable[[Path, dict[str, Any]], Path]
) -> None:
    import torch

    path = write(tmp_path / "model.pt", _state())
    want = torch.load(path, weights_only=True)
    with ckptfix.open(path) as reader:
        assert sorted(reader.keys()) == sorted(want)
        for name, tensor in want.items():
            assert _same(reader.get(name, framework="pt"), tensor), name
            info = reader.info(name)
            assert (info.shape, info.nbytes) == (tuple(tensor.shape), len(torch_bytes(tensor)))


def test_numpy_arrays_hold_the_same_bytes(tmp_path: Path) -> None:
    import numpy as np
    import torch

    path = _zip(tmp_path / "model.pt", _state())
    want = torch.load(path, weights_only=True)
    with ckptfix.open(path) as reader:
        for name, tensor in want.items():
            if reader.info(name).dtype in ("BF16", "F8_E4M3", "F8_E5M2") or "F8" in name:
                continue
            array = reader.get(name)
            assert isinstance(array, np.ndarray) and array.flags.writeable
            assert array.shape == tuple(tensor.shape)
            assert np.ascontiguousarray(array).tobytes() == torch_bytes(tensor), name


def test_numpy_refuses_bf16_and_names_the_framework_that_has_it(tmp_path: Path) -> None:
    path = _zip(tmp_path / "model.pt", _state())
    with ckptfix.open(path) as reader, pytest.raises(ValueError) as caught:
        reader.get("BF16.matrix")
    assert str(caught.value) == (
        "error: framework: tensor 'BF16.matrix' is BF16, which numpy has no dtype for "
        '(rule usage; read it with framework="pt" (a torch tensor))'
    )


def test_safetensors_folders_read_with_their_metadata_and_alias_record(tmp_path: Path) -> None:
    import torch

    state = views_state_dict()
    written = ckptfix.save(state, tmp_path / "out", max_shard=200, metadata={"origin": "test"})
    assert written.aliases == {"lm_head": "embed"}  # "embed" < "lm_head": kept
    assert written.index is not None
    with ckptfix.open(tmp_path / "out") as reader:
        assert sorted(reader.keys()) == sorted(state)
        assert reader.aliases == {"lm_head": "embed"}
        assert reader.metadata == {"origin": "test", "format": "pt"}
        for name, tensor in state.items():
            assert _same(reader.get(name, framework="pt"), tensor), name
        assert reader.info("lm_head").stored_as == "embed"
        assert torch.equal(reader.get("lm_head", framework="pt"), state["embed"])


def _tied_folder(root: Path, config: dict[str, Any]) -> Path:
    import torch

    root.mkdir()
    state = {"model.embed_tokens.weight": torch.randn(8, 4), "model.norm.weight": torch.ones(4)}
    from safetensors.torch import save_file

    save_file(state, str(root / "model.safetensors"), metadata={"format": "pt"})
    (root / "config.json").write_text(json.dumps(config))
    return root


def test_a_head_config_json_ties_reads_as_the_embedding(tmp_path: Path) -> None:
    tied = {"architectures": ["LlamaForCausalLM"], "model_type": "llama"}
    folder = _tied_folder(tmp_path / "tied", {**tied, "tie_word_embeddings": True})
    with ckptfix.open(folder) as reader:
        assert reader.keys() == ["model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"]
        assert reader.aliases == {"lm_head.weight": "model.embed_tokens.weight"}
        assert (reader.get("lm_head.weight") == reader.get("model.embed_tokens.weight")).all()
    # llama leaves the head untied unless config.json says so; an encoder has no LM head
    for name, config in [("untied", tied), ("encoder", {"model_type": "bert"})]:
        with ckptfix.open(_tied_folder(tmp_path / name, config)) as reader:
            assert "lm_head.weight" not in reader.keys()  # noqa: SIM118 - keys() is the API


def test_a_closed_reader_refuses(factory: Factory) -> None:
    reader = ckptfix.open(factory.safetensors("m.safetensors", [Spec("a")]))
    reader.close()
    with pytest.raises(ValueError, match="closed"):
        reader.get("a")


def test_error_findings_refuse_as_a_rewrite_does(factory: Factory, tmp_path: Path) -> None:
    folder = tmp_path / "sharded"
    ckptfix.save({"a": _ones(4), "b": _ones(4)}, folder, max_shard=16)
    (folder / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(ValueError) as caught:
        ckptfix.open(folder)
    run = cli("hash", folder)
    assert run.code == 1
    assert run.error_lines == [caught.value.line()]  # type: ignore[attr-defined]


def _ones(count: int) -> Any:
    import numpy as np

    return np.ones(count, dtype=np.float32)


@pytest.mark.slow
def test_a_url_reads_as_the_local_folder(tmp_path: Path) -> None:
    need("aiohttp")
    import torch

    root = tmp_path / "served"
    root.mkdir()
    state = {"w": torch.randn(6, 3), "b": torch.randn(3).to(torch.bfloat16)}
    ckptfix.save(state, root / "model", max_shard=40)
    with http_server(root) as server, ckptfix.open(f"{server.url}/model") as reader:
        assert sorted(reader.keys()) == ["b", "w"]
        for name, tensor in state.items():
            assert _same(reader.get(name, framework="pt"), tensor)


BYTES_READ = """
import sys, ckptfix
def read_so_far():
    with open("/proc/self/io") as io:
        return next(int(line.split()[1]) for line in io if line.startswith("rchar"))
with ckptfix.open(sys.argv[1]) as reader:
    reader.get(sys.argv[2])  # every module imported, every cache warm
reader = ckptfix.open(sys.argv[1])
opened = read_so_far()
tensor = reader.get(sys.argv[2])
print(read_so_far() - opened, tensor.nbytes)
"""


def _bytes_read(path: Path, name: str) -> tuple[int, int]:
    done = subprocess.run(
        [sys.executable, "-c", BYTES_READ, str(path), name],
        capture_output=True,
        text=True,
        check=True,
    )
    read, nbytes = map(int, done.stdout.split())
    return read, nbytes


@pytest.mark.slow
def test_get_reads_only_that_tensor(tmp_path: Path) -> None:
    import numpy as np

    state = {f"layer{i}": np.full((1024, 1024), i, dtype=np.float32) for i in range(6)}
    ckptfix.save(state, tmp_path / "out")
    read, nbytes = _bytes_read(tmp_path / "out" / "model.safetensors", "layer3")
    assert nbytes == 4 * 2**20
    assert nbytes <= read <= nbytes + 4096, read


@pytest.mark.slow
def test_get_from_a_dcp_folder_reads_that_tensor_and_the_metadata(tmp_path: Path) -> None:
    """A DCP folder's tensor read from its chunk: its bytes plus a few of the chunk's own
    header; `.metadata` itself is read by open(), not get()."""
    done = subprocess.run(
        [
            sys.executable,
            "-W",
            "ignore",
            "-c",
            "import sys, torch, torch.distributed.checkpoint as dcp\n"
            "state = {f'layer{i}.weight': torch.full((512, 1024), float(i)) for i in range(6)}\n"
            "dcp.save({'model': state}, checkpoint_id=sys.argv[1])",
            str(tmp_path / "dcp"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    read, nbytes = _bytes_read(tmp_path / "dcp", "layer4.weight")
    assert nbytes == 2 * 2**20
    assert nbytes <= read <= nbytes + 4096, read


ITERATE = """
import sys, ckptfix
def peak():
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM"))
with ckptfix.open(sys.argv[1]) as reader:
    for name, tensor in reader.iter(["t0"], framework="pt"):
        pass
    with open("/proc/self/clear_refs", "w") as refs:
        refs.write("5")  # the peak from here on
    before = peak()
    total = sum(tensor.numel() for name, tensor in reader.iter(framework="pt"))
print(peak() - before, total)
"""


@pytest.mark.slow
def test_iter_holds_one_tensor_at_a_time(tmp_path: Path) -> None:
    import numpy as np

    state = {f"t{i}": np.full(8 * 2**20, i, dtype=np.float32) for i in range(8)}  # 8 x 32 MiB
    ckptfix.save(state, tmp_path / "out")
    done = subprocess.run(
        [sys.executable, "-c", ITERATE, str(tmp_path / "out")],
        capture_output=True,
        text=True,
        check=True,
    )
    grown, total = map(int, done.stdout.split())
    assert total == 8 * 8 * 2**20
    # the tensor yielded and the one before it (still bound to the loop variable), plus one
    # chunk of reading: far below the 256 MiB of the checkpoint
    assert grown <= 2 * 32 * 2**20 + 32 * 2**20, grown


@pytest.mark.slow
def test_a_reader_left_open_at_exit_closes_quietly(tmp_path: Path) -> None:
    import numpy as np

    ckptfix.save({"a": np.ones(4, dtype=np.float32)}, tmp_path / "out")
    done = subprocess.run(
        [
            sys.executable,
            "-c",
            "import sys, ckptfix\n"
            "with ckptfix.open(sys.argv[1]) as reader:\n    reader.get('a')\n"
            "reader = ckptfix.open(sys.argv[1])\nreader.get('a')\n",
            str(tmp_path / "out"),
        ],
        capture_output=True,
        text=True,
        check=False,
    )
    assert (done.returncode, done.stderr) == (0, "")


@pytest.mark.slow
def test_dcp_folders_read_as_dcp_to_torch_save_writes_them(dcp_saved: Path, tmp_path: Path) -> None:
    import torch
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    dcp_to_torch_save(dcp_saved / "torch_save", tmp_path / "oracle.pt")
    oracle = torch.load(tmp_path / "oracle.pt", weights_only=True)["model"]
    reference = torch.load(dcp_saved / "reference.pt", weights_only=True)
    for folder in ("torch_save", "safetensors"):  # torch itself cannot read the second
        with ckptfix.open(dcp_saved / folder) as reader:
            assert sorted(reader.keys()) == sorted(oracle), folder
            for name, tensor in reader.iter(framework="pt"):
                assert _same(tensor, oracle[name]) and _same(tensor, reference[name]), name


@pytest.mark.slow
@pytest.mark.parametrize("name", [f"zero{stage}_{dtype}" for stage, dtype in ZERO_CONFIGS if stage])
def test_zero_master_weights_are_what_zero_to_fp32_makes(zero_saved: Path, name: str) -> None:
    import contextlib
    import io

    from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

    with contextlib.redirect_stdout(io.StringIO()):
        oracle = dict(get_fp32_state_dict_from_zero_checkpoint(str(zero_saved / name)))
    with ckptfix.open(zero_saved / name) as reader:
        # zero_to_fp32 loses stage 1's frozen layer (no frozen_param_shapes); ckptfix has it
        assert set(oracle) <= set(reader.keys())
        for key, tensor in oracle.items():
            assert _same(reader.get(key, framework="pt"), tensor), key


@pytest.mark.slow
def test_zero_module_weights_on_request(zero_saved: Path) -> None:
    import torch

    module = torch.load(
        zero_saved / "zero2_bf16" / "global_step2" / "mp_rank_00_model_states.pt",
        weights_only=False,  # our own fixture, written by DeepSpeed in this session
    )["module"]
    with ckptfix.open(zero_saved / "zero2_bf16", zero_weights="module") as reader:
        assert sorted(reader.keys()) == sorted(module)
        for key, tensor in module.items():
            assert _same(reader.get(key, framework="pt"), tensor), key
