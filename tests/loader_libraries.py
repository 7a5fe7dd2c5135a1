"""Loader-matrix layouts of the libraries around transformers: a diffusers pipeline, a PEFT
adapter, a sentence-transformers model, accelerate's `save_model`, Lightning's trainer
checkpoints and the pickled training dictionaries of DeepSpeed and timm. Each is written by
the library itself and loaded back by its own API (see tests/loader_layouts.py).

torch and the libraries are imported inside the functions (tests/test_no_torch.py)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from tests.builders import tiny_llama
from tests.loader_layouts import TOKENS, Layout, assert_all_loaded, quietly

SENTENCES = ["the cat sat on the mat", "a dog ran fast"]


# --- diffusers: a tiny StableDiffusionPipeline -------------------------------------------------


def _clip_tokenizer(folder: Path) -> Any:
    """A CLIP tokenizer over single letters (no merges): enough for a fixed prompt."""
    from transformers import CLIPTokenizer

    letters = "abcdefghijklmnopqrstuvwxyz"
    vocab = {token: i for i, token in enumerate([*letters, *(c + "</w>" for c in letters)])}
    vocab.update({"<|startoftext|>": len(vocab), "<|endoftext|>": len(vocab) + 1})
    folder.mkdir(parents=True)
    (folder / "vocab.json").write_text(json.dumps(vocab))
    (folder / "merges.txt").write_text("#version: 0.2\n")
    return CLIPTokenizer(
        str(folder / "vocab.json"), str(folder / "merges.txt"), model_max_length=16
    )


def _text_encoder(tokenizer: Any) -> Any:
    from transformers import CLIPTextConfig, CLIPTextModel

    config = CLIPTextConfig(
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        hidden_size=16,
        intermediate_size=32,
        num_attention_heads=2,
        num_hidden_layers=2,
        vocab_size=len(tokenizer),
        max_position_embeddings=16,
        projection_dim=16,
    )
    return CLIPTextModel(config)


@quietly
def build_pipeline(root: Path) -> None:
    """StableDiffusionPipeline.save_pretrained of tiny components: unet/ and vae/ hold
    diffusion_pytorch_model.safetensors, text_encoder/ model.safetensors."""
    import torch
    from diffusers import AutoencoderKL, DDIMScheduler, StableDiffusionPipeline
    from diffusers import UNet2DConditionModel as UNet

    torch.manual_seed(0)
    tokenizer = _clip_tokenizer(root / "vocab")
    blocks = {"block_out_channels": (8, 16), "norm_num_groups": 4}
    unet = UNet(
        **blocks,
        layers_per_block=1,
        sample_size=16,
        down_block_types=("CrossAttnDownBlock2D", "DownBlock2D"),
        up_block_types=("UpBlock2D", "CrossAttnUpBlock2D"),
        cross_attention_dim=16,
        attention_head_dim=2,
    )
    vae = AutoencoderKL(
        **blocks,
        down_block_types=("DownEncoderBlock2D",) * 2,
        up_block_types=("UpDecoderBlock2D",) * 2,
        latent_channels=4,
        sample_size=32,
    )
    scheduler = DDIMScheduler(
        beta_schedule="scaled_linear", clip_sample=False, set_alpha_to_one=False, steps_offset=1
    )
    StableDiffusionPipeline(
        unet=unet,
        vae=vae,
        text_encoder=_text_encoder(tokenizer),
        tokenizer=tokenizer,
        scheduler=scheduler,
        safety_checker=None,
        feature_extractor=None,
        requires_safety_checker=False,
    ).save_pretrained(root / "pipe")


def _assert_components_loaded(path: Path) -> None:
    """Each model component loads every weight it has (diffusers and transformers report
    missing and unexpected keys in their loading info)."""
    from diffusers import AutoencoderKL, UNet2DConditionModel
    from transformers import CLIPTextModel

    for kind, folder in ((UNet2DConditionModel, "unet"), (AutoencoderKL, "vae")):
        options = _diffusers_options(path / folder)
        info = kind.from_pretrained(path / folder, output_loading_info=True, **options)[1]
        assert_all_loaded(info)
    info = CLIPTextModel.from_pretrained(path / "text_encoder", output_loading_info=True)[1]
    assert_all_loaded(info)


def _diffusers_options(component: Path) -> dict[str, bool]:
    """diffusers finds a sharded .bin only when told not to look for safetensors (its own
    `save_pretrained(safe_serialization=False)` output needs the same)."""
    if any(component.glob("*.safetensors")):
        return {}
    return {"use_safetensors": False}


def load_pipeline(root: Path, path: Path, dtype: str | None) -> Any:
    """`StableDiffusionPipeline.from_pretrained` of the whole pipeline; two DDIM steps of a
    fixed prompt and seed: the image."""
    import torch
    from diffusers import AutoencoderKL, StableDiffusionPipeline, UNet2DConditionModel

    _assert_components_loaded(path)
    # A component held only as sharded .bin is loaded as diffusers documents, and handed in.
    components = {
        folder: kind.from_pretrained(path / folder, use_safetensors=False)
        for kind, folder in ((UNet2DConditionModel, "unet"), (AutoencoderKL, "vae"))
        if _diffusers_options(path / folder)
    }
    pipe = StableDiffusionPipeline.from_pretrained(path, **components)
    pipe.set_progress_bar_config(disable=True)
    generator = torch.Generator().manual_seed(0)
    return pipe(
        prompt="a cat",
        num_inference_steps=2,
        height=32,
        width=32,
        generator=generator,
        output_type="pt",
    ).images


# --- PEFT: a LoRA adapter ----------------------------------------------------------------------


@quietly
def build_adapter(root: Path) -> None:
    """A base model (save_pretrained) and a LoRA adapter on it (adapter_model.safetensors +
    adapter_config.json), its B matrices non-zero so the adapter changes the logits."""
    from peft import LoraConfig, get_peft_model

    base = tiny_llama(bos_token_id=0, eos_token_id=1)
    base.save_pretrained(root / "base")
    config = LoraConfig(r=4, target_modules=["q_proj", "v_proj"], init_lora_weights=False)
    get_peft_model(base, config).save_pretrained(root / "adapter")


def load_adapter(root: Path, path: Path, dtype: str | None) -> Any:
    """`PeftModel.from_pretrained(base, path)`: logits. A missing adapter key is a warning
    in PEFT (an error under this suite's filterwarnings)."""
    import torch
    from peft import PeftModel
    from transformers import AutoModelForCausalLM

    base = AutoModelForCausalLM.from_pretrained(root / "base")
    model = PeftModel.from_pretrained(base, str(path)).eval()
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits


# --- sentence-transformers ---------------------------------------------------------------------


@quietly
def build_sentence_model(root: Path) -> None:
    """A tiny BERT with a word-piece vocabulary, mean pooling, SentenceTransformer.save."""
    import torch
    from sentence_transformers import SentenceTransformer
    from sentence_transformers.sentence_transformer.modules import Pooling, Transformer
    from transformers import BertConfig, BertModel, BertTokenizer

    bert = root / "bert"
    bert.mkdir(parents=True)
    words = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *" ".join(SENTENCES).split()]
    (bert / "vocab.txt").write_text("\n".join(dict.fromkeys(words)) + "\n")
    BertTokenizer(str(bert / "vocab.txt")).save_pretrained(bert)
    torch.manual_seed(0)
    config = BertConfig(
        vocab_size=len(dict.fromkeys(words)),
        hidden_size=32,
        num_hidden_layers=2,
        num_attention_heads=2,
        intermediate_size=64,
        max_position_embeddings=32,
    )
    BertModel(config).save_pretrained(bert)
    word = Transformer(str(bert), max_seq_length=16)
    model = SentenceTransformer(modules=[word, Pooling(word.get_embedding_dimension())])
    model.save(str(root / "model"))


