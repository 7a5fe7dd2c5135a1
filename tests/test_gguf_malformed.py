"""Every GGUF malformation of the corpus (tests/cases.py) as a built file, with the exact
error line inspect prints for it; absurd counts and lengths refused at once; the header
bound."""

from __future__ import annotations

import struct
import time
from pathlib import Path

import pytest

from tests.builders import Factory
from tests.cases import GGUF_CASES, Case
from tests.gguf_files import RawGguf, kv
from tests.helpers import cli, one_error_line

# The line inspect prints for each case, `{path}` standing for the file's path.
LINES = {
    "gguf-too-small": "error: {path}: file has 8 bytes; a GGUF file needs at least 24 (rule gguf-too-small; re-download the file, or convert the model to GGUF again)",
    "gguf-html": "error: {path}: file is named .gguf but is an HTML page titled 'Sign in - Hugging Face', not a GGUF file (rule gguf-bad-magic; download it again from the model's repository: what was saved is not the model)",
    "gguf-json": 'error: {path}: file is named .gguf but is JSON text starting \'{"error":"Repository not found"}\', not a GGUF file (rule gguf-bad-magic; download it again from the model\'s repository: what was saved is not the model)',
    "gguf-zeros": "error: {path}: file is named .gguf but is all zero bytes at its start (the first 1024: never written), not a GGUF file (rule gguf-bad-magic; download it again from the model's repository: what was saved is not the model)",
    "gguf-binary": "error: {path}: file is named .gguf but is binary data starting with bytes 7f 45 4c 46 02 01 01 00, not a GGUF file (rule gguf-bad-magic; download it again from the model's repository: what was saved is not the model)",
    "gguf-safetensors": "error: {path}: file is named .gguf but is a safetensors file, not a GGUF file (rule gguf-bad-magic; download it again from the model's repository: what was saved is not the model)",
    "gguf-lfs": "error: {path}: file is a Git LFS pointer to a 4.98 GB object (oid sha256:abababababab…), not the weights (rule lfs-pointer; run `git lfs pull`, or download the file itself)",
    "gguf-big-endian": "error: {path}: GGUF version field reads 0x3000000: a big-endian GGUF file, which ckptfix does not read (rule gguf-big-endian; use the little-endian file the model was published as)",
    "gguf-version-1": "error: {path}: GGUF version 1 (llama.cpp's first format, which it no longer reads either) is not supported; versions 2 and 3 are (rule gguf-version; re-download the file, or convert the model to GGUF again)",
    "gguf-version-4": "error: {path}: GGUF version 4 is not supported; versions 2 and 3 are (rule gguf-version; re-download the file, or convert the model to GGUF again)",
    "gguf-tensors-2-60": "error: {path}: header claims 1152921504606846976 tensor(s) and 1 metadata key(s), over the 1,000,000-tensor limit (rule gguf-counts; re-download the file, or convert the model to GGUF again)",
    "gguf-keys-2-60": "error: {path}: header claims 1 tensor(s) and 1152921504606846976 metadata key(s), over the 1,000,000-key limit (rule gguf-counts; re-download the file, or convert the model to GGUF again)",
    "gguf-tensors-claimed": "error: {path}: tensor info 2 runs past the end of the file (it reaches byte 2679278775348232326; the file has 160) (rule gguf-past-end; re-download the file, or convert the model to GGUF again)",
    "gguf-key-2-50": "error: {path}: metadata key 0 runs past the end of the file (it reaches byte 1125899906842656; the file has 128) (rule gguf-past-end; re-download the file, or convert the model to GGUF again)",
    "gguf-string-2-50": "error: {path}: metadata key 'general.name' runs past the end of the file (it reaches byte 1125899906842680; the file has 128) (rule gguf-past-end; re-download the file, or convert the model to GGUF again)",
    "gguf-array-2-60": "error: {path}: metadata key 'a' runs past the end of the file (it reaches byte 4611686018427387953; the file has 128) (rule gguf-past-end; re-download the file, or convert the model to GGUF again)",
    "gguf-strings-2-60": "error: {path}: metadata key 'tokenizer.ggml.tokens' runs past the end of the file (it reaches byte 9223372036854775877; the file has 160) (rule gguf-past-end; re-download the file, or convert the model to GGUF again)",
    "gguf-metadata-cut": "error: {path}: metadata key 0 runs past the end of the file (it reaches byte 52; the file has 40) (rule gguf-past-end; re-download the file, or convert the model to GGUF again)",
    "gguf-infos-cut": "error: {path}: tensor info 'a' runs past the end of the file (it reaches byte 94; the file has 90) (rule gguf-past-end; re-download the file, or convert the model to GGUF again)",
    "gguf-key-not-utf8": "error: {path}: metadata key 0 is not UTF-8 text: b'general.\\xff' (rule gguf-bad-string; re-download the file, or convert the model to GGUF again)",
    "gguf-duplicate-key": "error: {path}: metadata key 'general.architecture' is given twice (llama.cpp refuses the file) (rule gguf-duplicate-key; re-download the file, or convert the model to GGUF again)",
    "gguf-value-type": "error: {path}: metadata key 'a' holds unknown value type 13 (rule gguf-bad-value-type; re-download the file, or convert the model to GGUF again)",
    "gguf-nested-array": "error: {path}: metadata key 'a' holds arrays of arrays, which llama.cpp does not read (rule gguf-bad-value-type; re-download the file, or convert the model to GGUF again)",
    "gguf-bool-2": "error: {path}: metadata key 'a' is a bool stored as 2, not 0 or 1 (rule gguf-bad-value; re-download the file, or convert the model to GGUF again)",
    "gguf-alignment-48": "error: {path}: general.alignment is UINT32 48; ggml needs a UINT32 power of two (rule gguf-alignment; re-download the file, or convert the model to GGUF again)",
    "gguf-alignment-u64": "error: {path}: general.alignment is UINT64 32; ggml needs a UINT32 power of two (rule gguf-alignment; re-download the file, or convert the model to GGUF again)",
    "gguf-split-string": "error: {path}: metadata key 'split.count' is STRING '3'; llama.cpp reads it only as UINT16 and refuses the file (rule gguf-bad-value; re-download the file, or convert the model to GGUF again)",
    "gguf-split-u32": "error: {path}: metadata key 'split.count' is UINT32 1; llama.cpp reads it only as UINT16 and refuses the file (rule gguf-bad-value; re-download the file, or convert the model to GGUF again)",
    "gguf-split-negative": "error: {path}: metadata key 'split.tensors.count' is INT32 -1, not a non-negative integer (rule gguf-bad-value; re-download the file, or convert the model to GGUF again)",
    "gguf-alignment-0": "error: {path}: general.alignment is UINT32 0; ggml needs a UINT32 power of two (rule gguf-alignment; re-download the file, or convert the model to GGUF again)",
    "gguf-key-70000": "error: {path}: metadata key 0 is 70000 bytes long, over the 65535-byte limit (rule gguf-bad-string; re-download the file, or convert the model to GGUF again)",
    "gguf-array-item-2-32": "error: {path}: metadata key 'a' holds elements of unknown value type 4294967295 (rule gguf-bad-value-type; re-download the file, or convert the model to GGUF again)",
    "gguf-bool-array-2": "error: {path}: metadata key 'a' holds a bool that is not 0 or 1 (rule gguf-bad-value; re-download the file, or convert the model to GGUF again)",
    "gguf-html-escapes": "error: {path}: file is named .gguf but is an HTML page titled '\\x1b]0;pwned\\x07\\n::error::x ##\\x5by]', not a GGUF file (rule gguf-bad-magic; download it again from the model's repository: what was saved is not the model)",
    "gguf-name-64": "error: {path}: tensor 'nnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnnn' has a name over 63 bytes (rule gguf-name-too-long; re-download the file, or convert the model to GGUF again)",
    "gguf-name-not-utf8": "error: {path}: tensor info 0 is not UTF-8 text: b'w\\xff' (rule gguf-bad-string; re-download the file, or convert the model to GGUF again)",
    "gguf-5-dims": "error: {path}: tensor 'w' has 5 dimensions; ggml allows at most 4 (rule gguf-dims; re-download the file, or convert the model to GGUF again)",
    "gguf-zero-dim": "error: {path}: tensor 'w' has a zero dimension (ggml dims [4, 0]) (rule gguf-zero-dim; re-download the file, or convert the model to GGUF again)",
    "gguf-type-99": "error: {path}: tensor 'w' has unknown ggml type 99 (rule gguf-unknown-type; re-download the file, or convert the model to GGUF again)",
    "gguf-type-removed": "error: {path}: tensor 'w' has unknown ggml type 4 (Q4_2, removed from ggml) (rule gguf-unknown-type; re-download the file, or convert the model to GGUF again)",
    "gguf-partial-block": "error: {path}: tensor 'w' (Q4_0) has rows of 33 elements, not a multiple of its 32-element block (rule gguf-partial-block; re-download the file, or convert the model to GGUF again)",
    "gguf-shape-overflow": "error: {path}: tensor 'w' has 18446744073709551616 elements, over 2^63 (rule gguf-shape-overflow; re-download the file, or convert the model to GGUF again)",
    "gguf-misaligned": "error: {path}: tensor 'w' starts at data offset 8, not a multiple of the alignment (32) (rule gguf-misaligned; re-download the file, or convert the model to GGUF again)",
    "gguf-offset-2-64": "error: {path}: tensor 'w' is at data offset 18446744073709551584, but ggml expects 0: tensors are packed in order, each padded to 32 bytes (rule gguf-layout; re-download the file, or convert the model to GGUF again)",
    "gguf-rank-2-32": "error: {path}: tensor 'w' has 4294967295 dimensions; ggml allows at most 4 (rule gguf-dims; re-download the file, or convert the model to GGUF again)",
    "gguf-type-2-32": "error: {path}: tensor 'w' has unknown ggml type 4294967295 (rule gguf-unknown-type; re-download the file, or convert the model to GGUF again)",
    "gguf-bytes-2-65": "error: {path}: file is truncated: its tensors need 36893488147419103360 bytes but the file has 192 (1 tensor(s) such as 'w' lie past its end) (rule truncated; re-download the file)",
    "gguf-overlap": "error: {path}: tensor 'b' starts at data offset 32, inside 'a' (data bytes 0-64) (rule gguf-overlap; re-download the file, or convert the model to GGUF again)",
    "gguf-gap": "error: {path}: tensor 'b' is at data offset 64, but ggml expects 32: tensors are packed in order, each padded to 32 bytes (rule gguf-layout; re-download the file, or convert the model to GGUF again)",
    "gguf-out-of-order": "error: {path}: tensor 'a' is at data offset 32, but ggml expects 0: tensors are packed in order, each padded to 32 bytes (rule gguf-layout; re-download the file, or convert the model to GGUF again)",
    "gguf-duplicate-name": "error: {path}: tensor 'a' is stored twice (rule gguf-duplicate-name; re-download the file, or convert the model to GGUF again)",
    "gguf-truncated": "error: {path}: file is truncated: its tensors need 224 bytes but the file has 184 (2 tensor(s) such as 'a' lie past its end) (rule truncated; re-download the file)",
    "gguf-trailing": "error: {path}: file has 4 bytes after the last tensor (expected 224 bytes, found 228) (rule trailing-bytes; re-download the file, or convert the model to GGUF again)",
}


