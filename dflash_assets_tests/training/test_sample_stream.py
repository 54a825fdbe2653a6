"""Streaming hidden-state objects from the store through a bounded local cache."""

from __future__ import annotations

import contextlib
import os
import shutil
import threading
import time
from pathlib import Path

import pytest
import torch

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.extraction.sample_format import sample_object_name, write_sample
from dflash_assets.storage.open_store import open_store
from dflash_assets.storage.store import ObjectStore
from dflash_assets.training.sample_stream import SampleMismatchError, SampleStream

LAYERS = [1, 2, 3]
HIDDEN = 32
TARGET = "tiny-target"


def drafter_config(**overrides: object) -> DrafterConfig:
    fields = {
        "hidden_size": HIDDEN,
        "num_heads": 2,
        "num_kv_heads": 1,
        "head_dim": 16,
        "intermediate_size": 64,
        "vocab_size": 100,
        "mask_token_id": 99,
        "target_layer_ids": LAYERS,
        "target_num_hidden_layers": 6,
        "target_model": TARGET,
    }
    return DrafterConfig(**{**fields, **overrides})


def put_samples(
    store: ObjectStore,
    scratch: Path,
    count: int,
    *,
    partition: str = "00000000-00000099",
    num_tokens: int = 40,
) -> list[tuple[str, int]]:
    scratch.mkdir(parents=True, exist_ok=True)
    objects = []
    for index in range(count):
        path = scratch / sample_object_name(index)
        write_sample(
            path,
            sample_index=index,
            input_ids=torch.full((num_tokens,), index),
            loss_mask=torch.ones(num_tokens, dtype=torch.uint8),
            hidden_states=torch.randn(num_tokens, len(LAYERS), HIDDEN),
            target_layer_ids=LAYERS,
            target_model=TARGET,
        )
        key = f"hidden-states/{partition}/{path.name}"
        objects.append((key, store.put_file(key, path).size))
        path.unlink()
    return objects


def directory_bytes(directory: Path) -> int:
    total = 0
    for dirpath, _, filenames in os.walk(directory):
        for name in filenames:
            with contextlib.suppress(FileNotFoundError):  # evicted while we looked
                total += (Path(dirpath) / name).stat().st_size
    return total


@pytest.fixture
def store(tmp_path: Path) -> ObjectStore:
    return open_store(str(tmp_path / "store"))


def test_samples_arrive_in_the_requested_order_and_the_cache_ends_empty(
    store: ObjectStore, tmp_path: Path
) -> None:
    objects = put_samples(store, tmp_path / "scratch", 6)
    order = [objects[i] for i in (4, 0, 5, 2, 1, 3)]
    stream = SampleStream(store, tmp_path / "cache", cache_budget_bytes=10**7, config=drafter_config())

    seen = [(key, sample.sample_index, int(sample.input_ids[0])) for key, sample in stream.iterate(order)]

    assert seen == [(key, i, i) for key, i in ((objects[i][0], i) for i in (4, 0, 5, 2, 1, 3))]
    assert directory_bytes(tmp_path / "cache") == 0
    assert stream.stats.cached_bytes == 0 and stream.stats.downloaded == 6


def test_the_cache_never_holds_more_than_its_budget(store: ObjectStore, tmp_path: Path) -> None:
    objects = put_samples(store, tmp_path / "scratch", 24)
    size = max(s for _, s in objects)
    budget = int(3.5 * size)  # room for three objects, while prefetch alone would allow eight
    stream = SampleStream(
        store, tmp_path / "cache", cache_budget_bytes=budget, prefetch_objects=8, download_threads=4
    )
    high_water = 0
    done = threading.Event()

    def watch() -> None:
        nonlocal high_water
        while not done.is_set():
            high_water = max(high_water, directory_bytes(tmp_path / "cache"))

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        for _ in stream.iterate(objects):
            time.sleep(0.005)  # a consumer slower than the downloads, so prefetch fills up
    finally:
        done.set()
        watcher.join()

    assert 0 < high_water <= budget
    assert stream.stats.peak_cached_bytes <= budget
    assert stream.stats.peak_cached_bytes > 2 * size  # it did prefetch, up to what the budget allows


def test_an_object_larger_than_the_whole_budget_is_refused_naming_it(
    store: ObjectStore, tmp_path: Path
) -> None:
    objects = put_samples(store, tmp_path / "scratch", 2)
    stream = SampleStream(store, tmp_path / "cache", cache_budget_bytes=objects[0][1] - 1)
    with pytest.raises(ValueError, match=f"{objects[0][0]}.*raise the cache budget"):
        stream.iterate(objects)


def test_a_file_already_cached_at_the_right_size_is_not_downloaded_again(
    store: ObjectStore, tmp_path: Path
) -> None:
    objects = put_samples(store, tmp_path / "scratch", 4)
    stream = SampleStream(store, tmp_path / "cache", cache_budget_bytes=10**7)
    first_key = objects[0][0]
    stream.local_path(first_key).parent.mkdir(parents=True)
    shutil.copy(store.uri(first_key), stream.local_path(first_key))
    stray = tmp_path / "cache" / "left-over.tmp"
    stray.write_bytes(b"x" * 100)

    indices = [sample.sample_index for _, sample in stream.iterate(objects)]

    assert indices == [0, 1, 2, 3]
    assert (stream.stats.reused, stream.stats.downloaded) == (1, 3)
    assert not stray.exists()  # files no one will read do not eat into the budget


def test_stopping_early_gives_the_budget_back(store: ObjectStore, tmp_path: Path) -> None:
    objects = put_samples(store, tmp_path / "scratch", 8)
    stream = SampleStream(store, tmp_path / "cache", cache_budget_bytes=10**7, prefetch_objects=4)
    samples = stream.iterate(objects)
    next(samples)
    samples.close()
    assert stream.stats.cached_bytes == 0
    assert [s.sample_index for _, s in stream.iterate(objects[5:])] == [5, 6, 7]


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        (
            {"target_layer_ids": [1, 2, 4]},
            r"target layers \[1, 2, 3\] but the drafter is configured for \[1, 2, 4\]",
        ),
        ({"hidden_size": 48}, "hidden size 32 but the drafter expects target hidden size 48"),
        ({"target_model": "other-model"}, "target model 'tiny-target' .* for 'other-model'"),
    ],
)
def test_a_sample_captured_for_another_target_is_rejected_naming_object_partition_and_values(
    store: ObjectStore, tmp_path: Path, overrides: dict[str, object], message: str
) -> None:
    objects = put_samples(store, tmp_path / "scratch", 2, partition="00000100-00000199")
    stream = SampleStream(
        store, tmp_path / "cache", cache_budget_bytes=10**7, config=drafter_config(**overrides)
    )
    with pytest.raises(SampleMismatchError, match=message) as error:
        list(stream.iterate(objects))
    assert objects[0][0] in str(error.value) and "partition 00000100-00000199" in str(error.value)


def test_samples_stream_from_s3(s3_store_url: str, tmp_path: Path) -> None:
    store = open_store(s3_store_url)
    objects = put_samples(store, tmp_path / "scratch", 5)
    stream = SampleStream(
        store, tmp_path / "cache", cache_budget_bytes=2 * objects[0][1], config=drafter_config()
    )
    assert [s.sample_index for _, s in stream.iterate(objects)] == [0, 1, 2, 3, 4]
    assert stream.stats.peak_cached_bytes <= 2 * objects[0][1]
