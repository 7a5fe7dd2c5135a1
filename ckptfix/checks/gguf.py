"""Findings about GGUF files beyond one file's header: llama.cpp split sets whose parts do
not make one model (a part missing, `split.*` keys disagreeing with the files or with each
other, a tensor in two parts, a renamed part), and, with `--scan-values`, tensors whose
bytes are all zero (a preallocated download that never finished)."""

from __future__ import annotations

import itertools
import os
from collections.abc import Sequence

from ckptfix.checks.folder import duplicate_name_findings
from ckptfix.core.checkpoint import Checkpoint, FileRecord
from ckptfix.core.findings import Finding, finding, name_list
from ckptfix.core.tensor import TensorInfo
from ckptfix.formats.gguf_file import PROBE, GgufFile
from ckptfix.io.gather import Sources, tensor_chunks
from ckptfix.layouts.gguf import SPLIT_KIND, part_name, split_part
from ckptfix.layouts.names import GGUF

_AGAIN = "download the set again, every part from one upload"


def _split_finding(where: str, what: str, fix: str = _AGAIN) -> Finding:
    return finding("split-set", f"{what} ({fix})", file=where)


def split_findings(checkpoint: Checkpoint) -> list[Finding]:
    """Every split set of the checkpoint (a set named by its first part, or the sets of a
    folder) checked against its files, and single files that carry split keys."""
    if checkpoint.kind == SPLIT_KIND:
        family = checkpoint.layout.families[0]
        root = os.path.dirname(checkpoint.path)
        found = _set_findings(checkpoint, root, family.stem, family.files)
        return found + duplicate_name_findings(
            record.read for record in checkpoint.files if record.read is not None
        )
    if checkpoint.kind == "gguf":
        return _renamed_part(checkpoint.files[0])
    if checkpoint.kind != "folder" or checkpoint.layout is None:
        return []
    found = []
    for family in checkpoint.layout.families:
        if family.ext != GGUF:
            continue
        if family.stem == "loose":
            for name in family.files:
                record = checkpoint.record(os.path.join(checkpoint.path, name))
                found += _renamed_part(record) if record is not None else []
        else:
            found += _set_findings(checkpoint, checkpoint.path, family.stem, family.files)
    return found


def _renamed_part(record: FileRecord) -> list[Finding]:
    """A file with split keys that is not named as a part: llama.cpp refuses to load it."""
    read = record.read
    if not isinstance(read, GgufFile) or read.split is None or read.split.count < 2:
        return []
    return [
        _split_finding(
            record.label,
            f"file carries split.no {read.split.number} of split.count {read.split.count} "
            "but is not named as a part of a split set, so llama.cpp cannot find the other parts",
            "give the parts their names, NAME-00001-of-"
            f"{read.split.count:05d}.gguf, ..., or merge them with `ckptfix reshard`",
        )
    ]


def _set_findings(
    checkpoint: Checkpoint, root: str, stem: str, names: Sequence[str]
) -> list[Finding]:
    parts = {name: split_part(name) for name in names}
    counts = sorted({named[2] for named in parts.values() if named is not None})
    first = os.path.join(root, names[0])
    if len(counts) > 1:
        shown = ", ".join(f"of-{count:05d}" for count in counts)
        return [_split_finding(first, f"the parts' names disagree on the count ({shown})")]
    count = counts[0]
    found = _missing_parts(root, stem, count, {named[1] for named in parts.values() if named})
    reads: list[GgufFile] = []
    for name, named in parts.items():
        record = checkpoint.record(os.path.join(root, name))
        if named is not None and record is not None and isinstance(record.read, GgufFile):
            found += _part_keys(record.read, named[1], count)
            reads.append(record.read)
    if not found and len(reads) == count:
        found += _tensor_total(reads)
    return found


def _missing_parts(root: str, stem: str, count: int, present: set[int]) -> list[Finding]:
    """Part numbers 1..count that are absent (the count comes from a name: never listed
    whole), or outside that range."""
    absent = count - len({part for part in present if 1 <= part <= count})
    outside = sorted(part for part in present if not 1 <= part <= count)
    found = []
    if absent:
        missing = list(itertools.islice((p for p in range(1, count + 1) if p not in present), 3))
        shown = ", ".join(part_name(stem, number, count) for number in missing)
        more = f" and {absent - len(missing)} more" if absent > len(missing) else ""
        found.append(
            _split_finding(
                os.path.join(root, part_name(stem, 1, count)),
                f"split set is missing {absent} of its {count} parts: {shown}{more}",
                "download the missing part(s)",
            )
        )
    if outside:
        found.append(
            _split_finding(
                os.path.join(root, part_name(stem, 1, count)),
                f"part number(s) {', '.join(map(str, outside[:5]))} are outside 1..{count}",
            )
        )
    return found


def _part_keys(read: GgufFile, number: int, count: int) -> list[Finding]:
    """A part's split.no and split.count against its name."""
    split = read.split
    if split is None:
        what = "has no split.count key (or it is 0), so llama.cpp loads it alone"
        return [_split_finding(read.label, f"file is named as part {number} of {count} but {what}")]
    problems = []
    if split.count != count:
        problems.append(f"split.count is {split.count}")
    if split.number != number - 1:
        problems.append(f"split.no is {split.number} (expected {number - 1}: it counts from 0)")
    if not problems:
        return []
    return [
        _split_finding(
            read.label, f"file is named as part {number} of {count} but {'; '.join(problems)}"
        )
    ]


def _tensor_total(reads: Sequence[GgufFile]) -> list[Finding]:
    """split.tensors.count (llama.cpp checks it against the tensors it found) of each part."""
    total = sum(len(read.tensors) for read in reads)
    wrong = [read for read in reads if read.split is not None and read.split.tensors != total]
    if not wrong:
        return []
    claimed = wrong[0].split.tensors if wrong[0].split is not None else 0
    return [
        _split_finding(
            wrong[0].label,
            f"split.tensors.count is {claimed} but the {len(reads)} parts hold {total} tensors "
            f"({len(wrong)} part(s) disagree)",
        )
    ]


def _all_zero(sources: Sources, tensor: TensorInfo) -> bool:
    return all(not chunk.strip(b"\0") for chunk in tensor_chunks(sources, tensor))


def zero_findings(checkpoint: Checkpoint, found: list[Finding]) -> list[Finding]:
    """With --scan-values: every tensor of a GGUF file read; those of at least PROBE bytes
    that are all zero are reported (this replaces the tail probe's finding)."""
    gguf = [record.read for record in checkpoint.files if isinstance(record.read, GgufFile)]
    if not gguf:
        return found
    labels = {read.label for read in gguf}
    kept = [item for item in found if item.code != "zero-filled" or item.file not in labels]
    for read in gguf:
        zero = [t for t in read.tensors if t.nbytes >= PROBE and _all_zero(checkpoint.source, t)]
        if zero:
            kept.append(
                finding(
                    "zero-filled",
                    f"{len(zero)} tensor(s) such as {name_list([t.name for t in zero], 2)} "
                    f"({sum(t.nbytes for t in zero)} bytes) hold only zero bytes: parts of the "
                    "file were never written, as in a preallocated download that never "
                    "finished (re-download it)",
                    file=read.label,
                    tensors=[t.name for t in zero],
                )
            )
    return kept
