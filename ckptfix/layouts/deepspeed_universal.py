"""DeepSpeed universal checkpoints, as `ds_to_universal` writes them: a folder (`<tag>_universal/`,
named by `latest_universal` beside `latest`) with the model states copied from the ZeRO
checkpoint, and `zero/<param>/` for each parameter: `fp32.pt` (its fp32 weight), `exp_avg.pt`,
`exp_avg_sq.pt` and `step.pt` (its Adam state); `zero/optimizer_state.pt` holds the rest.

The model is what DeepSpeed's universal loader restores: each parameter the model states'
`param_shapes` name, from its `fp32.pt` (its shape checked against param_shapes), and the
frozen parameters, buffers and tied aliases from the model states, as for a ZeRO checkpoint
(layouts.zero_model). The optimizer state is left out and reported. Names on disk are
hostile: a parameter's folder must be a real folder in `zero/` named exactly as the model
states name the parameter, and its `fp32.pt` a regular file (or a link that stays inside the
checkpoint, or goes into its Hugging Face cache repository's blobs); a folder in `zero/` that
names no parameter of the model states is an error, not skipped.
"""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass

from ckptfix.core.errors import UsageError
from ckptfix.core.findings import finding, name_list
from ckptfix.core.tensor import TensorInfo
from ckptfix.core.text import plain_file_name
from ckptfix.formats.zero import ModelStates
from ckptfix.formats.zero_universal import UniversalParam, read_universal_param
from ckptfix.layouts.deepspeed_files import Reader, segment, spread_tensor, view_tensor
from ckptfix.layouts.hub import stays_inside
from ckptfix.layouts.zero_model import Assembled, from_states, module
from ckptfix.layouts.zero_weights import numel, slice_pieces

ZERO = "zero"
LATEST = "latest_universal"
WEIGHT = "fp32.pt"
GLOBAL_STATE = "optimizer_state.pt"
_MOMENTS = ("exp_avg.pt", "exp_avg_sq.pt")
_AGAIN = "run ds_to_universal again on the ZeRO checkpoint"


def is_universal(tag_dir: str) -> bool:
    """A tag folder of a universal checkpoint: it holds `zero/`."""
    return os.path.isdir(os.path.join(tag_dir, ZERO))


def holds_universal(root: str, names: list[str]) -> bool:
    """A universal checkpoint's folder, even without its model states: `zero/` with the
    optimizer's global state in it."""
    return ZERO in names and os.path.isfile(os.path.join(root, ZERO, GLOBAL_STATE))


def refuse_zero_folder(root: str, names: list[str]) -> None:
    """The `zero/` folder passed alone is refused, with the folder to pass instead."""
    if os.path.basename(os.path.normpath(root)) == ZERO and GLOBAL_STATE in names:
        raise UsageError(
            root,
            "folder is the zero/ part of a DeepSpeed universal checkpoint (no model states)",
            f"pass the folder that holds it: {os.path.dirname(os.path.normpath(root))}",
        )


def load_universal(
    root: str,
    tag_dir: str,
    models: dict[int | None, str],
    reader: Reader,
    weights: str,
    partitions: bool = False,
) -> Assembled:
    """The fp32 weights of a universal checkpoint, or with weights="module" the training-dtype
    copy its (stage 0-2) model states hold. `partitions`: the folder holds the ZeRO
    partitions too (the fix of a missing weight says they can be read instead)."""
    zero = os.path.join(tag_dir, ZERO)
    if weights == "module" and models:  # without model states: reported as missing below
        found = module(tag_dir, models, {}, reader)
        found.left_out_bytes = _left_out(zero, None)[0]
        return found
    found = Assembled(weights="universal")
    ranks = [rank for rank in models if rank is not None]
    if ranks and None not in models:  # ZeRO-3: every rank's model states
        found.stage, found.world = 3, max(ranks) + 1
    params = _Params(root, zero, reader, found, partitions)
    return from_states(tag_dir, models, reader, found, params)


def unread(tag_dir: str) -> tuple[int, int]:
    """(bytes, tensor files) of a universal checkpoint's `zero/` (its weights and optimizer
    state), for a tag folder whose partitions are read instead; nothing through a link."""
    zero = os.path.join(tag_dir, ZERO)
    return (0, 0) if os.path.islink(zero) else _left_out(zero, None)


