"""Length-bucketed batching under a token budget, so the target's forward passes carry little padding.

A batch costs `batch_size * longest_sample` tokens (right padding); `plan_batches` keeps that under
the budget. Extraction plans its forward passes with it (training plans by memory: `train.micro_batches`).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch


def _check_budget(max_tokens_per_batch: int, max_batch_size: int | None) -> None:
    if max_tokens_per_batch <= 0:
        raise ValueError(f"max_tokens_per_batch must be positive, got {max_tokens_per_batch}")
    if max_batch_size is not None and max_batch_size <= 0:
        raise ValueError(f"max_batch_size must be positive (or None for no limit), got {max_batch_size}")


def _pack(
    order: Sequence[int],
    lengths: Sequence[int],
    max_tokens_per_batch: int,
    max_batch_size: int | None,
    max_padding_fraction: float | None = None,
) -> list[list[int]]:
    """Greedy packing of `order` (longest first): the first sample of a batch fixes its padded length.

    With `max_padding_fraction`, a batch also closes when the next sample would push its share of
    padded positions over that bound, so padding stays bounded however the lengths are spread."""
    batches: list[list[int]] = []
    batch: list[int] = []
    padded_length = 0
    real_tokens = 0
    for index in order:
        length = lengths[index]
        new_padded = max(padded_length, length)
        full = max_batch_size is not None and len(batch) >= max_batch_size
        computed = (len(batch) + 1) * new_padded
        too_padded = (
            max_padding_fraction is not None
            and computed > 0
            and (computed - real_tokens - length) / computed > max_padding_fraction
        )
        if batch and (full or computed > max_tokens_per_batch or too_padded):
            batches.append(batch)
            batch, new_padded, real_tokens = [], length, 0
        batch.append(index)
        real_tokens += length
        padded_length = new_padded
    if batch:
        batches.append(batch)
    return batches


def plan_batches(
    lengths: Sequence[int],
    max_tokens_per_batch: int,
    max_batch_size: int | None = None,
    max_padding_fraction: float | None = 0.05,
) -> list[list[int]]:
    """Indices into `lengths`, grouped so `len(batch) * max(length) <= max_tokens_per_batch` and each
    batch carries at most `max_padding_fraction` padding (None: no bound).

    Longest batches come first, so an out-of-memory error shows up in the first seconds of a run,
    not hours in. A single sample longer than the budget gets a batch of its own.
    """
    _check_budget(max_tokens_per_batch, max_batch_size)
    for index, length in enumerate(lengths):
        if length < 0:
            raise ValueError(f"sample {index} has negative length {length}")
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    return _pack(order, lengths, max_tokens_per_batch, max_batch_size, max_padding_fraction)


def pad_batch(sequences: Sequence[Sequence[int]], pad_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Right-pad token sequences: `(input_ids [B, T] long, attention_mask [B, T] long)`.

    Right padding keeps every real token at the same position as when the sample runs alone, and
    causal layers (attention and the gated-delta-net recurrence alike) never look ahead at the pads.
    """
    if not sequences:
        raise ValueError("cannot pad an empty batch")
    longest = max(len(sequence) for sequence in sequences)
    input_ids = torch.full((len(sequences), longest), pad_id, dtype=torch.long)
    attention_mask = torch.zeros((len(sequences), longest), dtype=torch.long)
    for row, sequence in enumerate(sequences):
        input_ids[row, : len(sequence)] = torch.as_tensor(list(sequence), dtype=torch.long)
        attention_mask[row, : len(sequence)] = 1
    return input_ids, attention_mask


def padding_fraction(batches: Sequence[Sequence[int]], lengths: Sequence[int]) -> float:
    """Padded tokens / computed tokens over all batches (0.0 when nothing is computed)."""
    computed = sum(len(batch) * max((lengths[i] for i in batch), default=0) for batch in batches)
    real = sum(lengths[i] for batch in batches for i in batch)
    return (computed - real) / computed if computed else 0.0
