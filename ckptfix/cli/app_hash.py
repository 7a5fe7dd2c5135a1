"""`ckptfix hash` and `ckptfix diff` (registered on the app by ckptfix.cli.app)."""

from __future__ import annotations

import os
import sys
from enum import Enum
from typing import Annotated

import typer

from ckptfix.cli.app import ToHfOption, _progress, _write_json, command
from ckptfix.cli.options import LOCAL_PATH, JsonOption, input_path

NoAliasRecordOption = Annotated[
    bool,
    typer.Option(
        "--no-alias-record",
        help="Leave out the names the ckptfix.dropped record maps to a kept tensor.",
    ),
]


@command("hash")
def hash_command(
    path: Annotated[
        str, typer.Argument(metavar="PATH", help="Checkpoint file or model folder, or a URL.")
    ],
    json_output: JsonOption = False,
    tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor's digest.")] = False,
    manifest: Annotated[
        str | None,
        typer.Option(
            "--manifest",
            **{**LOCAL_PATH, "metavar": "OUT.json"},
            help="Also write the --json document to this file.",
        ),
    ] = None,
    no_alias_record: NoAliasRecordOption = False,
) -> None:
    """Fingerprint a checkpoint: a SHA-256 digest per tensor and one for the model, the same
    whatever the format, sharding, tensor order or metadata.

    \b
    Example: ckptfix hash ./my-model --manifest my-model.manifest.json
    """
    from ckptfix.ops.hash import HashOptions, hash_checkpoint

    replaced = False
    if manifest is not None:
        from ckptfix.ops.manifest import check_manifest_out

        check_manifest_out(manifest, input_path(path))  # before hashing, not after
    with _progress(not json_output and sys.stderr.isatty(), "hashing") as advance:
        options = HashOptions(alias_record=not no_alias_record, progress=advance)
        result = hash_checkpoint(input_path(path), options)
    if manifest is not None:
        from ckptfix.ops.manifest import write_manifest

        replaced = write_manifest(result.to_dict(), manifest, input_path(path))
    if json_output:
        document = result.to_dict()
        if manifest is not None:  # what the write did, beside the manifest's own content
            document["manifest"] = {"path": os.fspath(manifest), "replaced": replaced}
        if result.remote is not None:
            document["remote"] = result.remote
        if result.weights_note is not None:
            document["weights_note"] = result.weights_note
        _write_json(document)
    else:
        from ckptfix.cli import render_hash

        render_hash.hash_result(result, show_tensors=tensors, manifest=manifest, replaced=replaced)


class DiffFailOn(str, Enum):
    any = "any"
    layout = "layout"
    names = "names"
    never = "never"


@command()
def diff(
    a: Annotated[
        str, typer.Argument(metavar="A", help="Checkpoint file or model folder, or a URL.")
    ],
    b: Annotated[
        str, typer.Argument(metavar="B", help="Checkpoint file or model folder, or a URL.")
    ],
    json_output: JsonOption = False,
    values: Annotated[
        bool,
        typer.Option("--values", help="Count differing elements and their largest differences."),
    ] = False,
    strip_prefix: Annotated[
        str | None,
        typer.Option(
            "--strip-prefix", metavar="auto|PREFIX", help="Compare names without a wrapper prefix."
        ),
    ] = None,
    fail_on: Annotated[
        DiffFailOn,
        typer.Option(
            "--fail-on",
            help="Exit 1 on: any difference, layout (names, dtypes, shapes), names, or never.",
        ),
    ] = DiffFailOn.any,
    no_alias_record: NoAliasRecordOption = False,
    to_hf: ToHfOption = None,
) -> None:
    """Compare two checkpoints tensor by tensor, whatever their formats and sharding.

    \b
    Example: ckptfix diff pytorch_model.bin ./converted-model
    """
    from ckptfix.ops.diff import DiffOptions
    from ckptfix.ops.diff import diff as run_diff

    with _progress(not json_output and sys.stderr.isatty(), "comparing") as advance:
        options = DiffOptions(
            values=values,
            strip_prefix=strip_prefix,
            alias_record=not no_alias_record,
            progress=advance,
            to_hf=to_hf,
        )
        result = run_diff(input_path(a), input_path(b), options)
    if json_output:
        _write_json(result.to_dict())
    else:
        from ckptfix.cli import render_hash

        render_hash.diff_result(result, fail_on=fail_on.value)
    raise typer.Exit(result.exit_code(fail_on.value))
