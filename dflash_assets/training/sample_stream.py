"""Offline training input: hidden-state objects read from the store, decoded and checked off the training
thread, with a cache the node's ranks share.

- **One request an object.** Sizes come from the manifest, so an object is one GET (no HEAD first).
- **The node's cache** (`NodeCache`) holds the objects that fit its budget (`plan_node_cache`: held-out
  ones first, then training ones in the manifest's order). Such a *resident* object is downloaded once
  for the run by whichever rank of the node needs it first (a lock file per object keeps the others
  from fetching it too, across processes) and read from the local disk ever after: at two ranks the
  share of each global batch moves every epoch, and the node still fetches each object once. When the
  budget holds the whole data set, every object is downloaded once for the run.
- **The rest is streamed**: fetched into memory, decoded in place and dropped once consumed, so it is read
  from the store again every epoch and never touches the disk.
- **Read ahead** (`SampleStream`): a stream keeps up to `window_bytes` of objects ahead of its consumer
  (in flight or decoded and waiting) with up to `max_in_flight` requests at once. That starts at
  `START_IN_FLIGHT` and grows by `IN_FLIGHT_STEP` whenever the consumer had to wait for a sample while
  every request was busy: the store's latency and bandwidth decide how many requests it takes.

Decoding is zero-copy: the tensors are views of the fetched bytes (or of the cached file, mapped), so the
only copy is collation's into the padded batch, which `training/data.py` makes ahead of the training
thread.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import math
import mmap
import os
import shutil
import struct
import threading
import time
import warnings
from collections.abc import Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import torch

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.extraction.sample_format import (
    CorruptSampleError,
    HiddenStateSample,
    check_sample_metadata,
    sample_from_tensors,
)
from dflash_assets.storage.store import PARTIAL_SUFFIX, ObjectStore, StoreError

START_IN_FLIGHT = 8
IN_FLIGHT_STEP = 2
MAX_IN_FLIGHT = 64
# A stream reads ahead this many mean objects (at least two of the largest): room for the requests in
# flight and the samples decoded while the consumer trains; and no more than `WINDOW_MAX_BYTES` of them,
# which long samples reach first (32 objects of an 8 K-token sample at a 27B target's width are 15 GiB a
# rank; a large object reads at several connections' rate through ranged GETs, so a few in flight keep up).
WINDOW_OBJECTS = 32
WINDOW_MAX_BYTES = 4 * 2**30
FETCH_ATTEMPTS = 4  # a body cut short or a checksum that fails is fetched again (botocore retries requests)
NODE_CACHE_DIR = "node-cache"
_LOCKS_DIR = ".locks"


class SampleMismatchError(ValueError):
    """A hidden-state object was captured for a different target or layer set than the drafter's."""


class StreamClosed(RuntimeError):
    """The stream's iteration ended (or the wait was cancelled) before the sample was read."""


def partition_of(key: str) -> str:
    """`hidden-states/<partition>/hs_00000017.safetensors` -> `<partition>` (or the key's parent)."""
    parts = key.split("/")
    return parts[-2] if len(parts) >= 2 else ""


def check_sample_matches(sample: HiddenStateSample, config: DrafterConfig, key: str) -> None:
    """Raise SampleMismatchError naming the object, its partition and both values on any mismatch."""
    where = f"hidden-state object {key} (partition {partition_of(key)}, sample {sample.sample_index})"
    if sample.target_layer_ids != config.target_layer_ids:
        raise SampleMismatchError(
            f"{where} holds target layers {sample.target_layer_ids} but the drafter is configured for "
            f"{config.target_layer_ids}; recapture the partition with those layers or set "
            "DFLASH_TARGET_LAYER_IDS to the captured ones"
        )
    if sample.hidden_size != config.target_hidden_size:
        raise SampleMismatchError(
            f"{where} has hidden size {sample.hidden_size} but the drafter expects target hidden size "
            f"{config.target_hidden_size}; the partition was captured from a different target model"
        )
    # `extra["target_model_name"]` is the target's identity as capture records it (independent of the
    # path the target is loaded from); `target_model` is only where the embeddings are read.
    expected_model = config.extra.get("target_model_name") or config.target_model
    if expected_model and sample.target_model.rstrip("/") != expected_model.rstrip("/"):
        raise SampleMismatchError(
            f"{where} was captured from target model {sample.target_model!r} but the drafter is trained "
            f"for {expected_model!r}; set DFLASH_TARGET_MODEL to the captured model or recapture"
        )
    expected_shape = (sample.num_tokens, config.num_context_layers, config.target_hidden_size)
    if tuple(sample.hidden_states.shape) != expected_shape:
        raise SampleMismatchError(
            f"{where} has hidden_states of shape {tuple(sample.hidden_states.shape)}, expected "
            f"{expected_shape} [T, K, H]"
        )


