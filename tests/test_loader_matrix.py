"""The loader matrix: a rewrite is correct only when the consumer that would have
loaded the input loads the output with identical results.

Each cell builds an input with the real library (once per session, copied per cell), computes
the reference with the library loading the *input*, runs one ckptfix command on a copy, loads
the *output* with the same library API and compares: logits, images and embeddings bitwise
(`torch.equal`), or within the cast dtype's rounding (`assert_close`, dtype included) when
`--dtype` was asked. The layouts are in tests/loader_layouts.py (transformers 5 and 4,
Mistral, hub cache) and tests/loader_libraries.py (diffusers, PEFT, sentence-transformers,
accelerate); Lightning and training dictionaries in tests/loader_training.py.

A cell that is known to fail goes into XFAIL with what its loader says (a strict xfail, so it
fails the suite once it passes); today XFAIL is empty: every cell passes.
"""

from __future__ import annotations

import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from tests.helpers import cli
from tests.loader_layouts import (
    COMMANDS,
    TRANSFORMERS_LAYOUTS,
    Command,
    Layout,
    tf4_built,
    tf4_missing_reason,
)
from tests.loader_libraries import LIBRARY_LAYOUTS
from tests.loader_training import TRAINING_LAYOUTS

pytestmark = [
    pytest.mark.slow,
    # PEFT 0.21 asks transformers 5 for a renamed attribute when it loads an adapter
    pytest.mark.filterwarnings("ignore:`is_gradient_checkpointing` is deprecated:FutureWarning"),
]

LAYOUTS = {
    layout.name: layout for layout in [*TRANSFORMERS_LAYOUTS, *LIBRARY_LAYOUTS, *TRAINING_LAYOUTS]
}

EVERY = (
    "reshard-o",
    "reshard-in-place",
    "convert",
    "convert-torch",
    "convert-bf16",
    "dedupe",
    "dedupe-content",
)
SHARDED = ("reshard-o", "reshard-one", "reshard-in-place", "convert", "convert-torch", "dedupe")
CELLS: dict[str, tuple[str, ...]] = {
    "llama-untied": EVERY,
    "gpt2-tied": EVERY,
    "llama-sharded": SHARDED,
    "llama-equal-head": ("convert", "dedupe", "dedupe-content"),
    "llama-fp16-variant": SHARDED,
    "stale-bin-beside": ("reshard-o", "convert", "convert-torch", "dedupe"),
    "mistral-consolidated": ("reshard-o", "reshard-in-place", "convert", "dedupe"),
    "hub-snapshot": ("reshard-o", "convert", "convert-torch", "dedupe"),
    "tf4-llama-bin": ("convert", "convert-torch", "convert-bf16", "dedupe", "dedupe-content"),
    "tf4-llama-bin-sharded": ("convert", "convert-torch", "dedupe"),
    "tf4-gpt2-tied-bin": ("convert", "convert-torch", "dedupe"),
    "diffusers-unet": (
        "reshard-o",
        "reshard-in-place",
        "convert",
        "convert-torch",
        "dedupe",
        "dedupe-content",
    ),
    "diffusers-vae": ("reshard-in-place", "convert"),
    "diffusers-text-encoder": ("reshard-in-place",),
    "peft-lora": ("reshard-o", "reshard-in-place", "convert", "convert-torch", "dedupe"),
    "sentence-transformers": (*SHARDED, "dedupe-content"),
    "accelerate-sharded": ("reshard-o", "reshard-one", "convert", "convert-torch", "dedupe"),
    "lightning-epoch=0-step=2": ("convert",),
    "lightning-last": ("convert", "convert-torch", "dedupe"),
    "deepspeed-model-states": ("convert", "convert-torch"),
    "timm-checkpoint": ("convert", "convert-torch"),
}

# Cells that fail today, with what the loader says. Empty: every cell passes.
XFAIL: dict[tuple[str, str], str] = {}


def _cells() -> list[Any]:
    cells = []
    for layout, commands in CELLS.items():
        for command in commands:
            reason = XFAIL.get((layout, command))
            marks = [pytest.mark.xfail(strict=True, reason=reason)] if reason else []
            cells.append(pytest.param(layout, command, marks=marks, id=f"{layout}:{command}"))
    return cells


Inputs = Callable[[Layout, "str | None"], "tuple[Path, Any]"]


