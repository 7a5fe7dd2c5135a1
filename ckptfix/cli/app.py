"""`ckptfix` command line. Exceptions become exit codes here and nowhere else."""

from __future__ import annotations

import contextlib
import os
import sys
from collections.abc import Callable, Iterator
from functools import partial
from typing import TYPE_CHECKING, Annotated

import typer

import ckptfix
from ckptfix.cli.executor import (
    CommitOption,
    CpusPerTaskOption,
    Executor,
    ExecutorOption,
    PartOption,
    inspect_reports,
    split_run,
    with_executor,
)
from ckptfix.cli.exits import Group, error_line
from ckptfix.cli.help import PlainUsage
from ckptfix.cli.options import (
    AllowExpansionOption,
    CloneOption,
    DequantizeOption,
    DryRunOption,
    DtypeChoice,
    DtypeOption,
    ExcludeOption,
    FailOn,
    ForceOption,
    FormatOption,
    HfPrOption,
    JsonOption,
    KeepOption,
    KeyOption,
    ManifestOption,
    MaxShardOption,
    NoVerifyOption,
    OutOption,
    OutputFormat,
    ReplaceAnyOption,
    ReportFormat,
    ResumeOption,
    SrcArgument,
    StripPrefixOption,
    ToHfOption,
    ToOption,
    UploadConcurrencyOption,
    VerifyReadbackOption,
    ZeroWeights,
    ZeroWeightsOption,
    input_path,
    uploads,
)
from ckptfix.core.sizes import DEFAULT_MAX_SHARD_TEXT, parse_size

if TYPE_CHECKING:
    from ckptfix.executors.ray_cluster import Cluster
    from ckptfix.ops.report import Report
    from ckptfix.ops.rewrite import RewriteResult


app = typer.Typer(
    cls=Group,
    add_completion=False,
    no_args_is_help=True,
    pretty_exceptions_enable=False,
    rich_markup_mode=None,
    help="Find and fix what is wrong with model checkpoints.",
)
command = partial(app.command, cls=PlainUsage)


def _version(value: bool) -> None:
    if value:
        sys.stdout.write(f"ckptfix {ckptfix.__version__}\n")
        raise typer.Exit()


@app.callback()
def _root(
    version: Annotated[
        bool,
        typer.Option("--version", callback=_version, is_eager=True, help="Print the version."),
    ] = False,
) -> None:
    """Find and fix what is wrong with model checkpoints."""


@command()
def inspect(
    paths: Annotated[
        list[str],  # not Path: it would fold the // of a URL
        typer.Argument(
            metavar="PATH...",
            help="Checkpoint files or model folders, local or URLs (one or more).",
        ),
    ],
    json_output: Annotated[bool, typer.Option("--json", help="Short for --format json.")] = False,
    output_format: FormatOption = None,
    tensors: Annotated[bool, typer.Option("--tensors", help="List every tensor.")] = False,
    max_shard: MaxShardOption = DEFAULT_MAX_SHARD_TEXT,
    hash_values: Annotated[
        bool, typer.Option("--hash", help="Hash tensor bytes to find duplicate content.")
    ] = False,
    scan_values: Annotated[
        bool, typer.Option("--scan-values", help="Read tensor values to find NaN and Inf.")
    ] = False,
    fail_on: Annotated[
        FailOn,
        typer.Option("--fail-on", help="Exit 1 on findings at or above this severity."),
    ] = FailOn.error,
    manifest: ManifestOption = None,
    zero_weights: ZeroWeightsOption = ZeroWeights.master,
    executor: ExecutorOption = Executor.local,
    cpus_per_task: CpusPerTaskOption = 1.0,
) -> None:
    """Report problems in checkpoints without changing them.

    \b
    Example: ckptfix inspect ./my-model --fail-on warning
    """
    from ckptfix.formats.base import ReadOptions

    chosen = _report_format(json_output, output_format)
    limit = parse_size(max_shard)
    # Every PATH is read before anything is printed: a missing one is a usage error (exit 2)
    # with nothing on stdout.
    options = {
        "max_shard": limit,
        "hash_values": hash_values,
        "scan_values": scan_values,
        "manifest": manifest,
        "read": ReadOptions(zero_weights=zero_weights.value),
    }
    reports = inspect_reports([input_path(p) for p in paths], options, executor, cpus_per_task)
    _print_reports(reports, chosen, show_tensors=tensors, fail_on=fail_on.value)
    for report in reports:
        for line in report.error_lines():
            error_line(line)
    raise typer.Exit(max(report.exit_code(fail_on.value) for report in reports))


def _report_format(json_output: bool, output_format: ReportFormat | None) -> ReportFormat:
    if json_output and output_format is not None and output_format is not ReportFormat.json:
        raise typer.BadParameter(
            f"--json is short for --format json; it cannot be combined with "
            f"--format {output_format.value}",
            param_hint="'--json'",
        )
    if json_output:
        return ReportFormat.json
    return output_format or ReportFormat.text


