"""convert and dedupe: bitwise against torch.load(weights_only=True), aliases, views, nesting."""

from __future__ import annotations

import json
import shutil
from collections import OrderedDict
from pathlib import Path
from typing import TYPE_CHECKING

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from safetensors import safe_open

import ckptfix
from ckptfix.ops.rewrite import DROPPED_KEY
from tests.builders import (
    HOSTILE_FORMS,
    SAVED_DTYPES,
    ZIP_ONLY_DTYPES,
    hostile_checkpoint,
    hostile_pickles,
    random_tensor,
    random_views_state,
    tiny_gpt2,
    view_specs,
    views_state_dict,
)
from tests.helpers import cli, load_safetensors_folder, torch_bytes

if TYPE_CHECKING:
    import torch


def assert_same(got: torch.Tensor, want: torch.Tensor, name: str) -> None:
    assert got.dtype == want.dtype, name
    assert tuple(got.shape) == tuple(want.shape), name
    assert torch_bytes(got) == torch_bytes(want), name


def load_model_file(folder: Path) -> dict[str, torch.Tensor]:
    """The one model.safetensors of an output folder (a sharded output fails), as
    safetensors itself reads it."""
    from safetensors.torch import load_file

    return load_file(folder / "model.safetensors")


def check_conversion(source: Path, out: Path) -> dict[str, str]:
    """Every source name resolves (directly or via the dropped record) to equal bytes."""
    import torch

    oracle = torch.load(source, weights_only=True)
    written = load_safetensors_folder(out)
    with safe_open(str(next(out.glob("*.safetensors"))), "pt") as handle:
        metadata = handle.metadata() or {}
    index = out / "model.safetensors.index.json"
    if index.exists():
        dropped = json.loads(index.read_text())["metadata"].get(DROPPED_KEY, {})
    else:
        dropped = json.loads(metadata.get(DROPPED_KEY, "{}"))
    assert metadata.get("format") == "pt"
    for name, tensor in oracle.items():
        assert_same(written[dropped.get(name, name)], tensor, name)
    assert set(written) | set(dropped) == set(oracle)
    return dropped


@pytest.mark.parametrize("legacy", [False, True], ids=["zip", "legacy"])
def test_views_aliases_and_strides(tmp_path: Path, legacy: bool) -> None:
    import torch

    source = tmp_path / "views.bin"
    torch.save(views_state_dict(), source, _use_new_zipfile_serialization=not legacy)
    out = tmp_path / "out"
    run = cli("convert", source, "-o", out, "--json")
    assert run.code == 0, run.stderr
    dropped = check_conversion(source, out)
    assert dropped == {"lm_head": "embed"}  # first name in source order is kept
    assert run.json()["plan"]["dropped"] == {"lm_head": "embed"}
    assert ckptfix.inspect(out).findings == tuple(
        f for f in ckptfix.inspect(out).findings if f.code == "dtype-mix"
    )


@pytest.mark.parametrize("dtype", SAVED_DTYPES + ZIP_ONLY_DTYPES)
def test_every_dtype(tmp_path: Path, dtype: str) -> None:
    import torch

    source = tmp_path / "d.pt"
    base = random_tensor(dtype, (6, 4), 0)
    torch.save(
        {
            "m": base,
            "t": base.t(),
            "s": random_tensor(dtype, (), 1),
            "z": torch.empty(0, 3, dtype=getattr(torch, dtype)),
        },
        source,
    )
    out = tmp_path / "out"
    assert cli("convert", source, "-o", out).code == 0
    check_conversion(source, out)


@pytest.mark.slow
@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(view_specs, st.sampled_from(["float32", "bfloat16", "int64", "bool"]), st.integers(1, 3))
def test_random_state_dicts_round_trip(
    tmp_path: Path, specs: list[tuple[int, str]], dtype: str, shard_kb: int
) -> None:
    import torch

    source = tmp_path / "random.pt"
    torch.save(random_views_state(dtype, specs), source)
    out = tmp_path / "out"
    if out.exists():
        shutil.rmtree(out)
    run = cli("convert", source, "-o", out, "--max-shard", f"{shard_kb * 100}")
    assert run.code == 0, run.stderr
    check_conversion(source, out)


def test_written_size_is_what_the_views_use(tmp_path: Path) -> None:
    import torch

    source = tmp_path / "view.pt"
    torch.save({"head": torch.zeros(1000, 1000)[:2]}, source)  # a 4 MB storage on disk
    assert source.stat().st_size > 4_000_000
    out = tmp_path / "out"
    assert cli("convert", source, "-o", out).code == 0
    written = out / "model.safetensors"
    assert written.stat().st_size < 8000 + 200  # 2 rows of 1000 floats and a header


