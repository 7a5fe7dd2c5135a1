"""hf:// through the Hub's HTTP API, on huggingface_hub's session (its token, its endpoint).

Every request is ckptfix's own: a GET with CKPTFIX_REMOTE_TIMEOUT as its limit and no retry
loop of huggingface_hub's (HfFileSystem's listings retry inside the library, unbounded in
time and uncounted), so `RemoteSession` retries and counts every attempt, as for the other
schemes. Three kinds of request:
- the commit a branch or tag points to (`/api/{type}s/{repo}/revision/{rev}`), once per run
  and revision: every listing and read of the run is then at that commit, whatever is pushed
  meanwhile;
- a folder's entries (`/api/{type}s/{repo}/tree/{commit}/{path}`, pages followed by their
  `Link` header, within remote_answers' bounds for a listing): names, sizes, blob ids and
  LFS hashes;
- a file's bytes (`/{prefix}{repo}/resolve/{commit}/{path}` with `Range`): exactly the
  range, refused before the body is read unless the answer is a 206 for it.
Every answer is read against remote_answers' bounds, and redirects are followed by ckptfix.

URLs: `hf://org/name[@revision][/path]`, `hf://datasets/org/name…`, `hf://spaces/org/name…`;
a revision with a slash is written quoted (`@refs%2Fpr%2F1`), as the Hub's own URLs do.
"""

from __future__ import annotations

import json
import re
import threading
from typing import Any, TypeVar
from urllib.parse import quote, unquote, urljoin, urlsplit

from ckptfix.core.errors import UsageError
from ckptfix.io.remote import Info
from ckptfix.io.remote_answers import (
    IDENTITY,
    Listing,
    answer_seconds,
    new_body,
    redirect_target,
)
from ckptfix.io.remote_errors import (
    MAX_REDIRECTS,
    HttpError,
    UnexpectedAnswer,
    credentials_carried,
    too_many_redirects,
)

T = TypeVar("T")
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
        self.answer_seconds = answer_seconds(timeout)
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
        root, entries, bounds = _root(path), list[Info](), Listing(self.answer_seconds)
        with bounds.pages_of_this_thread():
            while url is not None:
                data, url = self._answer(url, {})
                page = [_entry(root, item) for item in _json(data, list)]
                entries += page
                bounds.page(len(page), more=url is not None)
        return entries

    def read(self, path: str, start: int, end: int, info: Info) -> bytes:
        kind, repo, revision, inner = _split(path)
        commit = self._commit(kind, repo, revision)
        from huggingface_hub import constants

        prefix = constants.REPO_TYPES_URL_PREFIXES.get(kind, "")
        url = f"{constants.ENDPOINT}/{prefix}{repo}/resolve/{commit}/{quote(inner)}"
        return self._answer(url, {"Range": f"bytes={start}-{end - 1}"})[0]

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
        sha = _json(self._answer(url, {})[0], dict).get("sha")
        if not isinstance(sha, str) or not _COMMIT.fullmatch(sha):
            raise UnexpectedAnswer("no commit in the answer about the revision")
        with self._lock:
            self._commits[key] = sha
        return sha

    @staticmethod
    def _api(kind: str, repo: str) -> str:
        from huggingface_hub import constants

        return f"{constants.ENDPOINT}/api/{kind}s/{repo}"

    def _answer(self, url: str, extra: dict[str, str]) -> tuple[bytes, str | None]:
        """GET `url` on huggingface_hub's session, following at most MAX_REDIRECTS
        redirects to http(s) URLs (the token never leaves the origin it was sent to): the
        body, read against its bound, and the URL of the next page if the answer links one.
        Redirects are followed here, not by httpx, which reads each redirect's body whole."""
        from huggingface_hub import get_session
        from huggingface_hub.utils import build_hf_headers  # type: ignore[attr-defined]

        client = get_session()
        headers = {**build_hf_headers(), **extra, **IDENTITY}
        token = "authorization" in (name.lower() for name in headers)
        for _ in range(MAX_REDIRECTS + 1):
            request = client.build_request("GET", url, headers=headers, timeout=self.timeout)
            response = client.send(request, stream=True, follow_redirects=False)
            try:
                if not response.has_redirect_location:
                    data = _body(response, extra.get("Range"), self.answer_seconds, token)
                    return data, response.links.get("next", {}).get("url")
                target = urljoin(url, redirect_target(response.headers.get("Location")))
            finally:
                response.close()
            if _origin(target) != _origin(url):
                headers = {k: v for k, v in headers.items() if k.lower() != "authorization"}
            url = target
        raise too_many_redirects()


def _body(response: Any, asked: str | None, seconds: float, token: bool) -> bytes:
    """A response's body, read against its bound; an error status is raised unread, with
    whether its request carried the `token` ckptfix has (see HttpError)."""
    if response.status_code >= 300:
        carried = credentials_carried(response.request.headers, token)
        raise HttpError(response.status_code, str(response.url), carried)
    body = new_body(asked, response.status_code, response.headers, seconds)
    for chunk in response.iter_raw():  # each as it arrives: the deadline is checked
        body.add(chunk)
    return body.data()


def _origin(url: str) -> tuple[str, str, int | None]:
    parts = urlsplit(url)
    return parts.scheme.lower(), (parts.hostname or "").lower(), parts.port


def _json(data: bytes, kind: type[T]) -> T:
    """The answer's JSON document, which must be a `kind` (of objects, for a list)."""
    try:
        document = json.loads(data)
    except (ValueError, RecursionError) as exc:
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
