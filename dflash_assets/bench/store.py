"""The store from this node: `dflash-assets bench --only store`, and the offline feed's row.

- **The configured store** (`bench_store`): write and read GB/s, objects/s and requests/s at the configured
  target's object size (its width × the plan's mean length), through the product's own uploader and the
  training reader (`training/sample_stream.py`, streaming). Saved where the plan reads it
  (`planning/store_result.py`). The objects go under `bench/store-<id>/` and are deleted after.
- **The feed row** (`bench_feed`): the training reader against plain parallel GETs (boto3's
  `get_object(...)["Body"].read()`, the same number of threads) through a loopback proxy that adds
  `delay_ms` to every response, in front of a real S3 server (`moto_server`); objects/s, GB/s, requests
  an object and client CPU an object (this process's CPU time: the proxy and the server run in processes
  of their own), interleaved over rounds, the median round's ratio reported.
"""

from __future__ import annotations

import contextlib
import statistics
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from dflash_assets.bench.latency_proxy import LatencyProxy
from dflash_assets.extraction.sample_format import sample_object_name, write_sample
from dflash_assets.planning.store_result import save_store_result
from dflash_assets.storage.layout import HIDDEN_STATES_PREFIX
from dflash_assets.storage.moto_server import moto_available, start_moto_server
from dflash_assets.storage.s3_store import S3Settings, S3Store
from dflash_assets.storage.store import ObjectStore
from dflash_assets.storage.units import human_bytes
from dflash_assets.storage.uploader import Uploader
from dflash_assets.training.sample_stream import SampleStream, plan_node_cache

FEED_RATIO_FIGURE = "feed: training reader / plain GETs, objects/s (25 ms proxy)"
FEED_GOAL = 0.8
DEFAULT_BENCH_BYTES = 2**30  # written and read per store figure (quick: a quarter)
FEED_THREADS = 8


@dataclass(frozen=True)
class ObjectShape:
    """The hidden-state object the bench moves: the configured target's, at the plan's mean length."""

    num_tokens: int
    layer_ids: list[int]
    hidden_size: int
    dtype: str  # "bf16" / "fp8"
    target_model: str
    how: str  # where the shape comes from, for the report
    final_state: bool = False  # the objects hold the target's final state too (the default capture)

    def write(self, path: Path) -> int:
        """One sample object of this shape at `path` (random states; written once, sent many times)."""
        slots = len(self.layer_ids) + int(self.final_state)
        states = torch.randn(self.num_tokens, slots, self.hidden_size, dtype=torch.bfloat16)
        return write_sample(
            path,
            sample_index=0,
            input_ids=torch.zeros(self.num_tokens, dtype=torch.int32),
            loss_mask=torch.ones(self.num_tokens, dtype=torch.uint8),
            hidden_states=states,
            target_layer_ids=self.layer_ids,
            target_model=self.target_model,
            check_finite=False,
            durable=False,
            hidden_state_dtype=self.dtype,
            final_state=self.final_state,
        )


def object_count(object_bytes: int, total_bytes: int) -> int:
    """Objects moved per figure: `total_bytes` worth, between 8 and 256."""
    return max(8, min(256, round(total_bytes / max(object_bytes, 1))))


@dataclass
class Phase:
    objects: int
    nbytes: int
    seconds: float
    cpu_seconds: float
    requests: dict[str, int]

    @property
    def objects_per_s(self) -> float:
        return self.objects / self.seconds

    @property
    def bytes_per_s(self) -> float:
        return self.nbytes / self.seconds

    @property
    def requests_per_s(self) -> float:
        return sum(self.requests.values()) / self.seconds

    @property
    def cpu_ms_per_object(self) -> float:
        return 1000 * self.cpu_seconds / self.objects

    def as_dict(self) -> dict[str, Any]:
        return {
            "objects": self.objects,
            "bytes": self.nbytes,
            "seconds": self.seconds,
            "bytes_per_s": self.bytes_per_s,
            "objects_per_s": self.objects_per_s,
            "requests_per_s": self.requests_per_s,
            "requests": dict(self.requests),
            "cpu_ms_per_object": self.cpu_ms_per_object,
        }


