"""Expanded (stride-0) tensors in a rewrite: 4 stored bytes may ask for gigabytes of output.
Past 1,024 times what they store and 1 GB in all, convert and dedupe refuse them before
writing anything, unless asked (--allow-expansion); below that they are written in full."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from ckptfix.plan import expansion
from tests.helpers import cli, load_safetensors_folder, torch_bytes

GIB_OF_F32 = 2**28  # elements: 1,073,741,824 bytes, over 1 GB


def _saved(path: Path, tensors: dict[str, Any]) -> Path:
    import torch

    torch.save(tensors, path)
    return path


def test_a_large_expansion_is_refused_unless_asked(tmp_path: Path) -> None:
    """4 bytes expanded to 1 GiB: refused by convert (a dry run too), with the error line
    naming the tensor, the sizes and the way through; nothing is written."""
    import torch

    source = _saved(
        tmp_path / "expanded.pt",
        {"mask": torch.zeros(1).expand(GIB_OF_F32), "w": torch.ones(2, 2)},
    )
    out = tmp_path / "out"
    line = (
        f"error: {source}: tensor 'mask' [{GIB_OF_F32}] is a stride-0 expansion that would be "
        "written as 1,073,741,824 bytes from the 4 bytes it stores: over 1,024 times as many, "
        "and over 1 GB (rule large-expansion; pass --allow-expansion to write the expansion "
        "in full)"
    )
    for extra in ([], ["--dry-run"], ["--to", "torch"]):
        run = cli("convert", source, "-o", out, *extra)
        assert (run.code, run.error_lines, run.stdout) == (1, [line], "")
        assert not out.exists()
    run = cli("convert", source, "-o", out, "--json")
    assert run.code == 1
    assert run.json()["error"]["rule"] == "large-expansion"
    allowed = cli("convert", source, "-o", out, "--dry-run", "--allow-expansion", "--json")
    assert allowed.code == 0, allowed.stderr
    shards = allowed.json()["plan"]["shards"]
    assert [(shard["tensors"], shard["bytes"]) for shard in shards] == [
        (["mask", "w"], 4 * GIB_OF_F32 + 16)
    ]


def test_expansions_count_together(tmp_path: Path) -> None:
    """Two expansions of 600 MB each, neither over 1 GB alone: refused together, by dedupe
    as by convert, the message naming the larger."""
    import torch

    source = _saved(
        tmp_path / "two.pt",
        {
            "a": torch.zeros(1).expand(150_000_000),
            "b": torch.zeros(2, dtype=torch.float64)[:1].expand(76_000_000),
        },
    )
    for command in ("convert", "dedupe"):
        run = cli(command, source, "-o", tmp_path / "out", "--dry-run")
        assert run.code == 1
        assert run.error_lines == [
            f"error: {source}: 2 tensors are stride-0 expansions (e.g. 'b' [76000000]) that "
            "together would be written as 1,208,000,000 bytes from the 12 bytes they store: "
            "over 1,024 times as many, and over 1 GB (rule large-expansion; pass "
            "--allow-expansion to write the expansion in full)"
        ]
        allowed = cli(command, source, "-o", tmp_path / "out", "--dry-run", "--allow-expansion")
        assert allowed.code == 0, allowed.stderr


def test_expansions_below_the_limits_and_allowed_ones_are_written_bitwise(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Written in full as torch expands them: a broadcast under 1 GB without asking, and (the
    limit lowered to 1 MB here, to keep the test small) one past the limit with
    --allow-expansion only."""
    import torch

    state = {
        "bias": torch.arange(256, dtype=torch.float32).expand(64, 256),  # 64 KiB from 1 KiB
        "mask": torch.full((1, 1), 7, dtype=torch.int16).expand(1024, 1024),  # 2 MiB from 2
        "w": torch.ones(3, 2),
    }
    source = _saved(tmp_path / "state.pt", state)
    monkeypatch.setattr(expansion, "EXPANSION_BYTES", 10**6)
    refused = cli("convert", source, "-o", tmp_path / "refused")
    assert refused.code == 1
    assert "(rule large-expansion;" in refused.error_lines[0]
    assert "2 tensors are stride-0 expansions (e.g. 'mask' [1024, 1024])" in refused.stderr
    run = cli("convert", source, "-o", tmp_path / "out", "--allow-expansion")
    assert run.code == 0, run.stderr
    written = load_safetensors_folder(tmp_path / "out")
    assert {
        name: (tensor.dtype, tensor.shape, torch_bytes(tensor)) for name, tensor in written.items()
    } == {name: (tensor.dtype, tensor.shape, torch_bytes(tensor)) for name, tensor in state.items()}
    monkeypatch.setattr(expansion, "EXPANSION_BYTES", 10**9)
    run = cli("convert", source, "-o", tmp_path / "unasked")
    assert run.code == 0, run.stderr
