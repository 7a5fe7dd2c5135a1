"""`ckptfix diff`: exact output lines, the JSON document, exit codes, prefixes, and --values
numbers against the same quantities computed by torch in memory."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import pytest

from ckptfix.ops.compare import DECODERS
from ckptfix.ops.diff import DiffOptions, diff
from tests import hash_oracle as oracle
from tests.builders import Factory, Spec
from tests.helpers import cli, measured

if TYPE_CHECKING:
    import torch


def _pair(tmp_path: Path) -> tuple[Path, Path]:
    import torch
    from safetensors.torch import save_file

    torch.manual_seed(0)
    a = {
        "embed.weight": torch.randn(10, 4),
        "t.weight": torch.randn(6, 4),
        "b": torch.randn(3).to(torch.bfloat16),
        "same": torch.arange(5),
    }
    b = {k: v.clone() for k, v in a.items() if k != "embed.weight"}
    b["t.weight"][1, 2] += 0.5
    b["b"] = b["b"].float()
    b["new"] = torch.zeros(2)
    save_file(a, str(tmp_path / "base.safetensors"))
    save_file(b, str(tmp_path / "tuned.safetensors"))
    return tmp_path / "base.safetensors", tmp_path / "tuned.safetensors"


def test_identical_across_formats_is_one_line(tmp_path: Path) -> None:
    import torch

    torch.manual_seed(0)
    embed = torch.randn(16, 8)
    state = {
        "embed": embed,
        "head": embed,
        "qkv.q": (fused := torch.randn(6, 8))[:2],
        "qkv.k": fused[2:],
        "t": torch.randn(8, 3).t(),
    }
    torch.save(state, tmp_path / "model.bin")
    assert (
        cli("convert", tmp_path / "model.bin", "-o", tmp_path / "out", "--max-shard", "300").code
        == 0
    )
    run = cli("diff", tmp_path / "model.bin", tmp_path / "out")
    assert run.code == 0, run.stderr
    assert run.stdout.splitlines() == [
        f"identical: 5 tensors, 1.31 KB (sha256 {oracle.digest(state)[:12]}…)"
    ]
    document = cli("diff", tmp_path / "model.bin", tmp_path / "out", "--json").json()
    assert document["identical"] is True
    assert document["digest"] == oracle.digest(state)


def test_differences_are_listed(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    run = cli("diff", a, b)
    assert run.code == 1
    assert run.stderr == ""
    assert run.stdout.splitlines() == [
        f"only in A ({a}): 1",
        "  embed.weight",
        f"only in B ({b}): 1",
        "  new",
        "dtype/shape changed: 1",
        "  b: BF16 [3] → F32 [3]",
        "tensors with other bytes: 1",
        "  t.weight",
        "different: 1 only in A, 1 only in B, 1 dtype/shape changed, 1 with other bytes; "
        "1 of 3 common tensors identical → exit 1 (--fail-on any)",
    ]


def test_json_document(tmp_path: Path) -> None:
    a, b = _pair(tmp_path)
    run = cli("diff", a, b, "--json")
    assert run.code == 1
    assert run.json() == {
        "schema_version": 1,
        "a": str(a),
        "b": str(b),
        "identical": False,
        "algorithm": "sha256",
        "digest": None,
        "compared": 3,
        "compared_bytes": 6 + 96 + 40,
        "stripped": {"a": [], "b": []},
        "only_in_a": ["embed.weight"],
        "only_in_b": ["new"],
        "layout_changed": [
            {"name": "b", "a": {"dtype": "BF16", "shape": [3]}, "b": {"dtype": "F32", "shape": [3]}}
        ],
        "bytes_changed": [{"name": "t.weight", "values": None}],
    }


@pytest.mark.parametrize(
    ("fail_on", "same_names", "same_layout", "code"),
    [
        ("any", True, True, 1),
        ("layout", True, True, 0),
        ("layout", True, False, 1),
        ("names", True, False, 0),
        ("names", False, True, 1),
        ("never", False, False, 0),
    ],
)
def test_fail_on(
    factory: Factory, fail_on: str, same_names: bool, same_layout: bool, code: int
) -> None:
    a = factory.safetensors("a.safetensors", [Spec("w"), Spec("v")])
    specs = [
        Spec("w", data=bytes(24)),
        Spec("v" if same_names else "u", "F32" if same_layout else "I32"),
    ]
    b = factory.safetensors("b.safetensors", specs)
    run = cli("diff", a, b, "--fail-on", fail_on)
    assert run.code == code
    assert run.stdout.splitlines()[-1].endswith(f"→ exit {code} (--fail-on {fail_on})")


def test_long_lists_are_counted(factory: Factory) -> None:
    a = factory.safetensors("a.safetensors", [Spec(f"t{i:02d}", "U8", (1,)) for i in range(25)])
    b = factory.safetensors("b.safetensors", [Spec("other", "U8", (1,))])
    run = cli("diff", a, b)
    lines = run.stdout.splitlines()
    assert lines[0] == f"only in A ({a}): 25"
    assert lines[1:21] == [f"  t{i:02d}" for i in range(20)]
    assert lines[21] == "  … and 5 more (--json lists every one)"
    assert len(cli("diff", a, b, "--json").json()["only_in_a"]) == 25


def test_strip_prefix(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    state = {"layer.weight": torch.randn(3, 3), "layer.bias": torch.randn(3)}
    torch.save({"module." + k: v for k, v in state.items()}, tmp_path / "ddp.bin")
    torch.save(
        {"state_dict": {"model." + k: v for k, v in state.items()}, "epoch": 1}, tmp_path / "l.ckpt"
    )
    save_file(state, str(tmp_path / "plain.safetensors"))
    plain = tmp_path / "plain.safetensors"
    assert cli("diff", tmp_path / "ddp.bin", plain).code == 1
    auto = cli("diff", tmp_path / "ddp.bin", plain, "--strip-prefix", "auto")
    assert auto.code == 0
    assert auto.stdout.startswith("identical: 2 tensors")
    lightning = cli(
        "diff", tmp_path / "l.ckpt", tmp_path / "ddp.bin", "--strip-prefix", "auto", "--json"
    )
    assert lightning.json()["identical"] is True
    assert lightning.json()["stripped"] == {"a": ["model."], "b": ["module."]}
    given = cli("diff", tmp_path / "ddp.bin", plain, "--strip-prefix", "module.")
    assert given.code == 0


def test_strip_prefix_collision_is_a_usage_error(factory: Factory) -> None:
    a = factory.safetensors("a.safetensors", [Spec("m.w"), Spec("w")])
    run = cli("diff", a, a, "--strip-prefix", "m.")
    assert run.code == 2
    assert run.error_lines == [
        f"error: --strip-prefix: 'w' and 'm.w' of {a} would both become 'w' (rule usage; strip a shorter prefix)"
    ]


def test_the_digest_is_the_hash_digest(tmp_path: Path) -> None:
    a, _ = _pair(tmp_path)
    document = cli("diff", a, a, "--json").json()
    assert document["identical"] is True
    assert document["digest"] == cli("hash", a, "--json").json()["digest"]


# --values ------------------------------------------------------------------------------------

# safetensors name -> torch dtype name (torch is imported by the tests, not at collection)
FLOATS = {
    "F64": "float64",
    "F32": "float32",
    "F16": "float16",
    "BF16": "bfloat16",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "F8_E4M3FNUZ": "float8_e4m3fnuz",
    "F8_E5M2FNUZ": "float8_e5m2fnuz",
    "F8_E8M0": "float8_e8m0fnu",
}


@pytest.mark.parametrize("name", sorted(name for name in FLOATS if name.startswith("F8")))
def test_float8_tables_match_torch(name: str) -> None:
    import numpy as np
    import torch

    bits = np.arange(256, dtype=np.uint8)
    ours = DECODERS[name](bits)
    theirs = (
        torch.arange(256, dtype=torch.int32)
        .to(torch.uint8)
        .view(getattr(torch, FLOATS[name]))
        .double()
        .numpy()
    )
    assert np.array_equal(ours, theirs, equal_nan=True)


def _expected(a: torch.Tensor, b: torch.Tensor) -> dict[str, object]:
    """docs/hash.md's definitions, computed by torch over whole tensors in memory."""
    import torch

    width = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[a.element_size()]
    differ = a.contiguous().view(width) != b.contiguous().view(width)
    x, y = a.double()[differ], b.double()[differ]
    gap = (x - y).abs()
    gap[x.isnan() & y.isnan()] = 0
    finite = gap.isfinite()
    scale = torch.maximum(x.abs(), y.abs())[finite]
    rel = torch.where(scale > 0, gap[finite] / scale, torch.zeros_like(scale))
    return {
        "numel": a.numel(),
        "differing": int(differ.sum()),
        "max_abs": float(gap[finite].max()) if finite.any() else 0.0,
        "max_rel": float(rel.max()) if finite.any() else 0.0,
        "non_finite": int((~finite).sum()),
    }


