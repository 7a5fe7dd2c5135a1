"""`python bench/bench.py --only store`: writing to S3 (moto's server, started here in its own
process on 127.0.0.1) against boto3's transfer manager uploading the same bytes.

- a safetensors folder (llama-2gb-5shards, 2.2 GB) resharded local -> S3 and S3 -> S3, and a
  DCP folder (dcp-llama-2gb) converted local -> S3: ckptfix's wall time against the best of
  boto3's `upload_file` (TransferConfig, 8 MiB parts as ckptfix's, several concurrencies) sending the
  files ckptfix wrote, in a fresh process each (target: at most 1.3x), and ckptfix's peak
  RSS, VmHWM of its own process (target: at most 256 MiB);
- resume: ckptfix killed (SIGKILL) once half the shards are complete, then run again with
  --resume: the share of the bytes it sent again (target: at most 55 %).

moto keeps what it stores in memory (parts above 5 MiB spill to temporary files, but each
completion joins its parts in memory): the outputs are cut into ~250 MB shards and every
object is deleted after each run. `--size half` uses the 0.5 GB inputs instead.
"""

from __future__ import annotations

import json
import os
import signal
import statistics
import subprocess
import tempfile
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from bench import CACHE, PYTHON, llama_tensors, split, write_folder

ROOT = Path(__file__).resolve().parent.parent
S3_ENV = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
    "AWS_EC2_METADATA_DISABLED": "true",
}
SHARDS = {"2gb": "250MB", "half": "60MB"}  # about 9 shards either way
SHARD = SHARDS["2gb"]
MOTO = (
    "import logging, sys, time\n"
    "logging.disable(logging.CRITICAL)\n"
    "from moto.server import ThreadedMotoServer\n"
    "server = ThreadedMotoServer(ip_address='127.0.0.1', port=int(sys.argv[1]), verbose=False)\n"
    "server.start()\n"
    "print('ready', flush=True)\n"
    "time.sleep(86400)\n"
)
MEASURED = (
    "import runpy, sys\n"
    "try:\n"
    "    runpy.run_module('ckptfix', run_name='__main__')\n"
    "finally:\n"
    "    hwm = [l for l in open('/proc/self/status') if l.startswith('VmHWM')][0]\n"
    "    print('peak-rss-kib', hwm.split()[1], file=sys.stderr)\n"
)
BOTO_DOWNLOAD = (
    "import os, sys, boto3\n"
    "from boto3.s3.transfer import TransferConfig\n"
    "bucket, prefix, folder = sys.argv[1:4]\n"
    "os.makedirs(folder, exist_ok=True)\n"
    "config = TransferConfig(multipart_chunksize=8 * 2**20, max_concurrency=8)\n"
    "client = boto3.client('s3')\n"
    "for item in client.list_objects_v2(Bucket=bucket, Prefix=prefix + '/')['Contents']:\n"
    "    name = item['Key'].rsplit('/', 1)[1]\n"
    "    client.download_file(bucket, item['Key'], os.path.join(folder, name), Config=config)\n"
)
BOTO_UPLOAD = (
    "import os, sys, boto3\n"
    "from boto3.s3.transfer import TransferConfig\n"
    "folder, bucket, prefix, concurrency = sys.argv[1:5]\n"
    "config = TransferConfig(multipart_threshold=8 * 2**20, multipart_chunksize=8 * 2**20,\n"
    "                        max_concurrency=int(concurrency))\n"
    "client = boto3.client('s3')\n"
    "for name in sorted(os.listdir(folder)):\n"
    "    client.upload_file(os.path.join(folder, name), bucket, f'{prefix}/{name}', Config=config)\n"
)


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


@contextmanager
def moto() -> Iterator[tuple[dict[str, str], Any]]:
    """moto's server in a process of its own; the environment that reaches it, a client."""
    import boto3

    port = _free_port()
    server = subprocess.Popen([PYTHON, "-c", MOTO, str(port)], stdout=subprocess.PIPE)
    try:
        assert server.stdout is not None and server.stdout.readline().strip() == b"ready"
        time.sleep(0.5)
        endpoint = f"http://127.0.0.1:{port}"
        env = {**os.environ, **S3_ENV, "AWS_ENDPOINT_URL": endpoint, "PYTHONPATH": str(ROOT)}
        env.pop("PYTHONDONTWRITEBYTECODE", None)
        client = boto3.client("s3", endpoint_url=endpoint, **_keys())
        client.create_bucket(Bucket="bench")
        yield env, client
    finally:
        server.kill()
        server.wait()