# ------------------------------------------------------------------------------------------ decoding

_DTYPES = {
    "BF16": torch.bfloat16,
    "F8_E4M3": torch.float8_e4m3fn,
    "F16": torch.float16,
    "F32": torch.float32,
    "I32": torch.int32,
    "I64": torch.int64,
    "U8": torch.uint8,
    "BOOL": torch.bool,
}

# torch warns once per process that a tensor over a read-only buffer could write to it; decoding reads
# only (collation copies), so that one warning is taken here, where no thread races `catch_warnings`.
with warnings.catch_warnings():
    warnings.simplefilter("ignore")
    torch.frombuffer(b"\0", dtype=torch.uint8)


def decode_sample(buffer: bytes | bytearray | memoryview | mmap.mmap, where: str) -> HiddenStateSample:
    """A sample whose tensors are views of `buffer` (no copy): `sample_format.read_sample`'s checks on the
    header, metadata, tensors and length, without its two copies of the bytes. The tensors are read, never
    written (collation copies them), so a read-only buffer (an object's bytes, a mapped file) serves."""
    view = memoryview(buffer)
    if len(view) < 8:
        raise CorruptSampleError(f"{where}: too short to be a safetensors file ({len(view)} bytes)")
    (header_length,) = struct.unpack_from("<Q", view, 0)
    if 8 + header_length > len(view):
        raise CorruptSampleError(f"{where}: header claims {header_length} bytes but the data is truncated")
    try:
        header = json.loads(bytes(view[8 : 8 + header_length]))
    except (UnicodeDecodeError, json.JSONDecodeError) as error:
        raise CorruptSampleError(f"{where}: unreadable safetensors header ({error})") from error
    if not isinstance(header, dict):
        raise CorruptSampleError(f"{where}: safetensors header is not an object")
    metadata = check_sample_metadata(header.pop("__metadata__", None) or {}, where)
    base, entries = 8 + header_length, {}
    for name, entry in header.items():
        try:
            dtype = _DTYPES[entry["dtype"]]
            shape = [int(n) for n in entry["shape"]]
            start, stop = (int(n) for n in entry["data_offsets"])
        except (KeyError, TypeError, ValueError) as error:
            raise CorruptSampleError(f"{where}: malformed tensor entry {name!r} ({error!r})") from error
        if start < 0 or stop - start != math.prod(shape) * dtype.itemsize:
            raise CorruptSampleError(f"{where}: tensor {name!r} does not fit the data it claims")
        entries[name] = (dtype, shape, start)
    described = base + max((int(e["data_offsets"][1]) for e in header.values()), default=0)
    if described != len(view):
        raise CorruptSampleError(f"{where}: {len(view)} bytes but the header describes {described}")
    tensors = {
        name: torch.frombuffer(buffer, dtype=dtype, count=math.prod(shape), offset=base + start).view(shape)
        if math.prod(shape)
        else torch.empty(shape, dtype=dtype)
        for name, (dtype, shape, start) in entries.items()
    }
    return sample_from_tensors(tensors, metadata, where)


def decode_file(path: Path) -> HiddenStateSample:
    """A cached object's sample, its tensors views of the file mapped read-only (the page cache's copy)."""
    with open(path, "rb") as file:
        try:
            mapped = mmap.mmap(file.fileno(), 0, access=mmap.ACCESS_READ)
        except ValueError as error:  # an empty file cannot be mapped
            raise CorruptSampleError(f"{path}: cannot be mapped ({error})") from error
    return decode_sample(mapped, str(path))


# ------------------------------------------------------------------------------------------ the node's cache


@dataclass(frozen=True)
class CacheLayout:
    """How a node's cache budget is used: which objects stay resident for the run, and how far each of
    its streams reads ahead (in memory)."""

    budget_bytes: int  # the node's, on disk
    resident: dict[str, int]  # key -> size: downloaded once, kept for the run
    resident_bytes: int
    total_bytes: int  # the whole data set
    window_bytes: int  # each stream's read-ahead, in memory