def _files_in(folder: str) -> dict[str, int]:
    """The regular files of a real folder (never through a link) and their sizes; none when
    it cannot be listed (what matters about it is reported where it is read)."""
    try:
        if os.path.islink(folder):
            return {}
        with os.scandir(folder) as listing:
            return {
                entry.name: entry.stat(follow_symlinks=False).st_size
                for entry in listing
                if entry.is_file(follow_symlinks=False)
            }
    except OSError:
        return {}


def _left_out(zero: str, names: set[str] | None) -> tuple[int, int]:
    """(bytes, tensor files) of what the model leaves out: the files in `zero/` and in the
    folders of the parameters `names`, but their fp32.pt, and their moments (with names
    None: every folder's files, and its fp32.pt counted with the moments)."""
    total, moments = sum(_files_in(zero).values()), 0
    for name in sorted(names) if names is not None else _folders(zero):
        if not plain_file_name(name):
            continue
        files = _files_in(os.path.join(zero, name))
        total += sum(size for file, size in files.items() if names is None or file != WEIGHT)
        moments += sum(moment in files for moment in _MOMENTS) + (names is None and WEIGHT in files)
    return total, moments


def _folders(zero: str) -> list[str]:
    try:
        with os.scandir(zero) as listing:
            return [entry.name for entry in listing if entry.is_dir(follow_symlinks=False)]
    except OSError:
        return []


@dataclass(frozen=True)
class _Entry:
    """An entry of `zero/`: a real folder, a link, or anything else."""

    folder: bool
    link: bool


