"""Reading hidden-state objects from the store ahead of training: streamed through memory, or through the
node's cache, where each resident object is downloaded once for the run by whichever rank (process)
needs it first."""

from __future__ import annotations

import contextlib
import os
import time
from pathlib import Path

import pytest
import torch

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.extraction.sample_format import (
    CorruptSampleError,
    read_sample,
    sample_object_name,
    write_sample,
)
from dflash_assets.storage.open_store import open_store
from dflash_assets.storage.store import ObjectStore
from dflash_assets.training.sample_stream import (
    WINDOW_MAX_BYTES,
    NodeCache,
    SampleMismatchError,
    SampleStream,
    decode_sample,
    plan_node_cache,
)

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


def stream(store: ObjectStore, objects, cache: Path | None = None, *, budget: int = 10**8, **kwargs):
    """A stream as one rank's training reads: through the node cache at `cache` with `budget`."""
    layout = plan_node_cache(objects, budget)
    node = NodeCache(store, cache, layout.resident) if cache is not None else None
    if node is not None:
        node.prepare()
    return SampleStream(
        store, window_bytes=kwargs.pop("window_bytes", layout.window_bytes), node_cache=node, **kwargs
    )


def test_samples_arrive_in_the_requested_order_streamed_through_memory(
    store: ObjectStore, tmp_path: Path
) -> None:
    objects = put_samples(store, tmp_path / "scratch", 6)
    order = [objects[i] for i in (4, 0, 5, 2, 1, 3)]
    reader = stream(store, objects, config=drafter_config())

    seen = [(key, sample.sample_index, int(sample.input_ids[0])) for key, sample in reader.iterate(order)]

    assert seen == [(key, i, i) for key, i in ((objects[i][0], i) for i in (4, 0, 5, 2, 1, 3))]
    assert (reader.stats.fetched, reader.stats.cached, reader.stats.ahead_bytes) == (6, 0, 0)


def test_the_read_ahead_never_holds_more_than_its_window(store: ObjectStore, tmp_path: Path) -> None:
    objects = put_samples(store, tmp_path / "scratch", 24)
    size = max(s for _, s in objects)
    reader = stream(store, objects, window_bytes=int(3.5 * size))  # three objects, where threads allow eight
    for _ in reader.iterate(objects):
        time.sleep(0.005)  # a consumer slower than the reads, so the window fills up

    assert 2 * size < reader.stats.peak_ahead_bytes <= int(3.5 * size)


def test_a_resident_object_is_downloaded_once_over_epochs_and_read_from_the_node_cache(
    store: ObjectStore, tmp_path: Path
) -> None:
    objects = put_samples(store, tmp_path / "scratch", 8)
    reader = stream(store, objects, tmp_path / "node")
    for epoch in range(3):
        order = objects[epoch:] + objects[:epoch]
        assert [s.sample_index for _, s in reader.iterate(order)] == [int(k[-20:-12]) for k, _ in order]

    assert (reader.stats.fetched, reader.stats.cached) == (8, 16)
    assert directory_bytes(tmp_path / "node") == sum(size for _, size in objects)


def test_a_budget_smaller_than_the_data_keeps_what_fits_and_streams_the_rest_every_epoch(
    store: ObjectStore, tmp_path: Path
) -> None:
    objects = put_samples(store, tmp_path / "scratch", 10)
    size = max(s for _, s in objects)
    layout = plan_node_cache(objects, int(4.5 * size), held_out=[7, 9])
    assert list(layout.resident) == [objects[7][0], objects[9][0], objects[0][0], objects[1][0]]
    node = NodeCache(store, tmp_path / "node", layout.resident)
    reader = SampleStream(store, window_bytes=layout.window_bytes, node_cache=node)
    for _ in range(3):
        assert len(list(reader.iterate(objects))) == 10

    assert reader.stats.fetched == 4 + 3 * 6 and reader.stats.cached == 2 * 4
    assert directory_bytes(tmp_path / "node") <= int(4.5 * size)


def test_leftovers_in_the_node_cache_that_the_run_will_not_read_are_removed(
    store: ObjectStore, tmp_path: Path
) -> None:
    objects = put_samples(store, tmp_path / "scratch", 4)
    node_dir = tmp_path / "node"
    keep = NodeCache(store, node_dir, dict(objects[:1]))
    keep.fetch(*objects[0])
    stray = node_dir / "hidden-states" / "other" / "hs_00000099.safetensors"
    stray.parent.mkdir(parents=True)
    stray.write_bytes(b"x" * 100)
    abandoned = keep.local_path(objects[1][0]).with_name(
        ".hs_00000001.safetensors.0123456789ab.dflash-partial"
    )
    abandoned.write_bytes(b"half")

    NodeCache(store, node_dir, dict(objects[:1])).prepare()

    assert keep.local_path(objects[0][0]).exists()
    assert not stray.exists() and not abandoned.exists()