@pytest.mark.slow
def test_tied_gpt2_loads_in_transformers(tmp_path: Path) -> None:
    import torch
    from transformers import GPT2LMHeadModel

    model = tiny_gpt2(vocab_size=100, n_positions=64)
    folder = tmp_path / "gpt2"
    folder.mkdir()
    model.config.save_pretrained(folder)
    torch.save(model.state_dict(), folder / "pytorch_model.bin")
    report = ckptfix.inspect(folder / "pytorch_model.bin")
    assert "shared-storage" in {f.code for f in report.findings}
    out = tmp_path / "converted"
    run = cli("convert", folder, "-o", out, "--json")
    assert run.code == 0, run.stderr
    assert run.json()["plan"]["dropped"] == {"lm_head.weight": "transformer.wte.weight"}
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    loaded, info = GPT2LMHeadModel.from_pretrained(out, output_loading_info=True)
    assert not info["missing_keys"] and not info["unexpected_keys"]
    tokens = torch.tensor([[1, 2, 3, 4, 5]])
    with torch.no_grad():
        assert torch.equal(loaded.eval()(tokens).logits, model(tokens).logits)


def lightning_checkpoint(path: Path) -> dict[str, torch.Tensor]:
    """A Lightning-style training checkpoint around three `model.`-prefixed weights."""
    import torch

    weights = OrderedDict(
        [
            ("model.encoder.weight", random_tensor(torch.float32, (4, 4), 1)),
            ("model.head.weight", random_tensor(torch.float32, (2, 4), 2)),
            ("model.head.bias", random_tensor(torch.float32, (2,), 3)),
        ]
    )
    torch.save(
        {
            "epoch": 3,
            "global_step": 10,
            "state_dict": weights,
            "optimizer_states": [{"state": {0: {"exp_avg": torch.zeros(4, 4)}}}],
        },
        path,
    )
    return weights


def test_lightning_key_and_prefix(tmp_path: Path) -> None:
    source = tmp_path / "last.ckpt"
    weights = lightning_checkpoint(source)
    out = tmp_path / "out"
    run = cli("convert", source, "-o", out, "--strip-prefix", "auto", "--json")
    assert run.code == 0, run.stderr
    plan = run.json()["plan"]
    assert plan["renamed"] == {name: name.removeprefix("model.") for name in weights}
    written = load_model_file(out)
    for name, tensor in weights.items():
        assert_same(written[name.removeprefix("model.")], tensor, name)
    bad = cli("convert", source, "-o", tmp_path / "bad", "--key", "ema")
    assert bad.code == 2
    assert bad.error_lines[0].startswith(f"error: --key: {source} has no tensor dictionary")
    assert not (tmp_path / "bad").exists()


def test_exclude_and_explicit_prefix(tmp_path: Path) -> None:
    import torch

    source = tmp_path / "ddp.bin"
    torch.save(
        {"module.a": torch.ones(2), "module.b": torch.ones(3), "module.aux.c": torch.ones(1)},
        source,
    )
    out = tmp_path / "out"
    run = cli(
        "convert",
        source,
        "-o",
        out,
        "--strip-prefix",
        "module.",
        "--exclude",
        "module.aux.*",
        "--json",
    )
    assert run.code == 0
    assert run.json()["plan"]["excluded"] == ["module.aux.c"]
    assert run.json()["plan"]["renamed"] == {"module.a": "a", "module.b": "b"}
    assert sorted(load_model_file(out)) == ["a", "b"]
    human = cli(
        "convert",
        source,
        "-o",
        tmp_path / "again",
        "--strip-prefix",
        "module.",
        "--exclude",
        "module.aux.*",
        "--dry-run",
    )
    assert "excluded 1 tensor(s): module.aux.c" in human.stdout
    assert "renamed 2 tensor(s), e.g. module.a → a" in human.stdout


def test_dtype_casts_floating_tensors_only(tmp_path: Path) -> None:
    import torch

    source = tmp_path / "mixed.pt"
    state = {
        "w": random_tensor(torch.float32, (3, 4), 0).clamp(-1e30, 1e30).nan_to_num(),
        "h": torch.randn(5, dtype=torch.float16),
        "i": torch.arange(4),
        "b": torch.ones(2) > 0,
    }
    torch.save(state, source)
    out = tmp_path / "out"
    assert cli("convert", source, "-o", out, "--dtype", "bf16").code == 0
    written = load_model_file(out)
    assert written["w"].dtype == torch.bfloat16 and torch.equal(written["w"], state["w"].bfloat16())
    assert written["h"].dtype == torch.bfloat16 and torch.equal(written["h"], state["h"].bfloat16())
    assert_same(written["i"], state["i"], "i")
    assert_same(written["b"], state["b"], "b")


