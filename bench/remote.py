"""`python bench/bench.py --only remote`: inspect over S3 and HTTP, on servers started here
on 127.0.0.1 (moto's S3 server; the tests' Range server and Hub, tests/remote_servers.py).

- wall time of `inspect --json` of a folder over S3 against the same folder on local disk
  (target: at most 2× the local time plus 50 ms);
- requests and bytes: ckptfix's own count (the JSON's remote object) and what the server
  sent, beside huggingface_hub's `get_safetensors_metadata` on the same Hub.
"""

from __future__ import annotations

import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.remote_servers import (  # noqa: E402
    REPO,
    S3_ENV,
    hub_server,
    moto_server,
    upload_tree,
)

CKPTFIX = [sys.executable, "-m", "ckptfix"]
QUIET = {"AWS_EC2_METADATA_DISABLED": "true", "HF_HUB_DISABLE_TELEMETRY": "1"}


def _env() -> dict[str, str]:
    """The environment of the measured processes: bytecode is written and read as in an
    installed copy (a PYTHONDONTWRITEBYTECODE=1 around the bench would have every run compile
    ckptfix's modules from source)."""
    env = {**os.environ, **QUIET}
    env.pop("PYTHONDONTWRITEBYTECODE", None)
    return env


def _run(command: list[str], env: dict[str, str]) -> tuple[float, dict[str, int]]:
    """Wall time of one fresh process, and its JSON's remote object."""
    start = time.perf_counter()
    done = subprocess.run(command, capture_output=True, env=env, check=False)
    seconds = time.perf_counter() - start
    if done.returncode not in (0, 1):
        raise SystemExit(f"{' '.join(command)} failed: {done.stderr.decode()[-400:]}")
    return seconds, json.loads(done.stdout).get("remote", {})


def _paired(
    local: list[str], remote: list[str], env: dict[str, str], repeat: int
) -> tuple[list[float], list[float], dict[str, int]]:
    """`repeat` wall times of each command, local and remote runs taking turns (so a change
    in the machine's load touches both), after one warm-up run of each (page cache, .pyc)."""
    _run(local, env), _run(remote, env)
    local_walls, remote_walls, counts = [], [], {}
    for _ in range(repeat):
        local_walls.append(_run(local, env)[0])
        seconds, counts = _run(remote, env)
        remote_walls.append(seconds)
    return local_walls, remote_walls, counts


@contextlib.contextmanager
def _s3(folders: dict[str, Path]) -> Iterator[dict[str, str]]:
    import boto3

    with moto_server() as endpoint:
        env = {**_env(), **S3_ENV, "AWS_ENDPOINT_URL": endpoint}
        client = boto3.client(
            "s3",
            endpoint_url=endpoint,
            region_name="us-east-1",
            aws_access_key_id="testing",
            aws_secret_access_key="testing",
        )
        client.create_bucket(Bucket="bench")
        for name, folder in folders.items():
            upload_tree(client, "bench", folder, name)
        yield env


def bench_s3(folders: dict[str, Path], repeat: int) -> list[str]:
    rows = [
        "| inspect --json | local disk (min / median) | S3, moto on 127.0.0.1 (min / median) "
        "| target: 2× local min + 50 ms | requests | bytes fetched | |",
        "|---|---|---|---|---|---|---|",
    ]
    with _s3(folders) as env:
        for name, folder in folders.items():
            local, remote, counts = _paired(
                [*CKPTFIX, "inspect", str(folder), "--json"],
                [*CKPTFIX, "inspect", f"s3://bench/{name}", "--json"],
                env,
                repeat,
            )
            target = 2 * min(local) + 0.05
            rows.append(
                f"| {name} | {min(local):.3f} / {statistics.median(local):.3f} s "
                f"| {min(remote):.3f} / {statistics.median(remote):.3f} s | {target:.3f} s "
                f"| {counts.get('requests')} | {counts.get('bytes_fetched', 0):,} "
                f"| {'met' if min(remote) <= target else 'MISSED'} |"
            )
    return rows


HF_METADATA = """
import json, sys
from huggingface_hub import constants
constants.ENDPOINT = sys.argv[1]
from huggingface_hub import HfApi
meta = HfApi(endpoint=sys.argv[1]).get_safetensors_metadata(sys.argv[2])
print(json.dumps({"files": len(meta.files_metadata)}))
"""


def bench_hub(folder: Path, repeat: int) -> list[str]:
    """Bytes and requests the Hub server saw: ckptfix inspect hf:// vs get_safetensors_metadata."""
    rows = [
        "| on the same Hub (127.0.0.1) | wall (median) | requests seen by the server | "
        "body bytes sent by the server |",
        "|---|---|---|---|",
    ]
    with hub_server(folder) as server:
        env = {**_env(), "HF_ENDPOINT": server.url}  # HF_HOME: per run, below
        env.pop("HF_TOKEN", None)
        jobs = {
            "`ckptfix inspect hf://… --json`": [*CKPTFIX, "inspect", f"hf://{REPO}", "--json"],
            "`HfApi.get_safetensors_metadata`": [
                sys.executable,
                "-c",
                HF_METADATA,
                server.url,
                REPO,
            ],
        }
        for label, command in jobs.items():
            walls, seen = [], []
            for _ in range(repeat):
                server.behaviour.reset()
                start = time.perf_counter()
                with tempfile.TemporaryDirectory() as home:  # no Hub cache kept between runs
                    run_env = {**env, "HF_HOME": home}
                    done = subprocess.run(command, capture_output=True, env=run_env, check=False)
                walls.append(time.perf_counter() - start)
                if done.returncode != 0:
                    raise SystemExit(f"{label} failed: {done.stderr.decode()[-600:]}")
                seen.append((server.behaviour.requests, server.behaviour.bytes_sent))
            requests, sent = seen[-1]
            rows.append(f"| {label} | {statistics.median(walls):.3f} s | {requests} | {sent:,} |")
    return rows


def fifty_shards(cache: Path) -> Path:
    """50 shards of 4 MiB (8 bf16 tensors each): a sharded model's headers, small enough for
    moto to hold in memory."""
    from bench import write_folder  # type: ignore[import-not-found]

    folder = cache / "fifty-4mib-shards"
    if not folder.exists():
        print(f"building {folder} ...", flush=True)
        shards = [[(f"layers.{s}.w{t}", (512, 512)) for t in range(8)] for s in range(50)]
        write_folder(folder, shards)
    return folder


def bench_remote(many: Path, cache: Path, repeat: int) -> list[str]:
    folders = {"fifty-4mib-shards": fifty_shards(cache), "many-50x2000": many}
    return [
        f"\nremote: {', '.join(folders)}; {repeat} runs of each command, each a fresh process "
        "(local and S3 runs taking turns, after a warm-up run of each)\n",
        *bench_s3(folders, repeat),
        "",
        *bench_hub(folders["fifty-4mib-shards"], repeat),
        "",
        *bench_hub(folders["many-50x2000"], repeat),
    ]
