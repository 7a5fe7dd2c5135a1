"""The one exception tree of ckptfix. The CLI turns these into exit codes in one place.

Each error is also the standard exception it means, so that a program catches it as it
would catch Python's own: a bad argument or a bad file is a ValueError, a path that does not
exist a FileNotFoundError (errno ENOENT), a file or an output the OS will not let ckptfix
read or write a PermissionError (errno EACCES). The exit codes are the CLI's and do not
depend on that.
"""

from __future__ import annotations

import errno
from typing import Any, TypeVar

from ckptfix.core.text import redact

_E = TypeVar("_E", bound="CkptfixError")


def _of_kind(cls: type[_E], kind: type[Any], *args: Any) -> _E:
    """A new error of `kind`, a subclass of `cls` chosen by the rule: the standard
    exception the rule means (see CorruptFileError, RemoteError)."""
    base = OSError if issubclass(kind, OSError) else Exception  # the layout's own __new__
    error: _E = base.__new__(kind, *args)
    return error


class Rejected(Exception):
    """A parser's refusal of what it reads (a pickle's walk, strict JSON): the rule broken
    and what; the reader that called it raises the CkptfixError that names the file."""

    def __init__(self, rule: str, what: str) -> None:
        super().__init__(what)
        self.rule = rule
        self.what = what


class CkptfixError(Exception):
    """Base of every error ckptfix raises on purpose."""

    exit_code = 1
    code: str | None = None  # the finding code inspect reports for it, when there is one
    rule: str | None = None  # the validation rule broken, when there is one
    kind = "error"  # what the error line names when there is neither (e.g. "usage")

    def __init__(
        self, path: str | None, what: str, fix: str | None = None, *, rule: str | None = None
    ) -> None:
        # An error names a URL without its credentials, whoever raised it (core.text.redact).
        self.path = redact(path) if path is not None else None
        self.what = redact(what)
        self.fix = redact(fix) if fix is not None else None
        if rule is not None:
            self.rule = rule
        super().__init__(self.line())
        if isinstance(self, OSError):
            _os_fields(self, self.what, self.path)

    def __str__(self) -> str:
        # The error line, also for the OSError kinds, whose own str() would show errno.
        return self.line()

    def __reduce__(self) -> tuple[Any, ...]:
        # Pickled by its fields: the default (the class called on `args`, the error line)
        # cannot rebuild an error whose __init__ takes the path and the rule. An error
        # raised in a Ray task crosses to the driver this way (ckptfix.executors).
        return (_restored, (type(self), dict(self.__dict__)))

    @property
    def label(self) -> str:
        """What the error line names: the rule broken, else the finding code, else the kind."""
        return self.rule or self.code or self.kind

    def detail(self) -> str:
        """The message without the file, as a finding's message: `<what> (rule <rule>; <how
        to fix>)`, the rule left out when there is none (the finding's code names it)."""
        return self._with_fix(self.what, self.rule)

    def _with_fix(self, what: str, label: str | None) -> str:
        if label:
            return f"{what} (rule {label}{f'; {self.fix}' if self.fix else ''})"
        return f"{what} ({self.fix})" if self.fix else what

    def message(self) -> str:
        """The message without the file, naming the rule: `<what> (rule <label>; <fix>)`."""
        return self._with_fix(self.what, self.label)

    def to_dict(self) -> dict[str, object]:
        """The `--json` error document's "error" object."""
        return {
            "code": self.code or self.kind,
            "rule": self.label,
            "file": self.path,
            "message": self.what,
            "fix": self.fix,
            "exit_code": self.exit_code,
        }

    def line(self) -> str:
        """The one line the CLI prints: `error: <file>: <what> (rule <code>; <how to fix>)`."""
        where = f"{self.path}: " if self.path else ""
        return f"error: {where}{self.message()}"


def _restored(kind: type[CkptfixError], fields: dict[str, Any]) -> CkptfixError:
    """An error unpickled: its fields set again, without its __init__ (see __reduce__)."""
    error = _of_kind(CkptfixError, kind)
    error.__dict__.update(fields)
    Exception.__init__(error, error.line())
    if isinstance(error, OSError):
        _os_fields(error, error.what, error.path)
    return error


def _os_fields(error: OSError, what: str, path: str | None) -> None:
    """errno, strerror and filename of an error that is an OSError too, as Python's own."""
    error.errno = errno.ENOENT if isinstance(error, FileNotFoundError) else errno.EACCES
    error.strerror, error.filename = what, path


class UsageError(CkptfixError, ValueError):
    """The command line asks for something impossible (bad option value, bad combination)."""

    exit_code = 2
    kind = "usage"


class InputNotFoundError(UsageError, FileNotFoundError):
    """The path given on the command line does not exist."""

    kind = "input-not-found"


class UnknownTensorError(UsageError, KeyError):
    """A tensor name the checkpoint does not hold (the library's `get`)."""

    kind = "unknown-tensor"