def test_every_case_has_its_line() -> None:
    assert sorted(LINES) == sorted(case.id for case in GGUF_CASES)


@pytest.mark.parametrize("case", GGUF_CASES, ids=lambda case: case.id)
def test_exact_error_line(factory: Factory, case: Case) -> None:
    path = case.build(factory)
    start = time.perf_counter()
    run = cli("inspect", path, "--json")
    elapsed = time.perf_counter() - start
    assert run.code == 1, run.stderr
    assert run.error_lines == [LINES[case.id].replace("{path}", str(path))]
    [found] = [item for item in run.json()["findings"] if item["severity"] == "error"]
    assert (found["code"], found["file"]) == (case.code, str(path))
    assert found["fix"].startswith("none: "), found  # every finding says what repairs it
    assert elapsed < 2, elapsed  # absurd counts and lengths are refused before any work


def test_a_header_over_the_bound_is_refused_without_reading_it(tmp_path: Path) -> None:
    """A 300 MiB string value in a 300 MiB (sparse) file: over the 256 MiB header bound."""
    size = 300 * 2**20
    raw = RawGguf(keys=[kv("general.name", 8, struct.pack("<Q", size - 200))], infos=[], data=b"")
    path = raw.write(tmp_path / "big.gguf")
    with open(path, "r+b") as handle:
        handle.truncate(size)
    line = one_error_line("inspect", path)
    assert line == (
        f"error: {path}: metadata key 'general.name' reaches byte {24 + 8 + 12 + 4 + 8 + size - 200}: metadata "
        f"and tensor infos over the {256 * 2**20}-byte limit (rule gguf-header-too-large; "
        "re-download the file, or convert the model to GGUF again)"
    )