# `make test-fast` compares F32; `make test` every float dtype (torch computes each: ~0.3 s).
@pytest.mark.parametrize(
    "name",
    [
        name if name == "F32" else pytest.param(name, marks=pytest.mark.slow)
        for name in sorted(FLOATS)
    ],
)
def test_values_match_torch(tmp_path: Path, name: str) -> None:
    """Random bit patterns (NaN and Inf included) against a copy with about a tenth of the
    elements replaced, over several chunks: a transposed .bin against a safetensors file, so
    the two sides' chunks are cut differently."""
    import torch
    from safetensors.torch import save_file

    dtype = getattr(torch, FLOATS[name])
    width = torch.empty((), dtype=dtype).element_size()
    generator = torch.Generator().manual_seed(len(name))
    raw = torch.randint(0, 256, (700 * 900 * width,), dtype=torch.uint8, generator=generator)
    a = raw.view(dtype).reshape(900, 700).t()  # 700 x 900, not contiguous
    integer = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[width]
    bits = a.contiguous().view(integer).clone()  # replaced as integers: fp8 has no index_put
    noise = torch.randint(0, 256, (700 * 900 * width,), dtype=torch.uint8, generator=generator)
    mask = torch.rand(700, 900, generator=generator) < 0.1
    bits[mask] = noise.view(integer).reshape(700, 900)[mask]
    b = bits.view(dtype)
    torch.save({"w": a}, tmp_path / "a.bin")
    save_file({"w": b}, str(tmp_path / "b.safetensors"))
    result = diff(tmp_path / "a.bin", tmp_path / "b.safetensors", DiffOptions(values=True))
    assert [change.name for change in result.bytes_changed] == ["w"]
    values = result.bytes_changed[0].values
    assert values is not None
    expected = _expected(a, b)
    got = values.to_dict()
    assert got["differing"] == expected["differing"] > 0
    assert got["non_finite"] == expected["non_finite"]
    assert math.isclose(got["max_abs"], expected["max_abs"], rel_tol=1e-12)  # type: ignore[arg-type]
    assert math.isclose(got["max_rel"], expected["max_rel"], rel_tol=1e-12)  # type: ignore[arg-type]


