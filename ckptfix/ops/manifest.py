"""Manifests: the `hash --json` document written to a file (`hash --manifest OUT.json`), and
`inspect PATH --manifest M.json`, which checks a checkpoint against one."""

from __future__ import annotations

import contextlib
import os
import re
import tempfile
from collections.abc import Iterator, Mapping
from dataclasses import dataclass, replace
from typing import Any

from ckptfix.core.checkpoint import Checkpoint
from ckptfix.core.dtypes import DTYPES
from ckptfix.core.errors import CkptfixError, CorruptFileError, UsageError, WriteError
from ckptfix.core.findings import Finding, finding, name_list
from ckptfix.core.memory import paused_gc
from ckptfix.core.signals import current as current_signals
from ckptfix.core.text import redact
from ckptfix.io.folder import inside
from ckptfix.io.urls import is_url, refuse_unknown_scheme, refuse_url
from ckptfix.ops.digest import (
    ALGORITHM,
    WORKERS,
    content_digests,
    layout_key,
    model_digest,
    tensor_digest,
)
from ckptfix.ops.hash import SCHEMA_VERSION
from ckptfix.ops.report import Report
from ckptfix.ops.tensorset import tensor_set
from ckptfix.platform import system
from ckptfix.write.stores.base import ObjectStore, StoredObject, StoreOptions
from ckptfix.write.stores.location import output_url, overlap

MAX_MANIFEST = 10**9  # bytes: about 3,000,000 tensors
_HEX = re.compile(r"[0-9a-f]{64}")
_REGENERATE = "regenerate it with `ckptfix hash PATH --manifest M.json`"


@dataclass(frozen=True)
class Entry:
    dtype: str
    shape: tuple[int, ...]
    digest: bytes


@dataclass(frozen=True)
class Manifest:
    path: str
    entries: dict[str, Entry]
    digest: str | None = None


@dataclass(frozen=True)
class ManifestCheck:
    """What `inspect --manifest` found: how many of the manifest's tensors matched."""

    path: str
    tensor_count: int
    verified: int
    digest: str | None
    algorithm: str = ALGORITHM

    @property
    def ok(self) -> bool:
        return self.verified == self.tensor_count

    def to_dict(self) -> dict[str, object]:
        return {
            "path": self.path,
            "algorithm": self.algorithm,
            "digest": self.digest,
            "tensor_count": self.tensor_count,
            "verified": self.verified,
            "ok": self.ok,
        }


def check_manifest_out(out: str | os.PathLike[str], source: str) -> bool:
    """Refuse a manifest path that would replace the checkpoint's own file (`hash model.bin
    --manifest model.bin`) or a file in its folder; True when OUT replaces another file."""
    shown = os.fspath(out)
    refuse_unknown_scheme(shown)
    if is_url(shown):
        return _stored_manifest(shown, source)[2] is not None
    target = os.path.realpath(shown)
    if not os.path.lexists(target):
        return False
    if not os.path.isfile(target):
        raise UsageError(shown, "is not a regular file", "name a file for the manifest")
    if not is_url(source) and any(
        inside(path(shown), path(source)) for path in (os.path.abspath, os.path.realpath)
    ):  # abspath too: a cache snapshot's file is a link into its blobs
        raise UsageError(
            shown,
            f"is a file of the input {source}; the manifest would replace it",
            "write the manifest to a new file, or outside the checkpoint",
        )
    return True


def write_manifest(document: Mapping[str, Any], out: str | os.PathLike[str], source: str) -> bool:
    """Write the document to `out` atomically: a new temporary file beside it, fsynced, then
    renamed over it. Nothing else is ever replaced; a link named OUT is written through.
    Returns whether an existing file was replaced (the output names it)."""
    from ckptfix.core.text import json_bytes

    shown = os.fspath(out)
    refuse_unknown_scheme(shown)
    if is_url(shown):
        return _put_manifest(document, shown, source)
    target = os.path.realpath(shown)
    replaced = check_manifest_out(out, source)
    folder = os.path.dirname(target)
    if not os.path.isdir(folder):
        raise UsageError(shown, "its folder does not exist", "create it first")
    data = json_bytes(document) + b"\n"
    with _held():
        _replace(shown, target, data)
    return replaced


def _stored_manifest(url: str, source: str) -> tuple[ObjectStore, str, StoredObject | None]:
    """The store holding a manifest URL (s3://bucket/prefix/name.json), the object's name
    in it, and the object already there, if any."""
    from ckptfix.write.stores import open_store

    url = output_url(url)
    parent, _, name = url.rpartition("/")
    if "://" not in parent or not name:
        raise UsageError(redact(url), "names no object", "write --manifest s3://BUCKET/NAME.json")
    if overlap(url, [source]) is not None:
        raise UsageError(
            redact(url),
            f"is inside the input {redact(source)}; the manifest would be one of its files",
            "write the manifest to another prefix",
        )
    store = open_store(parent, StoreOptions())
    return store, name, store.stat(name)


