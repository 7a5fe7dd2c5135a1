"""What `save` and `Writer` share: the options checked, OUT claimed as the CLI claims it, the
files every output gets, and the result."""

from __future__ import annotations

import json
import os
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ckptfix.api.types import ConfigLike
from ckptfix.core.errors import CkptfixError, UsageError
from ckptfix.io.urls import is_url, refuse_unknown_scheme
from ckptfix.layouts.huggingface import MAX_CONFIG_SIZE
from ckptfix.plan.alias_record import DROPPED_KEY
from ckptfix.write.output import check_free_space, wrap_os_error
from ckptfix.write.sink import LocalSink, Sink
from ckptfix.write.staging import claim_output

RESERVED = ("__metadata__",)  # the one name a safetensors header keeps for itself


@dataclass(frozen=True)
class SaveResult:
    """What was written: OUT, its files (shards, the index, config.json) with their sizes,
    and the names written once for another (`aliases`: dropped -> kept, also recorded in
    the output as `ckptfix.dropped`)."""

    path: str
    files: dict[str, int]
    aliases: dict[str, str] = field(default_factory=dict)
    index: str | None = None

    @property
    def nbytes(self) -> int:
        return sum(self.files.values())


def checked_metadata(metadata: Mapping[str, str] | None) -> dict[str, str]:
    """String metadata for the headers (or the index); `ckptfix.dropped` is ckptfix's own."""
    if metadata is None:
        return {}
    if not isinstance(metadata, Mapping) or not all(
        isinstance(key, str) and isinstance(value, str) for key, value in metadata.items()
    ):
        raise UsageError("metadata", "must map strings to strings", "as safetensors headers do")
    if DROPPED_KEY in metadata:
        raise UsageError("metadata", f"{DROPPED_KEY!r} is written by ckptfix", "leave it out")
    return dict(metadata)


def checked_name(name: str, taken: object = ()) -> None:
    """A tensor name a header and an index can hold, not given twice."""
    try:
        name.encode("utf-8")
    except UnicodeEncodeError:
        raise UsageError(
            "tensors", f"name {name!r} is not valid Unicode", "rename the tensor"
        ) from None
    if name in RESERVED:
        raise UsageError("tensors", f"{name!r} is reserved by safetensors", "rename the tensor")
    if name in taken:  # type: ignore[operator]
        raise UsageError("tensors", f"{name!r} was given twice", "give every tensor its own name")


def config_of(config: ConfigLike | None) -> tuple[dict[str, Any] | None, bytes | None]:
    """The config (for its ties) and config.json's bytes: a mapping is written as
    transformers writes it; a file is copied as it is."""
    if config is None:
        return None, None
    if isinstance(config, Mapping):
        try:
            data = json.dumps(config, indent=2, sort_keys=True) + "\n"
        except (TypeError, ValueError) as exc:
            raise UsageError("config", f"is not JSON: {exc}", "pass plain values") from exc
        return dict(config), data.encode()
    path = os.fspath(config)
    try:
        with open(path, "rb") as handle:
            raw = handle.read(MAX_CONFIG_SIZE + 1)
        parsed = json.loads(raw)
    except FileNotFoundError as exc:
        raise UsageError(path, "no such config file", "pass the model's config.json") from exc
    except (OSError, ValueError, RecursionError) as exc:
        raise UsageError(path, f"cannot read it as JSON: {exc}", "pass a config.json") from exc
    if not isinstance(parsed, dict) or len(raw) > MAX_CONFIG_SIZE:
        raise UsageError(path, "is not a JSON object of at most 16 MiB", "pass a config.json")
    return parsed, raw


def open_sink(
    out: str | os.PathLike[str], *, needed: int = 0, single_file: bool | None = None
) -> Sink:
    """Claim OUT as the CLI's writes do without --force (a new folder, or an empty one; an
    existing one is locked for the run) and stage the output beside it. A URL (s3://) is an
    empty prefix written through a StoreSink; `single_file` says whether the output is one
    file (None: not known before the end; in a store, the shards are then written under
    provisional names and renamed, see StoreSink.rename)."""
    target = os.fspath(out)
    refuse_unknown_scheme(target)
    if is_url(target):
        return _store_sink(target, single_file)
    try:
        claim = claim_output(target, [])
        try:
            if needed:
                check_free_space(_existing(os.path.dirname(claim.real)), needed, target)
            return LocalSink(claim)
        except BaseException:
            claim.release()
            raise
    except CkptfixError:
        raise
    except OSError as exc:
        raise wrap_os_error(exc, target) from exc


def _store_sink(url: str, single_file: bool | None) -> Sink:
    from ckptfix.write.store_output import claim_store
    from ckptfix.write.store_sink import StoreSink
    from ckptfix.write.stores.base import StoreOptions

    options = StoreOptions()
    try:
        claim = claim_store(url, [], force=False, replace_any=False, write=True, options=options)
    except UsageError as exc:  # worded for the CLI: the library has no --force or --resume
        if exc.what.startswith("output prefix is not empty"):
            raise UsageError(
                exc.path, exc.what, "save to an empty prefix, or delete what is there first"
            ) from exc
        raise
    if single_file is None:  # a Writer: shards named at the end (StoreSink.rename)
        return StoreSink(claim.store, options, claim.state, renames=True)
    return StoreSink(claim.store, options, claim.state, single_file=single_file)


def _existing(folder: str) -> str:
    while not os.path.isdir(folder):
        folder = os.path.dirname(folder)
    return folder


@contextmanager
def writing(sink: Sink) -> Iterator[Sink]:
    """The write as one step: OS errors become one-line errors; on any failure (or
    KeyboardInterrupt) nothing reaches OUT."""
    try:
        yield sink
    except CkptfixError:
        sink.discard()
        raise
    except OSError as exc:
        sink.discard()
        raise wrap_os_error(exc, sink.out) from exc
    except BaseException:
        sink.discard()
        raise
