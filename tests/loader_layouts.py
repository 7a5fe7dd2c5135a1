"""The loader matrix's vocabulary and its transformers layouts: a `Layout` is an input written
by the real library plus the library call that loads it; a `Command` is a ckptfix rewrite.

Each layout's `build(root)` writes the input under `root`; `load(root, path, dtype)` is the
consumer's own API loading `path` (the input itself for the reference, ckptfix's output for
the cell) and returns what the model computes for a fixed input, after asserting that the
library loaded every weight (no missing or unexpected keys). `dtype` is None for the
library's default, or the dtype a `--dtype` cast asked for (the reference then asks the
library to cast the input itself).

torch and the libraries are imported inside the functions: collecting the suite must not
import torch (tests/test_no_torch.py).
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import subprocess
import warnings
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tests.builders import tiny_gpt2, tiny_llama

ROOT = Path(__file__).resolve().parent.parent
TOKENS = [[2, 5, 7, 11, 13, 3]]
# Built by `make test` (Makefile): transformers 4 cannot share a venv with transformers 5.
TF4_PYTHON = ROOT / ".venv-tf4" / "bin" / "python"


@dataclass(frozen=True)
class Command:
    """One ckptfix rewrite. `sharded` passes the layout's --max-shard; `cast` is --dtype."""

    id: str
    argv: tuple[str, ...]
    in_place: bool = False
    sharded: bool = True
    cast: str | None = None


COMMANDS = {
    command.id: command
    for command in (
        Command("reshard-o", ("reshard",)),
        Command("reshard-one", ("reshard",), sharded=False),
        Command("reshard-in-place", ("reshard",), in_place=True),
        Command("convert", ("convert",)),
        Command("convert-torch", ("convert", "--to", "torch")),
        Command("convert-bf16", ("convert", "--dtype", "bf16"), cast="bf16"),
        Command("dedupe", ("dedupe",)),
        Command("dedupe-content", ("dedupe", "--by-content")),
    )
}


@dataclass(frozen=True)
class Layout:
    """An input layout. `target` (under root) is what ckptfix rewrites; when `home` is set the
    target is a component of it (a diffusers `unet/`): the output takes the target's place
    and the library loads `home`. `max_shard` is passed to commands that shard,
    `convert_options` to `convert` (`--key`); `reference` replaces loading the input with
    `load` when the input's consumer is another API (a training checkpoint's own loader)."""

    name: str
    build: Callable[[Path], None]
    load: Callable[[Path, Path, str | None], Any]
    target: str = "model"
    home: str | None = None
    max_shard: str | None = None
    reference: Callable[[Path, str | None], Any] | None = None
    convert_options: tuple[str, ...] = ()

    def reference_output(self, root: Path, dtype: str | None) -> Any:
        if self.reference is not None:
            return self.reference(root, dtype)
        return self.load(root, root / (self.home or self.target), dtype)


def quietly(build: Callable[[Path], None]) -> Callable[[Path], None]:
    """For the builders: library chatter while writing an input is not what a cell tests
    (loading the output runs under the suite's warnings-as-errors)."""

    @functools.wraps(build)
    def quiet_build(root: Path) -> None:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            build(root)

    return quiet_build


def torch_dtype(name: str | None) -> Any:
    import torch

    return {None: None, "bf16": torch.bfloat16, "fp16": torch.float16}[name]


def assert_all_loaded(info: dict[str, Any]) -> None:
    """transformers' loading info: every weight of the model found, nothing left over."""
    problems = {key: sorted(map(str, info.get(key) or [])) for key in info}
    assert not any(problems.values()), f"loading info: {problems}"


def causal_lm_logits(path: Path | str, dtype: str | None = None, **options: Any) -> Any:
    """`AutoModelForCausalLM.from_pretrained` (transformers 5) and its logits for TOKENS."""
    import torch
    from transformers import AutoModelForCausalLM

    if dtype is not None:
        options["dtype"] = torch_dtype(dtype)
    model, info = AutoModelForCausalLM.from_pretrained(path, output_loading_info=True, **options)
    assert_all_loaded(info)
    with torch.no_grad():
        return model.eval()(torch.tensor(TOKENS)).logits


