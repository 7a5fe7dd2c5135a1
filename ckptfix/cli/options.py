"""The options and arguments the commands share, each defined once (as `Annotated` types a
command's parameters are declared with), with the choices they take, and those of the rewrites
that write to an object store (`-o s3://bucket/prefix`)."""

from __future__ import annotations

from enum import Enum
from pathlib import Path
from typing import Annotated, Any, TypedDict

import typer


def input_path(text: str) -> str:
    """An input as commands take it: a URL as given, a local path as pathlib spells it."""
    from ckptfix.core.errors import UsageError
    from ckptfix.io.urls import is_url, refuse_unknown_scheme

    try:  # before pathlib folds `ftp://host/x` into the folder `ftp:/host/x`
        refuse_unknown_scheme(text)
    except UsageError as exc:
        raise typer.BadParameter(f"{exc.path}: {exc.what}; {exc.fix}") from exc
    return text if is_url(text) else str(Path(text))


# -o and --manifest are parsed as inputs are, not as Path: a Path would fold the // of a URL
# into a relative path (`s3:/bucket/x`), which was then written; the operations refuse URLs.
LOCAL_PATH: dict[str, Any] = {"parser": input_path, "metavar": "OUT"}


class FailOn(str, Enum):
    error = "error"
    warning = "warning"
    info = "info"
    never = "never"


class ZeroWeights(str, Enum):
    master = "master"
    module = "module"
    universal = "universal"


ZeroWeightsOption = Annotated[
    ZeroWeights,
    typer.Option(
        "--zero-weights",
        help="DeepSpeed: fp32 master weights from the optimizer partitions, the "
        "training-dtype module copy (stages 0-2), or a universal checkpoint's fp32 weights.",
    ),
]


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


class ReportFormat(str, Enum):
    text = "text"
    json = "json"
    github = "github"
    gitlab = "gitlab"
    sarif = "sarif"
    junit = "junit"


FormatOption = Annotated[
    ReportFormat | None,
    typer.Option(
        "--format",
        help="text (default), json, github (workflow commands), gitlab (Code Quality), "
        "sarif or junit.",
    ),
]
ManifestOption = Annotated[
    str | None,
    typer.Option(
        "--manifest",
        **{**LOCAL_PATH, "metavar": "M.json"},
        help="Check every tensor against a manifest written by `ckptfix hash --manifest`.",
    ),
]


class OutputFormat(str, Enum):
    safetensors = "safetensors"
    torch = "torch"


class DtypeChoice(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"
    keep = "keep"


class DecodeChoice(str, Enum):
    bf16 = "bf16"
    fp16 = "fp16"
    fp32 = "fp32"


SrcArgument = Annotated[  # str, not Path: a Path would fold the // of a URL
    str, typer.Argument(metavar="SRC", help="Checkpoint file or model folder, or a URL.")
]
DryRunOption = Annotated[bool, typer.Option("--dry-run", help="Print the plan; write nothing.")]
KeepOption = Annotated[
    str,
    typer.Option("--keep", help="Name kept for aliases: first, last, or a regex to prefer."),
]
CloneOption = Annotated[
    bool, typer.Option("--clone", help="Write every alias as its own copy instead.")
]
NoVerifyOption = Annotated[bool, typer.Option("--no-verify", help="Skip reading the output back.")]
AllowExpansionOption = Annotated[
    bool,
    typer.Option(
        "--allow-expansion",
        help="Write expanded (stride-0) tensors over 1,024x what they store and 1 GB in full.",
    ),
]
DequantizeOption = Annotated[
    DecodeChoice | None,
    typer.Option("--dequantize", help="GGUF: decode block-quantized tensors to this dtype."),
]
ToOption = Annotated[OutputFormat, typer.Option("--to", help="Output format.")]
DtypeOption = Annotated[
    DtypeChoice, typer.Option("--dtype", help="Cast floating tensors (others keep theirs).")
]
ToHfOption = Annotated[
    str | None,
    typer.Option(
        "--to-hf",
        metavar="CONFIG",
        help="Megatron: map to the Hugging Face model of this config.json (or folder), or "
        "a model type its training arguments determine.",
    ),
]

KeyOption = Annotated[
    str, typer.Option("--key", help="Where the tensors sit in a training checkpoint, or auto.")
]
NoAliasRecordOption = Annotated[
    bool,
    typer.Option(
        "--no-alias-record",
        help="Leave out the names the ckptfix.dropped record maps to a kept tensor.",
    ),
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
        "match the plan; send the rest (without --force, replace and delete nothing).",
    ),
]
HfPrOption = Annotated[
    bool,
    typer.Option(
        "--hf-pr", help="hf:// OUT: open a pull request instead of committing to the branch."
    ),
]


class Uploads(TypedDict):
    """The rewrite options the object-store options set (ops.rewrite_options.RewriteOptions)."""

    upload_concurrency: int
    verify_readback: bool
    resume: bool
    hf_pr: bool


def uploads(concurrency: int, readback: bool, resume: bool, hf_pr: bool) -> Uploads:
    return Uploads(
        upload_concurrency=concurrency, verify_readback=readback, resume=resume, hf_pr=hf_pr
    )
