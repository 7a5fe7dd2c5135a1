"""The one exception tree of ckptfix. The CLI turns these into exit codes in one place."""

from __future__ import annotations


class CkptfixError(Exception):
    """Base of every error ckptfix raises on purpose."""

    exit_code = 1
    code: str | None = None  # the finding code inspect reports for it, when there is one
    rule: str | None = None  # the validation rule broken, when there is one

    def __init__(
        self, path: str | None, what: str, fix: str | None = None, *, rule: str | None = None
    ) -> None:
        self.path = path
        self.what = what
        self.fix = fix
        if rule is not None:
            self.rule = rule
        super().__init__(self.line())

    def detail(self) -> str:
        """The message without the file: `<what> (rule <rule>; <how to fix>)`."""
        if self.rule:
            fix = f"; {self.fix}" if self.fix else ""
            return f"{self.what} (rule {self.rule}{fix})"
        return f"{self.what} ({self.fix})" if self.fix else self.what

    def line(self) -> str:
        """The one line the CLI prints: `error: <file>: <what> (<how to fix>)`."""
        where = f"{self.path}: " if self.path else ""
        return f"error: {where}{self.detail()}"


class UsageError(CkptfixError):
    """The command line asks for something impossible (bad option value, bad combination)."""

    exit_code = 2


class InputNotFoundError(UsageError):
    """The path given on the command line does not exist."""


class CorruptFileError(CkptfixError):
    """A file cannot be parsed or breaks a validation rule; `rule` names the rule."""

    code = "corrupt-file"

    def __init__(self, path: str | None, rule: str, what: str, fix: str | None = None) -> None:
        super().__init__(path, what, fix, rule=rule)


class LfsPointerError(CorruptFileError):
    """A weight file is a Git LFS pointer stub, not the weights."""

    code = "lfs-pointer"


class DuplicateNameError(CorruptFileError):
    """Two tensors of one file would have the same name, so one would be lost."""

    code = "duplicate-name"


class UnsupportedFormatError(CkptfixError):
    """A file is of a kind ckptfix recognises but does not read (yet, or ever)."""

    code = "unsupported-format"


class WriteError(CkptfixError):
    """Writing the output failed (disk full, permissions, a source that changed)."""


class SourceChangedError(WriteError):
    """A source file ended early (or changed) while it was being read; nothing was written."""

    def __init__(self, path: str | None) -> None:
        super().__init__(
            path, "file ended early: it changed during the run", "run again on a stable copy"
        )


class PlanError(CkptfixError):
    """The output cannot be written as asked (e.g. a header over the format's limit)."""


class OutputConflictError(WriteError):
    """Another program created, changed or is writing OUT; nothing of it was touched."""


class VerificationError(CkptfixError):
    """What was written does not read back as exactly what was planned."""


class Interrupted(CkptfixError):
    """SIGINT or SIGTERM arrived; the output (`path`, if a write had begun) was left as it was."""

    def __init__(self, path: str | None, signal_name: str, exit_code: int) -> None:
        self.exit_code = exit_code
        what = f"interrupted by {signal_name}"
        super().__init__(path, f"{what}; the output was left as it was" if path else what)


class UnsafePickleError(CkptfixError):
    """A pickle names a global outside the allowlist; it was not loaded."""

    code = "unsafe-pickle"


class RemoteError(CkptfixError):
    """A remote source (s3://, gs://, hf://, http(s)://) could not be read: no credentials,
    refused, not found, no range requests, timed out; `rule` names which."""

    def __init__(self, url: str, rule: str, what: str, fix: str | None = None) -> None:
        super().__init__(url, what, fix, rule=rule)


class RemoteChangedError(SourceChangedError):
    """A remote object was replaced while it was being read (its ETag or version moved)."""

    def __init__(self, url: str, what: str) -> None:
        CkptfixError.__init__(
            self, url, what, "run again once the upload is complete", rule="remote-changed"
        )