def _read_epochs(store_root: str, node_dir: str, objects, epochs, rank: int, queue) -> None:
    reader = stream(open_store(store_root), objects, Path(node_dir))
    indices = []
    for epoch in range(epochs):
        share = objects[(epoch + rank) % 2 :: 2]  # each epoch, the other half of the objects
        indices += [s.sample_index for _, s in reader.iterate(share)]
    queue.put((rank, reader.stats.fetched, sorted(indices)))


@pytest.mark.slow  # two processes
def test_two_ranks_sharing_the_node_cache_download_each_object_once_as_their_shares_move(
    store: ObjectStore, tmp_path: Path
) -> None:
    import multiprocessing

    objects = put_samples(store, tmp_path / "scratch", 16)
    context = multiprocessing.get_context("spawn")
    queue = context.Queue()
    ranks = [
        context.Process(
            target=_read_epochs, args=(store.url, str(tmp_path / "node"), objects, 3, rank, queue)
        )
        for rank in (0, 1)
    ]
    for process in ranks:
        process.start()
    results = sorted(queue.get(timeout=120) for _ in ranks)
    for process in ranks:
        process.join(timeout=60)

    assert sum(fetched for _, fetched, _ in results) == 16  # each object once for the node
    assert all(len(indices) == 3 * 8 for _, _, indices in results)


def test_an_object_larger_than_the_read_ahead_window_is_refused_naming_it(
    store: ObjectStore, tmp_path: Path
) -> None:
    objects = put_samples(store, tmp_path / "scratch", 2)
    reader = SampleStream(store, window_bytes=objects[0][1] - 1)
    with pytest.raises(ValueError, match=f"{objects[0][0]}.*read-ahead window"):
        reader.iterate(objects)


def test_stopping_early_gives_the_window_back(store: ObjectStore, tmp_path: Path) -> None:
    objects = put_samples(store, tmp_path / "scratch", 8)
    reader = stream(store, objects, prefetch_objects=4)
    samples = reader.iterate(objects)
    next(samples)
    samples.close()
    assert reader.stats.ahead_bytes == 0
    assert [s.sample_index for _, s in reader.iterate(objects[5:])] == [5, 6, 7]


def test_decoding_in_place_gives_what_read_sample_gives(store: ObjectStore, tmp_path: Path) -> None:
    objects = put_samples(store, tmp_path / "scratch", 1)
    data = store.get_bytes(objects[0][0])
    ours, theirs = decode_sample(data, "x"), read_sample(data)
    for name in ("input_ids", "loss_mask", "hidden_states"):
        assert torch.equal(getattr(ours, name), getattr(theirs, name))
    assert (ours.sample_index, ours.target_layer_ids, ours.metadata) == (
        theirs.sample_index,
        theirs.target_layer_ids,
        theirs.metadata,
    )
    with pytest.raises(CorruptSampleError, match="bytes but the header describes"):
        decode_sample(data[:-1], "x")


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
    reader = stream(store, objects, config=drafter_config(**overrides))
    with pytest.raises(SampleMismatchError, match=message) as error:
        list(reader.iterate(objects))
    assert objects[0][0] in str(error.value) and "partition 00000100-00000199" in str(error.value)


def test_samples_stream_from_s3_with_one_get_an_object_and_no_head(
    s3_store_url: str, faulty_proxy, tmp_path: Path
) -> None:
    from dflash_assets.storage.s3_store import S3Settings

    objects = put_samples(open_store(s3_store_url), tmp_path / "scratch", 5)
    proxy = faulty_proxy()
    store = open_store(s3_store_url, S3Settings(endpoint_url=proxy.endpoint_url))
    reader = stream(store, objects, tmp_path / "node", budget=3 * objects[0][1], config=drafter_config())
    for _ in range(2):
        assert [s.sample_index for _, s in reader.iterate(objects)] == [0, 1, 2, 3, 4]

    assert proxy.counters.by_method == {"GET": 3 + 2 * 2}  # three stay resident, two are read twice


def test_the_read_ahead_window_is_a_few_objects_of_long_samples_never_32_of_them() -> None:
    mib = 2**20
    seeds = plan_node_cache([(f"hs_{i}", 118 * mib) for i in range(100)], 0)  # ~2 K tokens, 27B width
    eight_k = plan_node_cache([(f"hs_{i}", 480 * mib) for i in range(100)], 0)
    long = plan_node_cache([(f"hs_{i}", 1920 * mib) for i in range(100)], 0)  # 32 K tokens
    longer = plan_node_cache([(f"hs_{i}", 3840 * mib) for i in range(100)], 0)  # 64 K tokens
    assert seeds.window_bytes == 32 * 118 * mib  # under the cap: 32 mean objects
    assert eight_k.window_bytes == WINDOW_MAX_BYTES == 4 * 2**30  # not 32 x 480 MiB = 15 GiB a rank
    assert long.window_bytes == WINDOW_MAX_BYTES and long.window_bytes // (1920 * mib) == 2
    assert longer.window_bytes == 2 * 3840 * mib  # at least two of the largest
