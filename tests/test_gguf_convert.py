"""convert from GGUF: unquantized tensors to safetensors as they are stored (names, dtypes,
row-major shapes, bytes), the GGUF metadata kept as one JSON entry; a quantized tensor
refused with the reason unless `--dequantize DTYPE`, which decodes it with gguf-py's own
dequantizers; and the tail of zeros a download that never finished leaves."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest

from tests.gguf_files import (
    LLAMA_TENSORS,
    PLAIN_TENSORS,
    Tensor,
    gguf_py_fields,
    gguf_py_tensors,
    write_gguf,
)
from tests.helpers import cli, one_error_line, read_tensors


def test_plain_tensors_convert_as_stored(tmp_path: Path) -> None:
    source = write_gguf(tmp_path / "m.gguf", "gemma3", PLAIN_TENSORS)
    run = cli("convert", source, "-o", tmp_path / "out", "--json")
    assert run.code == 0, run.stderr
    written = read_tensors(tmp_path / "out")
    assert written == gguf_py_tensors(source)
    from safetensors import safe_open

    with safe_open(tmp_path / "out" / "model.safetensors", "np") as handle:
        assert list(handle.keys()) == sorted(t.name for t in PLAIN_TENSORS)
        kept = json.loads(handle.metadata()["gguf"])
    assert kept["version"] == 3
    fields = gguf_py_fields(source)
    assert list(kept["metadata"]) == list(fields)
    for key, entry in kept["metadata"].items():
        value = entry["value"]
        if key == "test.f64":  # NaN: kept as the string Python writes for it
            assert entry == {"type": "FLOAT64", "value": "nan"}
        elif isinstance(fields[key], float):
            assert math.isclose(value, fields[key]), key
        else:
            assert value == fields[key], key
    assert kept["metadata"]["test.ints"] == {"type": "ARRAY", "items": "INT64", "value": [1, -2, 3]}


def test_a_quantized_tensor_is_refused_with_the_reason(tmp_path: Path) -> None:
    source = write_gguf(tmp_path / "m.gguf")
    assert one_error_line("convert", source, "-o", tmp_path / "out") == (
        f"error: {source}: 6 tensor(s) such as 'token_embd.weight' are block-quantized (IQ4_XS, "
        "Q4_0, Q4_K, Q5_K, Q6_K, Q8_0), which safetensors and torch have no dtype for (rule "
        "quantized-tensor; decode them with --dequantize bf16, fp16 or fp32, or keep the model "
        "as GGUF (`ckptfix reshard` splits and merges it))"
    )
    assert not (tmp_path / "out").exists()


def _dequantized(source: Path) -> dict[str, object]:
    import numpy as np
    from gguf import GGUFReader
    from gguf.quants import dequantize

    return {
        t.name: np.asarray(dequantize(t.data, t.tensor_type), dtype=np.float32)
        for t in GGUFReader(source).tensors
    }


def test_dequantize_fp32_equals_gguf_py(tmp_path: Path) -> None:
    import numpy as np

    source = write_gguf(tmp_path / "m.gguf")
    run = cli("convert", source, "-o", tmp_path / "out", "--dequantize", "fp32", "--json")
    assert run.code == 0, run.stderr
    written = read_tensors(tmp_path / "out")
    stored = gguf_py_tensors(source)
    expected = _dequantized(source)
    for tensor in LLAMA_TENSORS:
        dtype, shape, data = written[tensor.name]
        assert shape == tensor.shape, tensor.name
        if tensor.ggml in ("F32", "F16", "BF16"):  # not quantized: as stored
            assert (dtype, data) == (tensor.ggml, stored[tensor.name][2]), tensor.name
            continue
        assert dtype == "F32", tensor.name
        values = np.frombuffer(data, dtype="<f4").reshape(shape)
        assert values.tobytes() == expected[tensor.name].reshape(shape).tobytes(), tensor.name


def test_dequantize_bf16_rounds_the_decoded_values(tmp_path: Path) -> None:
    import torch

    source = write_gguf(tmp_path / "m.gguf", tensors=[Tensor("q", "Q8_0", (64, 64))])
    assert cli("convert", source, "-o", tmp_path / "out", "--dequantize", "bf16").code == 0
    dtype, shape, data = read_tensors(tmp_path / "out")["q"]
    values = torch.from_numpy(_dequantized(source)["q"].reshape(shape).copy())
    assert (dtype, shape) == ("BF16", (64, 64))
    assert data == values.to(torch.bfloat16).view(torch.uint8).numpy().tobytes()


@pytest.mark.slow
def test_dequantize_memory_is_bounded(tmp_path: Path) -> None:
    """A 36 MiB Q4_0 tensor decodes to 256 MiB of F32, a chunk at a time: the peak is
    what a tensor of 4 MiB takes (about 62 MiB, measured), not the tensor's size."""
    from tests.helpers import measured

    source = write_gguf(tmp_path / "m.gguf", tensors=[Tensor("big", "Q4_0", (8192, 8192))])
    run = measured("convert", source, "-o", tmp_path / "out", "--dequantize", "fp32")
    assert run.code == 0, run.stderr
    assert (tmp_path / "out" / "model.safetensors").stat().st_size > 256 * 2**20
    assert run.peak_rss < 100 * 2**20, run.peak_rss


def test_a_type_gguf_py_cannot_decode_is_refused_before_writing(tmp_path: Path) -> None:
    source = write_gguf(tmp_path / "m.gguf", tensors=[Tensor("q", "Q8_1", (2, 64))])
    assert one_error_line("convert", source, "-o", tmp_path / "out", "--dequantize", "fp16") == (
        f"error: {source}: the gguf package cannot decode Q8_1 tensors (rule "
        "quantized-tensor; keep the model as GGUF, or --exclude those tensors)"
    )
    assert not (tmp_path / "out").exists()


def test_dequantize_takes_a_dtype(tmp_path: Path) -> None:
    source = write_gguf(tmp_path / "m.gguf")
    run = cli("convert", source, "-o", tmp_path / "out", "--dequantize", "int4")
    assert run.code == 2
    assert "--dequantize" in run.stderr and not (tmp_path / "out").exists()


# --- zeros where a download should have written data -----------------------------------------


def _zero_tail(path: Path, count: int) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) - count :] = bytes(count)
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("scan", [False, True])
def test_a_tail_of_zeros_is_found(tmp_path: Path, scan: bool) -> None:
    tensors = [Tensor(f"w{i}", "F32", (32, 32)) for i in range(4)]
    source = write_gguf(tmp_path / "m.gguf", tensors=tensors)
    clean = cli("inspect", source, "--json", *(["--scan-values"] if scan else []))
    assert [item["code"] for item in clean.json()["findings"]] == []
    _zero_tail(source, 8192)  # w2 and w3 are zeros
    run = cli("inspect", source, "--json", *(["--scan-values"] if scan else []))
    [found] = [item for item in run.json()["findings"] if item["code"] == "zero-filled"]
    assert found["severity"] == "warning" and found["fix"].startswith("none: ")
    if scan:
        assert found["tensors"] == ["w2", "w3"]
        assert found["message"].startswith(
            "2 tensor(s) such as 'w2', 'w3' (8192 bytes) hold only zero bytes"
        )
    else:
        assert found["message"].startswith("the last 4096 bytes of tensor data are all zero")