def _put_manifest(document: Mapping[str, Any], url: str, source: str) -> bool:
    """The manifest as one object (one PutObject: atomic), checked against what the store
    then holds; True when it replaced one."""
    from ckptfix.core.text import json_bytes

    store, name, before = _stored_manifest(url, source)
    with _held():
        store.publish({name: json_bytes(document) + b"\n"}, [], message="ckptfix manifest")
    return before is not None


@contextlib.contextmanager
def _held() -> Iterator[None]:
    """SIGINT and SIGTERM wait while the manifest is written, so that the temporary file is
    always removed; once OUT is in place, the run is not reported as interrupted."""
    signals = current_signals()
    if signals is None:
        yield
        return
    outer = signals.writing
    with signals.held():
        signals.writing = True  # the console script would otherwise exit at once
        try:
            yield
            signals.committed = True
        finally:
            signals.writing = outer


def _replace(shown: str, target: str, data: bytes) -> None:
    folder = os.path.dirname(target)
    temp = None
    try:
        fd, temp = tempfile.mkstemp(prefix=".ckptfix-manifest-", suffix=".tmp", dir=folder)
        with os.fdopen(fd, "wb") as handle:
            handle.write(data)
            handle.flush()
            system().sync(handle.fileno())
        os.chmod(temp, 0o666 & ~_umask())
        system().replace(temp, target)
        temp = None
    except OSError as exc:
        raise WriteError(
            shown, f"cannot write the manifest: {exc.strerror}", "check the folder"
        ) from exc
    finally:
        if temp is not None:
            with contextlib.suppress(OSError):
                os.unlink(temp)


def _umask() -> int:
    mask = os.umask(0o022)
    os.umask(mask)
    return mask


def read_manifest(path: str | os.PathLike[str]) -> Manifest:
    """Parse and check a manifest: its version, algorithm, entries, and that its digests
    agree with each other (an edited entry is found before any tensor is read)."""
    import orjson

    refuse_url(path, "a manifest is read only from a local file", "download it first")
    shown = os.fspath(path)
    if not os.path.isfile(shown):
        what = "is not a file" if os.path.exists(shown) else "no such manifest file"
        raise UsageError(shown, what, "pass the file `ckptfix hash --manifest` wrote")
    if os.path.getsize(shown) > MAX_MANIFEST:
        raise _bad(shown, "manifest-too-large", f"the manifest is over {MAX_MANIFEST:,} bytes")
    try:
        with open(shown, "rb") as handle, paused_gc():
            document = orjson.loads(handle.read())
    except orjson.JSONDecodeError as exc:
        raise _bad(shown, "manifest-not-json", f"the manifest is not JSON ({exc})") from exc
    except OSError as exc:
        raise _bad(shown, "unreadable", f"cannot read the manifest: {exc.strerror}") from exc
    with paused_gc():
        entries = _entries(document, shown)
        manifest = Manifest(shown, entries, document.get("digest"))
        _check_digests(manifest)
    return manifest


def _bad(path: str, rule: str, what: str) -> CorruptFileError:
    return CorruptFileError(path, rule, what, _REGENERATE)


def _entries(document: Any, path: str) -> dict[str, Entry]:
    if not isinstance(document, dict) or not isinstance(document.get("tensors"), dict):
        raise _bad(path, "bad-manifest", 'the manifest is not an object with "tensors"')
    if document.get("schema_version") != SCHEMA_VERSION:
        version = document.get("schema_version")
        raise _bad(path, "manifest-version", f"unknown manifest schema_version {version!r}")
    if document.get("algorithm") != ALGORITHM:
        algorithm = document.get("algorithm")
        raise _bad(path, "manifest-algorithm", f"unknown algorithm {algorithm!r} (not sha256)")
    return {name: _entry(name, value, path) for name, value in document["tensors"].items()}


def _entry(name: str, value: Any, path: str) -> Entry:
    problem = None
    if not isinstance(value, dict):
        problem = "is not an object"
    elif value.get("dtype") not in DTYPES:
        problem = f"has an unknown dtype {value.get('dtype')!r}"
    elif not _is_shape(value.get("shape")):
        problem = "has a shape that is not a list of non-negative integers"
    elif not _is_hex(value.get("digest")) or ("content" in value and not _is_hex(value["content"])):
        problem = "has a digest that is not 64 lowercase hex digits"
    if problem is not None:
        raise _bad(path, "bad-manifest", f"the manifest entry {name!r} {problem}")
    if (
        "content" in value
        and tensor_digest(name, bytes.fromhex(value["content"])).hex() != value["digest"]
    ):
        raise _bad(
            path,
            "manifest-inconsistent",
            f"the entry {name!r} has a digest that is not its content's",
        )
    return Entry(value["dtype"], tuple(value["shape"]), bytes.fromhex(value["digest"]))


