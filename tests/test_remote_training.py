"""A torch.distributed.checkpoint folder read over HTTP: `.metadata` and the chunk headers
by ranged requests, the same report and the same converted model as from the local copy."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from tests import training_fixtures as fixtures
from tests.helpers import cli, tree_digests
from tests.optional import needs
from tests.remote_servers import copy_tree, http_server

pytestmark = [needs("aiohttp"), pytest.mark.slow]
dcp_saved = fixtures.dcp_saved


def test_a_dcp_folder_over_http(dcp_saved: Path, tmp_path: Path) -> None:
    served = copy_tree(dcp_saved, tmp_path / "served" / "step-100")
    with http_server(tmp_path / "served") as server:
        url = f"{server.url}/step-100"
        want = cli("inspect", served, "--json")
        got = cli("inspect", url, "--json")
        assert got.code == want.code == 0, got.stderr
        document = got.json()
        remote = document.pop("remote")
        text = json.dumps(document).replace(url, str(served))
        assert json.loads(text) == want.json()
        assert remote["bytes_fetched"] < 1_000_000
        local = cli("convert", served, "-o", tmp_path / "local")
        remote_run = cli("convert", url, "-o", tmp_path / "remote")
        assert local.code == remote_run.code == 0, remote_run.stderr
        assert tree_digests(tmp_path / "remote") == tree_digests(tmp_path / "local")
