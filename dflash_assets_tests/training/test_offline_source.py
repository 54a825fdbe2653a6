"""The offline source as the trainer drives it: a micro-batch prepared before its samples are yielded is
collated on another thread and handed over by `collate`; held-out samples read in between do not take
its place, and a pass that ends first leaves nothing waiting."""

from __future__ import annotations

import threading
from pathlib import Path

import torch

from dflash_assets.storage.open_store import open_store
from dflash_assets.training.data import OfflineData, OfflineSource, collate_hidden_state_samples
from dflash_assets.training.settings import TrainSettings
from dflash_assets_tests.training.test_sample_stream import drafter_config, put_samples


def source_of(tmp_path: Path, count: int = 12) -> OfflineSource:
    store = open_store(str(tmp_path / "store"))
    objects = put_samples(store, tmp_path / "scratch", count)
    settings = TrainSettings(mode="offline", eval_samples=2, max_length=64)
    source = OfflineSource(OfflineData(store, objects, tmp_path / "cache"), drafter_config(), settings)
    source.setup_streams([0, 1])
    return source


def assert_same_batch(one, other) -> None:
    assert one.sample_indices == other.sample_indices
    for name in ("input_ids", "loss_mask", "hidden_states", "lengths"):
        assert torch.equal(getattr(one, name), getattr(other, name)), name


def test_a_micro_batch_prepared_before_its_samples_arrive_is_collated_off_the_training_thread(tmp_path):
    source = source_of(tmp_path)
    ids = list(range(2, 12))
    samples = source.iterate(ids)
    first = [next(samples) for _ in range(3)]
    assert_same_batch(source.collate(first), collate_hidden_state_samples(first, 64))

    collated_on: list[str] = []
    original = source._collate_now

    def spy(batch_samples):
        collated_on.append(threading.current_thread().name)
        return original(batch_samples)

    source._collate_now = spy
    source.prepare(ids[3:6])  # the next step's first micro-batch: not yielded yet
    # Held-out samples evaluated in between are collated here and leave the prepared batch alone.
    held_out = list(source.iterate([0, 1], "eval"))
    source.collate(held_out)
    later = [next(samples) for _ in range(3)]
    batch = source.collate(later)

    assert_same_batch(batch, collate_hidden_state_samples(later, 64))
    # The prepared batch on the collate-ahead thread, the held-out one here: in either order, since the
    # thread collates only once its samples arrive, which may be after the held-out ones are collated.
    ahead = [name for name in collated_on if name.startswith("collate-ahead")]
    assert len(ahead) == 1 and sorted(collated_on) == sorted([*ahead, threading.current_thread().name])
    assert source._pending is None
    samples.close()


def test_a_pass_that_ends_before_a_prepared_batch_arrives_leaves_nothing_waiting(tmp_path):
    source = source_of(tmp_path)
    samples = source.iterate(list(range(2, 12)))
    next(samples)
    source.prepare([8, 9])
    samples.close()  # the run reached its last step
    source.iterate([2, 3])  # the next pass drops what was prepared for the old one
    assert source._pending is None
    assert source._ahead is None or source._ahead.submit(lambda: 1).result(timeout=10) == 1
