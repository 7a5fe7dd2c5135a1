"""Real layouts: outputs keep the family's names, the family read is the one a loader
would load, and separate checkpoints in one folder are never merged."""

from __future__ import annotations

from pathlib import Path

import pytest

import ckptfix
from tests.builders import Factory, Spec
from tests.helpers import cli

A, B = Spec("a", "F32", (2, 3)), Spec("b", "F32", (4,))


@pytest.mark.parametrize(
    ("names", "expected"),
    [
        (
            ["diffusion_pytorch_model.safetensors"],
            [
                "diffusion_pytorch_model-00001-of-00002.safetensors",
                "diffusion_pytorch_model-00002-of-00002.safetensors",
                "diffusion_pytorch_model.safetensors.index.json",
            ],
        ),
        (
            ["adapter_model.safetensors"],
            [
                "adapter_model-00001-of-00002.safetensors",
                "adapter_model-00002-of-00002.safetensors",
                "adapter_model.safetensors.index.json",
            ],
        ),
        (
            ["model.fp16.safetensors"],
            [
                "model.fp16-00001-of-00002.safetensors",
                "model.fp16-00002-of-00002.safetensors",
                "model.safetensors.index.fp16.json",
            ],
        ),
        (
            ["consolidated.safetensors"],
            [
                "consolidated-00001-of-00002.safetensors",
                "consolidated-00002-of-00002.safetensors",
                "consolidated.safetensors.index.json",
            ],
        ),
    ],
)
def test_reshard_keeps_the_family_names(
    factory: Factory, tmp_path: Path, names: list[str], expected: list[str]
) -> None:
    factory.safetensors(f"m/{names[0]}", [A, B])
    out = tmp_path / "out"
    run = cli("reshard", factory.root / "m", "-o", out, "--max-shard", "24")
    assert run.code == 0, run.stderr
    assert sorted(p.name for p in out.iterdir()) == sorted(expected)
    assert ckptfix.inspect(out).tensor_count == 2


def test_reshard_in_place_keeps_a_diffusers_component_loadable(factory: Factory) -> None:
    unet = factory.root / "pipe" / "unet"
    factory.safetensors("pipe/unet/diffusion_pytorch_model.safetensors", [A, B])
    factory.path("pipe/unet/config.json").write_text("{}")
    run = cli("reshard", unet, "--in-place", "--max-shard", "24")
    assert run.code == 0, run.stderr
    names = sorted(p.name for p in unet.iterdir())
    assert "diffusion_pytorch_model.safetensors.index.json" in names
    assert not any(name.startswith("model") for name in names)


@pytest.mark.parametrize(
    ("source", "output"),
    [
        ("model.safetensors", "pytorch_model.bin"),
        ("diffusion_pytorch_model.safetensors", "diffusion_pytorch_model.bin"),
        ("adapter_model.safetensors", "adapter_model.bin"),
        ("model.fp16.safetensors", "pytorch_model.fp16.bin"),
    ],
)
def test_convert_to_torch_takes_the_matching_bin_name(
    factory: Factory, tmp_path: Path, source: str, output: str
) -> None:
    factory.safetensors(f"m/{source}", [A, B])
    out = tmp_path / "out"
    run = cli("convert", factory.root / "m", "-o", out, "--to", "torch")
    assert run.code == 0, run.stderr
    assert sorted(p.name for p in out.iterdir()) == [output]


def test_safetensors_beside_a_stale_bin_is_what_convert_reads(
    factory: Factory, tmp_path: Path
) -> None:
    """transformers loads model.safetensors; a stale pytorch_model.bin beside it is ignored
    by the loader, so convert reads (and inspect counts) the safetensors only."""
    import torch

    folder = factory.root / "m"
    factory.safetensors("m/model.safetensors", [A, B])
    torch.save(
        {"a": torch.zeros(2, 3), "b": torch.zeros(4), "old": torch.ones(5)},
        folder / "pytorch_model.bin",
    )
    report = ckptfix.inspect(folder)
    assert report.tensor_count == 2
    assert report.to_dict()["checkpoint"]["family"] == "model*.safetensors"
    assert "mixed-formats" in {item.code for item in report.findings}
    out = tmp_path / "out"
    run = cli("convert", folder, "-o", out, "--json")
    assert run.code == 0, run.stderr
    assert sorted(name for shard in run.json()["plan"]["shards"] for name in shard["tensors"]) == [
        "a",
        "b",
    ]
    assert run.json()["plan"]["left_out"] == ["pytorch_model.bin"]


def test_separate_loose_checkpoints_are_never_merged(factory: Factory, tmp_path: Path) -> None:
    """Lightning's epoch=N.ckpt beside last.ckpt: two checkpoints of one model, not one."""
    import torch

    folder = factory.root / "runs"
    folder.mkdir()
    for name in ("epoch=3.ckpt", "last.ckpt"):
        torch.save({"state_dict": {"model.w": torch.ones(2)}, "epoch": 3}, folder / name)
    report = ckptfix.inspect(folder)
    several = [item for item in report.findings if item.code == "several-checkpoints"]
    assert len(several) == 1 and "'epoch=3.ckpt', 'last.ckpt'" in several[0].message
    for command in ("reshard", "convert", "dedupe"):
        run = cli(command, folder, "-o", tmp_path / command)
        assert run.code == 2, (command, run.stderr)
        assert run.error_lines == [
            f"error: {folder}: folder holds 2 separate checkpoints (epoch=3.ckpt, last.ckpt), "
            f"which are never merged (rule usage; pass the one to use, e.g. {folder / 'epoch=3.ckpt'})"
        ]
    run = cli("convert", folder / "last.ckpt", "-o", tmp_path / "one")
    assert run.code == 0, run.stderr


