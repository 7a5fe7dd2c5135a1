"""The invariances of the digest as properties: random state dicts (dtypes incl. bf16 and
fp8, views, aliases, scalars, empty tensors) written in every format and sharding hash to the
oracle's digest (hashlib over torch's bytes); a flipped bit, a new name, dtype or shape
changes it, and diff names exactly what changed."""

from __future__ import annotations

import json
import os
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

import ckptfix
from ckptfix.ops.diff import diff
from ckptfix.ops.hash import hash_checkpoint
from ckptfix.ops.rewrite import ConvertOptions
from tests import hash_oracle as oracle

if TYPE_CHECKING:
    import torch

pytestmark = pytest.mark.slow

EXAMPLES = max(int(os.environ.get("CKPTFIX_FUZZ_EXAMPLES", "300")) // 10, 20)
PROPERTY = settings(
    max_examples=EXAMPLES,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow],
)
DTYPES = [
    "float32",
    "float16",
    "bfloat16",
    "float64",
    "float8_e4m3fn",
    "int64",
    "int8",
    "uint8",
    "bool",
]
State = dict[str, "torch.Tensor"]


def _random(shape: tuple[int, ...], dtype: torch.dtype, seed: int) -> torch.Tensor:
    """Random bit patterns (NaNs included: the hash sees bytes, not values)."""
    import torch

    generator = torch.Generator().manual_seed(seed)
    numel = 1
    for dim in shape:
        numel *= dim
    if dtype == torch.bool:
        return torch.randint(0, 2, shape, generator=generator).bool()
    width = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (numel * width,), dtype=torch.uint8, generator=generator)
    return raw.view(dtype).reshape(shape)


@st.composite
def state_dicts(draw: st.DrawFn) -> State:
    import torch

    state: State = {}
    for index in range(draw(st.integers(1, 5))):
        dtype = getattr(torch, draw(st.sampled_from(DTYPES)))
        shape = tuple(draw(st.lists(st.integers(0, 6), min_size=0, max_size=3)))
        tensor = _random(shape, dtype, draw(st.integers(0, 2**16)))
        kind = draw(st.sampled_from(["plain", "transposed", "sliced", "expanded", "alias"]))
        if kind == "transposed" and tensor.dim() >= 2:
            tensor = tensor.transpose(0, 1)
        elif kind == "sliced" and tensor.dim() >= 1 and tensor.shape[0] > 1:
            tensor = tensor[1:] if draw(st.booleans()) else tensor[::2]
        elif kind == "expanded" and tensor.dim() >= 1 and tensor.shape[0] == 1:
            tensor = tensor.expand(3, *tensor.shape[1:])
        elif kind == "alias" and state:
            tensor = state[draw(st.sampled_from(sorted(state)))]
        prefix = draw(st.sampled_from(["", "model.layers.", "blocks.é."]))
        state[f"{prefix}{index}.weight"] = tensor
    return state


def _contiguous(state: State) -> State:
    return {name: tensor.contiguous().clone() for name, tensor in state.items()}


def _safetensors(state: State, folder: Path, draw: st.DrawFn) -> Path:
    from safetensors.torch import save_file

    path = folder / "model.safetensors"
    names = draw(st.permutations(sorted(state)))
    metadata = {"format": "pt", "note": draw(st.text(max_size=5))}
    save_file({name: state[name].contiguous().clone() for name in names}, str(path), metadata)
    return path


def _sharded(state: State, folder: Path, draw: st.DrawFn, *, torch_files: bool = False) -> Path:
    """Shards of random sizes in random order, with their index."""
    import torch
    from safetensors.torch import save_file

    names = list(draw(st.permutations(sorted(state))))
    count = draw(st.integers(1, len(names)))
    cuts = sorted(
        draw(st.lists(st.integers(1, len(names)), min_size=count - 1, max_size=count - 1))
    )
    groups = [names[a:b] for a, b in zip([0, *cuts], [*cuts, len(names)], strict=True)]
    groups = [group for group in groups if group]
    stem, ext = ("pytorch_model", "bin") if torch_files else ("model", "safetensors")
    weight_map = {}
    for number, group in enumerate(groups, start=1):
        shard = f"{stem}-{number:05d}-of-{len(groups):05d}.{ext}"
        part = {name: state[name] for name in group}
        if torch_files:
            torch.save(part, folder / shard)
        else:
            save_file(_contiguous(part), str(folder / shard), {"format": "pt"})
        weight_map.update(dict.fromkeys(group, shard))
    index = {"metadata": {"total_size": 0}, "weight_map": weight_map}
    (folder / f"{stem}.{ext}.index.json").write_text(json.dumps(index))
    return folder