def _keys() -> dict[str, str]:
    return {
        "region_name": "us-east-1",
        "aws_access_key_id": "testing",
        "aws_secret_access_key": "testing",
    }


def _empty(client: Any, prefix: str) -> None:
    for page in client.get_paginator("list_objects_v2").paginate(Bucket="bench", Prefix=prefix):
        for item in page.get("Contents", []):
            client.delete_object(Bucket="bench", Key=item["Key"])
    for upload in client.list_multipart_uploads(Bucket="bench").get("Uploads", []):
        client.abort_multipart_upload(
            Bucket="bench", Key=upload["Key"], UploadId=upload["UploadId"]
        )


def _ckptfix(args: list[str], env: dict[str, str]) -> tuple[float, int, dict[str, Any]]:
    """Wall seconds, peak RSS (bytes) and the JSON of one ckptfix run in a fresh process."""
    start = time.perf_counter()
    done = subprocess.run([PYTHON, "-c", MEASURED, *args, "--json"], env=env, capture_output=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"ckptfix {' '.join(args)} failed: {done.stderr.decode()[-600:]}")
    peak = int(done.stderr.decode().splitlines()[-1].split()[1]) * 1024
    return wall, peak, json.loads(done.stdout)


def _boto(folder: Path, concurrency: int, env: dict[str, str]) -> float:
    start = time.perf_counter()
    subprocess.run(
        [PYTHON, "-c", BOTO_UPLOAD, str(folder), "bench", "boto", str(concurrency)],
        env=env,
        check=True,
    )
    return time.perf_counter() - start


def inputs(size: str) -> dict[str, Path]:
    """The safetensors folder and the DCP folder (built once, as bench.py builds them)."""
    layers = 22 if size == "2gb" else 3
    folder = CACHE / f"llama-{size}-5shards"
    if not folder.exists():
        print(f"building {folder} ...", flush=True)
        write_folder(folder, split(llama_tensors(layers=layers), 5))
    from training import SAVE_DCP, _build

    script = SAVE_DCP.format(bench=str(ROOT / "bench"))
    dcp = _build(CACHE / f"dcp-llama-{'2gb' if size == '2gb' else '0.5gb'}", script, str(layers))
    return {"safetensors": folder, "dcp": dcp}


def _row(label: str, ours: list[float], peak: int, boto: dict[int, float]) -> str:
    best_c, best = min(boto.items(), key=lambda item: item[1])
    mine = statistics.median(ours)
    tried = ", ".join(f"{c}: {s:.1f} s" for c, s in sorted(boto.items()))
    return (
        f"| {label} | {mine:.1f} s | {best:.1f} s (concurrency {best_c}; {tried}) | "
        f"{mine / best:.2f}x (<= 1.3x: {'met' if mine <= 1.3 * best else 'NOT met'}) | "
        f"{peak / 2**20:.0f} MiB (<= 256: {'met' if peak <= 256 * 2**20 else 'NOT met'}) |"
    )


def _compare(
    label: str, args: list[str], local: Path, env: dict[str, str], client: Any, repeat: int
) -> tuple[str, float, float]:
    """ckptfix writing `args` to s3://bench/out, against boto3 uploading `local`'s files: the
    table row, ckptfix's median wall and boto3's best."""
    walls, peak = [], 0
    for _ in range(repeat):
        wall, rss, _ = _ckptfix([*args, "-o", "s3://bench/out", "--max-shard", SHARD], env)
        walls.append(wall)
        peak = max(peak, rss)
        _empty(client, "out/")
    boto = {}
    for concurrency in (4, 8, 16):
        boto[concurrency] = min(_boto(local, concurrency, env) for _ in range(repeat))
        _empty(client, "boto/")
    return _row(label, walls, peak, boto), statistics.median(walls), min(boto.values())