def _print_reports(
    reports: list[Report], chosen: ReportFormat, *, show_tensors: bool, fail_on: str
) -> None:
    if chosen is ReportFormat.json and len(reports) == 1:
        _write_chunks(reports[0].json_chunks())
    elif chosen is ReportFormat.json:
        from ckptfix.reports.documents import json_list_chunks

        _write_chunks(json_list_chunks(reports))
    elif chosen is ReportFormat.text:
        from ckptfix.cli import render  # rich loads only for human output

        if len(reports) == 1:
            render.report(reports[0], show_tensors=show_tensors, fail_on=fail_on)
        else:
            render.reports(reports, show_tensors=show_tensors, fail_on=fail_on)
    else:
        from ckptfix.reports import render as render_for_ci
        from ckptfix.reports.locations import workspace_root

        root = workspace_root(os.environ, os.getcwd())
        data = render_for_ci(chosen.value, reports, root=root, fail_on=fail_on)
        sys.stdout.flush()
        sys.stdout.buffer.write(data)
        sys.stdout.buffer.flush()


@command()
def reshard(
    src: Annotated[
        str,
        typer.Argument(
            metavar="SRC", help="safetensors or GGUF file, model folder or split set, or a URL."
        ),
    ],
    out: OutOption = None,
    max_shard: MaxShardOption = DEFAULT_MAX_SHARD_TEXT,
    dry_run: DryRunOption = False,
    json_output: JsonOption = False,
    force: ForceOption = False,
    replace_any: ReplaceAnyOption = False,
    in_place: Annotated[
        bool, typer.Option("--in-place", help="Rewrite SRC itself, swapping it atomically.")
    ] = False,
    upload_concurrency: UploadConcurrencyOption = 8,
    verify_readback: VerifyReadbackOption = False,
    resume: ResumeOption = False,
    hf_pr: HfPrOption = False,
    executor: ExecutorOption = Executor.local,
    cpus_per_task: CpusPerTaskOption = 1.0,
    part: PartOption = None,
    commit: CommitOption = False,
) -> None:
    """Rewrite a checkpoint into verified shards of at most --max-shard bytes.

    \b
    Example: ckptfix reshard ./my-model -o ./my-model-2gb --max-shard 2GB
    """
    from ckptfix.ops.rewrite import reshard as run_reshard
    from ckptfix.ops.rewrite_options import ReshardOptions

    limit = parse_size(max_shard)
    show_progress = not json_output and not dry_run and sys.stderr.isatty()
    with (
        split_run(executor, cpus_per_task, part, commit) as (split, cluster),
        _progress(show_progress) as advance,
    ):
        upload = uploads(upload_concurrency, verify_readback, resume, hf_pr)
        options = ReshardOptions(
            limit,
            dry_run,
            force,
            replace_any,
            advance,
            in_place=in_place,
            **upload,
            **split,
        )
        result = run_reshard(input_path(src), out, options)
    _show(result, json_output, cluster)


@command()
def convert(
    src: SrcArgument,
    out: OutOption = None,
    to: ToOption = OutputFormat.safetensors,
    dtype: DtypeOption = DtypeChoice.keep,
    key: KeyOption = "auto",
    strip_prefix: StripPrefixOption = None,
    exclude: ExcludeOption = None,
    keep: KeepOption = "first",
    clone: CloneOption = False,
    max_shard: MaxShardOption = DEFAULT_MAX_SHARD_TEXT,
    no_verify: NoVerifyOption = False,
    dry_run: DryRunOption = False,
    json_output: JsonOption = False,
    force: ForceOption = False,
    replace_any: ReplaceAnyOption = False,
    zero_weights: ZeroWeightsOption = ZeroWeights.master,
    allow_expansion: AllowExpansionOption = False,
    dequantize: DequantizeOption = None,
    to_hf: ToHfOption = None,
    upload_concurrency: UploadConcurrencyOption = 8,
    verify_readback: VerifyReadbackOption = False,
    resume: ResumeOption = False,
    hf_pr: HfPrOption = False,
    executor: ExecutorOption = Executor.local,
    cpus_per_task: CpusPerTaskOption = 1.0,
    part: PartOption = None,
    commit: CommitOption = False,
) -> None:
    """Convert a PyTorch, safetensors, GGUF, DCP, DeepSpeed or Megatron checkpoint into verified safetensors (or torch) shards.

    \b
    Example: ckptfix convert pytorch_model.bin -o ./model --dtype bf16 --strip-prefix auto
    """
    from ckptfix.ops.rewrite import convert as run_convert
    from ckptfix.ops.rewrite_options import ConvertOptions

    shown = not json_output and not dry_run and sys.stderr.isatty()
    with (
        split_run(executor, cpus_per_task, part, commit) as (split, cluster),
        _progress(shown) as advance,
    ):
        options = ConvertOptions(
            parse_size(max_shard), dry_run, force, replace_any, advance,
            to=to.value, dtype=dtype.value, key=key,
            strip_prefix=strip_prefix,
            exclude=tuple(exclude or ()),
            keep=keep,
            clone=clone,
            verify=not no_verify,
            zero_weights=zero_weights.value,
            allow_expansion=allow_expansion,
            dequantize=dequantize.value if dequantize is not None else None,
            to_hf=to_hf,
            **uploads(upload_concurrency, verify_readback, resume, hf_pr),
            **split,
        )  # fmt: skip
        result = run_convert(input_path(src), out, options)
    _show(result, json_output, cluster)


