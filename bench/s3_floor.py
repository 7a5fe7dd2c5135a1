"""The least an S3 inspect of `fifty-4mib-shards` can cost against moto on this machine: a
bare client (urllib3 and botocore's SigV4 signer, no service model, no checks) lists the
folder and fetches each file's first 64 KiB, 16 requests in flight, in a fresh process.

    python bench/s3_floor.py      (after `python bench/bench.py --only remote` built the folder)
"""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import remote

BARE_CLIENT = r"""
import sys, time
from concurrent.futures import ThreadPoolExecutor
start = time.perf_counter()
import urllib3
from botocore.auth import SigV4Auth
from botocore.awsrequest import AWSRequest
from botocore.credentials import Credentials
imported = time.perf_counter()
pool, endpoint = urllib3.PoolManager(maxsize=16), sys.argv[1]
signer = SigV4Auth(Credentials("testing", "testing"), "s3", "us-east-1")

def get(url, headers):
    request = AWSRequest("GET", url, headers=headers)
    signer.add_auth(request)
    response = pool.request("GET", url, headers=dict(request.headers))
    assert response.status in (200, 206), response.status
    return response.data

listing = get(endpoint + "/bench?list-type=2&prefix=f/", {}).decode()
keys = [part.split("</Key>")[0] for part in listing.split("<Key>")[1:]]
with ThreadPoolExecutor(16) as pool_of_threads:
    fetched = sum(map(len, pool_of_threads.map(
        lambda key: get(f"{endpoint}/bench/{key}", {"Range": "bytes=0-65535"}), keys)))
done = time.perf_counter()
print(f"{len(keys) + 1} requests, {fetched:,} bytes: imports {imported - start:.3f} s, "
      f"requests {done - imported:.3f} s", end="")
"""


def main() -> None:
    folder = Path(__file__).resolve().parent.parent / ".bench-cache" / "fifty-4mib-shards"
    with remote._s3({"f": folder}) as env:
        for _ in range(5):
            start = time.perf_counter()
            subprocess.run([sys.executable, "-c", BARE_CLIENT, env["AWS_ENDPOINT_URL"]], env=env)
            print(f"; whole process {time.perf_counter() - start:.3f} s", flush=True)


if __name__ == "__main__":
    main()