def plan_node_cache(
    objects: Sequence[tuple[str, int]],
    budget_bytes: int,
    *,
    held_out: Sequence[int] = (),
    window_bytes: int | None = None,
) -> CacheLayout:
    """The node's layout, the same on each of its ranks (it depends only on what they all know): the
    held-out objects first (every evaluation reads them), then the training ones in the manifest's
    order, as many as `budget_bytes` holds on disk. A stream's read-ahead window is memory, apart from
    the budget: `WINDOW_OBJECTS` mean objects up to `WINDOW_MAX_BYTES`, at least two of the largest."""
    if budget_bytes < 0:
        raise ValueError(f"the sample cache budget must be 0 or more bytes, got {budget_bytes}")
    sizes = [size for _, size in objects]
    total = sum(sizes)
    largest = max(sizes, default=0)
    if window_bytes is None:
        mean = total / len(sizes) if sizes else 0
        window_bytes = max(2 * largest, min(round(WINDOW_OBJECTS * mean), WINDOW_MAX_BYTES))
    elif window_bytes < largest:
        raise ValueError(
            f"a read-ahead window of {window_bytes} bytes cannot hold the largest hidden-state object "
            f"({largest} bytes)"
        )
    first = list(dict.fromkeys(held_out))
    held = set(first)
    order = first + [i for i in range(len(objects)) if i not in held]
    resident, used = {}, 0
    for index in order:
        key, size = objects[index]
        if used + size <= budget_bytes:
            resident[key] = size
            used += size
    return CacheLayout(budget_bytes, resident, used, total, max(1, window_bytes))


class NodeCache:
    """The node's resident objects in one directory its ranks share: `fetch` downloads an object once for
    the node and returns its file. An `flock` per object (in `.locks/`) makes the other processes wait
    for the one fetching it; files are written under a partial name and renamed, so a file under its
    own name is whole."""

    def __init__(self, store: ObjectStore, directory: str | Path, resident: Mapping[str, int]) -> None:
        self.store = store
        self.directory = Path(directory)
        self.resident = dict(resident)

    def local_path(self, key: str) -> Path:
        return self.directory.joinpath(*key.split("/"))

    def prepare(self) -> None:
        """Remove what this run will not read from the directory (other data, an earlier layout, a
        download a dead process left half done): the disk holds no more than the resident set."""
        if not self.directory.exists():
            return
        wanted = {self.local_path(key): size for key, size in self.resident.items()}
        for dirpath, dirnames, filenames in os.walk(self.directory):
            if Path(dirpath) == self.directory and _LOCKS_DIR in dirnames:
                dirnames.remove(_LOCKS_DIR)
            for name in filenames:
                path = Path(dirpath) / name
                if name.endswith(PARTIAL_SUFFIX):
                    self._remove_abandoned(path)
                else:
                    with contextlib.suppress(FileNotFoundError):
                        if wanted.get(path) != path.stat().st_size:
                            path.unlink(missing_ok=True)

    def _remove_abandoned(self, partial: Path) -> None:
        # `.{name}.{12 hex}.dflash-partial` (store.partial_path): its object's lock tells whether a live
        # process is still writing it.
        name = partial.name[1 : -len(PARTIAL_SUFFIX)].rsplit(".", 1)[0]
        key = "/".join((*partial.parent.relative_to(self.directory).parts, name))
        with self._object_lock(key, blocking=False) as held:
            if held:
                partial.unlink(missing_ok=True)

    @contextlib.contextmanager
    def _object_lock(self, key: str, *, blocking: bool = True) -> Iterator[bool]:
        locks = self.directory / _LOCKS_DIR
        locks.mkdir(parents=True, exist_ok=True)
        digest = hashlib.sha1(key.encode()).hexdigest()[:24]
        with open(locks / f"{digest}.lock", "a+b") as handle:
            try:
                fcntl.flock(handle.fileno(), fcntl.LOCK_EX | (0 if blocking else fcntl.LOCK_NB))
            except BlockingIOError:
                yield False
                return
            try:
                yield True
            finally:
                fcntl.flock(handle.fileno(), fcntl.LOCK_UN)

    def _present(self, path: Path, size: int) -> bool:
        try:
            return path.stat().st_size == size
        except FileNotFoundError:
            return False

    def fetch(self, key: str, size: int) -> tuple[Path, bool]:
        """(the object's file, whether this call downloaded it): one GET unless the node has it."""
        path = self.local_path(key)
        if not self._present(path, size):
            with self._object_lock(key):
                if not self._present(path, size):  # another rank may have fetched it meanwhile
                    path.parent.mkdir(parents=True, exist_ok=True)
                    self.store.download(key, path, size=size)
                    return path, True
        return path, False


