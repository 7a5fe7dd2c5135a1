"""Remote folders: the Folder interface over listings, and the entry point for a URL.

A folder is listed once (one request per folder: S3, GCS and the Hub say each file's size
and ETag in the listing, so no file needs a HEAD; an HTTP listing page does not, so each
file opened gets one); paths under the folder are URLs (`os.path.join(url, name)`), mapped
to the backend's paths by their place under the root. `map` runs the loader's per-file
work on a bounded pool of threads, so the headers of every shard are requested at once.

Those URLs are labels: the URL given, without its credentials (core.text.redact), so no
report, error or output can print them; requests go to the backend's paths, made from the
URL as given.
"""

from __future__ import annotations

import posixpath
import threading
from collections.abc import Callable, Iterable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import TypeVar

from ckptfix.core.errors import RemoteError
from ckptfix.core.text import redact
from ckptfix.io.folder import too_large
from ckptfix.io.remote import Info, RemoteFile, RemoteSession, Settings, size_of
from ckptfix.io.remote_backends import make_backend, scheme_of
from ckptfix.io.urls import climbs_out

T = TypeVar("T")
R = TypeVar("R")


def _name(entry: Info) -> str:
    return posixpath.basename(str(entry["name"]).rstrip("/"))


class RemoteFolder:
    """A remote folder, addressed by URL (see the module docstring)."""

    def __init__(self, session: RemoteSession, root: str, root_path: str) -> None:
        self.session = session
        self.root = root  # a label (without credentials)
        self.root_path = root_path  # the backend's path, from the URL as given
        self._listings: dict[str, dict[str, Info]] = {}
        self._files: dict[str, RemoteFile] = {}
        self._lock = threading.Lock()

    def escapes(self, url: str) -> bool:
        """Whether `url` is not the folder or a path under it, once decoded (urls)."""
        if url == self.root:
            return False
        return not url.startswith(self.root + "/") or climbs_out(url[len(self.root) + 1 :])

    def _path(self, url: str) -> str:
        """The backend's path for a URL under the folder; every request of the folder's
        files and sub-folders is made for one, so none leaves the folder."""
        if url == self.root:
            return self.root_path
        if self.escapes(url):
            raise RemoteError(
                url,
                "remote-outside",
                "path is outside the folder being read (once its URL is decoded)",
                "check the names the checkpoint's files give",
            )
        return self.root_path.rstrip("/") + url[len(self.root) :]

    def _listing(self, url: str) -> dict[str, Info]:
        with self._lock:
            if url in self._listings:
                return self._listings[url]
        path = self._path(url)
        entries = self.session.call(url, lambda: self.session.backend.ls(path))
        listing = {
            name: entry
            for entry in entries
            if (name := _name(entry)) and not self.escapes(f"{url}/{name}")
        }
        with self._lock:
            self._listings[url] = listing
        return listing

    def _entry(self, url: str) -> Info | None:
        parent, name = posixpath.split(url)
        if url == self.root or self.escapes(url):
            return None
        try:
            return self._listing(parent).get(name)
        except RemoteError as exc:
            if exc.rule == "remote-not-found":
                return None
            raise

    def listdir(self, path: str) -> list[str]:
        return sorted(self._listing(path))

    def file_names(self, path: str) -> list[str]:
        return sorted(n for n, e in self._listing(path).items() if e.get("type") == "file")

    def is_file(self, path: str) -> bool:
        entry = self._entry(path)
        return entry is not None and entry.get("type") == "file"

    def is_dir(self, path: str) -> bool:
        if path == self.root:
            return True
        entry = self._entry(path)
        return entry is not None and entry.get("type") == "directory"

    def size(self, path: str) -> int:
        return self.open(path).size

    def open(self, path: str) -> RemoteFile:
        with self._lock:
            found = self._files.get(path)
        if found is not None:
            return found
        entry = self._entry(path)
        info = entry if entry is not None and isinstance(entry.get("size"), int) else None
        remote = RemoteFile(self.session, path, self._path(path), info)
        with self._lock:
            return self._files.setdefault(path, remote)

    def read_small(self, path: str, display: str, limit: int, what: str) -> bytes:
        source = self.open(path)
        if source.size > limit:
            raise too_large(display, what, source.size, limit)
        return source.read_at(0, source.size)

    def map(self, function: Callable[[T], R], items: Iterable[T]) -> list[R]:
        work = list(items)
        if len(work) <= 1:
            return [function(item) for item in work]
        workers = min(self.session.settings.concurrency, len(work))
        with ThreadPoolExecutor(workers, thread_name_prefix="ckptfix-remote") as pool:
            return list(pool.map(function, work))


@dataclass(frozen=True)
class RemoteTarget:
    """What a URL names: a folder or a file, and the session reading it."""

    url: str
    session: RemoteSession
    folder: RemoteFolder
    file: RemoteFile | None  # None for a folder


def open_url(url: str, settings: Settings | None = None) -> RemoteTarget:
    """Resolve a URL to a folder or a file with one request (none for an HTTP URL that
    ends in `/`, which is a folder)."""
    settings = settings or Settings.from_env()
    backend = make_backend(url, settings)
    session = RemoteSession(backend, settings)
    http_folder = scheme_of(url) == "http" and url.endswith("/")
    root = url.rstrip("/") if "://" in url.rstrip("/") else url
    label, path = redact(root), backend.to_path(root)
    info: Info = {"type": "directory"} if http_folder else session.info(label, path)
    if info.get("type") == "directory":
        return RemoteTarget(label, session, RemoteFolder(session, label, path), None)
    parent = posixpath.dirname(root)
    folder = RemoteFolder(session, redact(parent), backend.to_path(parent))
    size_of(label, info)
    remote = RemoteFile(session, label, path, info)
    folder._files[label] = remote
    return RemoteTarget(label, session, folder, remote)