def test_values_of_integers_complex_and_output(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    a = {
        "i": torch.arange(10),
        "c": torch.tensor([1 + 1j, 2 - 1j, 0j], dtype=torch.complex64),
        "m": torch.tensor([True, False]),
    }
    b = {
        "i": torch.arange(10) * torch.tensor([1] * 7 + [2] * 3),
        "c": torch.tensor([1 + 1j, 2 + 3j, 0j], dtype=torch.complex64),
        "m": torch.tensor([True, True]),
    }
    save_file(a, str(tmp_path / "a.safetensors"))
    save_file(b, str(tmp_path / "b.safetensors"))
    run = cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--values")
    assert run.code == 1
    assert run.stdout.splitlines()[:4] == [
        "tensors with other bytes: 3",
        "  c: 1 of 3 elements differ, max abs 4, max rel 1.1094",
        "  i: 3 of 10 elements differ",
        "  m: 1 of 2 elements differ",
    ]


def test_values_report_nan_on_one_side(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    save_file(
        {"w": torch.tensor([1.0, float("nan"), 3.0, float("inf")])}, str(tmp_path / "a.safetensors")
    )
    save_file({"w": torch.tensor([1.5, 2.0, 3.0, float("inf")])}, str(tmp_path / "b.safetensors"))
    run = cli("diff", tmp_path / "a.safetensors", tmp_path / "b.safetensors", "--values")
    assert run.stdout.splitlines()[1] == (
        "  w: 2 of 4 elements differ, max abs 0.5, max rel 0.333333, 1 with NaN or Inf on one side"
    )


def test_no_names_in_common_suggests_stripping(tmp_path: Path) -> None:
    import torch
    from safetensors.torch import save_file

    state = {"w": torch.ones(2)}
    torch.save({"module.w": state["w"]}, tmp_path / "ddp.bin")
    save_file(state, str(tmp_path / "m.safetensors"))
    run = cli("diff", tmp_path / "ddp.bin", tmp_path / "m.safetensors")
    assert run.stdout.splitlines()[-1] == (
        "different: 1 only in A, 1 only in B; no names in common (try --strip-prefix auto) "
        "→ exit 1 (--fail-on any)"
    )


@pytest.mark.slow
def test_values_in_bounded_memory(factory: Factory) -> None:
    """--values over two 1 GiB tensors (sparse files: no disk) that differ in their last
    element: every element decoded, in well under 150 MiB."""
    shape = (2**29,)
    a = factory.sparse_safetensors("a.safetensors", "BF16", shape)
    b = factory.sparse_safetensors("b.safetensors", "BF16", shape)
    with open(b, "r+b") as handle:
        handle.seek(-2, 2)
        handle.write(b"\x80\x3f")  # bf16 1.0, little-endian
    run = measured("diff", a, b, "--values", "--json", timeout=300)
    assert run.code == 1, run.stderr
    (change,) = json.loads(run.stdout)["bytes_changed"]
    assert change["values"] == {
        "numel": 2**29,
        "differing": 1,
        "max_abs": 1.0,
        "max_rel": 1.0,
        "non_finite": 0,
    }
    assert run.peak_rss < 150 * 2**20, run.peak_rss