def remove_node_cache(directory: str | Path) -> None:
    """Delete a node's cache after its run (a failed run keeps it: the resumed run reads it again)."""
    shutil.rmtree(Path(directory), ignore_errors=True)


# ------------------------------------------------------------------------------------------ streams


@dataclass
class StreamStats:
    window_bytes: int
    ahead_bytes: int  # fetched or being fetched, not yet consumed
    peak_ahead_bytes: int
    fetched: int  # objects this stream read from the store (streamed, or downloaded into the node cache)
    fetched_bytes: int
    cached: int  # objects read from the node's cache without a request
    in_flight_limit: int  # requests at once, as adapted
    retries: int
    waits: int  # times the consumer waited for a sample


class SampleStream:
    """`iterate(objects)` yields `(key, HiddenStateSample)` in the given order, reading ahead on threads of
    its own: resident objects through `node_cache`, the rest straight into memory.

    One stream serves one iteration at a time; training and evaluation each have their own."""

    def __init__(
        self,
        store: ObjectStore,
        *,
        window_bytes: int,
        node_cache: NodeCache | None = None,
        max_in_flight: int = MAX_IN_FLIGHT,
        prefetch_objects: int = 4 * MAX_IN_FLIGHT,
        config: DrafterConfig | None = None,
    ) -> None:
        if window_bytes <= 0 or max_in_flight <= 0 or prefetch_objects <= 0:
            raise ValueError("window_bytes, max_in_flight and prefetch_objects must be positive")
        self.store = store
        self.node_cache = node_cache
        self.window_bytes = window_bytes
        self.max_in_flight = max_in_flight
        self.prefetch_objects = prefetch_objects
        self.config = config
        self._cond = threading.Condition()
        self._limit = min(START_IN_FLIGHT, max_in_flight)
        self._ahead_bytes = self._peak_ahead = 0
        self._fetched = self._fetched_bytes = self._cached = self._retries = self._waits = 0

    @property
    def stats(self) -> StreamStats:
        with self._cond:
            return StreamStats(
                window_bytes=self.window_bytes,
                ahead_bytes=self._ahead_bytes,
                peak_ahead_bytes=self._peak_ahead,
                fetched=self._fetched,
                fetched_bytes=self._fetched_bytes,
                cached=self._cached,
                in_flight_limit=self._limit,
                retries=self._retries,
                waits=self._waits,
            )

    def iterate(self, objects: Sequence[tuple[str, int]]) -> Iterator[tuple[str, HiddenStateSample]]:
        """Decoded samples of `(key, size)` objects, in order."""
        return iter(self.open(objects))

    def open(self, objects: Sequence[tuple[str, int]]) -> StreamIteration:
        too_big = next(((key, size) for key, size in objects if size > self.window_bytes), None)
        if too_big is not None:
            raise ValueError(
                f"object {too_big[0]} is {too_big[1]} bytes, more than the stream's whole read-ahead window "
                f"({self.window_bytes} bytes)"
            )
        return StreamIteration(self, list(objects))

    # -- used by the iteration's threads

    def _fetch(self, key: str, size: int) -> HiddenStateSample:
        """One object's sample (a worker thread): through the node cache when resident, else from the
        store into memory; transient failures (a body cut short) are fetched again."""
        for attempt in range(1, FETCH_ATTEMPTS + 1):
            try:
                if self.node_cache is not None and key in self.node_cache.resident:
                    path, fetched = self.node_cache.fetch(key, size)
                    sample = decode_file(path)
                else:
                    sample = decode_sample(self.store.get_bytes(key, size), key)
                    fetched = True
                break
            except StoreError as error:
                if not error.transient or attempt == FETCH_ATTEMPTS:
                    raise
                with self._cond:
                    self._retries += 1
                time.sleep(0.2 * 2**attempt)
        with self._cond:
            if fetched:
                self._fetched += 1
                self._fetched_bytes += size
            else:
                self._cached += 1
        if self.config is not None:
            check_sample_matches(sample, self.config, key)
        return sample