def _is_shape(value: Any) -> bool:
    return isinstance(value, list) and all(
        isinstance(dim, int) and not isinstance(dim, bool) and 0 <= dim < 2**64 for dim in value
    )


def _is_hex(value: Any) -> bool:
    return isinstance(value, str) and _HEX.fullmatch(value) is not None


def _check_digests(manifest: Manifest) -> None:
    if manifest.digest is None:
        return
    expected = model_digest({name: entry.digest for name, entry in manifest.entries.items()})
    if manifest.digest != expected.hex():
        raise _bad(
            manifest.path,
            "manifest-inconsistent",
            "the manifest's digest is not the digest of its tensors (it was edited)",
        )


def verified_report(
    checkpoint: Checkpoint, report: Report, manifest: Manifest, *, workers: int = WORKERS
) -> Report:
    """The report with what checking the checkpoint against the manifest found: findings,
    and a ManifestCheck. Only tensors whose name, dtype and shape match are read."""
    with paused_gc():
        return _verified(checkpoint, report, manifest, workers)


def _verified(checkpoint: Checkpoint, report: Report, manifest: Manifest, workers: int) -> Report:
    try:
        tensors = tensor_set(checkpoint, report)
    except CkptfixError as exc:
        message = (
            f"the checkpoint was not checked against the manifest {manifest.path}: {exc.detail()}"
        )
        unverified = finding("manifest-unverified", message, file=checkpoint.path)
        check = ManifestCheck(manifest.path, len(manifest.entries), 0, manifest.digest)
        return _with(report, [unverified], check)
    names = tensors.tensors
    missing = _sorted(manifest.entries.keys() - names.keys())
    extra = _sorted(names.keys() - manifest.entries.keys())
    common = _sorted(manifest.entries.keys() & names.keys())
    layout = [n for n in common if (names[n].dtype, names[n].shape) != _layout(manifest.entries[n])]
    unread = set(layout)
    read = [n for n in common if n not in unread]
    contents = content_digests([names[n] for n in read], tensors.source, workers=workers)
    differ = [
        n
        for n in read
        if tensor_digest(n, contents[layout_key(names[n])]) != manifest.entries[n].digest
    ]
    check = ManifestCheck(
        manifest.path, len(manifest.entries), len(read) - len(differ), manifest.digest
    )
    found = _findings(checkpoint.path, manifest.path, missing, extra, layout, differ)
    return _with(report, found, check)


def _layout(entry: Entry) -> tuple[str, tuple[int, ...]]:
    return entry.dtype, entry.shape


def _sorted(names: Any) -> list[str]:
    return sorted(names)  # code point order, which is the order of the UTF-8 bytes


def _with(report: Report, found: list[Finding], check: ManifestCheck) -> Report:
    findings = sorted([*report.findings, *found], key=lambda item: -item.severity.rank)
    return replace(report, findings=tuple(findings), manifest=check)


def _findings(
    path: str,
    manifest: str,
    missing: list[str],
    extra: list[str],
    layout: list[str],
    differ: list[str],
) -> list[Finding]:
    found = []
    changed = _sorted(layout + differ)
    if changed:
        kinds = f"{len(differ)} in bytes, {len(layout)} in dtype or shape"
        found.append(
            finding(
                "manifest-mismatch",
                f"{len(changed)} tensor(s) differ from the manifest {manifest} ({kinds}): "
                f"{name_list(changed)}; the files changed since it was made, or are not that "
                "model (re-download them, or regenerate the manifest if the change is intended)",
                file=path,
                tensors=changed,
            )
        )
    if missing:
        found.append(
            finding(
                "manifest-missing-tensor",
                f"{len(missing)} tensor(s) of the manifest {manifest} are not in the checkpoint: "
                f"{name_list(missing)} (a shard is missing, or this is another checkpoint)",
                file=path,
                tensors=missing,
            )
        )
    if extra:
        found.append(
            finding(
                "manifest-extra-tensor",
                f"{len(extra)} tensor(s) are not in the manifest {manifest}: {name_list(extra)} "
                "(this is another checkpoint, or the manifest is out of date)",
                file=path,
                tensors=extra,
            )
        )
    return found
