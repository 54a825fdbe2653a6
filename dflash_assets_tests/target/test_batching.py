"""Length-bucketed batching: the token budget, little padding, and deterministic training shuffles."""

from __future__ import annotations

import random

import pytest
import torch

from dflash_assets.target.batching import pad_batch, padding_fraction, plan_batches


def random_lengths(n: int = 300, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randint(1, 3000) for _ in range(n)]


def assert_partition_of(batches: list[list[int]], n: int) -> None:
    flat = [i for batch in batches for i in batch]
    assert sorted(flat) == list(range(n)), "every sample exactly once"


def test_every_batch_fits_the_token_budget_and_every_sample_appears_once():
    lengths = random_lengths()
    batches = plan_batches(lengths, max_tokens_per_batch=8192)
    assert_partition_of(batches, len(lengths))
    for batch in batches:
        assert len(batch) * max(lengths[i] for i in batch) <= 8192


def test_a_sample_longer_than_the_budget_gets_a_batch_of_its_own():
    lengths = [100, 5000, 120, 90]
    batches = plan_batches(lengths, max_tokens_per_batch=1000)
    assert [1] in batches
    assert_partition_of(batches, 4)
    assert all(len(batch) * max(lengths[i] for i in batch) <= 1000 for batch in batches if batch != [1])


def test_max_batch_size_caps_samples_per_batch():
    batches = plan_batches([10] * 25, max_tokens_per_batch=10_000, max_batch_size=8)
    assert [len(b) for b in batches] == [8, 8, 8, 1]


def test_longest_batches_come_first_so_out_of_memory_shows_early():
    lengths = random_lengths(seed=3)
    batches = plan_batches(lengths, max_tokens_per_batch=8192)
    padded = [max(lengths[i] for i in batch) for batch in batches]
    assert padded == sorted(padded, reverse=True)


def test_bucketing_pads_far_less_than_batching_in_dataset_order():
    lengths = random_lengths(seed=1)
    bucketed = plan_batches(lengths, max_tokens_per_batch=16384)
    in_order = [list(range(i, min(i + 8, len(lengths)))) for i in range(0, len(lengths), 8)]
    assert padding_fraction(bucketed, lengths) < 0.05
    assert padding_fraction(in_order, lengths) > 0.3


def test_padding_fraction_counts_padded_over_computed_tokens():
    assert padding_fraction([[0, 1]], [2, 4]) == pytest.approx(2 / 8)
    assert padding_fraction([[0], [1]], [2, 4]) == 0.0
    assert padding_fraction([], []) == 0.0


def test_invalid_budgets_are_refused():
    with pytest.raises(ValueError, match="max_tokens_per_batch"):
        plan_batches([1, 2], 0)
    with pytest.raises(ValueError, match="max_batch_size"):
        plan_batches([1, 2], 10, max_batch_size=0)


def test_pad_batch_pads_on_the_right_with_a_matching_mask():
    input_ids, attention_mask = pad_batch([[5, 6, 7], [8]], pad_id=0)
    assert input_ids.dtype == torch.long and attention_mask.dtype == torch.long
    assert input_ids.tolist() == [[5, 6, 7], [8, 0, 0]]
    assert attention_mask.tolist() == [[1, 1, 1], [1, 0, 0]]


def test_planned_batches_keep_padding_under_the_bound_even_for_widely_spread_lengths():
    rng = random.Random(1)
    lengths = [rng.randint(5, 3000) for _ in range(500)]
    batches = plan_batches(lengths, 16384)
    assert sorted(i for batch in batches for i in batch) == list(range(500))
    for batch in batches:
        assert padding_fraction([batch], lengths) <= 0.05 or len(batch) == 1
    unbounded = plan_batches(lengths, 16384, max_padding_fraction=None)
    assert padding_fraction(batches, lengths) < padding_fraction(unbounded, lengths)
