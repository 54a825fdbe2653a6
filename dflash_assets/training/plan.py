"""Which samples each optimiser step trains on: the held-out split, the shuffled global batches of an
epoch (a pure function of seed and epoch, so resume is exact at any world size), each rank's share of a
global batch, and micro-batches that fit memory."""

from __future__ import annotations

import random
from collections.abc import Sequence

import torch

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.objective import anchors_per_sequence, estimate_step_bytes
from dflash_assets.training.settings import TrainSettings

GIB = 2**30


def split_eval(num_samples: int, eval_samples: int, seed: int) -> tuple[list[int], list[int]]:
    """(train ids, held-out ids): a fixed random choice for the seed, at least one sample left to train."""
    count = min(eval_samples, num_samples - 1) if num_samples > 1 else 0
    held_out = sorted(random.Random(f"dflash-eval:{seed}").sample(range(num_samples), count))
    held = set(held_out)
    return [i for i in range(num_samples) if i not in held], held_out


def epoch_plan(
    source_lengths: Sequence[int], train_ids: Sequence[int], settings: TrainSettings, epoch: int
) -> list[list[int]]:
    """Epoch `epoch`'s optimiser steps as lists of sample ids: a fresh shuffle for (seed, epoch), cut into
    global batches of `global_batch_size` sequences (the last may be smaller). Within a step, samples
    are ordered longest first, so micro-batches of neighbours carry little padding."""
    order = list(train_ids)
    random.Random(f"dflash-epoch:{settings.seed}:{epoch}").shuffle(order)
    size = settings.global_batch_size
    steps = [order[start : start + size] for start in range(0, len(order), size)]
    return [sorted(step, key=lambda i: (-source_lengths[i], i)) for step in steps]


def rank_share(ids: Sequence[int], lengths: Sequence[int], world_size: int, rank: int) -> list[int]:
    """Rank `rank`'s share of one global batch `ids` (longest first): each sample goes, longest first,
    to the rank with the fewest tokens so far (then the fewest samples, then the lowest rank), so the
    ranks' steps take about as long. A pure function of the batch and the world size: every rank
    computes every share alike, and together the shares are the batch, each sample once."""
    if world_size == 1:
        return list(ids)
    tokens, counts = [0] * world_size, [0] * world_size
    mine: list[int] = []
    for index in ids:
        chosen = min(range(world_size), key=lambda r: (tokens[r], counts[r], r))
        tokens[chosen] += lengths[index]
        counts[chosen] += 1
        if chosen == rank:
            mine.append(index)
    return mine


def micro_batches(
    ids: Sequence[int],
    lengths: Sequence[int],
    config: DrafterConfig,
    settings: TrainSettings,
    budget_bytes: int,
    attention: str = "materialised",
) -> list[list[int]]:
    """`ids` (longest first) cut into consecutive micro-batches whose estimated activation memory
    (`estimate_step_bytes` for the `attention` backend that runs, padded to the longest sample and its
    anchor count) fits `budget_bytes`. A sample that alone exceeds the budget still gets a micro-batch of
    its own."""
    batches: list[list[int]] = []
    for index in ids:
        candidate = [*batches[-1], index] if batches else [index]
        longest = max(lengths[i] for i in candidate)
        # The most anchors a row of this micro-batch can get: its longest sequence's, all labelled.
        blocks = max(
            1,
            min(longest - 1, anchors_per_sequence(longest, settings.num_anchors, settings.tokens_per_anchor)),
        )
        estimate = estimate_step_bytes(config, len(candidate), longest, blocks, attention=attention)
        if batches and estimate <= budget_bytes:
            batches[-1] = candidate
        else:
            batches.append([index])
    return batches


def default_micro_batch_bytes(device: torch.device, reserved_bytes: int) -> int:
    """Activation memory for one micro-batch: on CUDA, 70 % of what is free once weights and optimiser
    state (`reserved_bytes`) are in place; on the CPU, 4 GiB."""
    if device.type == "cuda":
        free, _ = torch.cuda.mem_get_info(device)
        return max(GIB // 4, int((free - reserved_bytes) * 0.7))
    return 4 * GIB
