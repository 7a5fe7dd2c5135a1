"""What went wrong with a remote request, in one line: each backend (botocore, aiohttp,
huggingface_hub, gcsfs) raises its own exceptions, often wrapped in another; this
module looks through the chain for an HTTP status or a known kind of failure and says which
rule it breaks, whether trying again may help, and what the user can do.

Exceptions are recognised by their class names and attributes, so nothing here imports a
backend: the remote extra stays optional.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import TypeVar

from ckptfix.core.errors import CkptfixError, RemoteChangedError, RemoteError

T = TypeVar("T")

_CREDENTIALS_FIX = {
    "s3": "set AWS_ACCESS_KEY_ID and AWS_SECRET_ACCESS_KEY or AWS_PROFILE (and AWS_ENDPOINT_URL "
    "for another S3 service), as the AWS CLI reads them",
    "gs": "set GOOGLE_APPLICATION_CREDENTIALS or run `gcloud auth application-default login`",
    "hf": "set HF_TOKEN, or run `hf auth login`",
    "http": "give a user name and password in the URL (user:password@ before the host), or "
    "a signed URL that is still valid",
}
# What the request that got a 401 carried, where the backend knows (HttpError.credentials):
# the URL's user name and password (http) or the token (hf), and what to do when they are
# refused.
_SENT = {
    "http": ("user name and password", "check the user name and password in the URL"),
    "hf": (
        "token",
        "check the token (HF_TOKEN, or the one `hf auth login` saved): it may have expired, "
        "been revoked, or not be allowed to read this repository",
    ),
}
_CREDENTIAL_ERRORS = {
    "NoCredentialsError",
    "PartialCredentialsError",
    "CredentialRetrievalError",
    "DefaultCredentialsError",
    "RefreshError",
    "LocalTokenNotFoundError",
}
_TIMEOUT_ERRORS = {
    "TimeoutError",
    "FSTimeoutError",
    "ReadTimeoutError",
    "ConnectTimeoutError",
    "ServerTimeoutError",
    "ConnectionTimeoutError",
    "SocketTimeoutError",
    "ReadTimeout",
    "ConnectTimeout",
    "WriteTimeout",
    "PoolTimeout",
    "TimeoutException",
}
_CONNECTION_ERRORS = {
    "ClientConnectorError",
    "ClientConnectorDNSError",
    "ClientOSError",
    "ServerDisconnectedError",
    "ClientPayloadError",
    "EndpointConnectionError",
    "ConnectionClosedError",
    "ConnectError",
    "RemoteProtocolError",
    "IncompleteRead",
    "IncompleteReadError",  # botocore: a body that ended before its Content-Length
    "ResponseStreamingError",  # botocore: the connection broke while a body streamed
    "ConnectionError",
    "ConnectionResetError",
    "ConnectionRefusedError",
    "ConnectionAbortedError",
    "BrokenPipeError",
    "ProxyError",  # also what gcsfs raises for an HTTP 502
}
TRANSIENT_STATUS = {408, 425, 429, 500, 502, 503, 504}


@dataclass(frozen=True)
class Failure:
    """A classified failure: its rule, the one-line description, and whether another
    attempt may succeed."""

    rule: str
    what: str
    fix: str
    transient: bool = False


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    current: BaseException | None = exc
    while current is not None and id(current) not in seen:
        seen.add(id(current))
        yield current
        current = current.__cause__ or current.__context__


def status_of(exc: BaseException) -> int | None:
    """The HTTP status an exception carries: aiohttp's `status`, requests' and httpx's
    `response.status_code`, botocore's `response["ResponseMetadata"]`, gcsfs's `code` (and
    its bare "Forbidden" OSError)."""
    status = getattr(exc, "status", None)
    if isinstance(status, int) and 100 <= status < 600:
        return status
    # gcsfs's HttpError; only there: aiohttp's errors warn that `code` is deprecated
    code = getattr(exc, "code", None) if type(exc).__name__ == "HttpError" else None
    if isinstance(code, int) and 100 <= code < 600:
        return code
    if _gcsfs_forbidden(exc):
        return 403
    response = getattr(exc, "response", None)
    code = getattr(response, "status_code", None)
    if isinstance(code, int):
        return code
    if isinstance(response, dict):
        meta = response.get("ResponseMetadata", {})
        code = meta.get("HTTPStatusCode") if isinstance(meta, dict) else None
        return code if isinstance(code, int) else None
    return None


def _gcsfs_forbidden(exc: BaseException) -> bool:
    """gcsfs answers a 403 with a bare OSError("Forbidden: <path>\n<message>")."""
    return type(exc) is OSError and str(exc).startswith("Forbidden: ")


def boto_code(exc: BaseException) -> str | None:
    response = getattr(exc, "response", None)
    if isinstance(response, dict) and isinstance(response.get("Error"), dict):
        code = response["Error"].get("Code")
        return str(code) if code is not None else None
    return None


def from_status(status: int, scheme: str, credentials: str = "") -> Failure:
    """The failure an HTTP status stands for (`credentials`: see HttpError)."""
    if status == 401:
        return _unauthorized(scheme, credentials)
    if status == 403:
        return Failure(
            "remote-forbidden",
            "access denied (HTTP 403)",
            "check that the credentials in use may read this object",
        )
    if status in (404, 410):
        return Failure(
            "remote-not-found", f"no such file or folder (HTTP {status})", "check the URL"
        )
    if status in TRANSIENT_STATUS:
        return Failure(
            "remote-server-error",
            f"the server failed (HTTP {status})",
            "try again later",
            transient=True,
        )
    return Failure("remote-http-error", f"the request failed with HTTP {status}", "check the URL")


# huggingface_hub reads a 401 from the Hub's API as "repository not found" too
_UNAUTHORIZED = {
    "hf": " (or check the repository's name: the Hub answers 401 for one it does not show)"
}
_REDIRECTED = {
    "withheld": "HTTP 401 from another server the request was redirected to, which its "
    "credentials are not sent to",
    "redirect": "HTTP 401 to the user name and password in the URL the server redirected "
    "the request to, not ones given to ckptfix",
}
_REDIRECT_FIX = "check the URL and the server's redirects"


def _unauthorized(scheme: str, credentials: str) -> Failure:
    """HTTP 401, said as what the request carried where the backend knows it (http's user
    name and password, the Hub's token): they were refused, there were none, they were
    withheld from the server a redirect led to, or the redirect's URL had its own.
    Otherwise (gs, s3) as either."""
    fix = _CREDENTIALS_FIX.get(scheme, _CREDENTIALS_FIX["http"]) + _UNAUTHORIZED.get(scheme, "")
    kind, refused_fix = _SENT.get(scheme, ("credentials", fix))
    if credentials == "sent":
        what = f"the server refused the {kind} the request carried (HTTP 401)"
        return Failure("remote-credentials", what, refused_fix)
    if credentials in _REDIRECTED:
        return Failure("remote-credentials", _REDIRECTED[credentials], _REDIRECT_FIX)
    if credentials == "none":
        what = f"the server refused the request: HTTP 401 (the request carried no {kind})"
    else:
        what = "the server refused the request: HTTP 401 (credentials missing or refused)"
    return Failure("remote-credentials", what, fix)


def _by_name(exc: BaseException, scheme: str) -> Failure | None:
    name = type(exc).__name__
    if name in _CREDENTIAL_ERRORS:
        what = f"no credentials were found ({name})"
        return Failure(
            "remote-credentials", what, _CREDENTIALS_FIX.get(scheme, _CREDENTIALS_FIX["http"])
        )
    if name in _TIMEOUT_ERRORS or isinstance(exc, TimeoutError):
        return Failure("remote-timeout", "no answer in time", _TIMEOUT_FIX, transient=True)
    if name in _CONNECTION_ERRORS or isinstance(exc, ConnectionError):
        detail = str(exc).splitlines()[0][:160] if str(exc) else name
        return Failure(
            "remote-unreachable", f"the connection failed: {detail}", _ENDPOINT_FIX, transient=True
        )
    return None


_TIMEOUT_FIX = (
    "check the network and the endpoint; CKPTFIX_REMOTE_TIMEOUT sets the limit in seconds"
)
_ENDPOINT_FIX = "check the network and the endpoint (AWS_ENDPOINT_URL, HF_ENDPOINT, the URL)"


RANGE_FIX = "serve the files from a server that supports HTTP Range requests, or download them"
_ANSWER_FIX = "check the URL and the endpoint the backend is configured with"


def _answer(exc: BaseException) -> Failure | None:
    """An answer ckptfix refuses (remote_answers), or a redirect aiohttp refused to follow."""
    if isinstance(exc, RangeRefused):
        return Failure("remote-no-range", str(exc), RANGE_FIX)
    if isinstance(exc, UnexpectedAnswer):
        return Failure("remote-error", f"unexpected answer from the server: {exc}", _ANSWER_FIX)
    name = type(exc).__name__
    if name == "TooManyRedirects":  # aiohttp's, past the MAX_REDIRECTS it was given
        what = str(too_many_redirects())
    elif name == "NonHttpUrlRedirectClientError":
        scheme = str(getattr(exc, "url", exc)).partition(":")[0][:20]
        what = f"the server redirected to a URL that is not HTTP(S) ({scheme}:)"
    elif name == "InvalidUrlRedirectClientError":
        what = "the server redirected to an invalid URL"
    else:
        return None
    return Failure("remote-error", f"unexpected answer from the server: {what}", _ANSWER_FIX)


def _one(exc: BaseException, scheme: str) -> Failure | None:
    answer = _answer(exc)
    if answer is not None:
        return answer
    code = boto_code(exc)
    if code in ("InvalidAccessKeyId", "SignatureDoesNotMatch", "ExpiredToken", "InvalidToken"):
        return Failure(
            "remote-credentials", f"the credentials were refused ({code})", _CREDENTIALS_FIX["s3"]
        )
    if code in ("NoSuchBucket", "NoSuchKey"):
        return Failure("remote-not-found", f"no such file or folder ({code})", "check the URL")
    status = status_of(exc)
    if status is not None:
        return from_status(status, scheme, exc.credentials if isinstance(exc, HttpError) else "")
    by_name = _by_name(exc, scheme)
    if by_name is not None:
        return by_name
    if isinstance(exc, FileNotFoundError):
        return Failure("remote-not-found", "no such file or folder", "check the URL")
    if isinstance(exc, PermissionError):
        return Failure(
            "remote-forbidden",
            "access denied",
            "check that the credentials in use may read this object",
        )
    return None


def classify(exc: BaseException, scheme: str) -> Failure | None:
    """The failure behind `exc`: the most specific one found along its chain (a status
    beats a generic FileNotFoundError that wraps it); None for an exception that is not a
    failure to fetch (a bug, which must not pass for a network problem)."""
    found = [failure for item in _chain(exc) if (failure := _one(item, scheme)) is not None]
    specific = [f for f in found if f.what not in ("no such file or folder", "access denied")]
    if specific:
        return specific[0]
    if found:
        return found[0]
    if not any(isinstance(item, OSError) for item in _chain(exc)):
        return None
    text = str(exc).splitlines()[0][:160] if str(exc) else ""
    what = f"the request failed: {type(exc).__name__}" + (f": {text}" if text else "")
    return Failure("remote-error", what, "check the URL and the network")


def parsed(call: Callable[[], T], what: str, also: tuple[type[BaseException], ...] = ()) -> T:
    """`call()`, a backend's request and its parsing of the answer: a parser's ValueError,
    KeyError, TypeError or AttributeError (or one of `also`) on a body that is not `what` (a
    proxy's page, another service, a value out of form) is an unexpected answer."""
    caught: tuple[type[BaseException], ...] = (ValueError, KeyError, TypeError, AttributeError)
    try:
        return call()
    except caught + also as exc:
        raise UnexpectedAnswer(f"not {what} ({type(exc).__name__}: {str(exc)[:80]})") from exc


class UnexpectedAnswer(OSError):
    """A server's answer that is not what its API answers: not JSON, fields missing, pages
    without end (a proxy's or a captive portal's page, another service at the endpoint)."""


MAX_REDIRECTS = 10  # followed for one request (aiohttp's default, and ckptfix's own loop's)


def too_many_redirects() -> UnexpectedAnswer:
    return UnexpectedAnswer(
        f"the server redirected the request more than {MAX_REDIRECTS} times (a loop, or a chain)"
    )


class HttpError(Exception):
    """An HTTP status, as the classifier reads it (`status`), and what the request that got
    it carried (`credentials`): "sent" (an Authorization header: the URL's user name and
    password, the Hub's token), "none" (none was given), "withheld" (some were given, and
    not sent to the server a redirect led to), "redirect" (none were given, and the URL a
    redirect led to had its own), or "" (not known)."""

    def __init__(self, status: int, url: str, credentials: str = "") -> None:
        super().__init__(f"HTTP {status} for {url}")
        self.status = status
        self.credentials = credentials


def credentials_carried(sent: Mapping[str, str], given: bool) -> str:
    """HttpError.credentials of a request whose headers were `sent`, credentials `given`."""
    if any(name.lower() == "authorization" for name in sent):
        return "sent" if given else "redirect"
    return "withheld" if given else "none"


class RangeRefused(UnexpectedAnswer):
    """An answer to a ranged read that is not the range: the whole file, another range,
    more bytes than asked."""


class ObjectReplaced(Exception):
    """A read pinned to a version (a Cloud Storage generation) found it gone."""


def is_precondition_failed(exc: BaseException) -> bool:
    """A read pinned to an ETag (If-Match) or a version found the object replaced."""
    return any(
        status_of(item) == 412
        or boto_code(item) == "PreconditionFailed"
        or isinstance(item, ObjectReplaced)
        for item in _chain(exc)
    )


def remote_error(url: str, failure: Failure, attempts: int) -> CkptfixError:
    tries = f" after {attempts} attempts" if attempts > 1 else ""
    return RemoteError(url, failure.rule, failure.what + tries, failure.fix)


def changed(url: str) -> RemoteChangedError:
    return RemoteChangedError(
        url, "the object changed while it was being read (its ETag or version no longer matches)"
    )
