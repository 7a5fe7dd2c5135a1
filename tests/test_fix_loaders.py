"""`ckptfix fix` against the consumer's own loader: a tiny Llama saved by transformers,
broken the ways folders break in the wild, repaired, then loaded by
`AutoModelForCausalLM.from_pretrained` (offline) with weights and logits identical to the
model that was saved. And a property: any mix of the repairable breakages is repaired to
the same tensors, clean for `inspect --fail-on warning`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from tests.builders import Factory, tiny_llama
from tests.fix_cases import REPAIRABLE, broken, clean, loaded
from tests.helpers import cli, read_weights, torch_bytes, tree_snapshot
from tests.loader_layouts import TOKENS, assert_all_loaded

INDEX = "model.safetensors.index.json"


def _perturbed(state: dict[str, Any]) -> dict[str, Any]:
    return {name: tensor + 1 for name, tensor in state.items()}


def _break(folder: Path, state: dict[str, Any]) -> None:
    """A stale index (an entry dropped, total_size wrong), a shard without "format", a
    stale single-file export beside the shards and a stale .bin of older weights."""
    import torch
    from safetensors.torch import load_file, save_file

    index = json.loads((folder / INDEX).read_text())
    dropped = sorted(index["weight_map"])[0]
    del index["weight_map"][dropped]
    index["metadata"]["total_size"] = 1
    (folder / INDEX).write_text(json.dumps(index))
    shard = sorted(folder.glob("model-*.safetensors"))[-1]
    save_file(load_file(shard), str(shard))  # no metadata: no "format"
    stale = _perturbed(state)
    save_file(stale, str(folder / "model.safetensors"), metadata={"format": "pt"})
    torch.save(stale, folder / "pytorch_model.bin")


def _load(folder: Path) -> tuple[dict[str, bytes], Any]:
    import torch
    from transformers import AutoModelForCausalLM

    model, info = AutoModelForCausalLM.from_pretrained(folder, output_loading_info=True)
    assert_all_loaded(info)
    with torch.no_grad():
        logits = model.eval()(torch.tensor(TOKENS)).logits
    return {name: torch_bytes(t) for name, t in model.state_dict().items()}, logits


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["-o", "--in-place"])
def test_transformers_loads_the_repaired_folder(tmp_path: Path, mode: str) -> None:
    import torch

    model = tiny_llama()
    folder = tmp_path / "model"
    model.save_pretrained(folder, max_shard_size="40KB")
    assert len(list(folder.glob("model-*.safetensors"))) > 2
    state = {name: tensor.detach().clone() for name, tensor in model.state_dict().items()}
    with torch.no_grad():
        expected_logits = model(torch.tensor(TOKENS)).logits
    expected = {name: torch_bytes(tensor) for name, tensor in state.items()}
    _break(folder, state)
    assert _load(folder)[0] != expected  # broken: transformers reads the stale export
    out = tmp_path / "out" if mode == "-o" else folder
    run = cli("fix", folder, *(["-o", out] if mode == "-o" else ["--in-place"]), "--json")
    assert run.code == 0, run.stderr
    moved = {item["source"] for item in run.json()["plan"]["moved"]}
    assert moved == {"model.safetensors", "pytorch_model.bin", INDEX}
    weights, logits = _load(out)
    assert weights == expected
    assert torch.equal(logits, expected_logits)
    assert cli("inspect", out, "--fail-on", "warning").code == 0


def _index_choice(folder: Path) -> dict[str, tuple[str, tuple[int, ...], bytes]]:
    """name -> the copy the folder's index maps it to, where that file holds it."""
    from ckptfix.io.gather import tensor_bytes
    from ckptfix.io.source import LocalFile

    path = folder / INDEX
    if not path.exists():
        return {}
    weight_map = json.loads(path.read_text())["weight_map"]
    chosen = {}
    for file in set(weight_map.values()):
        if not (folder / file).exists():
            continue
        with LocalFile(str(folder / file)) as source:
            for tensor in read_weights(folder / file).tensors:
                if weight_map.get(tensor.name) == file:
                    chosen[tensor.name] = (tensor.dtype, tensor.shape, tensor_bytes(source, tensor))
    return chosen


def _held_twice(folder: Path) -> bool:
    """Whether some name is stored in two safetensors files of the folder's top level."""
    seen: set[str] = set()
    for path in folder.glob("*.safetensors"):
        names = {tensor.name for tensor in read_weights(path).tensors}
        if names & seen:
            return True
        seen |= names
    return False


@pytest.mark.slow
@settings(
    max_examples=30,
    deadline=None,
    suppress_health_check=[HealthCheck.function_scoped_fixture],
)
@given(cases=st.lists(st.sampled_from(sorted(REPAIRABLE)), min_size=1, max_size=4, unique=True))
def test_any_mix_of_breakages_is_repaired(tmp_path_factory: Any, cases: list[str]) -> None:
    """Breakages applied in turn (a later one may undo or compound an earlier one): fix
    either repairs the folder, keeping every tensor as the clean folder has it unless the
    index points at another copy, or refuses what the headers cannot decide (a name held
    twice, numbered shards with a part absent and no index), changing nothing."""
    root = tmp_path_factory.mktemp("mix")
    factory = Factory(root)
    expected = loaded(clean(factory, "clean"))
    folder = broken(factory, cases[0])
    for case in cases[1:]:
        if case in ("lost-index", "numbering") and not (folder / INDEX).exists():
            continue  # nothing left to lose or rename
        REPAIRABLE[case][0](factory, "broken")
    expected.update(_index_choice(folder))
    before = tree_snapshot(folder)
    run = cli("fix", folder, "-o", root / "out", "--json")
    if run.code != 0:
        rule = run.json()["error"]["rule"]
        if rule == "shard-numbering":  # names of 1..M with a part absent, and no index
            assert not (folder / INDEX).exists(), run.stderr
        else:
            assert rule == "duplicate-name" and _held_twice(folder), run.stderr
        assert tree_snapshot(folder) == before and not (root / "out").exists()
        return
    assert loaded(root / "out") == expected
    check = cli("inspect", root / "out", "--fail-on", "warning")
    assert check.code == 0, check.stdout