@contextlib.contextmanager
def _timed(objects: int, nbytes: int, requests: Callable[[], dict[str, int]]) -> Iterator[list[Phase]]:
    """Times the block (wall and this process's CPU) and the requests it sent: a `Phase` in the list."""
    before, wall, cpu = dict(requests()), time.perf_counter(), time.process_time()
    out: list[Phase] = []
    yield out
    seconds, cpu_seconds = time.perf_counter() - wall, time.process_time() - cpu
    after = requests()
    sent = {method: after.get(method, 0) - before.get(method, 0) for method in after}
    out.append(Phase(objects, nbytes, seconds, cpu_seconds, {m: n for m, n in sent.items() if n}))


def read_with_training_reader(
    store: ObjectStore, objects: list[tuple[str, int]], threads: int | None
) -> None:
    """Every object through the training reader as offline training streams it: one GET each into memory
    (ranged GETs into one buffer from the multipart threshold on), decoded in place on the reader's
    threads, `threads` requests at most (None: the trainer's own)."""
    kwargs = {"max_in_flight": threads} if threads else {}
    # The trainer's own read-ahead for objects of these sizes (a few, for long samples).
    reader = SampleStream(store, window_bytes=plan_node_cache(objects, 0).window_bytes, **kwargs)
    for _ in reader.iterate(objects):
        pass


# ------------------------------------------------------------------------------------------ the store