def _load_causal_lm(root: Path, path: Path, dtype: str | None) -> Any:
    return causal_lm_logits(path, dtype)


# --- transformers 5: save_pretrained ----------------------------------------------------------


def _save(model: Any, root: Path, **options: Any) -> None:
    model.save_pretrained(root / "model", **options)


@quietly
def build_llama(root: Path) -> None:
    _save(tiny_llama(bos_token_id=0, eos_token_id=1), root)


@quietly
def build_gpt2(root: Path) -> None:
    _save(tiny_gpt2(), root)


@quietly
def build_llama_sharded(root: Path) -> None:
    _save(tiny_llama(bos_token_id=0, eos_token_id=1), root, max_shard_size="40KB")


@quietly
def build_llama_equal_head(root: Path) -> None:
    """Untied, but lm_head holds the embedding's values (as after an untie): two names a
    loader needs, with equal bytes."""
    import torch

    model = tiny_llama(bos_token_id=0, eos_token_id=1)
    with torch.no_grad():
        model.lm_head.weight.copy_(model.model.embed_tokens.weight)
    _save(model, root)


@quietly
def build_llama_variant(root: Path) -> None:
    """An fp16 variant, sharded: model.fp16-0000N-of-0000M.safetensors and
    model.safetensors.index.fp16.json."""
    _save(
        tiny_llama(bos_token_id=0, eos_token_id=1).half(),
        root,
        variant="fp16",
        max_shard_size="20KB",
    )


def _load_variant(root: Path, path: Path, dtype: str | None) -> Any:
    return causal_lm_logits(path, dtype, variant="fp16")


@quietly
def build_stale_bin(root: Path) -> None:
    """model.safetensors beside a stale pytorch_model.bin of other weights: transformers
    loads the safetensors, so a rewrite must read it too."""
    import torch

    build_llama(root)
    stale = tiny_llama(bos_token_id=0, eos_token_id=1, initializer_range=0.5)
    torch.save(stale.state_dict(), root / "model" / "pytorch_model.bin")


# --- Mistral-style consolidated.safetensors ----------------------------------------------------


@quietly
def build_consolidated(root: Path) -> None:
    """A single `consolidated.safetensors` (as Mistral ships beside params.json)."""
    from safetensors.torch import save_file

    model = tiny_llama(bos_token_id=0, eos_token_id=1)
    folder = root / "model"
    folder.mkdir(parents=True)
    save_file(model.state_dict(), folder / "consolidated.safetensors", metadata={"format": "pt"})
    (folder / "params.json").write_text(json.dumps(model.config.to_dict()))


def load_consolidated(root: Path, path: Path, dtype: str | None) -> Any:
    """mistral-inference's `Transformer.from_folder` reads `consolidated.safetensors` by that
    name; here the same file, by name, into the model it was saved from (strict)."""
    import torch
    from safetensors.torch import load_file
    from transformers import LlamaConfig, LlamaForCausalLM

    config = LlamaConfig(**json.loads((path / "params.json").read_text()))
    model = LlamaForCausalLM(config).eval()
    model.load_state_dict(load_file(path / "consolidated.safetensors"), strict=True)
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits


# --- a hub cache snapshot, built by hand -------------------------------------------------------

REPO = "models--tiny--llama"
REVISION = "0123456789abcdef0123456789abcdef01234567"
SNAPSHOT = f"hub/{REPO}/snapshots/{REVISION}"


