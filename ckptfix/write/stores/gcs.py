"""gs://bucket/prefix as an output (`base.ObjectStore`), through Cloud Storage's JSON API on
the session the remote reads use (io.remote_gcs: gcsfs's credentials, its aiohttp session,
STORAGE_EMULATOR_HOST, one attempt per request), each request retried with backoff for
429/5xx and counted by io.remote's `RemoteSession`, each failure one line (store.common).

Parallel composite uploads, not resumable ones (gcs_upload): a resumable upload takes its
chunks one after the other, so one object streams on one connection, and Cloud Storage has
no request that lists the resumable sessions a killed run left behind. Parts are ordinary
objects: uploaded `concurrency` at a time, each checked against its CRC-32C, listed by the
next run under `<prefix>/.ckptfix-upload/` (`dangling`) and deleted there. What that costs:
a composed object has a CRC-32C and no MD5 (the checksum compared here is the CRC-32C), and
a bucket whose storage class bills early deletion bills the parts' minimum duration.
"""

from __future__ import annotations

import contextlib
import uuid
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import quote

from ckptfix.core.errors import RemoteError, RemoteNotFoundError, UsageError, VerificationError
from ckptfix.io.remote import RemoteSession, Settings
from ckptfix.io.remote_answers import Listing
from ckptfix.io.remote_errors import Failure, UnexpectedAnswer, _chain, parsed, remote_error
from ckptfix.write.stores.base import Dangling, StoredObject, StoreOptions, UploadStats
from ckptfix.write.stores.common import Budget, Pages, index_last, mismatch, needs, request
from ckptfix.write.stores.gcs_upload import Crc32cHash, GcsUpload, Part, crc32c, crc_text

PIECE = 2**20
TEMP = ".ckptfix-upload"  # where the parts of unfinished uploads live, under the prefix


def parse_gs(url: str) -> tuple[str, str]:
    """The bucket and the prefix (no slash at either end) of a gs:// URL."""
    scheme, _, rest = url.partition("://")
    bucket, _, prefix = rest.strip("/").partition("/")
    if scheme.lower() not in ("gs", "gcs") or not bucket:
        raise UsageError(url, "is not a Cloud Storage URL", "write it as gs://bucket/prefix")
    return bucket, prefix.strip("/")