def test_one_loose_file_is_the_checkpoint(factory: Factory) -> None:
    factory.safetensors("m/weights.safetensors", [A, B])
    report = ckptfix.inspect(factory.root / "m")
    assert report.tensor_count == 2
    assert report.to_dict()["checkpoint"]["files"] == ["weights.safetensors"]


def test_a_variant_alone_is_chosen(factory: Factory) -> None:
    factory.safetensors("m/model.fp16.safetensors", [A])
    factory.safetensors("m/model.safetensors", [A, B])
    report = ckptfix.inspect(factory.root / "m")
    assert report.to_dict()["checkpoint"]["files"] == ["model.safetensors"]  # no variant asked
    only = factory.safetensors("v/model.fp16.safetensors", [A])
    assert ckptfix.inspect(only.parent).to_dict()["checkpoint"]["files"] == [
        "model.fp16.safetensors"
    ]


def _hub_cache(factory: Factory) -> Path:
    """A cache repository built as huggingface_hub lays it out: files in blobs/ by hash,
    the snapshot's entries relative links into ../../blobs/."""
    repo = factory.root / "hub" / "models--org--tiny"
    blobs, snapshot = repo / "blobs", repo / "snapshots" / "abc123"
    blobs.mkdir(parents=True)
    snapshot.mkdir(parents=True)
    (repo / "refs").mkdir()
    (repo / "refs" / "main").write_text("abc123")
    weights = factory.safetensors("staging/model.safetensors", [A, B])
    files = {"model.safetensors": weights.read_bytes(), "config.json": b'{"model_type": "llama"}'}
    for number, (name, data) in enumerate(files.items()):
        (blobs / f"blob{number}").write_bytes(data)
        (snapshot / name).symlink_to(Path("..") / ".." / "blobs" / f"blob{number}")
    return snapshot


def test_hub_snapshot_is_read_and_copied_through_its_links(
    factory: Factory, tmp_path: Path
) -> None:
    snapshot = _hub_cache(factory)
    assert ckptfix.inspect(snapshot).tensor_count == 2
    out = tmp_path / "out"
    run = cli("reshard", snapshot, "-o", out)
    assert run.code == 0, run.stderr
    config = out / "config.json"
    assert not config.is_symlink() and config.read_text() == '{"model_type": "llama"}'


def test_hub_snapshot_is_not_rewritten_in_place(factory: Factory) -> None:
    snapshot = _hub_cache(factory)
    before = {p.name: p.readlink() for p in snapshot.iterdir()}
    run = cli("reshard", snapshot, "--in-place", "--max-shard", "24")
    assert run.code == 2
    assert run.error_lines == [
        f"error: {snapshot}: is a snapshot of the Hugging Face cache (models--org--tiny): its "
        "files are links into the cache's blobs/, which a rewrite in place would orphan (rule usage; "
        "write the result elsewhere with -o OUT (what the links point to is copied))"
    ]
    assert {p.name: p.readlink() for p in snapshot.iterdir()} == before


def test_hub_repository_root_says_where_the_weights_are(factory: Factory) -> None:
    snapshot = _hub_cache(factory)
    repo = snapshot.parent.parent
    run = cli("inspect", repo)
    assert run.code == 2
    assert run.error_lines == [
        f"error: {repo}: is a Hugging Face cache repository (blobs/, refs/, snapshots/), not a "
        f"model folder (rule usage; pass one of its snapshots, e.g. {snapshot})"
    ]


def _pipeline(factory: Factory) -> Path:
    root = factory.root / "pipe"
    factory.safetensors("pipe/unet/diffusion_pytorch_model.safetensors", [A, B])
    factory.safetensors("pipe/vae/diffusion_pytorch_model.safetensors", [A])
    factory.safetensors("pipe/text_encoder/model.safetensors", [B], with_format=False)
    (root / "scheduler").mkdir()
    (root / "model_index.json").write_text(
        '{"_class_name": "StableDiffusionPipeline", "unet": ["diffusers", "UNet2DConditionModel"],'
        ' "vae": ["diffusers", "AutoencoderKL"], "text_encoder": ["transformers", "CLIPTextModel"],'
        ' "scheduler": ["diffusers", "PNDMScheduler"]}'
    )
    return root


def test_a_pipeline_root_is_inspected_as_its_components(factory: Factory) -> None:
    root = _pipeline(factory)
    run = cli("inspect", root, "--json")
    assert run.code == 0, run.stderr
    document = run.json()
    assert document["format"] == "diffusers-pipeline"
    assert document["tensor_count"] == 4
    assert sorted(document["checkpoint"]["components"]) == [
        "text_encoder",
        "unet",
        "vae",
    ]
    assert document["checkpoint"]["components"]["unet"]["files"] == [
        "diffusion_pytorch_model.safetensors"
    ]
    missing = [f for f in document["findings"] if f["code"] == "missing-format-metadata"]
    assert [f["file"] for f in missing] == [str(root / "text_encoder" / "model.safetensors")]


def test_rewriting_a_pipeline_root_says_to_take_a_component(
    factory: Factory, tmp_path: Path
) -> None:
    root = _pipeline(factory)
    run = cli("reshard", root, "-o", tmp_path / "out")
    assert run.code == 1
    assert len(run.error_lines) == 1
    assert "folder is a diffusers pipeline: its weights are in its components" in run.error_lines[0]
    assert f"e.g. {root / 'unet'}" in run.error_lines[0]
