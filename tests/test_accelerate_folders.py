"""accelerate's `save_state` and the Trainer's FSDP folders as a hostile folder holds them,
built by hand. The folders the frameworks themselves write are tested in
tests/test_training_writers.py."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from tests.helpers import cli, with_locked_folder


@pytest.mark.slow
def test_a_model_folder_nobody_may_list(tmp_path: Path) -> None:
    """`pytorch_model_fsdp_0/` that cannot be listed ended in 'internal error:
    PermissionError'."""
    folder = tmp_path / "state"
    model = folder / "pytorch_model_fsdp_0"
    model.mkdir(parents=True)
    (folder / "random_states_0.pkl").write_bytes(b"")
    run = with_locked_folder(model, "inspect", folder)
    assert run.code == 1, run.stderr
    assert run.error_lines == [
        f"error: {model}: cannot list the folder: Permission denied (rule unreadable; check its "
        "permissions)"
    ]


def test_a_model_folder_that_is_a_fifo_leaves_no_weights(tmp_path: Path) -> None:
    """`pytorch_model_fsdp_0` a FIFO: no model folder, so no weights; convert's line named no
    rule ('(check the path, or download the weights) (rule input-refused)')."""
    folder = tmp_path / "state"
    folder.mkdir()
    os.mkfifo(folder / "pytorch_model_fsdp_0")
    (folder / "random_states_0.pkl").write_bytes(b"")
    run = cli("convert", folder, "-o", tmp_path / "out")
    assert run.code == 1
    assert run.error_lines == [
        f"error: {folder}: folder holds no weight file (*.safetensors, *.bin, *.pt, ...) and no "
        "shard index (rule no-weights; check the path, or download the weights)"
    ]
    assert not (tmp_path / "out").exists()
