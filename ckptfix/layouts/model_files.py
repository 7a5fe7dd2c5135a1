"""What of a training checkpoint folder a conversion carries into the model folder it writes.

A training run's checkpoint folder (a Trainer `checkpoint-N/`, accelerate's `save_state`, a
DeepSpeed or DCP folder) holds, besides the weights, the state to resume training: optimizer
states (DeepSpeed's `global_stepN/`, accelerate's `optimizer_0/`, `optimizer.pt`), scheduler,
rng, scaler and sampler states, `trainer_state.json`, `training_args.bin`, DeepSpeed's `latest`
and its scripts, accelerate's own copy of the FSDP model. A model folder holds none of that:
only what a loader of the model reads, which is what transformers' `save_pretrained` writes
for a model, its tokenizer and its processors —

- the model: `config.json`, `generation_config.json`, `adapter_config.json` (peft), and the
  custom code its `auto_map` names (`modeling_x.py`, ...);
- the tokenizer: `tokenizer_config.json`, `tokenizer.json`, `special_tokens_map.json`,
  `added_tokens.json`, the chat template (`chat_template.jinja` / `.json`,
  `additional_chat_templates/`) and the vocabulary files its class names (`vocab.json`,
  `vocab.txt`, `merges.txt`, sentencepiece `*.model`, `*.spm`, `*.tiktoken`, `bpe.codes`, or
  other `*.json` / `*.txt`);
- processors: `preprocessor_config.json`, `processor_config.json`,
  `video_preprocessor_config.json` (any `*.json`).

So in a training folder: every `*.json` but `trainer_state.json`, `*.txt`, `*.jinja`,
`*.model`, `*.spm`, `*.tiktoken`, `bpe.codes`, `additional_chat_templates/`, and the `.py`
modules an `auto_map` names. Everything else is left out, and said so.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from ckptfix.core.errors import CkptfixError
from ckptfix.formats.strict_json import loads
from ckptfix.io.folder import LOCAL, Folder

# Written by trainers to resume training, never part of a model folder.
TRAINING_STATE = re.compile(
    r"^(?:trainer_state\.json|training_args\.bin|latest(?:_universal)?|zero_to_fp32\.py"
    r"|zero_to_torch\.py"
    r"|(?:optimizer|scheduler|sampler|scaler)(?:_\d+)?\.(?:pt|bin)|rng_state(?:_\d+)?\.pth"
    r"|random_states_\d+\.pkl|custom_checkpoint_\d+\.pkl|global_step\d+(?:_universal)?|optimizer_\d+"
    r"|pytorch_model_fsdp(?:_\d+)?(?:_rank\d+)?(?:\.bin)?|meta\.pt)$"
)
_MODEL_FILE = re.compile(
    r"^(?!trainer_state\.json$).+\.json$|^.+\.(?:txt|jinja|model|spm|tiktoken)$|^bpe\.codes$"
)
_MODEL_FOLDER = "additional_chat_templates"
# The files whose `auto_map` names custom code (`"AutoModel": "modeling_x.XModel"`).
_AUTO_MAP_FILES = (
    "config.json",
    "tokenizer_config.json",
    "processor_config.json",
    "preprocessor_config.json",
)
MAX_AUTO_MAP_FILE = 16 * 1024 * 1024

TRAINING = "training state"  # left-out reasons (ops.source)
NOT_MODEL = "not read by a loader of the model"


def is_training_folder(names: Iterable[str]) -> bool:
    """A folder a training run saved: it holds some of the trainers' resume state."""
    return any(TRAINING_STATE.match(name) for name in names)


def is_model_entry(name: str, is_dir: bool, code: set[str]) -> bool:
    """Whether a top-level entry of a training folder belongs in the model folder."""
    if is_dir:
        return name == _MODEL_FOLDER
    return name in code or (_MODEL_FILE.match(name) is not None and not TRAINING_STATE.match(name))


# In a DeepSpeed tag folder, beside the files read: the other copy of the weights (the
# optimizer partitions, or a universal checkpoint's zero/). Not a sign of a training folder.
_TAG_FOLDER_STATE = re.compile(
    r"^(?:zero|(?:bf16_)?zero_pp_rank_\d+_mp_rank_\d+_optim_states\.pt)$"
)


def left_out_reason(name: str) -> str:
    training = TRAINING_STATE.match(name) or _TAG_FOLDER_STATE.match(name)
    return TRAINING if training else NOT_MODEL


def code_modules(root: str, names: Iterable[str], folder: Folder = LOCAL) -> set[str]:
    """The `.py` files of `root` that an `auto_map` of its configs names (custom code a
    loader runs with trust_remote_code). An unreadable config names none: inspect reports it."""
    present = set(names)
    modules: set[str] = set()
    for config in _AUTO_MAP_FILES:
        if config not in present:
            continue
        path = os.path.join(root, config)
        if folder is LOCAL and os.path.islink(path):
            continue  # a link may lead out of the folder: never followed to read it
        try:
            parsed = loads(folder.read_small(path, path, MAX_AUTO_MAP_FILE, "config"))
        except (CkptfixError, ValueError):
            continue
        auto_map = parsed.get("auto_map") if isinstance(parsed, dict) else None
        for value in (auto_map or {}).values() if isinstance(auto_map, dict) else ():
            for reference in value if isinstance(value, list) else [value]:
                if isinstance(reference, str) and "--" not in reference and "." in reference:
                    modules.add(reference.rsplit(".", 1)[0] + ".py")
    return {module for module in modules if module in present}