@quietly
def build_snapshot(root: Path) -> None:
    """The cache layout huggingface_hub writes: every file of the snapshot is a relative
    link `../../blobs/<hash>`, refs/main names the revision. The model is sharded, and an
    older snapshot (another revision, another config) shares the cache."""
    import hashlib

    staging = root / "staging"
    tiny_llama(bos_token_id=0, eos_token_id=1).save_pretrained(staging, max_shard_size="40KB")
    repo = root / "hub" / REPO
    (repo / "blobs").mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text(REVISION)
    old = repo / "snapshots" / ("f" * 40)
    old.mkdir(parents=True)
    (old / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 64}))
    snapshot = root / SNAPSHOT
    snapshot.mkdir(parents=True)
    for file in sorted(staging.iterdir()):
        data = file.read_bytes()
        blob = hashlib.sha256(data).hexdigest()  # LFS files are named by sha256, others by
        (repo / "blobs" / blob).write_bytes(data)  # git's sha1: any unique name will do here
        (snapshot / file.name).symlink_to(f"../../blobs/{blob}")
    shutil.rmtree(staging)


def snapshot_reference(root: Path, dtype: str | None) -> Any:
    """The consumer of the input: from_pretrained by repo id, from the cache (offline)."""
    return causal_lm_logits("tiny/llama", dtype, cache_dir=root / "hub")


# --- transformers 4: .bin inputs, in the second venv -------------------------------------------


def tf4_missing_reason() -> str | None:
    if not TF4_PYTHON.exists():
        return f"{TF4_PYTHON} is missing: `make test` builds it (transformers 4 for .bin inputs)"
    return None


def _tf4(*args: str | os.PathLike[str]) -> str:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "PYTHONWARNINGS": "ignore"}
    done = subprocess.run(
        [TF4_PYTHON, ROOT / "tests" / "loader_tf4.py", *args],
        capture_output=True,
        text=True,
        env=env,
        timeout=600,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    return done.stdout


_TF4_BUILT: dict[str, Path] = {}


def tf4_built(factory: Any) -> Path:
    """Every transformers 4 input and its reference logits, written once per session."""
    if "out" not in _TF4_BUILT:
        out = factory.mktemp("tf4") / "built"
        _tf4("build", out)
        _TF4_BUILT["out"] = out
    return _TF4_BUILT["out"]


def load_tf4(root: Path, path: Path, dtype: str | None) -> Any:
    """transformers 4's `from_pretrained(path, dtype="auto")` (config.json's dtype): logits."""
    import torch

    result = root.parent / "tf4-result.pt"
    info = json.loads(_tf4("load", path, result))
    assert_all_loaded(info)
    return torch.load(result, weights_only=True)


def tf4_layout(name: str, max_shard: str | None = None) -> Layout:
    """A layout written by transformers 4; `build` copies it from the session's tf4 build
    (which needs a pytest factory, so the matrix's fixture fills `_TF4_BUILT` first)."""

    def build(root: Path) -> None:
        shutil.copytree(_TF4_BUILT["out"] / name, root / "model")

    def reference(root: Path, dtype: str | None) -> Any:
        import torch

        label = dtype or "keep"
        return torch.load(_TF4_BUILT["out"] / f"{name}.{label}.pt", weights_only=True)

    return Layout(name, build, load_tf4, max_shard=max_shard, reference=reference)


TRANSFORMERS_LAYOUTS = [
    Layout("llama-untied", build_llama, _load_causal_lm, max_shard="40KB"),
    Layout("gpt2-tied", build_gpt2, _load_causal_lm, max_shard="40KB"),
    Layout("llama-sharded", build_llama_sharded, _load_causal_lm, max_shard="40KB"),
    Layout("llama-equal-head", build_llama_equal_head, _load_causal_lm),
    Layout("llama-fp16-variant", build_llama_variant, _load_variant, max_shard="20KB"),
    Layout("stale-bin-beside", build_stale_bin, _load_causal_lm),
    Layout("mistral-consolidated", build_consolidated, load_consolidated),
    Layout(
        "hub-snapshot",
        build_snapshot,
        _load_causal_lm,
        target=SNAPSHOT,
        max_shard="40KB",
        reference=snapshot_reference,
    ),
    tf4_layout("tf4-llama-bin"),
    tf4_layout("tf4-llama-bin-sharded", max_shard="40KB"),
    tf4_layout("tf4-gpt2-tied-bin"),
]
