"""Object-store outputs: `open_store` gives the `ObjectStore` (stores.base) for an output URL.

Each scheme's backend is imported only when a URL of that scheme is written to (the remote
extra stays optional); any other scheme is a usage error.
"""

from __future__ import annotations

from importlib import import_module

from ckptfix.core.errors import UsageError
from ckptfix.core.text import redact
from ckptfix.write.stores.base import ObjectStore, StoreOptions

# scheme -> (module, class)
BACKENDS: dict[str, tuple[str, str]] = {
    "s3": ("ckptfix.write.stores.s3", "S3Store"),
    "gs": ("ckptfix.write.stores.gcs", "GcsStore"),
    "gcs": ("ckptfix.write.stores.gcs", "GcsStore"),  # as the remote reads take it
    "hf": ("ckptfix.write.stores.hub", "HubStore"),
}


def store_scheme(url: str) -> str:
    return url.partition("://")[0].lower()


def check_flags(target: str, options: StoreOptions) -> None:
    """--resume, --verify-readback and --hf-pr are for an object-store OUT (--hf-pr for an
    hf:// one): given for another, they would be ignored, so they are a usage error."""
    flags = {
        "--resume": options.resume,
        "--verify-readback": options.verify_readback,
        "--hf-pr": options.hf_pr,
    }
    given = [flag for flag, on in flags.items() if on]
    scheme = store_scheme(target) if "://" in target else ""
    if given and scheme not in BACKENDS:
        raise UsageError(
            given[0],
            "only applies to an object-store output (-o s3://, gs://, hf://)",
            f"drop {given[0]}",
        )
    if options.hf_pr and scheme != "hf":
        raise UsageError("--hf-pr", "only applies to an hf:// output", "drop --hf-pr")


def open_store(url: str, options: StoreOptions) -> ObjectStore:
    """The store an output URL names; a usage error for a scheme ckptfix cannot write to."""
    scheme = store_scheme(url)
    if scheme not in BACKENDS:
        raise UsageError(
            redact(url),
            f"cannot write to {scheme}:// URLs",
            "write to s3://, gs://, hf:// or a folder",
        )
    module, name = BACKENDS[scheme]
    try:
        backend = getattr(import_module(module), name)
    except ImportError as exc:
        raise UsageError(
            redact(url),
            f"writing to {scheme}:// needs the remote extra ({exc.name} is missing)",
            "pip install 'ckptfix[remote]'",
        ) from exc
    store: ObjectStore = backend(url, options)
    return store
