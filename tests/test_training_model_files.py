"""What a conversion of a training run's folder carries into the model folder it writes
(layouts.model_files), and the per-rank HF writer's headers read alone (formats.hf_sharding),
on small folders built here. The frameworks' own folders: tests/test_training_writers.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

from ckptfix.formats import read_file
from ckptfix.io.source import LocalFile
from tests.builders import Factory, Spec
from tests.helpers import cli


def _trainer_folder(factory: Factory) -> Path:
    """A Trainer checkpoint-N/ under ZeRO-2 as the Trainer lays it out, with custom code."""
    root = factory.root / "checkpoint-2"
    factory.safetensors("checkpoint-2/model.safetensors", [Spec("w")])
    config = {"model_type": "x", "auto_map": {"AutoModel": "modeling_x.XModel"}}
    (root / "config.json").write_text(json.dumps(config))
    for name in ("generation_config.json", "tokenizer.json", "chat_template.jinja"):
        (root / name).write_text("{}")
    (root / "modeling_x.py").write_text("class XModel: ...\n")
    (root / "zero_to_fp32.py").write_text("# DeepSpeed's script\n")
    (root / "trainer_state.json").write_text("{}")
    (root / "latest").write_text("global_step2")
    (root / "global_step2").mkdir()
    (root / "global_step2" / "bf16_zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"x")
    for name in ("optimizer.pt", "scheduler.pt", "rng_state_0.pth", "training_args.bin"):
        (root / name).write_bytes(b"state")
    (root / "README.md").write_text("notes\n")
    return root


def test_a_trainer_folder_converts_to_a_model_folder(factory: Factory, tmp_path: Path) -> None:
    root = _trainer_folder(factory)
    run = cli("convert", root, "-o", tmp_path / "out", "--json")
    assert run.code == 0, run.stderr
    assert sorted(os.listdir(tmp_path / "out")) == [
        "chat_template.jinja",
        "config.json",
        "generation_config.json",
        "model.safetensors",
        "modeling_x.py",
        "tokenizer.json",
    ]
    assert run.json()["plan"]["left_out_reasons"] == {
        "README.md": "not read by a loader of the model",
        "global_step2": "training state",
        "latest": "training state",
        "optimizer.pt": "training state",
        "rng_state_0.pth": "training state",
        "scheduler.pt": "training state",
        "trainer_state.json": "training state",
        "training_args.bin": "training state",
        "zero_to_fp32.py": "training state",
    }
    human = cli("convert", root, "-o", tmp_path / "again")
    assert "left out (training state): global_step2, latest, optimizer.pt" in human.stdout


def test_a_model_folder_without_trainer_state_keeps_its_files(
    factory: Factory, tmp_path: Path
) -> None:
    factory.safetensors("model/model.safetensors", [Spec("w")])
    for name in ("README.md", "LICENSE", "config.json"):
        (factory.root / "model" / name).write_text("{}")
    assert cli("convert", factory.root / "model", "-o", tmp_path / "out").code == 0
    assert sorted(os.listdir(tmp_path / "out")) == [
        "LICENSE",
        "README.md",
        "config.json",
        "model.safetensors",
    ]


def test_a_linked_config_is_not_followed_for_custom_code(factory: Factory, tmp_path: Path) -> None:
    root = _trainer_folder(factory)
    outside = tmp_path / "elsewhere.json"
    outside.write_text(json.dumps({"auto_map": {"AutoModel": "secret.Model"}}))
    (root / "tokenizer_config.json").symlink_to(outside)
    (root / "secret.py").write_text("x = 1\n")
    run = cli("convert", root, "-o", tmp_path / "out", "--json")
    assert run.code == 0, run.stderr
    assert "secret.py" not in os.listdir(tmp_path / "out")
    assert (
        run.json()["plan"]["left_out_reasons"]["secret.py"] == "not read by a loader of the model"
    )


def test_a_config_nested_too_deeply_names_no_custom_code(factory: Factory, tmp_path: Path) -> None:
    """A tokenizer config nested 100,000 deep: looking in it for an `auto_map` ended in an
    internal RecursionError. It names no code, and is carried as the loader's file it is."""
    root = _trainer_folder(factory)
    (root / "tokenizer_config.json").write_text("[" * 100_000 + "]" * 100_000)
    run = cli("convert", root, "-o", tmp_path / "out", "--json")
    assert run.code == 0, run.stderr
    written = sorted(os.listdir(tmp_path / "out"))
    assert "tokenizer_config.json" in written and "modeling_x.py" in written


def test_names_of_model_files_and_training_state() -> None:
    from ckptfix.layouts.model_files import is_model_entry, is_training_folder

    code = {"modeling_x.py"}
    kept = ["config.json", "vocab.txt", "merges.txt", "spiece.model", "added_tokens.json"]
    assert all(is_model_entry(name, False, code) for name in [*kept, "modeling_x.py"])
    dropped = ["trainer_state.json", "optimizer_1.bin", "random_states_0.pkl", "latest", "x.py"]
    assert not any(is_model_entry(name, False, code) for name in dropped)
    assert is_model_entry("additional_chat_templates", True, code)
    assert not is_model_entry("optimizer_0", True, code)
    assert is_training_folder(["config.json", "random_states_0.pkl"])
    assert not is_training_folder(["config.json", "model.safetensors", "README.md"])


def test_a_whole_tensor_file_of_the_hf_writer_is_clean(factory: Factory) -> None:
    """torch's HF writer marks every file, a rank-0 save of whole tensors too (offsets 0):
    that file is the model, not a piece."""
    from ckptfix.formats.hf_sharding import piece_findings

    info = json.dumps({"weight": {"saved_offsets": [0, 0]}})
    metadata = {"DCP_SHARDING_INFO": info, "DCP_VERSION": "1.0"}
    path = factory.safetensors("model-00001-of-00001.safetensors", [Spec("weight")], metadata)
    assert piece_findings(read_file(LocalFile(str(path)))) == []
    run = cli("inspect", path, "--json")
    assert run.code == 0 and run.json()["findings"] == []