class GcsStore:
    """An output prefix in a bucket (see the module docstring)."""

    def __init__(
        self, url: str, options: StoreOptions | None = None, settings: Settings | None = None
    ) -> None:
        from ckptfix.io.remote_backends import make_backend

        self.bucket, self.prefix = parse_gs(url)
        needs(url, "google_crc32c", "gcsfs", "aiohttp")
        self.options = options or StoreOptions()
        settings = settings or Settings.from_env()
        self.backend = make_backend(url, settings)
        self.fs = self.backend.fs  # type: ignore[attr-defined]
        self.session = RemoteSession(self.backend, settings)
        self.run = uuid.uuid4().hex[:12]
        self.budget = Budget(self.options.max_in_flight)
        self._sent = 0
        self._check_bucket()

    @property
    def display(self) -> str:
        return f"gs://{self.bucket}/{self.prefix}".rstrip("/")

    def key(self, name: str) -> str:
        return f"{self.prefix}/{name}" if self.prefix else name

    def url_of(self, name: str) -> str:
        return f"gs://{self.bucket}/{self.key(name)}"

    def temp_key(self, name: str, label: str) -> str:
        return self.key(f"{TEMP}/{self.run}/{name}/{label}")

    # --- requests ------------------------------------------------------------------------

    def _call(self, url: str, method: str, path: str, *args: str, **kwargs: Any) -> Any:
        """One JSON API request through gcsfs (retried, counted, one-line errors); a `body`
        callable makes the request's body anew for each attempt."""
        from fsspec.asyn import sync

        fs, body = self.fs, kwargs.pop("body", None)

        def once() -> Any:
            data = {"data": body()} if body is not None else {}
            return parsed(
                lambda: sync(fs.loop, fs._call, method, path, *args, **kwargs, **data),
                "Cloud Storage's JSON",
            )

        return request(self.session, url, once)

    def _json(self, url: str, method: str, path: str, *args: str, **kwargs: Any) -> dict[str, Any]:
        found = self._call(url, method, path, *args, json_out=True, **kwargs)
        if not isinstance(found, dict):
            what = "unexpected answer from the server: not Cloud Storage's JSON (no object)"
            raise remote_error(url, Failure("remote-error", what, "check the endpoint"), 1)
        return found

    def _check_bucket(self) -> None:
        """A missing bucket is one error before anything is sent (a listing, which the
        writes need the permission of anyway, rather than the bucket's metadata)."""
        try:
            self._objects(self.key(""), limit=1)
        except RemoteNotFoundError as exc:
            what = f"the bucket {self.bucket!r} does not exist (HTTP 404)"
            fix = "create the bucket, or check its name in the URL"
            raise remote_error(self.display, Failure("remote-not-found", what, fix), 1) from exc

    def _objects(self, prefix: str, limit: int | None = None) -> list[dict[str, Any]]:
        """Every object resource under `prefix` (no delimiter: sub-folders too), within the
        bounds of a listing; at most `limit` if given."""
        url = f"gs://{self.bucket}/{prefix}"

        def listing() -> list[dict[str, Any]]:
            bounds, token, found = Listing(self.backend.listing_seconds), None, []  # type: ignore[attr-defined]
            pages = Pages(url)
            while True:
                query = {"prefix": prefix, "maxResults": limit or 1000, "pageToken": token}
                page = self._sync_list(query)
                items = page.get("items", [])
                if not isinstance(items, list) or not all(isinstance(i, dict) for i in items):
                    raise UnexpectedAnswer("not Cloud Storage's JSON (items not objects)")
                found += items
                token = page.get("nextPageToken")
                more = limit is None and pages.more(bool(token), token)
                bounds.page(len(items), more=more)
                if not more:
                    return found

        return request(self.session, url, listing)

    def _sync_list(self, query: dict[str, Any]) -> dict[str, Any]:
        from fsspec.asyn import sync

        page = parsed(
            lambda: sync(self.fs.loop, self.fs._call_list_objects, self.bucket, **query),
            "Cloud Storage's JSON",
        )
        if not isinstance(page, dict):
            raise UnexpectedAnswer("not Cloud Storage's JSON (a listing that is no object)")
        return page

    def put(
        self, key: str, data: memoryview, crc: int, *, part: int | None = None
    ) -> dict[str, Any]:
        """One upload of `data` to `key` with its CRC-32C (the store refuses other bytes),
        checked against the resource the store answers. A `part` (numbered from 0) of an
        object goes to a temporary key that must be free, and errors name its object."""
        import aiohttp

        new = part is not None
        root = self.key("")
        url = f"gs://{self.bucket}/" + (_object_of(key, root) if new else key)
        path = f"{self.fs._location}/upload/storage/v1/b/{quote(self.bucket, safe='')}/o"
        extra = {"ifGenerationMatch": "0"} if new else {}

        def body() -> aiohttp.MultipartWriter:
            writer = aiohttp.MultipartWriter("related")
            writer.append_json({"name": key, "crc32c": crc_text(crc)})
            writer.append(_pieces(data), {"Content-Type": "application/octet-stream"})
            return writer

        try:
            resource = self._json(url, "POST", path, uploadType="multipart", body=body, **extra)
        except RemoteError as exc:
            if any("crc32c" in str(item).lower() for item in _chain(exc)):
                raise refused(url, part) from exc
            raise
        self._count(len(data))
        try:
            _check(url, resource, len(data), crc, part)
        except VerificationError:
            if not new:  # this run's own object, holding other bytes: not left there
                self.remove(key)
            raise
        return resource

    def compose(self, key: str, sources: Sequence[Part]) -> dict[str, Any]:
        """`sources` composed into `key`, each pinned to the generation uploaded."""
        document = {
            "sourceObjects": [
                {"name": part.key, "objectPreconditions": {"ifGenerationMatch": part.generation}}
                for part in sources
            ],
            "destination": {"contentType": "application/octet-stream"},
        }
        url = f"gs://{self.bucket}/{key}"
        return self._json(url, "POST", "b/{}/o/{}/compose", self.bucket, key, json=document)

    def remove(self, key: str) -> None:
        """Delete the object `key`; one already gone is not an error."""
        with contextlib.suppress(RemoteNotFoundError):
            self._call(f"gs://{self.bucket}/{key}", "DELETE", "b/{}/o/{}", self.bucket, key)

    def _count(self, sent: int) -> None:
        with self.session._lock:
            self._sent += sent

    # --- the protocol ----------------------------------------------------------------------

    def list(self) -> Sequence[StoredObject]:
        start = len(self.key(""))
        found = []
        for item in self._objects(self.key("")):
            name = str(item.get("name", ""))[start:]
            if name and not name.startswith(f"{TEMP}/"):
                crc = item.get("crc32c")
                checksum = ("crc32c", str(crc)) if crc else None
                found.append(StoredObject(name, _size(item, self.url_of(name)), checksum))
        return found

    def dangling(self, *, own: bool = False) -> Sequence[Dangling]:
        """The uploads of other runs whose parts are still under the temporary prefix: a
        ckptfix run's (`ours`), since only ckptfix puts objects under TEMP."""
        root = self.key(f"{TEMP}/")
        found: dict[tuple[str, str], str | None] = {}
        for item in self._objects(root):
            run, _, rest = str(item.get("name", ""))[len(root) :].partition("/")
            name = rest.rpartition("/")[0]
            if run and name and run != self.run:
                started = item.get("timeCreated")
                earlier = found.get((run, name))
                found[(run, name)] = min(filter(None, (earlier, started)), default=None)
        return [
            Dangling(name, run, started, ours=True)
            for (run, name), started in sorted(found.items())
        ]

    def abort_dangling(self, uploads: Iterable[Dangling]) -> None:
        keys = []
        for upload in uploads:
            folder = self.key(f"{TEMP}/{upload.upload_id}/{upload.name}/")
            keys += [str(item["name"]) for item in self._objects(folder) if "name" in item]
        self._remove_all(keys)

    def stat(self, name: str) -> StoredObject | None:
        """One object and the CRC-32C the store holds for it, or None if there is none."""
        try:
            item = self._json(self.url_of(name), "GET", "b/{}/o/{}", self.bucket, self.key(name))
        except RemoteNotFoundError:
            return None
        crc = item.get("crc32c")
        checksum = ("crc32c", str(crc)) if crc else None
        return StoredObject(name, _size(item, self.url_of(name)), checksum)

    def hasher(self, size: int) -> Crc32cHash:
        """What `stat` reports, computed on bytes (a composed object's CRC-32C is the whole
        object's: it does not depend on the parts)."""
        return Crc32cHash()

    def delete(self, names: Sequence[str]) -> None:
        """Delete objects now (several at once); those already gone are not an error."""
        self._remove_all([self.key(name) for name in names])

    def rename(self, old: str, new: str, sha256: str) -> StoredObject:
        """A compose of `old` alone (pinned to its generation) into `new`, whose CRC-32C and
        size must be `old`'s (checked when it was uploaded); then `old` deleted."""
        url = self.url_of(old)
        source = self._json(url, "GET", "b/{}/o/{}", self.bucket, self.key(old))
        size = _size(source, url)
        made = self.compose(self.key(new), [Part(self.key(old), str(source.get("generation")))])
        if (made.get("crc32c"), _size(made, url)) != (source.get("crc32c"), size):
            self.remove(self.key(new))
            raise VerificationError(
                self.url_of(new),
                f"the copy of {old} is reported with CRC-32C {made.get('crc32c')} where "
                f"{source.get('crc32c')} was sent: nothing was published",
                "check the endpoint, then run again",
            )
        self.remove(self.key(old))
        return StoredObject(new, size, ("crc32c", str(made.get("crc32c"))))

    def _remove_all(self, keys: Sequence[str]) -> None:
        """Delete `keys`, `concurrency` at a time."""
        if not keys:
            return
        workers = max(1, min(self.options.concurrency, len(keys)))
        with ThreadPoolExecutor(workers, "ckptfix-gcs-delete") as pool:
            for future in [pool.submit(self.remove, key) for key in keys]:
                future.result()

    def begin(self, name: str, size: int) -> GcsUpload:
        return GcsUpload(self, name, size)

    def publish(
        self, files: Mapping[str, bytes], delete: Sequence[str], *, message: str
    ) -> Sequence[StoredObject]:
        """The small files one upload each (every index last), then the deletions."""
        published = []
        for name, data in index_last(files):
            crc = crc32c(bytes(data))
            self.put(self.key(name), memoryview(data), crc)
            published.append(StoredObject(name, len(data), ("crc32c", crc_text(crc))))
        self.delete(delete)
        return published

    def read(self, name: str, start: int, end: int) -> bytes:
        if end <= start:
            return b""
        key, url = self.key(name), self.url_of(name)
        path = f"{self.fs._location}/download/storage/v1/b/{quote(self.bucket, safe='')}/o/"
        headers = {"Range": f"bytes={start}-{end - 1}"}
        _, data = self._call(url, "GET", path + quote(key, safe=""), alt="media", headers=headers)
        if len(data) != end - start:
            raise RemoteError(
                url,
                "remote-no-range",
                f"asked for {end - start:,} bytes, the store sent {len(data):,}",
                "check the endpoint",
            )
        return bytes(data)

    def stats(self) -> UploadStats:
        requests = self.session.stats()["requests"]
        return UploadStats(bytes_sent=self._sent, requests=requests)


