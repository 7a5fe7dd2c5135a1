"""gs:// through gcsfs's JSON API file system (its credentials, its aiohttp session, whose
answers are bounded by io.remote_aiohttp), with ckptfix's own requests where gcsfs's would
not end: gcsfs follows a listing's pages by itself without a bound, holding every entry, and
its info of a folder follows empty pages of a one-entry listing without end. Here each page
is one `objects.list` request through gcsfs, within remote_answers' bounds for a listing.

Each read is `cat_file(path, start, end)` pinned to the generation the object was listed
with. Cloud Storage answers 404 for a generation that is gone (the object was replaced or
deleted), which is the object changing under the run, not a missing file. gcsfs parses the
answers itself: its ValueError, KeyError, TypeError or AttributeError on a body that is not
Cloud Storage's JSON (a proxy's page, another service) is an unexpected answer.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from functools import partial
from typing import Any, TypeVar

from ckptfix.io.remote import Info
from ckptfix.io.remote_answers import Listing, answer_seconds
from ckptfix.io.remote_backends import GenericBackend
from ckptfix.io.remote_errors import ObjectReplaced, UnexpectedAnswer, parsed

T = TypeVar("T")
Page = tuple[list[Any], list[Any]]  # a listing page's objects and sub-folder prefixes


class GcsBackend(GenericBackend):
    """Cloud Storage (see the module docstring)."""

    def __init__(self, scheme: str, fs: Any, timeout: float) -> None:
        super().__init__(scheme, fs)
        self.listing_seconds = answer_seconds(timeout)

    def to_path(self, url: str) -> str:
        scheme, _, rest = url.partition("://")
        return super().to_path(f"{scheme.lower()}://{rest}")

    def info(self, path: str) -> Info:
        """An object's metadata, or a folder if any key lies under `path/`."""
        bucket, _, key = path.rstrip("/").partition("/")
        if not key:  # a bucket: its listing says whether it exists
            return {"name": bucket, "type": "directory", "size": 0}
        try:
            found = self._sync(self.fs._call, "GET", "b/{}/o/{}", bucket, key, json_out=True)
            return _parsed(lambda: _entry(bucket, found))
        except FileNotFoundError:
            pass
        for objects, folders in self._pages(bucket, key + "/", 1):
            if objects or folders:
                return {"name": path, "type": "directory", "size": 0}
        raise FileNotFoundError(path)

    def ls(self, path: str) -> list[Info]:
        bucket, _, key = path.partition("/")
        prefix = key.rstrip("/") + "/" if key.strip("/") else ""
        entries: list[Info] = []
        for objects, folders in self._pages(bucket, prefix, 1000):
            entries += [
                {"name": f"{bucket}/{str(folder).rstrip('/')}", "type": "directory", "size": 0}
                for folder in folders
            ]
            described = [_parsed(partial(_entry, bucket, item)) for item in objects]
            marker = f"{bucket}/{prefix}"  # the folder's own "folder" object, some tools make
            entries += [entry for entry in described if entry["name"] != marker]
        return entries

    def _pages(self, bucket: str, prefix: str, size: int) -> Iterator[Page]:
        """The pages of `objects.list` under `prefix`, within the bounds of a listing."""
        bounds, token = Listing(self.listing_seconds), None
        while True:
            query = {"delimiter": "/", "prefix": prefix, "maxResults": size, "pageToken": token}
            page = self._sync(self.fs._call_list_objects, bucket, timeout=bounds, **query)
            objects, folders = page.get("items", []), page.get("prefixes", [])
            if not isinstance(objects, list) or not isinstance(folders, list):
                raise UnexpectedAnswer("not Cloud Storage's JSON (items or prefixes not lists)")
            token = page.get("nextPageToken")
            bounds.page(len(objects) + len(folders), more=bool(token))
            yield objects, folders
            if not token:
                return

    def _sync(self, call: Any, *args: Any, timeout: Listing | None = None, **kwargs: Any) -> Any:
        """One request through gcsfs (within what is left of a listing's time), its JSON
        an object or an unexpected answer."""
        from fsspec.asyn import sync
        from fsspec.exceptions import FSTimeoutError

        seconds = timeout.remaining() if timeout is not None else None
        try:
            found = _parsed(lambda: sync(self.fs.loop, call, *args, timeout=seconds, **kwargs))
        except FSTimeoutError as exc:
            assert timeout is not None  # no other call has a time limit of its own
            raise UnexpectedAnswer(timeout.late()) from exc
        if not isinstance(found, dict):
            raise UnexpectedAnswer("not Cloud Storage's JSON (an answer that is no object)")
        return found

    def read(self, path: str, start: int, end: int, info: Info) -> bytes:
        generation = info.get("generation")
        if not generation:
            return _parsed(lambda: super(GcsBackend, self).read(path, start, end, info))
        try:
            return _parsed(
                lambda: bytes(self.fs.cat_file(path, start=start, end=end, generation=generation))
            )
        except FileNotFoundError as exc:
            raise ObjectReplaced(path) from exc


def _entry(bucket: str, item: Any) -> Info:
    """An object resource as the remote folder reads it: only what it uses (a listing of
    100,000 objects holds 100,000 of these), the keys gcsfs gives them."""
    return {
        "name": f"{bucket}/{item['name']}",
        "type": "file",
        "size": int(item.get("size", 0)),
        **{key: item.get(key) for key in ("generation", "etag", "updated")},
    }


def _parsed(call: Callable[[], T]) -> T:
    return parsed(call, "Cloud Storage's JSON")