def test_to_torch(tmp_path: Path) -> None:
    import torch

    source = tmp_path / "views.bin"
    torch.save(views_state_dict(), source)
    out = tmp_path / "out"
    run = cli("convert", source, "-o", out, "--to", "torch", "--max-shard", "200")
    assert run.code == 0, run.stderr
    index = json.loads((out / "pytorch_model.bin.index.json").read_text())
    oracle = torch.load(source, weights_only=True)
    loaded: dict[str, torch.Tensor] = {}
    for shard in sorted(set(index["weight_map"].values())):
        loaded.update(torch.load(out / shard, weights_only=True))
    # the alias is a name of its own on its kept tensor's storage, nothing is recorded
    assert DROPPED_KEY not in index["metadata"]
    assert index["weight_map"]["lm_head"] == index["weight_map"]["embed"]
    assert loaded["lm_head"].untyped_storage().data_ptr() == (
        loaded["embed"].untyped_storage().data_ptr()
    )
    assert list(loaded) == list(oracle)
    for name, tensor in oracle.items():
        assert_same(loaded[name], tensor, name)
    findings = ckptfix.inspect(out).findings
    # the tie is reported as in any tied .bin: a warning about safetensors, not a fault
    assert [(f.code, f.tensors) for f in findings if f.code != "dtype-mix"] == [
        ("shared-storage", ("embed", "lm_head"))
    ]


def test_clone_and_keep(tmp_path: Path) -> None:
    import torch

    shared = torch.ones(3, 2)
    source = tmp_path / "tied.bin"
    torch.save(
        OrderedDict([("embed", shared), ("head", shared), ("other", torch.zeros(1))]), source
    )
    cloned = tmp_path / "cloned"
    assert cli("convert", source, "-o", cloned, "--clone").code == 0
    assert sorted(load_model_file(cloned)) == ["embed", "head", "other"]
    last = tmp_path / "last"
    run = cli("dedupe", source, "-o", last, "--keep", "last", "--json")
    assert run.json()["plan"]["dropped"] == {"embed": "head"}
    regex = tmp_path / "regex"
    run = cli("dedupe", source, "-o", regex, "--keep", "^emb", "--json")
    assert run.json()["plan"]["dropped"] == {"head": "embed"}
    bad = cli("dedupe", source, "-o", tmp_path / "bad", "--keep", "(")
    assert bad.code == 2 and bad.error_lines[0].startswith("error: --keep: '(' is not a regular")


def _copies_folder(tmp_path: Path, config: dict[str, object] | None) -> Path:
    """A model whose lm_head and two LayerNorms hold equal bytes as separate tensors."""
    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "copies"
    folder.mkdir()
    embed = random_tensor(torch.float32, (4, 4), 7)
    save_file(
        {
            "model.embed_tokens.weight": embed.clone(),
            "lm_head.weight": embed.clone(),
            "model.layers.0.norm.weight": torch.ones(4),
            "model.layers.1.norm.weight": torch.ones(4),
            "model.other": random_tensor(torch.float32, (4, 4), 8),
            "model.half": embed.clone().to(torch.float16),
        },
        str(folder / "model.safetensors"),
    )
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_dedupe_by_content_merges_only_the_declared_tie(tmp_path: Path) -> None:
    source = _copies_folder(tmp_path, {"model_type": "gpt2", "tie_word_embeddings": True})
    out = tmp_path / "out"
    dry = cli("dedupe", source, "-o", out, "--by-content", "--dry-run", "--json")
    assert dry.code == 0 and not out.exists()
    plan = dry.json()["plan"]
    assert plan["dropped"] == {"lm_head.weight": "model.embed_tokens.weight"}
    assert plan["dropped_bytes"] == 64
    assert plan["kept_equal"] == [["model.layers.0.norm.weight", "model.layers.1.norm.weight"]]
    human = cli("dedupe", source, "-o", out, "--by-content", "--dry-run")
    assert "dropped (stored once, as the kept name): lm_head.weight → model.embed" in human.stdout
    assert "kept (equal bytes, not a declared tie; a loader needs each): " in human.stdout
    assert cli("dedupe", source, "-o", out, "--by-content").code == 0
    written = load_model_file(out)
    assert "lm_head.weight" not in written and "model.layers.1.norm.weight" in written
    with safe_open(str(out / "model.safetensors"), "pt") as handle:
        recorded = json.loads((handle.metadata() or {})[DROPPED_KEY])
    assert recorded == {"lm_head.weight": "model.embed_tokens.weight"}