class CorruptFileError(CkptfixError, ValueError):
    """A file cannot be parsed or breaks a validation rule; `rule` names the rule. Rule
    `unreadable` (the OS refused to open or list it) makes an UnreadableFileError."""

    code = "corrupt-file"

    def __new__(
        cls: type[_E], path: str | None, rule: str, what: str, fix: str | None = None
    ) -> _E:
        kind = UnreadableFileError if cls is CorruptFileError and rule == UNREADABLE else cls
        return _of_kind(cls, kind, path, rule, what, fix)

    def __init__(self, path: str | None, rule: str, what: str, fix: str | None = None) -> None:
        super().__init__(path, what, fix, rule=rule)


UNREADABLE = "unreadable"  # the rule of a file or folder the OS will not let us read


class UnreadableFileError(CorruptFileError, PermissionError):
    """A file or folder could not be opened or listed (permissions, another user's)."""


class LfsPointerError(CorruptFileError):
    """A weight file is a Git LFS pointer stub, not the weights."""

    code = "lfs-pointer"


class DuplicateNameError(CorruptFileError):
    """Two tensors of one file would have the same name, so one would be lost."""

    code = "duplicate-name"


class UnsupportedFormatError(CkptfixError, ValueError):
    """A file is of a kind ckptfix recognises but does not read (yet, or ever)."""

    code = "unsupported-format"


class WriteError(CkptfixError):
    """Writing the output failed (disk full, permissions, a source that changed)."""

    kind = "write-failed"


class WritePermissionError(WriteError, PermissionError):
    """The OS refused to let ckptfix write the output (EACCES, EPERM)."""


class SourceChangedError(WriteError):
    """A source file ended early (or changed) while it was being read; nothing was written."""

    kind = "source-changed"

    def __init__(
        self, path: str | None, what: str = "file ended early: it changed during the run"
    ) -> None:
        super().__init__(path, what, "run again on a stable copy")


class ClusterError(CkptfixError):
    """An executor's cluster could not run a task (its worker or node lost past the retries,
    the cluster gone)."""

    kind = "cluster-failed"


class OpenFilesError(WriteError):
    """The process ran out of descriptors (its open-file limit is lower than the files a
    run needs at once, even with the sources' idle ones closed); nothing was written."""

    kind = "open-files-limit"


class PlanError(CkptfixError, ValueError):
    """The output cannot be written as asked (e.g. a header over the format's limit)."""

    kind = "cannot-plan"


class OutputConflictError(WriteError):
    """Another program created, changed or is writing OUT; nothing of it was touched."""

    kind = "output-conflict"


class VerificationError(CkptfixError):
    """What was written does not read back as exactly what was planned."""

    kind = "verification-failed"


class Interrupted(CkptfixError):
    """SIGINT or SIGTERM arrived; the output (`path`, if a write had begun) was left as it was."""

    kind = "interrupted"

    def __init__(self, path: str | None, signal_name: str, exit_code: int) -> None:
        self.exit_code = exit_code
        what = f"interrupted by {signal_name}"
        super().__init__(path, f"{what}; the output was left as it was" if path else what)


class RepairRefusedError(CkptfixError):
    """`ckptfix fix` cannot repair a finding, so it wrote nothing: `code` is the finding's
    code, `rule` the validation rule broken when there is one (a corrupt file)."""

    kind = "cannot-repair"

    def __init__(
        self,
        path: str | None,
        code: str,
        what: str,
        fix: str | None = None,
        *,
        rule: str | None = None,
    ) -> None:
        self.code = code
        super().__init__(path, what, fix, rule=rule or code)


class MappingError(CkptfixError, ValueError):
    """A checkpoint and the model it is mapped to (`--to-hf`) do not correspond tensor for
    tensor: a tensor with no destination, a target with no source, a size that disagrees;
    `rule` names which."""

    kind = "mapping"


class UnsafePickleError(CkptfixError, ValueError):
    """A pickle names a global outside the allowlist; it was not loaded."""

    code = "unsafe-pickle"


class RemoteError(CkptfixError):
    """A remote source (s3://, gs://, hf://, http(s)://) could not be read: no credentials,
    refused, not found, no range requests, timed out; `rule` names which. Not found makes a
    RemoteNotFoundError, refused or unsigned a RemoteAccessError."""

    kind = "remote-error"

    def __new__(cls: type[_E], url: str, rule: str, what: str, fix: str | None = None) -> _E:
        kind = _REMOTE_KINDS.get(rule, cls) if cls is RemoteError else cls
        return _of_kind(cls, kind, url, rule, what, fix)

    def __init__(self, url: str, rule: str, what: str, fix: str | None = None) -> None:
        super().__init__(url, what, fix, rule=rule)


class RemoteNotFoundError(RemoteError, FileNotFoundError):
    """The URL names no object or folder (HTTP 404, NoSuchKey)."""


class RemoteAccessError(RemoteError, PermissionError):
    """The store refused the request: no credentials, or not allowed (HTTP 401, 403)."""


_REMOTE_KINDS: dict[str, type[RemoteError]] = {
    "remote-not-found": RemoteNotFoundError,
    "remote-credentials": RemoteAccessError,
    "remote-forbidden": RemoteAccessError,
}


class RemoteChangedError(SourceChangedError):
    """A remote object was replaced while it was being read (its ETag or version moved)."""

    def __init__(self, url: str, what: str) -> None:
        CkptfixError.__init__(
            self, url, what, "run again once the upload is complete", rule="remote-changed"
        )
