"""What a write to an object store says after the summary line: bytes and requests sent,
what --resume kept, what was deleted and when, the uploads found under the prefix."""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text

from ckptfix.cli.render import text
from ckptfix.core.sizes import format_size
from ckptfix.write.results import UploadReport, WriteResult


def _some(names: Sequence[str], base: str) -> str:
    names = [name.removeprefix(base.rstrip("/") + "/") for name in names]
    return (
        ", ".join(names) if len(names) <= 3 else f"{', '.join(names[:2])} and {len(names) - 2} more"
    )


def upload_notes(written: WriteResult, upload: UploadReport) -> list[Text]:
    how = "checksums as the store reports them" + (", and read back" if upload.read_back else "")
    lines = [
        text(f"verified: every object by its SHA-256 ({how})"),
        text(
            f"sent: {upload.bytes_sent:,} bytes ({format_size(upload.bytes_sent)}) in "
            f"{upload.requests:,} requests"
        ),
    ]
    if upload.kept:
        lines.append(
            text(
                f"resumed: {len(upload.kept)} object(s) already there kept, {upload.bytes_kept:,} "
                f"bytes ({format_size(upload.bytes_kept)}) not sent again"
            )
        )
    if upload.removed_first:
        removed = _some(upload.removed_first, written.path)
        lines.append(text(f"deleted before its shards were replaced: {removed}", style="yellow"))
    later = [name for name in written.replaced if name not in upload.removed_first]
    if later:
        removed = _some(later, written.path)
        lines.append(text(f"deleted after the new index was published: {removed}", style="yellow"))
    if upload.aborted:
        lines.append(text(f"aborted a killed run's uploads: {_some(upload.aborted, '')}"))
    if upload.left:
        lines.append(
            text(
                f"left alone: uploads under the prefix no ckptfix run recorded: "
                f"{_some(upload.left, '')}",
                style="yellow",
            )
        )
    return lines
