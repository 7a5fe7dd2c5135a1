"""accelerate's `save_state` and the Trainer's FSDP folders as a hostile folder holds them,
built by hand. The folders the frameworks themselves write are tested in
tests/test_training_writers.py."""

from __future__ import annotations

from pathlib import Path

from tests.helpers import with_locked_folder


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