def load_sentence_model(root: Path, path: Path, dtype: str | None) -> Any:
    """`SentenceTransformer(path)`: the embeddings of two fixed sentences."""
    from sentence_transformers import SentenceTransformer
    from transformers import AutoModel

    model = SentenceTransformer(str(path), device="cpu")
    # the module's weights load through transformers, which reports what it could not find
    assert_all_loaded(AutoModel.from_pretrained(path, output_loading_info=True)[1])
    return model.encode(SENTENCES, convert_to_tensor=True)


# --- accelerate: save_model and load_checkpoint_in_model ---------------------------------------


def tiny_net() -> Any:
    """A small torch module (embedding, linears, a LayerNorm), weights seeded."""
    import torch

    torch.manual_seed(0)
    return torch.nn.Sequential(
        torch.nn.Embedding(96, 16),
        torch.nn.Linear(16, 64),
        torch.nn.LayerNorm(64),
        torch.nn.Linear(64, 16),
    ).eval()


def net_output(model: Any) -> Any:
    import torch

    with torch.no_grad():
        return model(torch.tensor(TOKENS))


@quietly
def build_accelerate(root: Path) -> None:
    """`Accelerator.save_model(..., max_shard_size)`: sharded model-*.safetensors + index."""
    from accelerate import Accelerator

    Accelerator(cpu=True).save_model(tiny_net(), root / "model", max_shard_size="8KB")


def load_accelerate(root: Path, path: Path, dtype: str | None) -> Any:
    """`load_checkpoint_in_model(fresh, path, strict=True)`: the module's output."""
    import torch
    from accelerate.utils import load_checkpoint_in_model

    model = tiny_net()
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.zero_()  # nothing left from the seeded init: the checkpoint must set all
    load_checkpoint_in_model(model, str(path), strict=True)
    return net_output(model)


LIBRARY_LAYOUTS = [
    Layout(
        "diffusers-unet",
        build_pipeline,
        load_pipeline,
        target="pipe/unet",
        home="pipe",
        max_shard="100KB",
    ),
    Layout(
        "diffusers-vae",
        build_pipeline,
        load_pipeline,
        target="pipe/vae",
        home="pipe",
        max_shard="100KB",
    ),
    Layout(
        "diffusers-text-encoder",
        build_pipeline,
        load_pipeline,
        target="pipe/text_encoder",
        home="pipe",
        max_shard="20KB",
    ),
    Layout("peft-lora", build_adapter, load_adapter, target="adapter"),
    Layout("sentence-transformers", build_sentence_model, load_sentence_model, max_shard="40KB"),
    Layout("accelerate-sharded", build_accelerate, load_accelerate, max_shard="8KB"),
]