@pytest.fixture(scope="session")
def inputs(tmp_path_factory: pytest.TempPathFactory) -> Inputs:
    """layout, dtype -> (the input as the library wrote it, the library's output from it).
    Each input is built once per session, each reference computed once."""
    built: dict[Any, Path] = {}
    references: dict[Any, Any] = {}

    def get(layout: Layout, dtype: str | None) -> tuple[Path, Any]:
        if layout.name.startswith("tf4-"):
            if (reason := tf4_missing_reason()) is not None:
                pytest.skip(reason)
            tf4_built(tmp_path_factory)
        if layout.build not in built:
            root = tmp_path_factory.mktemp(layout.name) / "in"
            root.mkdir()
            layout.build(root)
            built[layout.build] = root
        root = built[layout.build]
        key = (layout.build, layout.home or layout.target, layout.reference, dtype)
        if key not in references:
            references[key] = layout.reference_output(root, dtype)
        return root, references[key]

    return get


def rewrite(layout: Layout, command: Command, root: Path, out: Path) -> Path:
    """Run `command` on the layout's target under `root`; return what the library loads."""
    source = root / layout.target
    args: list[str | Path] = [*command.argv, source]
    if command.sharded and layout.max_shard:
        args += ["--max-shard", layout.max_shard]
    if command.argv[0] == "convert":
        args += layout.convert_options
    args += ["--in-place"] if command.in_place else ["-o", out]
    run = cli(*args)
    assert run.code == 0, f"ckptfix {command.id} exited {run.code}: {run.stderr}"
    if layout.home is None:
        return source if command.in_place else out
    if not command.in_place:  # the rewritten component takes the old one's place
        shutil.rmtree(source)
        out.rename(source)
    return root / layout.home


def assert_same(actual: Any, expected: Any, cast: str | None) -> None:
    import torch

    if cast is not None:  # the library's own cast of the input: equal within its rounding
        torch.testing.assert_close(actual, expected)
        return
    assert actual.dtype == expected.dtype
    difference = (actual.double() - expected.double()).abs().max().item()
    assert torch.equal(actual, expected), f"outputs differ (max abs difference {difference})"


@pytest.mark.parametrize(("layout_name", "command_id"), _cells())
def test_cell(layout_name: str, command_id: str, inputs: Inputs, tmp_path: Path) -> None:
    layout, command = LAYOUTS[layout_name], COMMANDS[command_id]
    pristine, expected = inputs(layout, command.cast)
    root = tmp_path / "in"
    shutil.copytree(pristine, root, symlinks=True)
    loaded = rewrite(layout, command, root, tmp_path / "out")
    assert_same(layout.load(root, loaded, None), expected, command.cast)


def _cache_tree(root: Path) -> dict[str, str | bytes]:
    """Every entry under root: a link's target text, a file's bytes."""
    return {
        str(path.relative_to(root)): (
            f"-> {path.readlink()}" if path.is_symlink() else path.read_bytes()
        )
        for path in sorted(root.rglob("*"))
        if path.is_symlink() or path.is_file()
    }


def test_snapshot_in_place_is_refused(inputs: Inputs, tmp_path: Path) -> None:
    """Problem 2: rewriting a hub cache snapshot in place would replace its links into
    ../../blobs/ with files of its own; it is refused with a message that says why, and the
    cache is left as it was (the model still loads from it by repo id)."""
    from tests.loader_layouts import SNAPSHOT, snapshot_reference

    layout = LAYOUTS["hub-snapshot"]
    pristine, expected = inputs(layout, None)
    root = tmp_path / "in"
    shutil.copytree(pristine, root, symlinks=True)
    before = _cache_tree(root)
    run = cli("reshard", root / SNAPSHOT, "--in-place", "--max-shard", layout.max_shard or "5GB")
    assert run.code == 2, (run.code, run.stderr)
    assert len(run.error_lines) == 1 and "snapshot" in run.error_lines[0], run.stderr
    assert _cache_tree(root) == before
    assert_same(snapshot_reference(root, None), expected, None)


@pytest.mark.parametrize("command", ["convert", "dedupe"])
def test_separate_checkpoints_are_never_merged(
    command: str, inputs: Inputs, tmp_path: Path
) -> None:
    """Problem 4: Lightning's epoch=N-step=M.ckpt and last.ckpt are separate checkpoints of
    one model; a write command given their folder must ask which one (a usage error that
    names them), never merge them, and write nothing."""
    from tests.loader_training import LIGHTNING_FILES

    pristine, _ = inputs(LAYOUTS["lightning-last"], None)
    shutil.copytree(pristine / "ckpts", tmp_path / "ckpts")
    out = tmp_path / "out"
    run = cli(command, tmp_path / "ckpts", "-o", out)
    assert run.code == 2, (run.code, run.stderr)
    assert len(run.error_lines) == 1, run.stderr
    assert all(name in run.error_lines[0] for name in LIGHTNING_FILES), run.stderr
    assert not out.exists()
