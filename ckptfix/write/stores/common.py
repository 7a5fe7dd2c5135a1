"""What the GCS and Hub stores share: the bytes of parts held at once (`Budget`), the
remote reads' one-line errors said for a write, checksum mismatches as `VerificationError`s,
and the order small files are published in (the index last)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import TypeVar

from ckptfix.core.errors import CkptfixError, RemoteError, UsageError, VerificationError
from ckptfix.io.remote import RemoteSession
from ckptfix.io.remote_errors import Failure, _chain, remote_error

T = TypeVar("T")

_WRITE_FIX = {
    "remote-forbidden": "check that the credentials in use may create, read and delete objects "
    "under the output prefix",
    "remote-not-found": "check the URL: the bucket or repository must exist before ckptfix "
    "writes to it",
}
_QUOTA = "the store refused the write: quota exceeded (HTTP 403)"
QUOTA_FIX = "free space or raise the quota of the bucket, project or account, then try again"


class Budget:
    """Bytes of upload parts held at once, across every upload of a store. A part waits
    while `limit` bytes are taken, unless nothing is in flight: a part larger than the
    limit still proceeds alone (so the bound is the limit plus, at most, one part)."""

    def __init__(self, limit: int) -> None:
        self.limit = max(1, limit)
        self.taken = 0
        self._holders = 0
        self._cond = threading.Condition()

    def take(self, size: int, stop: Callable[[], bool] = lambda: False) -> bool:
        """Wait for room for `size` bytes; False if `stop()` became true meanwhile."""
        with self._cond:
            while self._holders and self.taken + size > self.limit:
                if stop():
                    return False
                self._cond.wait(0.1)
            self.taken += size
            self._holders += 1
            return True

    def give(self, size: int) -> None:
        with self._cond:
            self.taken -= size
            self._holders -= 1
            self._cond.notify_all()


def needs(url: str, *modules: str) -> None:
    """Import `modules` (what a store's scheme needs), or a usage error saying how to install
    them (exit 2), as for remote reads."""
    import importlib

    for module in modules:
        try:
            importlib.import_module(module)
        except ImportError as exc:
            raise UsageError(
                url,
                f"writing {url.split('://', 1)[0]}:// URLs needs {module.replace('_', '-')} "
                f"({(exc.name or module).partition('.')[0]} is not installed)",
                "pip install 'ckptfix[remote]'",
            ) from exc


def for_writing(error: RemoteError, url: str) -> CkptfixError:
    """A remote read's one-line error, said for an upload: a refusal names writing, and says
    so when it is over a quota."""
    cause = " ".join(str(item) for item in _chain(error)).lower()
    if "quota" in cause or "storage limit" in cause:
        return remote_error(url, Failure("remote-forbidden", _QUOTA, QUOTA_FIX), 1)
    fix = _WRITE_FIX.get(error.rule or "")
    if fix is None or error.rule is None:
        return error
    return remote_error(url, Failure(error.rule, error.what, fix), 1)


def request(session: RemoteSession, url: str, call: Callable[[], T]) -> T:
    """`call()` through the session (retried with backoff, counted), its failure one line
    worded for a write."""
    try:
        return session.call(url, call)
    except RemoteError as exc:
        worded = for_writing(exc, url)
        if worded is exc:
            raise
        raise worded from exc


def mismatch(
    url: str, what: str, stored: str, sent: str, of: str = "the object"
) -> VerificationError:
    """The store holds other bytes than were sent: `what` names the checksum or size, `of`
    what it is of (a part of the object)."""
    return VerificationError(
        url,
        f"the store reports {what} {stored} for {of}, the bytes sent have {sent}: "
        "nothing was published",
        "try again; if it happens again, the store or the network between changes bytes",
    )


def index_last(files: Mapping[str, bytes]) -> list[tuple[str, bytes]]:
    """The small files in the order they are published: every index after every other file,
    so a loader never sees an index before what it lists."""
    return sorted(files.items(), key=lambda item: item[0].endswith(".index.json"))


class Pages:
    """The continuation tokens of one listing: a page that says there is more must say
    where to go on, and never send the listing back where it has been. A listing that
    stops short or loops would pass a prefix holding a checkpoint as empty (or hold the run
    until the listing bounds end it)."""

    def __init__(self, url: str) -> None:
        self.url = url
        self.seen: set[object] = set()

    def more(self, truncated: bool, token: object) -> bool:
        """Whether to ask for another page at `token`; an error if the answer contradicts
        itself."""
        if not truncated:
            return False
        if not token or (isinstance(token, tuple) and not any(token)):
            raise self._inconsistent("a page says there is more and gives no token to go on")
        if token in self.seen:
            raise self._inconsistent("a continuation token came back a second time")
        self.seen.add(token)
        return True

    def _inconsistent(self, what: str) -> RemoteError:
        return RemoteError(
            self.url,
            "remote-error",
            f"the store's listing is inconsistent ({what}); nothing was written",
            "try again; if it happens again, the store or a proxy in front of it is at fault",
        )
