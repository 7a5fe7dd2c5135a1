"""hf://org/repo[@revision][/subfolder] as an output (`base.ObjectStore`), through
huggingface_hub's commit API: each shard's LFS upload as it completes
(`HfApi.preupload_lfs_files` with a `CommitOperationAdd`), then `publish()` is one
`create_commit` holding every shard, the small files and the deletions (or one pull request,
`StoreOptions.hf_pr`), on top of the commit the revision pointed to when the store opened
(`parent_commit`: a branch moved meanwhile fails the commit rather than mixing two outputs).

The LFS protocol needs each file's SHA-256 before its upload starts, and the client reads an
upload from a file (or bytes held whole): each object is therefore staged in the temporary
folder as it streams, hashed on the way, uploaded at `complete()` and removed. At most one
object is staged at a time: `begin` waits while another upload of the store is open (and
refuses a second one on the same thread, which could never go on).

Verified: after its upload, the Hub's LFS batch API must report an object of that SHA-256
and size (a store that kept other bytes has none of that name); after the commit, the tree
at the new commit must list every uploaded file with its SHA-256 and size. Where the client
uploads through Xet instead (hf_xet installed, HF_HUB_DISABLE_XET unset), the SHA-256 hf_xet
computes while reading the staged file must equal the one computed as it streamed, and the
commit's tree is checked the same way. Uploads that were never committed are not listed by
the Hub, which removes them itself: `dangling()` has none.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import tempfile
import threading
from collections.abc import Callable, Iterable, Mapping, Sequence
from functools import partial
from typing import Any, TypeVar

from ckptfix.core.errors import (
    CkptfixError,
    RemoteChangedError,
    RemoteError,
    RemoteNotFoundError,
    UsageError,
    VerificationError,
)
from ckptfix.io.remote import Info, RemoteSession, Settings
from ckptfix.io.remote_errors import Failure, UnexpectedAnswer, classify, remote_error
from ckptfix.io.remote_hub import HubBackend, _split, parse_url
from ckptfix.write.stores.base import Dangling, StoredObject, StoreOptions, UploadStats
from ckptfix.write.stores.common import index_last, mismatch, needs, request

T = TypeVar("T")
REGULAR_MAX = 10 * 2**20  # the Hub keeps larger files in LFS: a "regular" answer is refused


class HubStore:
    """A repository (and subfolder) on the Hub (see the module docstring)."""

    one_commit = True  # publish() is one commit: what precedes it is never visible

    def __init__(
        self, url: str, options: StoreOptions | None = None, settings: Settings | None = None
    ) -> None:
        needs(url, "huggingface_hub")
        from huggingface_hub import HfApi

        self.url = url.rstrip("/")
        self.kind, self.repo, self.revision, self.folder = _split(parse_url(url))
        self.folder = self.folder.strip("/")
        self.options = options or StoreOptions()
        settings = settings or Settings.from_env()
        self.backend = HubBackend(settings.timeout)
        self.session = RemoteSession(self.backend, settings)
        self.api = HfApi()
        self.parent = self._head()
        self.operations: dict[str, Any] = {}  # path in repo -> its CommitOperationAdd
        self.deletions: list[str] = []  # names `delete` was given: deleted by the commit
        self.stage = threading.Semaphore(1)
        self.staging: int | None = None  # the thread whose upload is staged
        self.published: str | None = None  # the commit publish() made
        self.repo_files: set[str] = set()  # the repository's own files there (`repo_file`)
        self._sent = 0

    @property
    def display(self) -> str:
        return self.url

    def path(self, name: str) -> str:
        return f"{self.folder}/{name}" if self.folder else name

    def url_of(self, name: str) -> str:
        return f"{self.url}/{name}"

    def _head(self) -> str:
        """The commit the revision points to; a repository or revision that does not exist
        is one error."""
        try:
            return request(
                self.session,
                self.url,
                lambda: self.backend._commit(self.kind, self.repo, self.revision),
            )
        except RemoteNotFoundError as exc:
            what = (
                f"the repository {self.repo} or its revision {self.revision!r} does not exist "
                "(HTTP 404)"
            )
            fix = "create the repository (and the branch) first, or check the URL"
            raise remote_error(self.url, Failure("remote-not-found", what, fix), 1) from exc

    def _root(self, commit: str) -> str:
        """The backend's path of the output folder at `commit`."""
        base = f"{self.kind}:{self.repo}@{commit}"
        return f"{base}/{self.folder}" if self.folder else base

    # --- the protocol ----------------------------------------------------------------------

    def repo_file(self, name: str) -> bool:
        """The repository's own files, made with it (`.gitattributes`, which keeps the
        weights in LFS, and the model card at its root): not part of any output, so never
        counted as one's nor deleted with one."""
        return name.rpartition("/")[2] == ".gitattributes" or (
            name == "README.md" and not self.folder
        )

    def list(self) -> Sequence[StoredObject]:
        """Every file under the output folder at the revision (sub-folders walked), but the
        repository's own (`repo_file`)."""
        found = []
        for name, entry in sorted(self._entries(self.published or self.parent).items()):
            if self.repo_file(name):
                self.repo_files.add(name)
                continue
            sha = entry.get("sha256")
            checksum = ("sha256", str(sha)) if sha else None
            found.append(StoredObject(name, int(entry.get("size") or 0), checksum))
        return found

    def _entries(self, commit: str) -> dict[str, Info]:
        """The tree entries of the files under the output folder at `commit`, by name."""
        found: dict[str, Info] = {}
        root = self._root(commit)
        folders = [root]
        while folders:
            folder = folders.pop()
            try:
                entries = request(self.session, self.url, partial(self.backend.ls, folder))
            except RemoteNotFoundError:
                entries = []  # a subfolder not made yet
            for entry in entries:
                if entry["type"] == "directory":
                    folders.append(entry["name"])
                else:
                    found[entry["name"][len(root) + 1 :]] = entry
        return found

    def dangling(self, *, own: bool = False) -> Sequence[Dangling]:
        return []

    def abort_dangling(self, uploads: Iterable[Dangling]) -> None:
        return None

    def stat(self, name: str) -> StoredObject | None:
        """A file at the revision, with its LFS SHA-256 (None for a file kept in git)."""
        path = f"{self._root(self.published or self.parent)}/{name}"
        try:
            entry = request(self.session, self.url_of(name), partial(self.backend.info, path))
        except RemoteNotFoundError:
            return None
        if entry.get("type") != "file":
            return None
        sha = entry.get("sha256")
        return StoredObject(name, int(entry.get("size") or 0), ("sha256", sha) if sha else None)

    def hasher(self, size: int) -> Sha256Hash:
        return Sha256Hash()

    def delete(self, names: Sequence[str]) -> None:
        """Deleted by the commit `publish` makes, with everything else (one commit)."""
        self.deletions += [name for name in names if name not in self.deletions]

    def begin(self, name: str, size: int) -> HubUpload:
        if self.staging == threading.get_ident():
            raise ValueError("one Hub upload at a time: complete or abort the open one first")
        self.stage.acquire()
        self.staging = threading.get_ident()
        try:
            return HubUpload(self, name, size)
        except BaseException:
            self.release()
            raise

    def release(self) -> None:
        self.staging = None
        self.stage.release()

    def rename(self, old: str, new: str, sha256: str) -> StoredObject:
        """The uploaded file goes into the commit at `new` (checked with the commit's tree)."""
        operation = self.operations.pop(self.path(old))
        if operation.upload_info.sha256.hex() != sha256:
            raise VerificationError(
                self.url_of(old),
                "was uploaded with another SHA-256 than its bytes have: nothing was published",
                "run again",
            )
        operation.path_in_repo = self.path(new)
        self.operations[self.path(new)] = operation
        return StoredObject(new, operation.upload_info.size, ("sha256", sha256))

    def publish(
        self, files: Mapping[str, bytes], delete: Sequence[str], *, message: str
    ) -> Sequence[StoredObject]:
        """One commit (or pull request): every uploaded object, `files`, the deletions."""
        from huggingface_hub import CommitOperationAdd, CommitOperationDelete

        clash = sorted(self.repo_files & {*files, *delete})
        if clash and not self.options.force:
            raise UsageError(
                self.url_of(clash[0]),
                "is the repository's own file, which the output would replace: nothing was "
                "published",
                "pass --force to replace it with the one carried from the input",
            )
        small = [
            CommitOperationAdd(path_in_repo=self.path(name), path_or_fileobj=bytes(data))
            for name, data in index_last(files)
        ]
        added = [*self.operations.values(), *small]
        # a file the commit adds again is replaced by it, not deleted (huggingface_hub warns
        # about a deletion of a path added in the same commit, and what it leaves is unclear)
        paths = {operation.path_in_repo for operation in added}
        gone = [*self.deletions, *(name for name in delete if name not in self.deletions)]
        deleted = [
            CommitOperationDelete(path_in_repo=self.path(name))
            for name in gone
            if self.path(name) not in paths
        ]
        try:
            info = request(
                self.session,
                self.url,
                lambda: _client(lambda: self._commit([*added, *deleted], message or "ckptfix")),
            )
        except RemoteChangedError as exc:  # the Hub's 412: the parent is no longer the head
            raise RemoteError(
                self.url,
                "remote-changed",
                f"the revision {self.revision!r} moved since the upload began (a commit was "
                "pushed meanwhile): nothing was published",
                "run again",
            ) from exc
        self.published = str(info.oid)
        self._sent += sum(len(data) for data in files.values())
        self._check_commit(added)
        return [
            StoredObject(name, len(data), ("sha256", hashlib.sha256(data).hexdigest()))
            for name, data in files.items()
        ]

    def _commit(self, operations: Sequence[Any], message: str) -> Any:
        return self.api.create_commit(
            repo_id=self.repo,
            repo_type=self.kind,
            operations=operations,
            commit_message=message,
            revision=self.revision,
            create_pr=self.options.hf_pr,
            parent_commit=self.parent,
        )

    def _check_commit(self, added: Sequence[Any]) -> None:
        """The tree of the new commit lists each file added with what was sent: an LFS
        file's SHA-256 and size, a file kept in git by its blob id."""
        assert self.published is not None
        entries = self._entries(self.published)
        for operation in added:
            path = operation.path_in_repo
            name = path[len(self.folder) + 1 :] if self.folder else path
            expected = _expected(operation)
            entry = entries.get(name, {})
            found = (
                (entry.get("sha256"), entry.get("size"))
                if expected[0] == "SHA-256"
                else (entry.get("blob_id"), entry.get("size"))
            )
            if found != expected[1:]:
                raise VerificationError(
                    self.url_of(name),
                    f"commit {self.published} lists {expected[0]} {found[0]} ({found[1]} bytes) "
                    f"for the file, the bytes sent have {expected[1]} ({expected[2]:,} bytes): "
                    "the commit is published",
                    "revert the commit on the Hub, then try again",
                )

    def read(self, name: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        path = f"{self._root(self.published or self.parent)}/{name}"
        return request(
            self.session, self.url_of(name), lambda: self.backend.read(path, start, end, {})
        )

    def stats(self) -> UploadStats:
        return UploadStats(bytes_sent=self._sent, requests=self.session.stats()["requests"])


def _client(call: Callable[[], T]) -> T:
    """`call()`, a request of huggingface_hub's: what it raises for an answer it cannot use
    (ValueError "Malformed response", a KeyError, a RuntimeError around either) is an
    unexpected answer; one that holds an HTTP status or a network failure is left for the
    session to classify."""
    try:
        return call()
    except (ValueError, KeyError, TypeError, AttributeError, RuntimeError) as exc:
        if isinstance(exc, CkptfixError) or classify(exc, "hf") is not None:
            raise
        detail = f"{type(exc).__name__}: {str(exc).splitlines()[0][:80] if str(exc) else ''}"
        raise UnexpectedAnswer(f"not the Hub's API ({detail})") from exc


class Sha256Hash:
    """The SHA-256 of bytes fed in order, as the Hub reports an LFS file's (`stat`)."""

    def __init__(self) -> None:
        self.sha = hashlib.sha256()

    def update(self, data: bytes | memoryview) -> None:
        self.sha.update(data)

    def value(self) -> tuple[str, str]:
        return "sha256", self.sha.hexdigest()


def _expected(operation: Any) -> tuple[str, str, int]:
    """What the tree must say of a file a commit added: (what, its value, its size)."""
    info = operation.upload_info
    if operation._upload_mode == "lfs":
        return "SHA-256", info.sha256.hex(), info.size
    data = operation.path_or_fileobj
    blob = hashlib.sha1(b"blob %d\0" % len(data) + data).hexdigest()  # git's id of the blob
    return "git blob id", blob, info.size


class HubUpload:
    """One object staged in the temporary folder while it streams (see the module
    docstring); made by `HubStore.begin`, which holds the one staging place for it."""

    def __init__(self, store: HubStore, name: str, size: int) -> None:
        self.store, self.name, self.size = store, name, size
        self.url = store.url_of(name)
        self.sha = hashlib.sha256()
        self.received = 0
        handle, self.staged = tempfile.mkstemp(prefix="ckptfix-hub-", suffix=".part")
        self.file = os.fdopen(handle, "wb")
        self.staged_here = True  # the staged file exists and holds the staging place
        self.state = "open"

    def send(self, data: bytes | memoryview) -> None:
        if self.state != "open":
            raise ValueError(f"the upload of {self.name} is {self.state}")
        if self.received + len(data) > self.size:
            self.abort()
            raise VerificationError(
                self.url,
                f"more than the object's {self.size:,} bytes were sent",
                "report this as a bug of ckptfix",
            )
        self.file.write(data)
        self.sha.update(data)
        self.received += len(data)

    def flush(self) -> None:
        """Upload the staged object and check it; it is not visible before the commit."""
        if self.state == "sent":
            return
        if self.state != "open":
            raise ValueError(f"the upload of {self.name} is {self.state}")
        try:
            if self.received != self.size:
                raise VerificationError(
                    self.url,
                    f"{self.received:,} bytes were sent for an object of {self.size:,} bytes",
                    "report this as a bug of ckptfix",
                )
            self.file.close()
            operation = self._upload()
        except BaseException:
            self.abort()
            raise
        finally:
            self._unstage()  # the staged file goes, whatever happened
        self.state = "sent"
        self.store.operations[self.store.path(self.name)] = operation

    def complete(self) -> StoredObject:
        """The object as uploaded (by `flush`, if it was not yet): part of the next commit."""
        self.flush()
        self.state = "done"
        return StoredObject(self.name, self.size, ("sha256", self.sha.hexdigest()))

    def _upload(self) -> Any:
        """The LFS (or Xet) upload of the staged file, checked (see the module docstring)."""
        from huggingface_hub import CommitOperationAdd
        from huggingface_hub.utils._runtime import is_xet_available

        store, sha = self.store, self.sha.digest()
        operation = CommitOperationAdd(
            path_in_repo=store.path(self.name), path_or_fileobj=self.staged
        )
        xet = is_xet_available()
        if not xet:
            operation.upload_info.sha256 = sha  # the client need not read the file again
        request(store.session, self.url, lambda: _client(lambda: self._preupload(operation)))
        store._sent += self.size
        if operation._upload_mode == "regular":
            return self._regular(operation)
        if xet and operation.upload_info.sha256 != sha:
            raise mismatch(
                self.url,
                "SHA-256",
                operation.upload_info.sha256.hex(),
                sha.hex(),
                "the staged copy of the object",
            )
        if not xet:
            request(store.session, self.url, lambda: _client(lambda: self._check_lfs(sha)))
        return operation

    def _preupload(self, operation: Any) -> None:
        """The upload, without the client's progress bar of the staged file (it would be
        printed on the terminal of a library and of the CLI, which shows its own)."""
        from huggingface_hub import constants
        from huggingface_hub.utils import disable_progress_bars  # type: ignore[attr-defined]

        store = self.store
        quiet = constants.HF_HUB_DISABLE_PROGRESS_BARS is not False  # =0 is the user's wish
        with disable_progress_bars() if quiet else contextlib.nullcontext():
            store.api.preupload_lfs_files(
                repo_id=store.repo,
                repo_type=store.kind,
                additions=[operation],
                revision=store.revision,
                create_pr=store.options.hf_pr,
            )

    def _regular(self, operation: Any) -> Any:
        """A file the Hub keeps in git itself: its bytes go in the commit (small, by the
        Hub's rule: a larger one is an unexpected answer)."""
        from huggingface_hub import CommitOperationAdd

        if self.size > REGULAR_MAX:
            what = f"unexpected answer from the server: the Hub asks for a file of {self.size:,} bytes in git, not LFS"
            raise remote_error(self.url, Failure("remote-error", what, "check the endpoint"), 1)
        with open(self.staged, "rb") as handle:
            return CommitOperationAdd(
                path_in_repo=operation.path_in_repo, path_or_fileobj=handle.read()
            )

    def _check_lfs(self, sha: bytes) -> None:
        """The Hub's LFS store must hold an object of this SHA-256 and size."""
        from huggingface_hub import constants, get_session
        from huggingface_hub.lfs import LFS_HEADERS
        from huggingface_hub.utils import build_hf_headers, hf_raise_for_status  # type: ignore[attr-defined]

        store = self.store
        prefix = constants.REPO_TYPES_URL_PREFIXES.get(store.kind, "")
        url = f"{store.api.endpoint}/{prefix}{store.repo}.git/info/lfs/objects/batch"
        document = {
            "operation": "download",
            "transfers": ["basic"],
            "objects": [{"oid": sha.hex(), "size": self.size}],
            "hash_algo": "sha256",
        }
        response = get_session().post(
            url, json=document, headers={**LFS_HEADERS, **build_hf_headers()}
        )
        hf_raise_for_status(response)
        objects = response.json().get("objects")
        found = objects[0] if isinstance(objects, list) and objects else {}
        if not isinstance(found, dict) or "error" in found or found.get("size") != self.size:
            raise VerificationError(
                self.url,
                f"after its upload the Hub holds no LFS object of SHA-256 {sha.hex()} and "
                f"{self.size:,} bytes, the bytes sent: it kept other bytes; nothing was published",
                "try again; if it happens again, the Hub or the network between changes bytes",
            )

    def abort(self) -> None:
        """Forget the object: remove the staged file, free the staging place, and leave it
        out of the commit if it was sent. Safe to call again."""
        if self.state == "sent":
            self.store.operations.pop(self.store.path(self.name), None)
        self._unstage()
        if self.state in ("open", "sent"):
            self.state = "aborted"

    def _unstage(self) -> None:
        if self.staged_here:
            self.staged_here = False
            self.file.close()
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.staged)
            self.store.release()