@command()
def dedupe(
    src: SrcArgument,
    out: OutOption = None,
    by_content: Annotated[
        bool, typer.Option("--by-content", help="Also merge separately stored equal tensors.")
    ] = False,
    clone: CloneOption = False,
    keep: KeepOption = "first",
    max_shard: MaxShardOption = DEFAULT_MAX_SHARD_TEXT,
    dry_run: DryRunOption = False,
    json_output: JsonOption = False,
    force: ForceOption = False,
    replace_any: ReplaceAnyOption = False,
    allow_expansion: AllowExpansionOption = False,
    upload_concurrency: UploadConcurrencyOption = 8,
    verify_readback: VerifyReadbackOption = False,
    resume: ResumeOption = False,
    hf_pr: HfPrOption = False,
    executor: ExecutorOption = Executor.local,
    cpus_per_task: CpusPerTaskOption = 1.0,
    part: PartOption = None,
    commit: CommitOption = False,
) -> None:
    """Write shared (and, with --by-content, identical) tensors once, as safetensors.

    \b
    Example: ckptfix dedupe ./model -o ./model-dedup --by-content
    """
    from ckptfix.ops.rewrite import dedupe as run_dedupe
    from ckptfix.ops.rewrite_options import DedupeOptions

    limit = parse_size(max_shard)
    with (
        split_run(executor, cpus_per_task, part, commit) as (split, cluster),
        _progress(not json_output and not dry_run and sys.stderr.isatty()) as advance,
    ):
        options = DedupeOptions(
            limit,
            dry_run,
            force,
            replace_any,
            advance,
            by_content=by_content,
            clone=clone,
            keep=keep,
            allow_expansion=allow_expansion,
            **uploads(upload_concurrency, verify_readback, resume, hf_pr),
            **split,
        )
        result = run_dedupe(input_path(src), out, options)
    _show(result, json_output, cluster)


def _show(result: RewriteResult, json_output: bool, cluster: Cluster | None = None) -> None:
    if json_output:
        _write_json(with_executor(result.to_dict(), cluster))
    else:
        from ckptfix.cli import render

        render.rewrite(result)


@contextlib.contextmanager
def _progress(
    enabled: bool, description: str = "writing"
) -> Iterator[Callable[[int, int], None] | None]:
    """A rich progress bar (bytes, rate, ETA) on stderr, or nothing when not interactive."""
    if not enabled:
        yield None
        return
    from ckptfix.cli import render

    with render.byte_progress(description) as advance:
        yield advance


def _write_json(document: object) -> None:
    # orjson (in json_bytes): a 100,000-tensor report encodes in 0.03 s instead of 0.3 s
    # with json.
    from ckptfix.core.text import json_bytes

    sys.stdout.flush()
    sys.stdout.buffer.write(json_bytes(document) + b"\n")
    sys.stdout.buffer.flush()


def _write_chunks(chunks: Iterator[bytes]) -> None:
    sys.stdout.flush()
    for chunk in chunks:
        sys.stdout.buffer.write(chunk)
    sys.stdout.buffer.write(b"\n")
    sys.stdout.buffer.flush()


def for_arguments(arguments: list[str]) -> typer.Typer:
    """`app` with only the command that `arguments` name, when they start with one: Typer
    builds every registered command's parameters before it parses (14 of a GGUF inspect's
    170 ms, measured), and a run needs one. Anything else (no command, an option first, a
    name that is no command) gets the whole app, for its help and its suggestions."""
    from copy import copy

    from typer.main import get_command_name

    if not arguments:
        return app
    named = [
        info
        for info in app.registered_commands
        if get_command_name(str(info.name or getattr(info.callback, "__name__", "")))
        == arguments[0]
    ]
    if len(named) != 1:
        return app
    narrowed = copy(app)
    narrowed.registered_commands = named
    return narrowed


def main() -> None:
    """Console-script entry point (kept for callers of `ckptfix.cli.app:main`)."""
    from ckptfix.cli.entry import main as run

    run()


# Commands defined in their own modules register on `app` when imported.
from ckptfix.cli import app_fix, app_hash  # noqa: E402, F401