class StreamIteration:
    """One pass over `objects`: iterate it for `(key, sample)` in order; `close()` stops the reading ahead.

    A consumer that collates ahead `hold`s the positions it will want (before the iteration yields them),
    reads them with `sample_at` from another thread, and `release`s them: a held position stays readable
    after the iteration has yielded it."""

    def __init__(self, stream: SampleStream, objects: list[tuple[str, int]]) -> None:
        self.stream, self.objects = stream, objects
        self._cond = stream._cond
        self._futures: dict[int, Future[HiddenStateSample]] = {}
        self._held: set[int] = set()
        self._consumed = 0
        self._in_flight = 0
        self._closed = False
        self._error: BaseException | None = None
        self._executor = ThreadPoolExecutor(stream.max_in_flight, thread_name_prefix="sample-fetch")
        self._producer = threading.Thread(target=self._produce, name="sample-read-ahead", daemon=True)
        self._producer.start()

    def _produce(self) -> None:
        stream = self.stream
        try:
            for position, (key, size) in enumerate(self.objects):
                with self._cond:
                    while not self._closed and not self._room_for(position, size):
                        self._cond.wait()
                    if self._closed:
                        return
                    stream._ahead_bytes += size
                    stream._peak_ahead = max(stream._peak_ahead, stream._ahead_bytes)
                    self._in_flight += 1
                    future = self._executor.submit(stream._fetch, key, size)
                    self._futures[position] = future
                    future.add_done_callback(self._fetch_done)
                    self._cond.notify_all()
        except BaseException as error:  # surfaced to the consumer, never lost in a thread
            with self._cond:
                self._error = error
                self._cond.notify_all()

    def _room_for(self, position: int, size: int) -> bool:
        stream = self.stream
        ahead = stream._ahead_bytes
        return (
            self._in_flight < stream._limit
            and position - self._consumed < stream.prefetch_objects
            and (ahead == 0 or ahead + size <= stream.window_bytes)
        )

    def _fetch_done(self, future: Future) -> None:
        with self._cond:
            self._in_flight -= 1
            self._cond.notify_all()

    def _wait_submitted(self, position: int, cancelled: threading.Event | None = None) -> Future:
        with self._cond:
            while position not in self._futures:
                if self._error is not None:
                    raise self._error
                if self._closed or (cancelled is not None and cancelled.is_set()):
                    raise StreamClosed(f"the stream closed before object {position} was read")
                self._cond.wait(0.05 if cancelled is not None else None)
            return self._futures[position]

    @property
    def consumed(self) -> int:
        """How many samples the iteration has yielded."""
        with self._cond:
            return self._consumed

    def hold(self, positions: Sequence[int]) -> bool:
        """Keep the samples at `positions` readable by `sample_at` after they are yielded; False (nothing
        held) when one was yielded already."""
        with self._cond:
            if any(p < self._consumed or p >= len(self.objects) for p in positions):
                return False
            self._held.update(positions)
            return True

    def release(self, positions: Sequence[int]) -> None:
        with self._cond:
            for position in positions:
                self._held.discard(position)
                if position < self._consumed:
                    self._futures.pop(position, None)

    def sample_at(self, position: int, cancelled: threading.Event | None = None) -> HiddenStateSample:
        """The sample at a held `position` once read; raises StreamClosed when the iteration closes (or
        `cancelled` is set) first."""
        future = self._wait_submitted(position, cancelled)
        while True:
            try:
                return future.result(timeout=0.05)
            except TimeoutError:
                if self._closed or (cancelled is not None and cancelled.is_set()):
                    raise StreamClosed(f"the stream closed before object {position} was read") from None

    def __iter__(self) -> Iterator[tuple[str, HiddenStateSample]]:
        stream = self.stream
        try:
            for position, (key, size) in enumerate(self.objects):
                future = self._wait_submitted(position)
                if not future.done():
                    with self._cond:
                        stream._waits += 1
                        # Starved while every request is busy: more requests in flight would have helped.
                        if self._in_flight >= stream._limit and stream._limit < stream.max_in_flight:
                            stream._limit = min(stream.max_in_flight, stream._limit + IN_FLIGHT_STEP)
                            self._cond.notify_all()
                try:
                    sample = future.result()
                finally:
                    with self._cond:
                        if position not in self._held:
                            self._futures.pop(position, None)
                        stream._ahead_bytes -= size
                        self._consumed = position + 1
                        self._cond.notify_all()
                yield key, sample
        finally:
            self.close()

    def close(self) -> None:
        """Stop reading ahead; what is in flight finishes and is dropped, its bytes given back."""
        with self._cond:
            if self._closed:
                return
            self._closed = True
            self._cond.notify_all()
        self._producer.join()
        self._executor.shutdown(wait=True, cancel_futures=True)
        with self._cond:
            for position in self._futures:
                if position >= self._consumed:  # read ahead, never yielded
                    self.stream._ahead_bytes -= self.objects[position][1]
            self._futures.clear()
            self._held.clear()
            self._cond.notify_all()
