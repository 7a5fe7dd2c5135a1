"""Names a `ckptfix.dropped` record declares are the checkpoint's own: every rewrite keeps
them (a shared storage in a `.bin`, as torch.save writes tied weights; a record entry or a
copy in safetensors) under --strip-prefix, --exclude, --keep and --clone, and the check of
names before writing catches a plan that would lose one."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from ckptfix.core.tensor import TensorInfo
from ckptfix.plan.coverage import missing_name
from ckptfix.plan.select import OutTensor, Selection
from ckptfix.plan.shards import plan_shards
from tests import hash_oracle
from tests.builders import random_tensor, tiny_llama
from tests.helpers import cli, loads_with_same_logits

EMBED, HEAD, NORM = "embed.weight", "lm_head.weight", "norm.weight"
RECORD = "ckptfix.dropped"


@pytest.fixture
def recorded(tmp_path: Path) -> Path:
    """A file whose record says lm_head.weight was written once, as embed.weight."""
    from safetensors.torch import save_file

    path = tmp_path / "src" / "model.safetensors"
    path.parent.mkdir()
    state = {EMBED: random_tensor("F32", (6, 4), 1), NORM: random_tensor("BF16", (4,), 2)}
    save_file(state, path, metadata={"format": "pt", RECORD: json.dumps({HEAD: EMBED})})
    return path


def _state(path: Path) -> dict[str, Any]:
    from safetensors.torch import load_file

    return load_file(path)


def _declared(path: Path) -> dict[str, Any]:
    """What the source stands for: every stored name, and the recorded one as its kept."""
    state = _state(path)
    return {**state, HEAD: state[EMBED]}


def _digest(path: Path) -> str:
    run = cli("hash", path)
    assert run.code == 0, run.stderr
    return run.stdout.split()[0]


@pytest.mark.slow
def test_convert_to_torch_makes_the_recorded_name_a_shared_storage(
    recorded: Path, tmp_path: Path
) -> None:
    import torch

    out = tmp_path / "bin"
    run = cli("convert", recorded, "-o", out, "--to", "torch")
    assert run.code == 0, run.stderr
    loaded = torch.load(out / "pytorch_model.bin", weights_only=True)
    want = _declared(recorded)
    assert sorted(loaded) == sorted(want)
    for name, tensor in want.items():
        assert loaded[name].dtype == tensor.dtype and loaded[name].shape == tensor.shape
        assert hash_oracle.row_major(loaded[name]) == hash_oracle.row_major(tensor), name
    assert loaded[HEAD].untyped_storage().data_ptr() == loaded[EMBED].untyped_storage().data_ptr()
    assert _digest(out) == _digest(recorded) == hash_oracle.digest(want)


def _header(folder: Path) -> tuple[list[str], dict[str, str]]:
    """Stored names and the record of every safetensors file (and index) in `folder`."""
    from safetensors import safe_open

    names, record = [], {}
    for path in sorted(folder.glob("*.safetensors")):
        with safe_open(path, "pt") as handle:
            names += list(handle.keys())
            record.update(json.loads((handle.metadata() or {}).get(RECORD, "{}")))
    for index in folder.glob("*.index.json"):
        record.update(json.loads(index.read_text())["metadata"].get(RECORD, {}))
    return sorted(names), record


REWRITES = [
    # (command and options, stored names, record, names renamed by the output)
    (["reshard", "--max-shard", "100"], [EMBED, NORM], {HEAD: EMBED}, {}),
    (["convert"], [EMBED, NORM], {HEAD: EMBED}, {}),
    (["convert", "--clone"], [EMBED, HEAD, NORM], {}, {}),
    (["dedupe", "--keep", "last"], [HEAD, NORM], {EMBED: HEAD}, {}),
    (["convert", "--exclude", EMBED], [HEAD, NORM], {}, {}),
    (
        ["convert", "--strip-prefix", "embed."],
        ["weight", NORM],
        {HEAD: "weight"},
        {EMBED: "weight"},
    ),
]


@pytest.mark.parametrize(
    ("args", "names", "record", "renamed"),
    REWRITES,
    ids=["reshard-sharded", "convert", "clone", "keep-last", "exclude-kept", "strip-prefix"],
)
def test_safetensors_rewrites_keep_every_recorded_name(
    recorded: Path,
    tmp_path: Path,
    args: list[str],
    names: list[str],
    record: dict[str, str],
    renamed: dict[str, str],
) -> None:
    """The output's stored names and record, and its digest: the source's names (less the
    excluded ones, renamed as asked) standing for the same bytes."""
    out = tmp_path / "out"
    run = cli(args[0], recorded, "-o", out, *args[1:])
    assert run.code == 0, run.stderr
    assert _header(out) == (sorted(names), record)
    excluded = set(args[args.index("--exclude") + 1 :][:1]) if "--exclude" in args else set()
    want = {renamed.get(n, n): t for n, t in _declared(recorded).items() if n not in excluded}
    assert _digest(out) == hash_oracle.digest(want)


def _info(name: str, offset: int) -> TensorInfo:
    return TensorInfo(name, "F32", (2,), 8, "m.safetensors", (offset, offset + 8))


def test_the_name_check_finds_a_plan_that_loses_a_name() -> None:
    embed, head = _info(EMBED, 0), _info(HEAD, 0)
    other = _info(NORM, 8)
    selection = Selection((OutTensor.same(embed), OutTensor.same(other)))
    plan = plan_shards([(EMBED, 8), (NORM, 8)], 100)
    assert missing_name([embed, other], selection, plan) is None
    lost = missing_name([embed, head, other], selection, plan)
    assert lost == f"{HEAD!r} would be in no output file and in no record"
    wrong = Selection(selection.tensors, dropped={HEAD: NORM})
    pointed = missing_name([embed, head, other], wrong, replace(plan, dropped={HEAD: NORM}))
    assert pointed == f"{HEAD!r} would name {NORM!r}, another tensor"


@pytest.mark.slow
def test_transformers_loads_the_bin_of_a_recorded_head(tmp_path: Path) -> None:
    """An untied Llama whose head holds the embedding's values, saved tied (one storage):
    safetensors drops the head with a record; the `.bin` converted from it must give it
    back, or transformers reports lm_head.weight missing and the logits change."""
    import torch
    from transformers import LlamaForCausalLM

    model = tiny_llama()
    state = model.state_dict()
    state["lm_head.weight"] = state["model.embed_tokens.weight"]
    model.load_state_dict(state)
    source = tmp_path / "bin-source"
    model.config.save_pretrained(source)
    torch.save(state, source / "pytorch_model.bin")
    assert cli("convert", source, "-o", tmp_path / "st").code == 0
    assert _header(tmp_path / "st")[1] == {"lm_head.weight": "model.embed_tokens.weight"}
    out = tmp_path / "out"
    run = cli("convert", tmp_path / "st", "-o", out, "--to", "torch")
    assert run.code == 0, run.stderr
    loads_with_same_logits(LlamaForCausalLM, out, model)


def test_an_index_that_reads_back_without_a_recorded_name_fails_the_write(
    recorded: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from ckptfix.write import output

    write_all = output.write_all

    def lossy(fd: int, data: bytes, offset: int) -> None:  # the disk loses a name
        write_all(fd, data.replace(b'"lm_head.weight"', b'"lm_head.weighX"'), offset)

    monkeypatch.setattr(output, "write_all", lossy)
    out = tmp_path / "out"
    run = cli("reshard", recorded, "-o", out, "--max-shard", "100")
    assert run.code == 1
    assert run.error_lines == [
        f"error: {out / 'model.safetensors.index.json'}: written index does not name every "
        "tensor as planned (rule verification-failed; check the disk and run again)"
    ]
    assert not out.exists()
