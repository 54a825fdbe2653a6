"""Offline training input: hidden-state objects streamed from the store through a bounded local cache.

Objects are downloaded a few ahead of the consumer by background threads, in the order they will be
consumed. Every object's bytes count against `cache_budget_bytes` from before its download starts until
the consumer has decoded it and its file is deleted, so the cache directory never holds more than the
budget; when it is full, prefetching waits.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.extraction.sample_format import HiddenStateSample, read_sample
from dflash_assets.storage.store import ObjectStore


class SampleMismatchError(ValueError):
    """A hidden-state object was captured for a different target or layer set than the drafter's."""


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


@dataclass
class CacheStats:
    cache_budget_bytes: int
    cached_bytes: int  # reserved for objects downloading or downloaded and not yet consumed
    peak_cached_bytes: int
    downloaded: int
    downloaded_bytes: int
    reused: int  # already in the cache at the right size (left by an earlier run): not downloaded again


class SampleStream:
    """`iterate(objects)` yields `(key, HiddenStateSample)` in the given order, prefetching ahead.

    The stream owns `cache_dir`: when an iteration starts, files there that it will not read soon are
    deleted. One stream serves one iteration at a time; use separate streams (and directories) for data
    read concurrently, e.g. training and evaluation, each with its own share of the disk.
    """

    def __init__(
        self,
        store: ObjectStore,
        cache_dir: str | Path,
        *,
        cache_budget_bytes: int,
        prefetch_objects: int = 16,
        download_threads: int = 8,
        config: DrafterConfig | None = None,
    ) -> None:
        if cache_budget_bytes <= 0 or prefetch_objects <= 0 or download_threads <= 0:
            raise ValueError("cache_budget_bytes, prefetch_objects and download_threads must be positive")
        self.store = store
        self.cache_dir = Path(cache_dir)
        self.cache_budget_bytes = cache_budget_bytes
        self.prefetch_objects = prefetch_objects
        self.download_threads = download_threads
        self.config = config
        self._cond = threading.Condition()
        self._cached_bytes = 0
        self._peak_cached_bytes = 0
        self._downloaded = 0
        self._downloaded_bytes = 0
        self._reused = 0

    @property
    def stats(self) -> CacheStats:
        with self._cond:
            return CacheStats(
                cache_budget_bytes=self.cache_budget_bytes,
                cached_bytes=self._cached_bytes,
                peak_cached_bytes=self._peak_cached_bytes,
                downloaded=self._downloaded,
                downloaded_bytes=self._downloaded_bytes,
                reused=self._reused,
            )

    def local_path(self, key: str) -> Path:
        return self.cache_dir.joinpath(*key.split("/"))

    def iterate(self, objects: Sequence[tuple[str, int]]) -> Iterator[tuple[str, HiddenStateSample]]:
        """Decoded samples for `(key, size)` objects, in order; each local file is deleted once read."""
        objects = list(objects)
        too_big = next(((key, size) for key, size in objects if size > self.cache_budget_bytes), None)
        if too_big is not None:
            raise ValueError(
                f"object {too_big[0]} is {too_big[1]} bytes, more than the whole sample cache budget "
                f"({self.cache_budget_bytes} bytes); raise the cache budget"
            )
        self._prepare_cache_dir(objects)
        return self._iterate(objects)

    def _prepare_cache_dir(self, objects: list[tuple[str, int]]) -> None:
        """Keep leftovers that the first prefetch window will use (download skips them); drop the rest,
        so files from an earlier run never push the directory over budget."""
        window: dict[Path, int] = {}
        budget = self.cache_budget_bytes
        for key, size in objects[: self.prefetch_objects]:
            if size > budget:
                break
            window[self.local_path(key)] = size
            budget -= size
        if not self.cache_dir.exists():
            return
        for dirpath, _, filenames in os.walk(self.cache_dir):
            for name in filenames:
                path = Path(dirpath) / name
                if window.get(path) != path.stat().st_size:
                    path.unlink(missing_ok=True)

    def _iterate(self, objects: list[tuple[str, int]]) -> Iterator[tuple[str, HiddenStateSample]]:
        futures: dict[int, Future[Path]] = {}
        consumed = 0
        stop = threading.Event()
        producer_error: list[BaseException] = []
        executor = ThreadPoolExecutor(self.download_threads, thread_name_prefix="sample-download")

        def produce() -> None:
            try:
                for position, (key, size) in enumerate(objects):
                    with self._cond:
                        while not stop.is_set() and (
                            position - consumed >= self.prefetch_objects
                            or self._cached_bytes + size > self.cache_budget_bytes
                        ):
                            self._cond.wait()
                        if stop.is_set():
                            return
                        self._cached_bytes += size
                        self._peak_cached_bytes = max(self._peak_cached_bytes, self._cached_bytes)
                        futures[position] = executor.submit(self._download, key, size)
                        self._cond.notify_all()
            except BaseException as error:  # surfaced to the consumer, never lost in a thread
                producer_error.append(error)
                with self._cond:
                    self._cond.notify_all()

        producer = threading.Thread(target=produce, name="sample-prefetch", daemon=True)
        producer.start()
        try:
            for position, (key, size) in enumerate(objects):
                with self._cond:
                    while position not in futures and not producer_error:
                        self._cond.wait()
                    if producer_error:
                        raise producer_error[0]
                    future = futures.pop(position)
                try:
                    path = future.result()
                    try:
                        sample = read_sample(path)
                    finally:
                        path.unlink(missing_ok=True)  # evict before releasing its bytes
                finally:
                    with self._cond:
                        self._cached_bytes -= size
                        consumed = position + 1
                        self._cond.notify_all()
                if self.config is not None:
                    check_sample_matches(sample, self.config, key)
                yield key, sample
        finally:
            stop.set()
            with self._cond:
                self._cond.notify_all()
            producer.join()
            executor.shutdown(wait=True, cancel_futures=True)
            # Downloaded but never consumed: leave the files (a resumed run reuses them) but give the
            # budget back, so the next iteration starts from an honest count.
            with self._cond:
                for position in futures:
                    self._cached_bytes -= objects[position][1]
                futures.clear()
                self._cond.notify_all()

    def _download(self, key: str, size: int) -> Path:
        path = self.local_path(key)
        if path.is_file() and path.stat().st_size == size:
            with self._cond:
                self._reused += 1
            return path
        path.parent.mkdir(parents=True, exist_ok=True)
        self.store.download(key, path)
        with self._cond:
            self._downloaded += 1
            self._downloaded_bytes += size
        return path