def bench_store(
    store: ObjectStore,
    store_url: str,
    shape: ObjectShape,
    *,
    uploader_fields: dict[str, Any],
    total_bytes: int = DEFAULT_BENCH_BYTES,
    result_path: Path | None = None,
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """Write then read `total_bytes` of objects of `shape` to the configured store and back; save the
    result for the plan at `result_path`."""
    counts = store.count_requests() if isinstance(store, S3Store) else None
    run = f"bench/store-{uuid.uuid4().hex[:12]}"
    with tempfile.TemporaryDirectory(prefix="dflash-store-bench-") as tmp:
        source = Path(tmp) / sample_object_name(0)
        size = shape.write(source)
        count = object_count(size, total_bytes)
        keys = [
            f"{run}/{HIDDEN_STATES_PREFIX}/00000000-{count - 1:08d}/{sample_object_name(i)}"
            for i in range(count)
        ]
        log(f"store bench: {count} objects of {human_bytes(size)} ({shape.how}), {store.description}")

        def requests() -> dict[str, int]:
            return dict(counts) if counts is not None else {}

        try:
            with (
                _timed(count, count * size, requests) as write,
                Uploader(store, **uploader_fields) as uploader,
            ):
                for key in keys:
                    uploader.submit(source, key, delete_after=False)
            with _timed(count, count * size, requests) as read:
                read_with_training_reader(store, [(key, size) for key in keys], None)
        finally:
            store.delete_prefix(f"{run}/")
    write_phase, read_phase = write[0], read[0]
    if counts is None:  # a local store: one operation an object
        write_phase.requests = read_phase.requests = {"objects": count}
    result = {
        "store": store_url,
        "endpoint": store.description,
        "object_bytes": size,
        "object_shape": shape.how,
        "objects": count,
        "in_flight": {"upload": uploader_fields.get("max_in_flight"), "read": "adaptive, 8 to 64"},
        "write": write_phase.as_dict(),
        "read": read_phase.as_dict(),
    }
    if result_path is not None:
        save_store_result(result_path, result)
        log(f"saved for `dflash-assets plan`: {result_path}")
    return {
        "store: write GB/s": write_phase.bytes_per_s / 1e9,
        "store: write objects/s": write_phase.objects_per_s,
        "store: write requests/s": write_phase.requests_per_s,
        "store: read GB/s (training reader)": read_phase.bytes_per_s / 1e9,
        "store: read objects/s": read_phase.objects_per_s,
        "store: read requests/s": read_phase.requests_per_s,
        "store: object MB": size / 1e6,
    }


# ---------------------------------------------------------------------------------- the training thread


def bench_training_thread(
    shape: ObjectShape,
    *,
    objects: int = 16,
    micro_batch: int = 2,
    step_ms_per_object: float = 80.0,
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """What the training thread spends on data an object, as the trainer drives the offline source
    (pull a step's samples, collate a micro-batch, prepare the next, train on it), with a step of
    `step_ms_per_object` a sample standing in for the drafter (a rank at 25 K tokens/s spends ~80 ms on a
    sample of 2,017 tokens); against decoding (`read_sample`) and collating on the training thread, as the
    feed did before. Objects come from a local store: the store's rate is not the subject here. The first
    step, which waits for the first reads in any run, is not counted."""
    from dflash_assets.drafter.config import DrafterConfig
    from dflash_assets.extraction.sample_format import read_sample
    from dflash_assets.storage.open_store import open_store
    from dflash_assets.training.data import OfflineData, OfflineSource, collate_hidden_state_samples
    from dflash_assets.training.settings import TrainSettings

    with tempfile.TemporaryDirectory(prefix="dflash-thread-bench-") as tmp:
        store = open_store(str(Path(tmp) / "store"))
        source_file = Path(tmp) / sample_object_name(0)
        size = shape.write(source_file)
        keys = [f"{HIDDEN_STATES_PREFIX}/00000000-00000099/{sample_object_name(i)}" for i in range(objects)]
        for key in keys:
            store.put_file(key, source_file)
        config = DrafterConfig(  # only its shape checks the samples: no drafter is built
            hidden_size=shape.hidden_size,
            num_heads=2,
            num_kv_heads=1,
            head_dim=32,
            intermediate_size=64,
            vocab_size=100,
            mask_token_id=99,
            target_layer_ids=shape.layer_ids,
            target_num_hidden_layers=max(shape.layer_ids) + 4,
        )
        settings = TrainSettings(mode="offline", eval_samples=0, max_length=max(shape.num_tokens, 1))
        data = OfflineData(
            store,
            [(key, size) for key in keys],
            Path(tmp) / "cache",
            cache_budget_bytes=0,  # streamed, as at size
            read_ahead_bytes=6 * size,  # bounded memory on a small machine: two steps ahead
        )
        source = OfflineSource(data, config, settings)
        source.setup_streams([])
        ids = list(range(objects))
        steps = [ids[i : i + 2 * micro_batch] for i in range(0, objects, 2 * micro_batch)]
        busy = 0.0
        samples = source.iterate(ids)
        for number, step in enumerate(steps):
            if number == 1:
                busy = 0.0  # the first step waited for the first reads
            started = time.perf_counter()
            pulled = [next(samples) for _ in step]
            busy += time.perf_counter() - started
            micros = [step[i : i + micro_batch] for i in range(0, len(step), micro_batch)]
            for index, micro in enumerate(micros):
                started = time.perf_counter()
                source.collate([pulled[step.index(i)] for i in micro])
                if index + 1 < len(micros):
                    following = micros[index + 1]
                else:  # the next step's first micro-batch, as the trainer prepares it
                    following = steps[number + 1][:micro_batch] if number + 1 < len(steps) else []
                source.prepare(following)
                busy += time.perf_counter() - started
                time.sleep(step_ms_per_object * len(micro) / 1000)  # the drafter's forward and backward
        samples.close()
        before = time.perf_counter()
        for key in keys:  # the feed before: read_sample and collation on the training thread
            local = Path(tmp) / "store" / key
            collate_hidden_state_samples([read_sample(local)], settings.max_length)
        inline = time.perf_counter() - before
    ahead_ms, inline_ms = 1000 * busy / (objects - len(steps[0])), 1000 * inline / objects
    log(
        f"training thread: {ahead_ms:.1f} ms an object on data with reading, decoding and collating ahead, "
        f"{inline_ms:.1f} ms decoding and collating there ({objects} objects of {human_bytes(size)})"
    )
    return {
        "feed: training thread ms an object (read ahead, collated ahead)": ahead_ms,
        "feed: training thread ms an object (decoded and collated there)": inline_ms,
    }


# ------------------------------------------------------------------------------------------ the feed row


def _loopback_credentials():
    """Throwaway credentials for the loopback server, so no real ones are sent to it; restored after."""
    from dflash_assets.settings import environment

    throwaway = {
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    return environment({"AWS_SESSION_TOKEN": None, "AWS_PROFILE": None, **throwaway})


def _plain_gets(client: Any, bucket: str, keys: list[str], threads: int) -> None:
    """The plain library call: `get_object(...)["Body"].read()` from `threads` threads."""
    with ThreadPoolExecutor(threads) as pool:
        for data in pool.map(lambda key: client.get_object(Bucket=bucket, Key=key)["Body"].read(), keys):
            assert data


def bench_feed(
    shape: ObjectShape,
    *,
    delay_ms: float = 25.0,
    threads: int = FEED_THREADS,
    total_bytes: int = DEFAULT_BENCH_BYTES,
    rounds: int = 3,
    log: Callable[[str], None] = print,
) -> dict[str, float]:
    """The training reader against plain GETs through a proxy `delay_ms` away (see the module docstring);
    {} without moto (the `test` extra)."""
    if not moto_available():
        log("feed row skipped: moto is not installed (pip install -e '.[test]')")
        return {}
    import boto3
    from botocore.config import Config

    server = start_moto_server()
    try:
        with _loopback_credentials(), LatencyProxy(server.endpoint_url, delay_ms) as proxy:
            direct = boto3.client(
                "s3", endpoint_url=server.endpoint_url, config=Config(s3={"addressing_style": "path"})
            )
            direct.create_bucket(Bucket="feed")
            with tempfile.TemporaryDirectory(prefix="dflash-feed-bench-") as tmp:
                source = Path(tmp) / sample_object_name(0)
                size = shape.write(source)
                count = object_count(size, total_bytes)
                body = source.read_bytes()
            keys = [
                f"{HIDDEN_STATES_PREFIX}/00000000-{count - 1:08d}/{sample_object_name(i)}"
                for i in range(count)
            ]
            for key in keys:  # straight to the server: only the reads go through the proxy
                direct.put_object(Bucket="feed", Key=key, Body=body)
            del body
            log(
                f"feed row: {count} objects of {human_bytes(size)} ({shape.how}), {threads} threads each "
                f"side, through a proxy adding {delay_ms:g} ms a response"
            )
            plain_client = boto3.client(
                "s3",
                endpoint_url=proxy.endpoint_url,
                config=Config(s3={"addressing_style": "path"}, max_pool_connections=2 * threads),
            )
            store = S3Store("s3://feed", S3Settings(endpoint_url=proxy.endpoint_url))
            objects = [(key, size) for key in keys]
            phases: dict[str, list[Phase]] = {"plain": [], "reader": []}
            for _ in range(rounds):
                with _timed(count, count * size, proxy.counters) as plain:
                    _plain_gets(plain_client, "feed", keys, threads)
                with _timed(count, count * size, proxy.counters) as reader:
                    read_with_training_reader(store, objects, threads)
                phases["plain"].append(plain[0])
                phases["reader"].append(reader[0])
    finally:
        server.stop()
    ratios = [
        r.objects_per_s / p.objects_per_s for r, p in zip(phases["reader"], phases["plain"], strict=True)
    ]
    middle = sorted(range(rounds), key=lambda i: ratios[i])[rounds // 2]
    plain, reader = phases["plain"][middle], phases["reader"][middle]
    per_object = {
        name: sum(phase.requests.values()) / phase.objects for name, phase in (("p", plain), ("r", reader))
    }
    log(
        f"feed row: training reader {reader.objects_per_s:,.1f} objects/s "
        f"({reader.bytes_per_s / 1e9:,.3f} GB/s, {reader.requests}), plain GETs "
        f"{plain.objects_per_s:,.1f} objects/s ({plain.requests}); ratio {statistics.median(ratios):.3f} "
        f"(median of {rounds} interleaved rounds; goal >= {FEED_GOAL})"
    )
    return {
        FEED_RATIO_FIGURE: statistics.median(ratios),
        "feed: training reader objects/s": reader.objects_per_s,
        "feed: training reader GB/s": reader.bytes_per_s / 1e9,
        "feed: plain GETs objects/s": plain.objects_per_s,
        "feed: plain GETs GB/s": plain.bytes_per_s / 1e9,
        "feed: training reader requests an object": per_object["r"],
        "feed: plain GETs requests an object": per_object["p"],
        "feed: training reader client CPU ms an object": reader.cpu_ms_per_object,
        "feed: plain GETs client CPU ms an object": plain.cpu_ms_per_object,
        "feed: object MB": size / 1e6,
    }
