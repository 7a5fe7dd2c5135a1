"""hf:// through the Hub's HTTP API, on huggingface_hub's session (its token, its endpoint).

Every request is ckptfix's own: a GET with CKPTFIX_REMOTE_TIMEOUT as its limit and no retry
loop of huggingface_hub's (HfFileSystem's listings retry inside the library, unbounded in
time and uncounted), so `RemoteSession` retries and counts every attempt, as for the other
schemes. Three kinds of request:
- the commit a branch or tag points to (`/api/{type}s/{repo}/revision/{rev}`), once per run
  and revision: every listing and read of the run is then at that commit, whatever is pushed
  meanwhile;
- a folder's entries (`/api/{type}s/{repo}/tree/{commit}/{path}`, pages followed by their
  `Link` header, at most MAX_PAGES): names, sizes, blob ids and LFS hashes;
- a file's bytes (`/{prefix}{repo}/resolve/{commit}/{path}` with `Range`), refused before
  the body is read unless the answer is a 206 for the range asked.

URLs: `hf://org/name[@revision][/path]`, `hf://datasets/org/name…`, `hf://spaces/org/name…`;
a revision with a slash is written quoted (`@refs%2Fpr%2F1`), as the Hub's own URLs do.
"""

from __future__ import annotations

import re
import threading
from typing import Any, TypeVar
from urllib.parse import quote, unquote

from ckptfix.core.errors import UsageError
from ckptfix.io.remote import Info, no_range, range_starts
from ckptfix.io.remote_errors import UnexpectedAnswer

T = TypeVar("T")
MAX_PAGES = 10_000  # of a folder listing (1,000 entries each): a server's endless pages end
_COMMIT = re.compile(r"[0-9a-f]{40}")
_TYPES = {"datasets": "dataset", "spaces": "space"}
_URL = re.compile(r"^(?:(datasets|spaces)/)?([^/@]+/[^/@]+)(?:@([^/]*))?(?:/(.*))?$")
_PATH = re.compile(r"^(model|dataset|space):([^/@]+/[^/@]+)@([^/]*)(?:/(.*))?$")
_USAGE = "hf://org/name[@revision][/path] (datasets/ or spaces/ before org for those repos)"


def _usage(url: str, what: str) -> UsageError:
    return UsageError(url, what, f"write the URL as {_USAGE}")


def parse_url(url: str) -> str:
    """The backend's path for an hf:// URL: `type:org/name@revision/path` (no network)."""
    rest = url.split("://", 1)[1].strip("/")
    if rest.startswith("buckets/") or rest == "buckets":
        raise UsageError(
            url, "is a Hub storage bucket, which ckptfix does not read", "download the files"
        )
    match = _URL.match(rest)
    if match is None:
        raise _usage(url, "is not a Hub repository URL")
    kind, repo, revision, path = match.groups()
    if revision == "":
        raise _usage(url, "names an empty revision after @")
    revision = unquote(revision) if revision is not None else "main"
    pinned = quote(revision, safe="")
    return f"{_TYPES.get(kind or '', 'model')}:{repo}@{pinned}" + (f"/{path}" if path else "")


def _split(path: str) -> tuple[str, str, str, str]:
    match = _PATH.match(path)
    if match is None:  # only paths made by parse_url and extended by RemoteFolder get here
        raise ValueError(f"not a Hub path: {path}")
    kind, repo, revision, inner = match.groups()
    return kind, repo, unquote(revision), inner or ""


