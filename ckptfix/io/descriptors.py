"""Room for open files. A local source stays open from its first read to the end of the
command (so a file replaced meanwhile is noticed, never mixed in), and a write takes every
source's change token before it starts: a checkpoint made of many files — a DeepSpeed
universal checkpoint has one per parameter — needs a descriptor for each at once. Before such
a layout opens them, the soft limit is raised as far as needed (never past the hard limit),
or the checkpoint is refused with the way out, instead of failing half-way (or in an import)
once the descriptors run out."""

from __future__ import annotations

from ckptfix.core.errors import CkptfixError

# Descriptors the process needs besides the checkpoint's files: the interpreter's own,
# imports, the output's files, thread pools, a remote session's sockets.
MARGIN = 256


def reserve(count: int, label: str) -> None:
    """Make sure `count` more files can be open at once (raise the soft RLIMIT_NOFILE up to
    the hard one), or refuse the checkpoint `label` names."""
    try:
        import resource
    except ImportError:  # not a POSIX system: nothing to raise
        return
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = count + MARGIN
    if soft == resource.RLIM_INFINITY or needed <= soft:
        return
    if hard != resource.RLIM_INFINITY and needed > hard:
        raise CkptfixError(
            label,
            f"checkpoint is made of {count:,} files, and this process may not have that "
            f"many open at once (the hard limit is {hard:,})",
            f"raise the hard limit of open files to at least {needed} (`ulimit -Hn` as root, "
            "or /etc/security/limits.conf), then run again",
            rule="too-many-files",
        )
    resource.setrlimit(resource.RLIMIT_NOFILE, (needed, hard))