async def _pieces(data: memoryview) -> AsyncIterator[memoryview]:
    """A part's bytes a MiB at a time: aiohttp waits for each to leave before the next, where
    the whole part in one write would be copied into the connection's buffer as it waits."""
    for start in range(0, len(data), PIECE):
        yield data[start : start + PIECE]


def _size(item: Mapping[str, Any], url: str) -> int:
    """An object resource's size (Cloud Storage writes it as a decimal string)."""
    size = item.get("size")
    if isinstance(size, bool) or not isinstance(size, str | int) or not str(size).isdigit():
        what = "unexpected answer from the server: an object resource without a size"
        raise remote_error(url, Failure("remote-error", what, "check the endpoint"), 1)
    return int(size)


def _object_of(key: str, root: str) -> str:
    """The object a part's temporary key is of: `<root><name>` for
    `<root>.ckptfix-upload/<run>/<name>/part-N`."""
    return key[: len(root)] + key[len(root) :].split("/", 2)[2].rpartition("/")[0]


def _part(part: int | None) -> str:
    return f"part {part + 1} of " if part is not None else ""


def refused(url: str, part: int | None) -> VerificationError:
    return VerificationError(
        url,
        f"the store refused the bytes of {_part(part)}the object it received: they do not "
        "match the CRC-32C computed "
        "while they were sent (changed on the way): nothing was published",
        "try again; if it happens again, check the network between",
    )


def _check(url: str, resource: Mapping[str, Any], size: int, crc: int, part: int | None) -> None:
    """The resource the store answered an upload with says the bytes sent."""
    stored_size, stored_crc = resource.get("size"), resource.get("crc32c")
    what = _part(part) + "the object"
    if str(stored_size) != str(size):
        raise mismatch(url, "a size of", f"{stored_size} bytes", f"{size:,} bytes", what)
    if stored_crc != crc_text(crc):
        raise mismatch(url, "CRC-32C", str(stored_crc), crc_text(crc), what)