def _resume(folder: Path, env: dict[str, str], client: Any, planned: int) -> str:
    """Kill ckptfix once half of the `planned` shards are complete, then resume: the bytes
    it sends again."""
    args = ["reshard", str(folder), "-o", "s3://bench/out", "--max-shard", SHARD]
    process = subprocess.Popen([PYTHON, "-m", "ckptfix", *args], env=env)
    shards = 0
    while process.poll() is None:
        listed = client.list_objects_v2(Bucket="bench", Prefix="out/").get("Contents", [])
        shards = len([item for item in listed if item["Key"].endswith(".safetensors")])
        if shards >= planned // 2:
            process.send_signal(signal.SIGKILL)
            break
        time.sleep(0.05)
    process.wait()
    _, _, document = _ckptfix([*args, "--resume"], env)
    upload = document["written"]["upload"]
    total = upload["bytes_sent"] + upload["bytes_kept"]
    share = upload["bytes_sent"] / total
    _empty(client, "out/")
    return (
        f"| resume after SIGKILL with {shards} of {planned} shards complete | sent again: "
        f"{upload['bytes_sent']:,} of {total:,} bytes ({share:.0%}; <= 55 %: "
        f"{'met' if share <= 0.55 else 'NOT met'}) | kept {upload['bytes_kept']:,} |"
    )


def _s3_to_s3(
    source: Path, local: Path, env: dict[str, str], client: Any, repeat: int
) -> list[str]:
    """reshard s3://bench/src -o s3://bench/out, against boto3 uploading the same bytes, and
    against boto3 downloading the source (download_file) and uploading the output."""
    subprocess.run(
        [PYTHON, "-c", BOTO_UPLOAD, str(source), "bench", "src", "8"], env=env, check=True
    )
    label = "safetensors, S3 -> S3 (reshard)"
    row, ckptfix, upload = _compare(
        label, ["reshard", "s3://bench/src"], local, env, client, repeat
    )
    print(row, flush=True)
    start = time.perf_counter()
    subprocess.run(
        [PYTHON, "-c", BOTO_DOWNLOAD, "bench", "src", str(local.parent / "download")],
        env=env, check=True,
    )  # fmt: skip
    download = time.perf_counter() - start
    _empty(client, "src/")
    floor = download + upload  # one moto process serves both: they add up
    ratio = ckptfix / floor
    line = (
        f"| (S3 -> S3: boto3 download_file of the source, concurrency 8) | {download:.1f} s | "
        "the reads alone, which moto answers by copying the whole object for every range; "
        f"boto3's download + upload: {floor:.1f} s, ckptfix {ratio:.2f}x it "
        f"(<= 1.3x: {'met' if ratio <= 1.3 else 'NOT met'}) | | |"
    )
    print(line, flush=True)
    return [row, line]


def bench_store(repeat: int = 2, size: str = "2gb", s3_to_s3: bool = True) -> list[str]:
    global SHARD
    SHARD = SHARDS[size]
    sources = inputs(size)
    rows = [
        f"\n### Writing to S3 (moto on 127.0.0.1, its own process), {size} inputs, "
        f"{SHARD} shards; best of {repeat} (boto3) / median of {repeat} (ckptfix)\n",
        "| job | ckptfix wall | boto3 upload_file, same bytes | ratio | ckptfix peak RSS |",
        "|---|---|---|---|---|",
    ]
    print("\n".join(rows), flush=True)
    with moto() as (env, client), tempfile.TemporaryDirectory(dir=CACHE) as scratch:
        for label, command, source in (
            ("safetensors, local -> S3 (reshard)", "reshard", sources["safetensors"]),
            ("DCP, local -> S3 (convert)", "convert", sources["dcp"]),
        ):
            local = Path(scratch) / label.split(",")[0]
            subprocess.run(
                [PYTHON, "-m", "ckptfix", command, str(source), "-o", str(local), "--max-shard", SHARD],
                env=env, check=True, capture_output=True,
            )  # fmt: skip
            rows.append(_compare(label, [command, str(source)], local, env, client, repeat)[0])
            print(rows[-1], flush=True)
        local = Path(scratch) / "safetensors"
        if s3_to_s3:
            rows += _s3_to_s3(sources["safetensors"], local, env, client, repeat)
        planned = len(list(local.glob("*.safetensors")))
        rows.append(_resume(sources["safetensors"], env, client, planned))
        print(rows[-1], flush=True)
    return rows


if __name__ == "__main__":
    import argparse

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--size", choices=["2gb", "half"], default="2gb")
    parser.add_argument("--repeat", type=int, default=2)
    parser.add_argument("--no-s3-to-s3", action="store_true", help="skip the S3 -> S3 rows")
    options = parser.parse_args()
    bench_store(options.repeat, options.size, not options.no_s3_to_s3)
