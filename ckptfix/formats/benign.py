"""The one table of benign values and unsupported tensor kinds that every pickle reader
shares: plain torch files, DCP's `.metadata` and chunks, DeepSpeed's states and universal
parameter files. A reader adds only the classes of its own format (`reader_allowlist`).

Benign values (`argparse.Namespace` in timm, torchvision and fairseq checkpoints, numpy
scalars, sets, paths, `torch.Size`, `torch.device`, DeepSpeed's loss scaler) unpickle to
inert stubs or plain data: nothing of the real class is imported or called. Every entry is
also known under the name a protocol 0-2 pickle gives it (`torch.save` writes protocol 2, in
which `builtins.set` is `__builtin__.set`). Unsupported dtypes (complex128, quantized ones)
and layouts (sparse, quantized, nested tensors) unpickle to markers and builders that refuse
the file as unsupported, not as unsafe, since they are not hostile.
"""

from __future__ import annotations

import _compat_pickle
from collections.abc import Mapping

from ckptfix.core.dtypes import TORCH_DTYPES
from ckptfix.formats.pickle_scan import PickleRejected
from ckptfix.formats.training_pickles import FROM_TYPE, LAYOUT, PATHS, SIZE, stubs
from ckptfix.formats.unpickler import (
    TORCH_ALLOWLIST,
    Allowlist,
    Builder,
    PickleUnsupported,
    Unsupported,
    brief,
    extended,
)

_UNSUPPORTED_DTYPES = (
    "complex128", "cdouble", "complex32", "chalf", "qint8", "quint8", "qint32", "quint4x2",
    "quint2x4", "bits1x8", "bits2x4", "bits4x2", "bits8", "bits16", "float4_e2m1fn_x2",
    "uint1", "uint2", "uint3", "uint4", "uint5", "uint6", "uint7",
    "int1", "int2", "int3", "int4", "int5", "int6", "int7",
)  # fmt: skip
_UNSUPPORTED_STORAGES = {
    "ComplexDoubleStorage": "complex128", "QInt8Storage": "qint8", "QUInt8Storage": "quint8",
    "QInt32Storage": "qint32", "QUInt4x2Storage": "quint4x2", "QUInt2x4Storage": "quint2x4",
}  # fmt: skip
_QSCHEMES = (
    "per_tensor_affine", "per_channel_affine", "per_tensor_symmetric",
    "per_channel_symmetric", "per_channel_affine_float_qparams",
)  # fmt: skip
_UNSUPPORTED_LAYOUTS = {
    "_rebuild_sparse_tensor": "a sparse tensor",
    "_rebuild_sparse_csr_tensor": "a sparse CSR tensor",
    "_rebuild_qtensor": "a quantized tensor",
    "_rebuild_nested_tensor": "a nested tensor",
    "_rebuild_meta_tensor_no_storage": "a meta tensor (no data)",
    "_rebuild_wrapper_subclass": "a tensor subclass",
    "_rebuild_device_tensor_from_numpy": "a tensor rebuilt from numpy",
    "_rebuild_xla_tensor": "an XLA tensor",
    "_rebuild_mtia_tensor": "an MTIA tensor",
}


def _refusing(what: str) -> Builder:
    def refuse(*args: object) -> object:
        raise PickleUnsupported(what)

    return Builder(what, refuse)


def _latin1(text: object, encoding: object = "latin1") -> bytes:
    """`_codecs.encode(text, "latin1")`: how protocol 2 pickles bytes (numpy scalars)."""
    if type(text) is not str or encoding not in ("latin1", "latin-1"):
        raise PickleRejected("bad-pickle", f"_codecs.encode of {brief(text)}, {brief(encoding)}")
    return text.encode("latin-1")


def _unsupported() -> dict[tuple[str, str], object]:
    entries: dict[tuple[str, str], object] = {}
    for name in _UNSUPPORTED_DTYPES:
        if name not in TORCH_DTYPES:
            entries[("torch", name)] = Unsupported(f"dtype torch.{name}")
    for name, dtype in _UNSUPPORTED_STORAGES.items():
        entries[("torch", name)] = Unsupported(f"dtype {dtype} (torch.{name})")
    for name in _QSCHEMES:
        entries[("torch", name)] = Unsupported(f"quantization scheme torch.{name}")
    for name, what in _UNSUPPORTED_LAYOUTS.items():
        entries[("torch._utils", name)] = _refusing(what)
    return entries


def both_spellings(entries: Mapping[tuple[str, str], object]) -> dict[tuple[str, str], object]:
    """The entries under their Python 3 names and under the names Python 3's pickler writes
    for protocols 0-2 (pickle's compat maps, as `save_global` applies them with
    fix_imports=True): `builtins.set` is also `__builtin__.set`."""
    spelled = dict(entries)
    for (module, name), value in entries.items():
        old = _compat_pickle.REVERSE_NAME_MAPPING.get((module, name))
        if old is None and module in _compat_pickle.REVERSE_IMPORT_MAPPING:
            old = (_compat_pickle.REVERSE_IMPORT_MAPPING[module], name)
        if old is not None:
            spelled.setdefault(old, value)
    return spelled


BENIGN: dict[tuple[str, str], object] = both_spellings(
    {
        **stubs("argparse", ["Namespace"]),
        **stubs("numpy.core.multiarray", ["scalar"]),
        **stubs("numpy._core.multiarray", ["scalar"]),
        **stubs("numpy", ["dtype"]),
        **stubs("builtins", ["set", "frozenset"]),
        **stubs("torch", ["device"]),
        ("_codecs", "encode"): Builder("_codecs.encode", _latin1),
        ("pathlib", "Path"): PATHS[("pathlib", "PosixPath")],
        **PATHS,
        **SIZE,
        **LAYOUT,
        # DeepSpeed's files, which may also be read on their own (`convert
        # mp_rank_00_model_states.pt --key module`, a universal `fp32.pt`): its loss scaler,
        # stage enum and fragment addresses, ZeRO-3's tensor wrapper, and the sub-parameter
        # shape a universal parameter of a fused layer records.
        **stubs("deepspeed.runtime.fp16.loss_scaler", ["LossScaler", "DynamicLossScaler"]),
        **stubs("deepspeed.runtime.zero.config", ["ZeroStageEnum"]),
        **stubs("deepspeed.utils.tensor_fragment", ["fragment_address"]),
        **stubs("deepspeed.checkpoint.universal_checkpoint", ["SubparamShape"]),
        **FROM_TYPE,
    }
)

# Every reader's allowlist by name, so a test can hold each one to the benign table.
READERS: dict[str, Allowlist] = {}


def reader_allowlist(reader: str, own: Mapping[tuple[str, str], object] | None = None) -> Allowlist:
    """What a reader's pickles may name: tensors, storages, dtypes, the benign values, the
    unsupported kinds (refused with their own message), and the reader's `own` classes."""
    allowed = extended(TORCH_ALLOWLIST, {**BENIGN, **_unsupported(), **both_spellings(own or {})})
    READERS[reader] = allowed
    return allowed


# What plain torch files (`torch.save`, either serialization) may name.
PLAIN_ALLOWLIST: Allowlist = reader_allowlist("plain")
