"""Where a rewrite writes (its destination, taken from one place): the local OUT claimed for
the run (write.staging), or an object-store prefix (write.store_output). `ops/rewrite.py`
writes to either without knowing which store it is."""

from __future__ import annotations

import os

from ckptfix.core.errors import CkptfixError, UsageError
from ckptfix.io.urls import is_url, refuse_unknown_scheme
from ckptfix.ops.rewrite_options import RewriteOptions
from ckptfix.write.output import wrap_os_error
from ckptfix.write.staging import Claim, claim_output
from ckptfix.write.store_output import StoreClaim, claim_store
from ckptfix.write.stores import check_flags
from ckptfix.write.stores.base import StoreOptions


def _refuse_hub_snapshot(source: str) -> None:
    """A Hugging Face cache snapshot's files are links into the repository's blobs/: files
    written in their place would leave the cache's bookkeeping wrong and its blobs orphaned."""
    from ckptfix.layouts.hub import snapshot_of

    repo = snapshot_of(source)
    if repo is not None:
        raise UsageError(
            source,
            f"is a snapshot of the Hugging Face cache ({os.path.basename(repo)}): its files are "
            "links into the cache's blobs/, which a rewrite in place would orphan",
            "write the result elsewhere with -o OUT (what the links point to is copied)",
        )


def _check_flags(source: str, *, replace_any: bool, force: bool) -> None:
    if not is_url(source) and not os.path.exists(source):
        raise UsageError(source, "no such file or directory", "check the path")
    if replace_any and not force:
        raise UsageError(
            "--replace-any", "only applies with --force", "add --force, or drop --replace-any"
        )


Destination = Claim | StoreClaim  # a local OUT, or an object-store prefix


def claim(
    source: str,
    out: str | os.PathLike[str] | None,
    options: RewriteOptions,
    *,
    in_place: bool,
) -> Destination:
    """Check the paths, then claim the output for the run (see staging.claim_output, and
    store_output.claim_store for a URL)."""
    force, replace_any, dry_run = options.force, options.replace_any, options.dry_run
    if is_url(source) and in_place:
        raise UsageError("--in-place", "cannot rewrite a URL in place", "use -o OUT")
    _check_flags(source, replace_any=replace_any, force=force)
    if in_place:
        if out is not None and os.path.abspath(os.fspath(out)) != os.path.abspath(source):
            raise UsageError("--in-place", "takes no -o folder other than SRC", "drop -o")
        if not os.path.isdir(source):
            raise UsageError(source, "--in-place needs a model folder", "use -o OUT for a file")
        _refuse_hub_snapshot(source)
        target = source
    elif out is None:
        raise UsageError("-o", "an output folder is required", "pass -o OUT, or --in-place")
    else:
        target = os.fspath(out)
    refuse_unknown_scheme(target)
    check_flags(target, store_options(options))
    if is_url(target):
        return _claim_store(source, target, options)
    if options.part is not None:  # a part writes beside OUT (ops.rewrite_parts), never in it
        dry_run = True
    try:
        return claim_output(
            target,
            [source],
            force=force,
            replace_any=replace_any,
            in_place=in_place,
            write=not dry_run,
        )
    except CkptfixError:  # already one line (an unreadable file is an OSError too)
        raise
    except OSError as exc:
        raise wrap_os_error(exc, target) from exc


def store_options(options: RewriteOptions) -> StoreOptions:
    return StoreOptions(
        concurrency=options.upload_concurrency,
        verify_readback=options.verify_readback,
        resume=options.resume,
        hf_pr=options.hf_pr,
    )


def _claim_store(source: str, target: str, options: RewriteOptions) -> StoreClaim:
    """The prefix for the run. Parts (--part, --commit) find each other's shards and records
    there: the claim lets them be, and ops.rewrite_parts checks the prefix against the plan
    by the usual rules; a part leaves the other parts' uploads under way alone."""
    if options.is_split and target.startswith("hf://"):
        # The Hub publishes what one process uploaded, in one commit: slices uploaded by
        # other processes would not be in it.
        raise UsageError(
            "--executor" if options.runner else ("--commit" if options.commit else "--part"),
            "an hf:// output is uploaded and committed by one process",
            "write to a folder or s3:// with parts, or run without --part and --executor ray",
        )
    parts = options.part is not None or options.commit
    return claim_store(
        target, [source], force=options.force or parts,
        replace_any=options.replace_any or parts,
        write=not options.dry_run and options.part is None, options=store_options(options),
    )  # fmt: skip
