"""convert --dtype sets the dtype config.json names, keeping every other byte."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given
from hypothesis import strategies as st

from ckptfix.plan.config_dtype import ConfigEdit, retype
from tests.helpers import cli

ORIGINAL = """{
  "architectures": ["LlamaForCausalLM"],
  "note": "\\"dtype\\": \\"float32\\" in a string stays",
  "torch_dtype":   "float32",
  "text_config": {"dtype": "float16", "hidden_size": 8, "list": ["dtype", "float32"]},
  "vision_config": {"torch_dtype": "auto"},
  "quantization_config": {"bnb_4bit_compute_dtype": "float32"},
  "d\\u0074ype": "float32"
}
"""


def test_only_dtype_values_change_and_every_other_byte_stays() -> None:
    text, edits = retype(ORIGINAL, "bfloat16")
    want = (
        ORIGINAL.replace('"torch_dtype":   "float32"', '"torch_dtype":   "bfloat16"')
        .replace('{"dtype": "float16"', '{"dtype": "bfloat16"')
        .replace('"d\\u0074ype": "float32"', '"d\\u0074ype": "bfloat16"')
    )
    assert text == want
    assert edits == (
        ConfigEdit("config.json", "torch_dtype", "float32", "bfloat16"),
        ConfigEdit("config.json", "text_config.dtype", "float16", "bfloat16"),
        ConfigEdit("config.json", "dtype", "float32", "bfloat16"),
    )


def test_a_config_already_in_the_target_dtype_is_left_alone() -> None:
    text = '{"torch_dtype": "bfloat16", "dtype": "auto"}'
    assert retype(text, "bfloat16") == (text, ())


_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.sampled_from(["float32", "float16", "auto"]),
    lambda inner: (
        st.lists(inner, max_size=3)
        | st.dictionaries(st.sampled_from(["dtype", "torch_dtype", "a", "b\\"]), inner, max_size=3)
    ),
    max_leaves=12,
)


def _expected(value: Any, key: str | None = None) -> Any:
    if isinstance(value, dict):
        return {k: _expected(v, k) for k, v in value.items()}
    if isinstance(value, list):
        return [_expected(v) for v in value]
    floating = value in ("float32", "float16")
    return "bfloat16" if key in ("dtype", "torch_dtype") and floating else value


@pytest.mark.slow
@given(
    st.dictionaries(st.text(max_size=4) | st.just("dtype"), _values, max_size=4), st.integers(0, 3)
)
def test_any_json_is_retyped_as_parsing_says(config: dict[str, Any], indent: int) -> None:
    text = json.dumps(config, indent=indent or None, ensure_ascii=indent % 2 == 0)
    retyped, edits = retype(text, "bfloat16")
    assert json.loads(retyped) == _expected(config)
    assert len(edits) == retyped.count('"bfloat16"')
    if not edits:
        assert retyped == text


def _folder(tmp_path: Path) -> Path:
    import torch
    from safetensors.torch import save_file

    folder = tmp_path / "model"
    folder.mkdir()
    save_file({"w": torch.ones(4, 4), "steps": torch.arange(3)}, str(folder / "model.safetensors"))
    (folder / "config.json").write_text(ORIGINAL)
    return folder


def test_convert_dtype_sets_config_json_and_says_so(tmp_path: Path) -> None:
    source = _folder(tmp_path)
    out = tmp_path / "out"
    dry = cli("convert", source, "-o", out, "--dtype", "bf16", "--dry-run", "--json")
    assert dry.code == 0 and not out.exists()
    edits = dry.json()["plan"]["config_edits"]
    assert [(e["key"], e["old"], e["new"]) for e in edits] == [
        ("torch_dtype", "float32", "bfloat16"),
        ("text_config.dtype", "float16", "bfloat16"),
        ("dtype", "float32", "bfloat16"),
    ]
    run = cli("convert", source, "-o", out, "--dtype", "bf16")
    assert run.code == 0, run.stderr
    assert "config.json: torch_dtype float32 → bfloat16 (set for the cast)" in run.stdout
    assert (out / "config.json").read_text() == retype(ORIGINAL, "bfloat16")[0]
    assert (source / "config.json").read_text() == ORIGINAL


def test_convert_without_a_cast_copies_config_json_unchanged(tmp_path: Path) -> None:
    source = _folder(tmp_path)
    run = cli("convert", source, "-o", tmp_path / "out", "--json")
    assert run.code == 0 and run.json()["plan"]["config_edits"] == []
    assert (tmp_path / "out" / "config.json").read_bytes() == ORIGINAL.encode()


@pytest.mark.slow  # transformers interop
def test_transformers_loads_the_cast_model_in_the_cast_dtype(tmp_path: Path) -> None:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(
        vocab_size=64,
        hidden_size=16,
        intermediate_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
    )
    torch.manual_seed(0)
    source, out = tmp_path / "fp32", tmp_path / "bf16"
    LlamaForCausalLM(config).save_pretrained(source)
    assert json.loads((source / "config.json").read_text())["dtype"] == "float32"
    assert cli("convert", source, "-o", out, "--dtype", "bf16").code == 0
    ids = torch.tensor([[1, 5, 9, 3]])
    want = LlamaForCausalLM.from_pretrained(source, dtype=torch.bfloat16)
    got = LlamaForCausalLM.from_pretrained(out)
    assert got.dtype == torch.bfloat16
    with torch.no_grad():
        assert torch.equal(got(ids).logits, want(ids).logits)


def _no_file_holds(root: Path, data: bytes) -> bool:
    for folder, _, files in os.walk(root):  # never follows links
        for name in files:
            path = Path(folder) / name
            if not path.is_symlink() and data in path.read_bytes():
                return False
    return True


@pytest.mark.parametrize("target", ["absolute", "relative"])
def test_a_linked_config_is_never_read_into_the_output(tmp_path: Path, target: str) -> None:
    """config.json linked to a file elsewhere (an API key here): the cast copied its
    contents into OUT, edited. It is carried as a link, as every other file would be."""
    secret = tmp_path / "secret" / "keys.json"
    secret.parent.mkdir()
    secret.write_text('{"api_key": "sk-SECRET-123", "torch_dtype": "float32"}')
    source = _folder(tmp_path)
    (source / "config.json").unlink()
    text = str(secret) if target == "absolute" else "../secret/keys.json"
    os.symlink(text, source / "config.json")
    out = tmp_path / "out"
    run = cli("convert", source, "-o", out, "--dtype", "bf16", "--json")
    assert run.code == 0, run.stderr
    assert run.json()["plan"]["config_edits"] == []
    assert os.readlink(out / "config.json") == text
    assert _no_file_holds(out, b"sk-SECRET-123")
    assert secret.read_text() == '{"api_key": "sk-SECRET-123", "torch_dtype": "float32"}'


def test_a_cache_snapshot_config_is_copied_and_set(tmp_path: Path) -> None:
    """In a Hugging Face cache snapshot the link into blobs/ is what a loader reads: it is
    copied as a file, and the copy edited; the blob stays as it was."""
    built = _folder(tmp_path)
    snapshot = tmp_path / "models--org--m" / "snapshots" / "abc"
    blobs = tmp_path / "models--org--m" / "blobs"
    snapshot.mkdir(parents=True)
    blobs.mkdir()
    for file in built.iterdir():
        file.rename(blobs / file.name)
        os.symlink(f"../../blobs/{file.name}", snapshot / file.name)
    out = tmp_path / "out"
    run = cli("convert", snapshot, "-o", out, "--dtype", "bf16")
    assert run.code == 0, run.stderr
    assert not (out / "config.json").is_symlink()
    assert (out / "config.json").read_text() == retype(ORIGINAL, "bfloat16")[0]
    assert (blobs / "config.json").read_text() == ORIGINAL


@pytest.mark.parametrize("target", ["relative", "absolute"])
def test_a_config_linked_inside_the_folder_is_copied_and_set(tmp_path: Path, target: str) -> None:
    """config.json a link to a file inside the model folder: OUT holds an edited copy (the
    link's target is the user's own file); the source, link and target, stays as it was."""
    source = _folder(tmp_path)
    (source / "configs").mkdir()
    (source / "config.json").rename(source / "configs" / "base.json")
    real = source / "configs" / "base.json"
    os.symlink(str(real) if target == "absolute" else "configs/base.json", source / "config.json")
    out = tmp_path / "out"
    run = cli("convert", source, "-o", out, "--dtype", "bf16", "--json")
    assert run.code == 0, run.stderr
    edits = [edit.to_dict() for edit in retype(ORIGINAL, "bfloat16")[1]]
    assert run.json()["plan"]["config_edits"] == edits and edits
    assert not (out / "config.json").is_symlink()
    assert (out / "config.json").read_text() == retype(ORIGINAL, "bfloat16")[0]
    assert real.read_text() == ORIGINAL and (source / "config.json").is_symlink()