@pytest.mark.parametrize(
    "config",
    [
        {"model_type": "llama"},  # untied by its class's default
        {"model_type": "gpt2", "tie_word_embeddings": False},
        None,  # no config: nothing is known to be tied
    ],
)
def test_dedupe_by_content_keeps_every_untied_name(
    tmp_path: Path, config: dict[str, object] | None
) -> None:
    source = _copies_folder(tmp_path, config)
    out = tmp_path / "out"
    run = cli("dedupe", source, "-o", out, "--by-content", "--json")
    assert run.code == 0
    assert run.json()["plan"]["dropped"] == {}
    groups = {frozenset(group) for group in run.json()["plan"]["kept_equal"]}
    assert groups == {
        frozenset({"lm_head.weight", "model.embed_tokens.weight"}),
        frozenset({"model.layers.0.norm.weight", "model.layers.1.norm.weight"}),
    }
    assert sorted(load_model_file(out)) == sorted(load_model_file(source))


def test_sharded_bin_folder_to_safetensors(tmp_path: Path) -> None:
    import torch

    folder = tmp_path / "m"
    folder.mkdir()
    a, b = random_tensor(torch.float32, (8, 8), 1), random_tensor(torch.float32, (8, 8), 2)
    torch.save({"a": a}, folder / "pytorch_model-00001-of-00002.bin")
    torch.save({"b": b}, folder / "pytorch_model-00002-of-00002.bin")
    (folder / "pytorch_model.bin.index.json").write_text(
        json.dumps(
            {
                "metadata": {"total_size": 512},
                "weight_map": {
                    "a": "pytorch_model-00001-of-00002.bin",
                    "b": "pytorch_model-00002-of-00002.bin",
                },
            }
        )
    )
    (folder / "config.json").write_text("{}")
    out = tmp_path / "out"
    assert cli("convert", folder, "-o", out).code == 0
    assert sorted(p.name for p in out.iterdir()) == ["config.json", "model.safetensors"]
    written = load_model_file(out)
    assert_same(written["a"], a, "a")
    assert_same(written["b"], b, "b")


@pytest.mark.parametrize("container", ["zip", "legacy"])
@pytest.mark.parametrize("form", HOSTILE_FORMS)
def test_hostile_pickles_convert_nothing(tmp_path: Path, form: str, container: str) -> None:
    canary = tmp_path / "CANARY"
    payload = hostile_pickles(canary)[form]
    source = hostile_checkpoint(tmp_path / "evil.bin", payload, container)
    for command in ("convert", "dedupe"):
        out = tmp_path / f"out-{command}"
        run = cli(command, source, "-o", out)
        assert run.code == 1
        assert len(run.error_lines) == 1 and "outside the allowlist" in run.error_lines[0]
        assert not out.exists()
    assert not canary.exists()
    assert not list(tmp_path.glob(".ckptfix-*"))


def test_tied_aliases_satisfy_tie_word_embeddings(tmp_path: Path) -> None:
    import torch

    folder = tmp_path / "m"
    folder.mkdir()
    embed = torch.ones(4, 2)
    torch.save(
        {"model.embed_tokens.weight": embed, "lm_head.weight": embed}, folder / "pytorch_model.bin"
    )
    (folder / "config.json").write_text(json.dumps({"tie_word_embeddings": True}))
    codes = {f.code for f in ckptfix.inspect(folder).findings}
    assert "tied-config-mismatch" not in codes and "shared-storage" in codes


def test_tar_checkpoints_are_refused(tmp_path: Path) -> None:
    import tarfile

    path = tmp_path / "ancient.pt"
    member = tmp_path / "sys_info"
    member.write_bytes(b"\x80\x02}q\x00.")
    with tarfile.open(path, "w") as archive:
        archive.add(member, arcname="sys_info")
    for args in (["inspect", path], ["convert", path, "-o", tmp_path / "out"]):
        run = cli(*args)
        assert run.code == 1
        assert run.error_lines == [
            f"error: {path}: file is a tar archive (the PyTorch checkpoint format before 0.4), "
            "not read (rule unsupported-format; load and re-save it with torch.save in a trusted environment)"
        ]
    assert not (tmp_path / "out").exists()
