"""Hidden-state objects of long samples (480 MiB at 8 K tokens, 1.9 GiB at 32 K, at a 27B target's width
with the final state) through a real S3 server on loopback (`moto_server`): written by the product's
uploader (multipart), then read back three ways, each in a process of its own so that its peak memory is
its own: the training reader (`SampleStream`: ranged GETs into one buffer, decoded in place), the node
cache's download to disk, and the plain library call (`get_object()["Body"].read()`). Prints, per size,
seconds and the reading process's peak resident memory above what it held before the read, in objects.

    python scripts/large_objects.py --mib 480 1920
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "large-objects",
    "AWS_SECRET_ACCESS_KEY": "large-objects",
    "AWS_DEFAULT_REGION": "us-east-1",
}


def _peak_rss() -> int:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def _current_rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    return 0


def child(how: str, url: str, key: str, size: int) -> None:
    """One read, in this process: print {seconds, peak_above_bytes}."""
    from dflash_assets.storage.open_store import open_store
    from dflash_assets.training.sample_stream import SampleStream

    store = open_store(url)
    before = _current_rss()
    started = time.monotonic()
    if how == "training reader":
        reader = SampleStream(store, window_bytes=2 * size)
        for _, sample in reader.iterate([(key, size)]):
            assert sample.num_tokens > 0
    elif how == "node cache (to disk)":
        with tempfile.TemporaryDirectory() as scratch:
            path = store.download(key, Path(scratch) / "object", size=size)
            assert path.stat().st_size == size
    else:  # boto3 alone, the store's code not in the path
        import boto3

        bucket, _, prefix = url.removeprefix("s3://").partition("/")
        body = boto3.client("s3").get_object(Bucket=bucket, Key=f"{prefix}/{key}")["Body"].read()
        assert len(body) == size
    seconds = time.monotonic() - started
    print(json.dumps({"seconds": seconds, "peak_above_bytes": _peak_rss() - before}))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--mib", type=int, nargs="+", default=[480, 1920], help="object sizes, MiB")
    parser.add_argument("--child", nargs=4, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        how, url, key, size = args.child
        child(how, url, key, int(size))
        return

    from dflash_assets.bench.store import ObjectShape
    from dflash_assets.storage.layout import HIDDEN_STATES_PREFIX
    from dflash_assets.storage.moto_server import start_moto_server
    from dflash_assets.storage.open_store import open_store
    from dflash_assets.storage.units import human_bytes
    from dflash_assets.storage.uploader import Uploader

    os.environ.update(CREDENTIALS)
    server = start_moto_server()
    os.environ["AWS_ENDPOINT_URL_S3"] = server.endpoint_url
    try:
        import boto3

        bucket = f"large-{uuid.uuid4().hex[:8]}"
        boto3.client("s3", endpoint_url=server.endpoint_url).create_bucket(Bucket=bucket)
        url = f"s3://{bucket}/dflash"
        store = open_store(url)
        print(f"moto_server at {server.endpoint_url}; store {url}")
        rows = []
        for mib in args.mib:
            # six states a token (5 layers and the final state) of a 5,120-wide target, bf16: 61,440 bytes
            tokens = round(mib * 2**20 / (6 * 5120 * 2))
            shape = ObjectShape(
                num_tokens=tokens, layer_ids=[1, 16, 31, 46, 61, 62], hidden_size=5120, dtype="bf16",
                target_model="large-objects", how=f"{tokens:,} tokens",
            )  # fmt: skip
            with tempfile.TemporaryDirectory() as scratch:
                source = Path(scratch) / "hs_00000000.safetensors"
                size = shape.write(source)
                key = f"{HIDDEN_STATES_PREFIX}/00000000-00000000/{source.name}"
                started = time.monotonic()
                with Uploader(store, max_in_flight=2) as uploader:
                    uploader.submit(source, key, delete_after=False)
                write_s = time.monotonic() - started
            line = f"{human_bytes(size)} ({tokens:,} tokens): write {write_s:.1f} s (uploader, multipart)"
            for how in ("training reader", "node cache (to disk)", "plain get_object().read()"):
                done = subprocess.run(
                    [sys.executable, __file__, "--child", how, url, key, str(size)],
                    capture_output=True, text=True, env={**os.environ}, check=False,
                )  # fmt: skip
                if done.returncode:
                    raise SystemExit(f"{how} failed:\n{done.stderr[-3000:]}")
                result = json.loads(done.stdout.strip().splitlines()[-1])
                rows.append({"bytes": size, "how": how, **result})
                line += (
                    f"; {how} {result['seconds']:.1f} s, peak +{human_bytes(result['peak_above_bytes'])} "
                    f"({result['peak_above_bytes'] / size:.2f} objects)"
                )
            print(line, flush=True)
            store.delete(key)
        print(json.dumps(rows))
    finally:
        server.stop()


if __name__ == "__main__":
    main()
