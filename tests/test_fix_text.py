"""A finding's `fix` is made where a report is shown (inspect, JSON, the table, the CI
formats), not where findings are made: a rewrite or a hash that shows no report never plans
the repair that text comes from (issue 23)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import pytest

import ckptfix
from ckptfix.core.findings import Finding
from ckptfix.core.fixes import Annotated
from ckptfix.ops.hash import hash_checkpoint
from ckptfix.ops.rewrite_options import ReshardOptions
from ckptfix.plan import repair_verdicts
from tests.builders import Factory, Spec

SHARDS = 4


def _unformatted(factory: Factory) -> Path:
    """A sharded folder whose shards lack "format" metadata: a warning each, which fix
    repairs (so each finding's fix names `ckptfix fix`)."""
    shards = [[Spec(f"layer{i}.weight", "F32", (4,))] for i in range(SHARDS)]
    folder = factory.sharded("m", shards)
    for number, specs in enumerate(shards, start=1):
        name = f"m/model-{number:05d}-of-{SHARDS:05d}.safetensors"
        factory.safetensors(name, specs, with_format=False)
    return folder


@pytest.fixture
def plans(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """Counts the repair plans made for a finding's fix (one entry per plan)."""
    made: list[int] = []
    real = repair_verdicts.annotate

    def counted(checkpoint: Any, findings: Sequence[Finding], max_shard: int) -> Annotated:
        made.append(len(findings))
        return real(checkpoint, findings, max_shard)

    monkeypatch.setattr(repair_verdicts, "annotate", counted)
    return made


def _fixes(document: dict[str, Any]) -> list[tuple[object, object]]:
    return [(item["code"], item["fix"]) for item in document["findings"]]  # type: ignore[index]


def test_a_dry_run_reshard_plans_no_repair_until_its_report_is_shown(
    factory: Factory, plans: list[int], tmp_path: Path
) -> None:
    folder = _unformatted(factory)
    result = ckptfix.reshard(folder, tmp_path / "out", ReshardOptions(dry_run=True))
    assert len(result.report.findings) == SHARDS
    assert plans == []
    shown = _fixes(result.report.to_dict())
    assert plans == [SHARDS]
    assert shown == _fixes(ckptfix.inspect(folder).to_dict())
    assert all(str(fix).startswith("ckptfix fix ") for _, fix in shown), shown


def test_a_hash_plans_no_repair(factory: Factory, plans: list[int]) -> None:
    folder = _unformatted(factory)
    assert hash_checkpoint(folder).tensors
    assert plans == []


def test_inspect_and_the_table_show_each_fix(
    factory: Factory, plans: list[int], tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """inspect's report carries its fixes (the library's callers read them); a report made
    without them gets them where the table renders it, planned once."""
    from ckptfix.cli import render

    folder = _unformatted(factory)
    report = ckptfix.inspect(folder)
    assert plans == [SHARDS]
    assert all(item.fix is not None for item in report.findings)
    bare = ckptfix.reshard(folder, tmp_path / "out", ReshardOptions(dry_run=True)).report
    assert all(item.fix is None for item in bare.findings)
    capsys.readouterr()
    render.report(bare, show_tensors=False, fail_on="error")
    assert plans == [SHARDS, SHARDS]
    shown = capsys.readouterr().out
    render.report(report, show_tensors=False, fail_on="error")
    assert shown == capsys.readouterr().out
    assert shown.count("fix: ckptfix fix ") == SHARDS, shown
