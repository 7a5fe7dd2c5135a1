"""A DeepSpeed universal checkpoint's parameter file (`zero/<param>/fp32.pt`, written by
`ds_to_universal`), read without deepspeed or torch: a torch zip holding the parameter's
fp32 weight, either alone (ZeRO-3: flattened) or as `{"param": tensor, ...}` beside what
DeepSpeed's loader needs to cut it for a new tensor-parallel size (`cat_dim`,
`param_n_sub_params`, `sub_param_shape`: the tensor itself is whole) and `vocab_tensor` (its
padding rows were cut off). The tensor stays a descriptor (a validated view).
"""

from __future__ import annotations

from dataclasses import dataclass

from ckptfix.core.errors import CorruptFileError, UnsupportedFormatError
from ckptfix.formats.benign import reader_allowlist
from ckptfix.formats.tensor_dict import View, check_view
from ckptfix.formats.torch_zip import read_zip
from ckptfix.formats.unpickler import Allowlist, TensorRef, brief
from ckptfix.io.source import ByteSource

UNIVERSAL_ALLOWLIST: Allowlist = reader_allowlist("deepspeed-universal")
_FIX = "run ds_to_universal again, or copy the parameter's folder again"


@dataclass(frozen=True)
class UniversalParam:
    """The weight in one `fp32.pt`; `vocab`: ds_to_universal cut its padding rows off."""

    label: str
    view: View
    vocab: bool


def read_universal_param(source: ByteSource) -> UniversalParam:
    path = source.label
    saved = read_zip(source, UNIVERSAL_ALLOWLIST)
    held, vocab = saved.obj, False
    if isinstance(held, dict):
        if held.get("is_expert_param") is True:
            raise UnsupportedFormatError(
                path,
                "file holds an expert-parallel parameter (every expert stacked, "
                "is_expert_param), which ckptfix does not map onto the model's experts",
                "load the universal checkpoint with DeepSpeed and save the model's state dict",
            )
        vocab = held.get("vocab_tensor") is True
        held = held.get("param")
    if not isinstance(held, TensorRef):
        raise CorruptFileError(
            path,
            "universal-param",
            f"file holds {brief(saved.obj)}, not a tensor or a dictionary with its `param`",
            _FIX,
        )
    return UniversalParam(path, check_view(path, "param", held, saved.storages), vocab)