class HubBackend:
    """The Hub (see the module docstring)."""

    scheme = "hf"

    def __init__(self, timeout: float) -> None:
        self.timeout = timeout
        self._commits: dict[tuple[str, str, str], str] = {}
        self._lock = threading.Lock()

    def to_path(self, url: str) -> str:
        return parse_url(url)

    def info(self, path: str) -> Info:
        kind, repo, revision, inner = _split(path)
        if not inner:
            self._commit(kind, repo, revision)  # the repository and revision exist
            return {"name": path, "type": "directory"}
        parent, _, name = inner.rpartition("/")
        root = _root(path)
        for entry in self.ls(f"{root}/{parent}" if parent else root):
            if entry["name"].rpartition("/")[2] == name:
                return entry
        raise FileNotFoundError(path)

    def ls(self, path: str) -> list[Info]:
        kind, repo, revision, inner = _split(path)
        commit = self._commit(kind, repo, revision)
        url: str | None = f"{self._api(kind, repo)}/tree/{commit}/{quote(inner)}".rstrip("/")
        root, entries = _root(path), list[Info]()
        for _ in range(MAX_PAGES):
            if url is None:
                return entries
            response = self._get(url)
            entries += [_entry(root, item) for item in _json(response, list)]
            url = response.links.get("next", {}).get("url")
        raise UnexpectedAnswer(f"the listing did not end after {MAX_PAGES:,} pages")

    def read(self, path: str, start: int, end: int, info: Info) -> bytes:
        kind, repo, revision, inner = _split(path)
        commit = self._commit(kind, repo, revision)
        from huggingface_hub import constants

        prefix = constants.REPO_TYPES_URL_PREFIXES.get(kind, "")
        url = f"{constants.ENDPOINT}/{prefix}{repo}/resolve/{commit}/{quote(inner)}"
        return self._range(url, start, end)

    def token(self, info: Info) -> tuple[object, ...]:
        return (info.get("size"), info.get("blob_id"), info.get("sha256"))

    def _commit(self, kind: str, repo: str, revision: str) -> str:
        if _COMMIT.fullmatch(revision):
            return revision
        key = (kind, repo, revision)
        with self._lock:
            known = self._commits.get(key)
        if known is not None:
            return known
        url = f"{self._api(kind, repo)}/revision/{quote(revision, safe='')}"
        sha = _json(self._get(url), dict).get("sha")
        if not isinstance(sha, str) or not _COMMIT.fullmatch(sha):
            raise UnexpectedAnswer("no commit in the answer about the revision")
        with self._lock:
            self._commits[key] = sha
        return sha

    @staticmethod
    def _api(kind: str, repo: str) -> str:
        from huggingface_hub import constants

        return f"{constants.ENDPOINT}/api/{kind}s/{repo}"

    def _get(self, url: str) -> Any:
        from huggingface_hub import get_session, hf_raise_for_status
        from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]

        response = get_session().get(url, headers=build_hf_headers(), timeout=self.timeout)
        hf_raise_for_status(response)
        return response

    def _range(self, url: str, start: int, end: int) -> bytes:
        from huggingface_hub import get_session, hf_raise_for_status
        from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]

        headers = {**build_hf_headers(), "Range": f"bytes={start}-{end - 1}"}
        headers["Accept-Encoding"] = "identity"
        with get_session().stream(
            "GET", url, headers=headers, timeout=self.timeout, follow_redirects=True
        ) as response:
            hf_raise_for_status(response)
            if response.status_code != 206 or not range_starts(response, start):
                raise no_range(url, start, end)  # the body, the whole file, is never read
            return bytes(response.read())


def _json(response: Any, kind: type[T]) -> T:
    """The answer's JSON document, which must be a `kind` (of objects, for a list)."""
    try:
        document = response.json()
    except ValueError as exc:
        raise UnexpectedAnswer("the answer is not JSON") from exc
    if not isinstance(document, kind) or (
        isinstance(document, list) and not all(isinstance(item, dict) for item in document)
    ):
        shape = "list of entries" if kind is list else "object"
        raise UnexpectedAnswer(f"the answer is not a JSON {shape}")
    return document


def _root(path: str) -> str:
    """`type:org/name@revision` of a backend path."""
    inner = _split(path)[3]
    return path[: len(path) - len(inner)].rstrip("/") if inner else path


def _entry(root: str, item: dict[str, Any]) -> Info:
    """A tree entry as the remote folder reads it: `name` under the repository's `root`."""
    name, kind, size = item.get("path"), item.get("type"), item.get("size")
    if not isinstance(name, str) or kind not in ("file", "directory"):
        raise UnexpectedAnswer("a listing entry without a path or a type")
    entry: Info = {"name": f"{root}/{name}", "type": kind, "blob_id": item.get("oid")}
    if kind == "file":
        lfs = item.get("lfs")
        entry["size"] = size if isinstance(size, int) and size >= 0 else None
        entry["sha256"] = lfs.get("oid") if isinstance(lfs, dict) else None
    return entry