class _Params:
    """The trainable parameters of a universal checkpoint, given its model states."""

    def __init__(
        self, root: str, zero: str, reader: Reader, found: Assembled, partitions: bool
    ) -> None:
        self.root, self.zero, self.reader, self.out = root, zero, reader, found
        self.partitions = partitions  # the ZeRO partitions are there too, never mixed in
        self.vocab_rows: int | None = None  # what the model states say a vocabulary keeps

    def __call__(self, states: list[ModelStates]) -> list[TensorInfo] | None:
        first = states[0]
        self.vocab_rows = first.original_vocab_size
        if self.out.stage is None:
            self.out.stage = first.stage
        self.out.world = first.dp_world_size
        entries = self._entries()
        if entries is None:
            return None
        shapes = {name: shape for group in first.param_shapes for name, shape in group.items()}
        tensors = [self._param(name, shape, entries.get(name)) for name, shape in shapes.items()]
        self._unknown(first, entries)
        trained = {name for name in shapes if name in entries and entries[name].folder}
        self.out.left_out_bytes, self.out.left_out_tensors = _left_out(self.zero, trained)
        return [tensor for tensor in tensors if tensor is not None]

    def _problem(self, path: str, what: str, rule: str, fix: str = _AGAIN) -> None:
        message = f"{what} (rule {rule}; {fix})"
        self.out.findings.append(finding("corrupt-file", message, file=path))

    def _entries(self) -> dict[str, _Entry] | None:
        """The entries of `zero/`, which must be a real folder."""
        if os.path.islink(self.zero):
            self._problem(
                self.zero, "zero/ is a link; it must be the folder itself", "universal-link"
            )
            return None
        try:
            with os.scandir(self.zero) as listing:
                return {
                    entry.name: _Entry(entry.is_dir(follow_symlinks=False), entry.is_symlink())
                    for entry in listing
                }
        except OSError as exc:
            self._problem(
                self.zero,
                f"cannot list the folder: {exc.strerror}",
                "unreadable",
                "check its permissions",
            )
            return None

    def _missing(self, name: str, weight: str) -> None:
        how = f"copy zero/{name}/ again, or {_AGAIN}"
        if self.partitions:
            how = (
                f"copy zero/{name}/ again, {_AGAIN}, or read the partitions: --zero-weights master"
            )
        fix = "ckptfix convert SRC -o OUT --zero-weights master" if self.partitions else None
        what = f"the fp32 weight of {name!r} is missing ({how})"
        self.out.findings.append(finding("missing-rank-file", what, file=weight, fix=fix))

    def _unknown(self, first: ModelStates, entries: dict[str, _Entry]) -> None:
        known = {name for group in first.param_shapes for name in group}
        known |= set(first.module) | set(first.frozen_shapes) | set(first.buffer_names)
        known |= set(first.shared_params)
        others = sorted(
            name
            for name, entry in entries.items()
            if (entry.folder or entry.link) and name not in known
        )
        if others:
            self._problem(
                self.zero,
                f"zero/ holds {len(others)} folder(s) that name no parameter of the model "
                f"states: {name_list(others)}",
                "universal-names",
                "move them out, or run ds_to_universal again on the ZeRO checkpoint",
            )

    def _param(self, name: str, shape: tuple[int, ...], entry: _Entry | None) -> TensorInfo | None:
        folder = os.path.join(self.zero, name)
        if not plain_file_name(name):
            what = f"the model states name a parameter {name!r}, which is no folder name in zero/"
            self._problem(self.zero, what, "path-traversal")
            return None
        weight = os.path.join(folder, WEIGHT)
        if entry is None:
            self._missing(name, weight)
            return None
        if not entry.folder:
            what = f"zero/{name} is {'a link' if entry.link else 'not a folder'}; a parameter's folder must be a real folder"
            self._problem(folder, what, "universal-link")
            return None
        if not self._plain_weight(name, weight):
            return None
        held = self.reader.read(weight, read_universal_param)
        return None if held is None else self._tensor(name, shape, held)

    def _plain_weight(self, name: str, weight: str) -> bool:
        """fp32.pt is a regular file, or a link to one inside the checkpoint (or the blobs of
        its Hugging Face cache repository): nothing the user did not name is read."""
        try:
            mode = os.lstat(weight).st_mode
        except FileNotFoundError:
            self._missing(name, weight)
            return False
        except OSError as exc:
            self._problem(
                weight,
                f"cannot read the file: {exc.strerror}",
                "unreadable",
                "check its permissions",
            )
            return False
        if stat.S_ISLNK(mode):
            if not stays_inside(weight, self.root):
                self._problem(
                    weight, "file is a link to a file outside the checkpoint", "universal-link"
                )
                return False
            real = os.path.realpath(weight)
            mode = os.stat(real).st_mode if os.path.exists(real) else 0
        if not stat.S_ISREG(mode):
            self._problem(weight, "file is not a regular file", "universal-link")
            return False
        return True

    def _tensor(self, name: str, shape: tuple[int, ...], held: UniversalParam) -> TensorInfo | None:
        """The weight as the model states shape it: as saved, or (ZeRO-3) flattened, or (a
        vocabulary tensor) without the padding rows ds_to_universal cut off."""
        view = held.view
        if view.shape == shape:
            return view_tensor(name, view, held.label)
        if len(view.shape) == 1 and view.contiguous and view.numel == numel(shape):
            pieces = slice_pieces([segment(view, held.label)], 0, view.numel, 0)
            return spread_tensor(name, view.dtype, shape, pieces)
        cut = len(view.shape) == len(shape) > 0 and view.shape[1:] == shape[1:]
        if held.vocab and cut and view.shape[0] <= shape[0]:
            return self._vocabulary(name, shape, held)
        self._problem(
            held.label,
            f"file holds a tensor of shape {list(view.shape)}, but the model states give "
            f"{name!r} the shape {list(shape)}",
            "universal-shape",
        )
        return None

    def _vocabulary(
        self, name: str, shape: tuple[int, ...], held: UniversalParam
    ) -> TensorInfo | None:
        """A vocabulary weight without its padding rows: ds_to_universal keeps the rows of
        the vocabulary's size before padding, which the model states record; any other
        number of rows is a weight cut short, never taken as the model's."""
        rows = held.view.shape[0]
        if rows == self.vocab_rows:
            return view_tensor(name, held.view, held.label)
        recorded = (
            "no original_vocab_size"
            if self.vocab_rows is None
            else (f"original_vocab_size {self.vocab_rows}")
        )
        self._problem(
            held.label,
            f"file holds {rows} row(s) of {name!r} {list(shape)} as a vocabulary without its "
            f"padding (vocab_tensor), but the model states record {recorded} "
            "(universal_checkpoint_info)",
            "universal-shape",
        )
        return None
