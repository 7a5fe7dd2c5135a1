"""http(s):// through the aiohttp session of fsspec's HTTP file system, every request
ckptfix's own: a HEAD for a file's size and ETag, a GET of a folder's listing page (the
links in an HTML page), and ranged GETs with If-Match. Answers are bounded by the session's
response class (io.remote_aiohttp): a ranged GET takes exactly the range, a listing page at
most ANSWER_CAP bytes and MAX_ENTRIES links, within the listing's time.
"""

from __future__ import annotations

import html
import posixpath
import re
from typing import Any
from urllib.parse import unquote, urljoin, urlsplit

from ckptfix.io.remote import Info
from ckptfix.io.remote_answers import (
    IDENTITY,
    MAX_ENTRIES,
    Listing,
    answer_seconds,
)
from ckptfix.io.remote_errors import (
    MAX_REDIRECTS,
    HttpError,
    UnexpectedAnswer,
    credentials_carried,
)

# A link's target in one tag's text (no quote or angle bracket inside it).
_HREF = re.compile(r"""\bhref\s*=\s*["']([^"'<>]*)["']""", re.IGNORECASE)


class HttpBackend:
    """Plain HTTP(S) (see the module docstring)."""

    scheme = "http"

    def __init__(self, fs: Any, timeout: float) -> None:
        self.fs = fs
        self.listing_seconds = answer_seconds(timeout)

    def to_path(self, url: str) -> str:
        return url

    def info(self, path: str) -> Info:
        async def head() -> Info:
            session = await self.fs.set_session()
            async with session.head(
                path, allow_redirects=True, max_redirects=MAX_REDIRECTS
            ) as response:
                if response.status >= 400:
                    raise _status_error(response, path)
                return _head_info(path, response)

        return dict(self._sync(head))

    def ls(self, path: str) -> list[Info]:
        listing = path if path.endswith("/") else path + "/"
        bounds = Listing(self.listing_seconds)

        async def page() -> str:
            session = await self.fs.set_session()
            async with session.get(listing, max_redirects=MAX_REDIRECTS) as response:
                if response.status >= 400:
                    raise _status_error(response, listing)
                mimetype = response.headers.get("Content-Type", "text/html").partition(";")[0]
                data = await response.read()  # bounded: remote_aiohttp
                return data.decode("utf-8", "replace") if mimetype.strip() == "text/html" else ""

        from fsspec.exceptions import FSTimeoutError

        try:
            text = self._sync(page, bounds.remaining())
        except FSTimeoutError as exc:
            raise UnexpectedAnswer(f"the listing did not end within {bounds.seconds:g} s") from exc
        entries = links_under(listing, text)
        bounds.page(len(entries), more=False)
        return entries

    def read(self, path: str, start: int, end: int, info: Info) -> bytes:
        headers = {"Range": f"bytes={start}-{end - 1}", **IDENTITY}
        etag = info.get("ETag")
        if isinstance(etag, str) and not etag.startswith("W/"):
            headers["If-Match"] = etag  # a strong ETag: the same bytes or a 412

        async def get() -> bytes:
            session = await self.fs.set_session()
            async with session.get(path, headers=headers, max_redirects=MAX_REDIRECTS) as response:
                if response.status >= 300:
                    raise _status_error(response, path)
                # exactly the range, refused from the status line or as soon as it is not
                return bytes(await response.read())

        return bytes(self._sync(get))

    def token(self, info: Info) -> tuple[object, ...]:
        return (info.get("size"), info.get("ETag"), info.get("Last-Modified"))

    def _sync(self, coroutine: Any, timeout: float | None = None) -> Any:
        from fsspec.asyn import sync

        return sync(self.fs.loop, coroutine, timeout=timeout)


def links_under(listing: str, page: str) -> list[Info]:
    """The entries of the folder at `listing` (a URL ending in `/`) that an HTML page links
    to: files, and sub-folders (links ending in `/`); sort and parent links, and links out
    of the folder or deeper into it, are not entries. In time linear in the page: each
    character is looked at a bounded number of times, whatever the page holds."""
    found: dict[str, Info] = {}
    start = page.find("<")
    while start != -1:
        end = page.find("<", start + 1)
        tag = page[start + 1 : end if end != -1 else len(page)].partition(">")[0]
        start = end
        if tag[:1] not in ("a", "A") or tag[1:2] not in (" ", "\t", "\r", "\n"):
            continue
        match = _HREF.search(tag)
        if match is None:
            continue
        target = urljoin(listing, html.unescape(match.group(1))).partition("#")[0]
        name = target[len(listing) :]
        if not target.startswith(listing) or "?" in target or "/" in name.rstrip("/"):
            continue
        if name.rstrip("/") and target not in found:
            kind = "directory" if name.endswith("/") else "file"
            found[target] = {"name": unquote(target), "size": None, "type": kind}
            if len(found) > MAX_ENTRIES:
                break  # the listing's bounds refuse it
    return list(found.values())


def _status_error(response: Any, url: str) -> HttpError:
    """An error status, with what its request carried: aiohttp sends the user name and
    password of a URL that has them, except to another server a redirect leads to."""
    given = "@" in urlsplit(url).netloc
    carried = credentials_carried(response.request_info.headers, given)
    return HttpError(response.status, url, carried)


def _head_info(path: str, response: Any) -> Info:
    headers = response.headers
    size = headers.get("Content-Length")
    encoded = headers.get("Content-Encoding", "identity") not in ("identity", "")
    mimetype = headers.get("Content-Type", "").partition(";")[0].strip()
    return {
        "name": path,
        "type": "directory" if mimetype == "text/html" and _looks_like_folder(path) else "file",
        "size": int(size) if size is not None and size.isdigit() and not encoded else None,
        "ETag": headers.get("ETag"),
        "Last-Modified": headers.get("Last-Modified"),
        "mimetype": mimetype,
    }


def _looks_like_folder(url: str) -> bool:
    """An HTML page at a URL whose last part has no weight-file extension is a listing."""
    name = posixpath.basename(url.rstrip("/"))
    return url.endswith("/") or not name.endswith(
        (".safetensors", ".bin", ".pt", ".pth", ".ckpt", ".json", ".distcp", ".metadata")
    )