def _hub(state: State, folder: Path, draw: st.DrawFn) -> Path:
    from huggingface_hub import save_torch_state_dict

    save_torch_state_dict(
        _contiguous(state), folder, max_shard_size=draw(st.sampled_from([64, 10**6]))
    )
    return folder


def _torch(state: State, folder: Path, draw: st.DrawFn, *, legacy: bool = False) -> Path:
    import torch

    path = folder / "model.pt"
    torch.save(state, path, _use_new_zipfile_serialization=not legacy)
    return path


def _converted(state: State, folder: Path, draw: st.DrawFn) -> Path:
    """ckptfix's own output: aliases written once and recorded as dropped -> kept."""
    import torch

    source = folder / "source.bin"
    torch.save(state, source)
    max_shard = draw(st.sampled_from([64, 5 * 10**9]))
    ckptfix.convert(source, folder / "out", ConvertOptions(max_shard=max_shard))
    source.unlink()
    return folder / "out"


WRITERS: dict[str, Callable[..., Path]] = {
    "safetensors": _safetensors,
    "safetensors-sharded": _sharded,
    "huggingface_hub": _hub,
    "torch-zip": _torch,
    "torch-legacy": lambda s, f, d: _torch(s, f, d, legacy=True),
    "torch-sharded": lambda s, f, d: _sharded(s, f, d, torch_files=True),
    "ckptfix-convert": _converted,
}


@PROPERTY
@given(state=state_dicts(), data=st.data())
def test_every_format_and_sharding_hashes_alike(tmp_path: Path, state: State, data: Any) -> None:
    expected = oracle.digest(state)
    for label, write in WRITERS.items():
        folder = tmp_path / f"{label}-{os.urandom(4).hex()}"
        folder.mkdir()
        path = write(state, folder, data.draw)
        result = hash_checkpoint(path)
        assert result.digest == expected, label
        assert {t.name: t.digest for t in result.tensors} == {
            name: digest.hex() for name, digest in oracle.tensor_digests(state).items()
        }, label


def _changed(state: State, draw: st.DrawFn) -> tuple[State, str, str]:
    """The state with one change: (new state, the name changed, the kind of change)."""
    import torch

    name = draw(st.sampled_from(sorted(state)))
    tensor = oracle.fresh(state[name])
    changes = ["renamed"]
    if tensor.numel():
        changes += ["bit", "shape"]
    if tensor.element_size() == 2:
        changes.append("dtype")
    kind = draw(st.sampled_from(changes))
    changed = {key: value for key, value in state.items() if key != name}
    if kind == "renamed":
        changed[name + ".renamed"] = tensor
        return changed, name, kind
    if kind == "bit":
        flat = tensor.reshape(-1).clone()
        if tensor.dtype == torch.bool:
            index = draw(st.integers(0, flat.numel() - 1))
            flat[index] = ~flat[index]
        else:
            raw = flat.view(torch.uint8)  # shares flat's storage
            raw[draw(st.integers(0, raw.numel() - 1))] ^= 1 << draw(st.integers(0, 7))
        tensor = flat.reshape(tensor.shape)
    elif kind == "shape":
        tensor = tensor.reshape(-1) if tensor.dim() != 1 else tensor.reshape(1, -1)
    else:
        tensor = tensor.view(torch.bfloat16 if tensor.dtype != torch.bfloat16 else torch.float16)
    changed[name] = tensor
    return changed, name, kind


@PROPERTY
@given(state=state_dicts(), data=st.data())
def test_any_change_is_seen_and_named(tmp_path: Path, state: State, data: Any) -> None:
    import torch

    changed, name, kind = _changed(state, data.draw)
    before = tmp_path / f"a-{os.urandom(4).hex()}.pt"
    torch.save(state, before)
    after = tmp_path / f"b-{os.urandom(4).hex()}"
    after.mkdir()
    path = data.draw(st.sampled_from([_safetensors, _sharded]))(changed, after, data.draw)
    assert hash_checkpoint(path).digest == oracle.digest(changed) != oracle.digest(state)
    result = diff(before, path)
    assert not result.identical
    if kind == "renamed":
        assert (result.only_in_a, result.only_in_b) == ((name,), (name + ".renamed",))
    elif kind == "bit":
        assert [change.name for change in result.bytes_changed] == [name]
    else:
        assert [change.name for change in result.layout_changed] == [name]
    assert result.difference_count == (2 if kind == "renamed" else 1)
