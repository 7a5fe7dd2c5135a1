"""`ckptfix fix` (registered on the app by ckptfix.cli.app)."""

from __future__ import annotations

import sys
from typing import Annotated

import typer

from ckptfix.cli.app import _progress, _write_json, command
from ckptfix.cli.exits import error_line
from ckptfix.cli.options import (
    DryRunOption,
    HfPrOption,
    JsonOption,
    OutOption,
    ResumeOption,
    UploadConcurrencyOption,
    VerifyReadbackOption,
    input_path,
)


@command("fix")
def fix_command(
    path: Annotated[
        str, typer.Argument(metavar="PATH", help="Model folder or safetensors file to repair.")
    ],
    out: OutOption = None,
    in_place: Annotated[
        bool,
        typer.Option(
            "--in-place",
            help="Repair PATH itself, swapping it atomically; what is taken out goes to "
            "PATH/ckptfix-aside/.",
        ),
    ] = False,
    dry_run: DryRunOption = False,
    json_output: JsonOption = False,
    upload_concurrency: UploadConcurrencyOption = 8,
    verify_readback: VerifyReadbackOption = False,
    resume: ResumeOption = False,
    hf_pr: HfPrOption = False,
) -> None:
    """Repair what the shards make recoverable: the index, shard numbering, "format"
    metadata, stale copies and other weight families (taken out, never deleted).

    \b
    Example: ckptfix fix ./my-model --in-place
    """
    from ckptfix.core.errors import RepairRefusedError
    from ckptfix.ops.fix import FixOptions, fix
    from ckptfix.write.stores.base import StoreOptions

    show_progress = not json_output and not dry_run and sys.stderr.isatty()
    with _progress(show_progress) as advance:
        upload = StoreOptions(
            upload_concurrency, verify_readback=verify_readback, resume=resume, hf_pr=hf_pr
        )
        result = fix(input_path(path), out, FixOptions(in_place, dry_run, advance, upload))
    if json_output:
        _write_json(result.to_dict())
    else:
        from ckptfix.cli import render_fix

        render_fix.fix_result(result, in_place=in_place)
    for item in result.plan.refusals:  # --dry-run of a checkpoint fix refuses
        error_line(
            RepairRefusedError(item.file, item.code, item.what, item.fix, rule=item.rule).line()
        )
    raise typer.Exit(result.exit_code)
