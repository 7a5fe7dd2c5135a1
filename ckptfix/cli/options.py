"""Options shared by several commands, and those of the rewrites that write to an object
store (`-o s3://bucket/prefix`)."""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any

import typer


def input_path(text: str) -> str:
    """An input as commands take it: a URL as given, a local path as pathlib spells it."""
    from ckptfix.io.urls import is_url

    return text if is_url(text) else str(Path(text))


# -o and --manifest are parsed as inputs are, not as Path: a Path would fold the // of a URL
# into a relative path (`s3:/bucket/x`), which was then written; the operations refuse URLs.
LOCAL_PATH: dict[str, Any] = {"parser": input_path, "metavar": "OUT"}


JsonOption = Annotated[
    bool, typer.Option("--json", help="Print one JSON document on stdout instead of tables.")
]
MaxShardOption = Annotated[
    str,
    typer.Option(
        "--max-shard",
        metavar="SIZE",
        help="Shard size limit: 5GB (10^9), 5GiB (2^30) or bytes.",
    ),
]


OutOption = Annotated[
    str | None,
    typer.Option(
        "-o", "--out", **LOCAL_PATH, help="Output folder to create, or s3://BUCKET/PREFIX."
    ),
]
ForceOption = Annotated[
    bool,
    typer.Option("--force", help="Replace a non-empty OUT that holds only checkpoint files."),
]
ReplaceAnyOption = Annotated[
    bool,
    typer.Option(
        "--replace-any",
        help="With --force: replace OUT even if it holds files that are not part of a checkpoint.",
    ),
]

KeyOption = Annotated[
    str, typer.Option("--key", help="Where the tensors sit in a training checkpoint, or auto.")
]
StripPrefixOption = Annotated[
    str | None,
    typer.Option("--strip-prefix", metavar="PREFIX|auto", help="Remove a wrapper prefix."),
]
ExcludeOption = Annotated[
    list[str] | None,
    typer.Option("--exclude", metavar="GLOB", help="Leave out matching tensors (repeatable)."),
]
UploadConcurrencyOption = Annotated[
    int,
    typer.Option(
        "--upload-concurrency",
        min=1,
        max=64,
        metavar="N",
        help="Object-store OUT: parts uploaded at once (at most 256 MiB of parts in memory).",
    ),
]
VerifyReadbackOption = Annotated[
    bool,
    typer.Option(
        "--verify-readback",
        help="Object-store OUT: also read every object back and check its checksum again.",
    ),
]
ResumeOption = Annotated[
    bool,
    typer.Option(
        "--resume",
        help="Object-store OUT: keep the objects already there whose size and checksum "
        "match the plan; send the rest.",
    ),
]


def uploads(concurrency: int, readback: bool, resume: bool) -> dict[str, object]:
    """The rewrite options these set (ops.rewrite_options.RewriteOptions)."""
    return {"upload_concurrency": concurrency, "verify_readback": readback, "resume": resume}
