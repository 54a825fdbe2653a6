"""What torch.compile makes of the drafter's flex attention: a few versions, compiled once, whatever
layers, lengths, batch sizes and gradient modes follow (counted on the CPU with `aot_eager`,
`support/compiled_flex.py`)."""

from __future__ import annotations

import pytest
import torch

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.model import DFlashDrafter
from dflash_assets.drafter.objective import (
    DrafterBatch,
    Objective,
    anchor_generator,
    dflash_loss,
    sample_anchors,
)
from dflash_assets_tests.support.compiled_flex import compiled_graphs, flex_compiled_on_cpu

# The versions a drafter's flex path may compile: the block mask, and the attention with gradients and
# without. A micro-batch's sequences reach both packed into one row, so one sequence and several share them.
VERSIONS = 1 + 2


def sliding_and_full(config: DrafterConfig, window: int) -> DrafterConfig:
    fields = {**config.__dict__, "layer_types": ["sliding_attention", "full_attention"]}
    return DrafterConfig(**{**fields, "sliding_window": window})


def batch_of(config: DrafterConfig, lengths: list[int], seed: int) -> DrafterBatch:
    generator = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    input_ids = torch.randint(0, config.mask_token_id, (len(lengths), longest), generator=generator)
    loss_mask = torch.zeros(len(lengths), longest, dtype=torch.bool)
    for row, length in enumerate(lengths):
        loss_mask[row, 2:length] = True
    shape = (len(lengths), longest, config.num_context_layers, config.target_hidden_size)
    hidden_states = torch.randn(shape, generator=generator).bfloat16()
    return DrafterBatch(input_ids, loss_mask, hidden_states, torch.tensor(lengths), list(range(len(lengths))))


def loss_step(drafter: DFlashDrafter, lengths: list[int], *, grad: bool, num_anchors: int, seed: int) -> None:
    batch = batch_of(drafter.config, lengths, seed)
    anchors = sample_anchors(
        batch.loss_mask, num_anchors, [anchor_generator(0, seed, i) for i in batch.sample_indices]
    )
    with torch.set_grad_enabled(grad):
        output = dflash_loss(drafter, batch, anchors, Objective())
        if grad:
            output.weighted_ce.backward()
    drafter.zero_grad(set_to_none=True)


@pytest.mark.slow  # compiles three versions on the CPU: a minute or more
def test_sliding_and_full_layers_compile_a_bounded_set_of_versions_whatever_the_lengths_and_grad_mode(
    config: DrafterConfig, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A limit of 4 per function: the fifth version of the mask or of the attention is an error here, where
    # a GPU would fall back to flex attention uncompiled (the full score matrix).
    with flex_compiled_on_cpu(monkeypatch, recompile_limit=4):
        torch.manual_seed(0)
        drafter = DFlashDrafter.from_target(sliding_and_full(config, window=12)).set_attention_backend("flex")
        # Every kind of call once: training (gradients), evaluation (none), speculative drafting (one block).
        loss_step(drafter, [40], grad=True, num_anchors=8, seed=0)
        loss_step(drafter, [44, 30], grad=True, num_anchors=8, seed=1)
        loss_step(drafter, [36], grad=False, num_anchors=8, seed=2)
        loss_step(drafter, [50, 41, 20], grad=False, num_anchors=8, seed=3)
        drafter.eval()
        with torch.no_grad():
            drafter.draft_block(torch.randn(9, config.num_context_layers, config.target_hidden_size), 5)
        drafter.train()
        first = compiled_graphs()
        # One mask rule for both layer types: the sliding layer compiles nothing of its own.
        assert first == VERSIONS

        # Then other lengths, batch sizes, anchor counts and context lengths: nothing new compiles.
        for seed, (lengths, grad) in enumerate(
            [([70, 64, 61, 12], True), ([25], True), ([90, 33], False), ([130], False), ([81, 80, 79], True)],
            start=10,
        ):
            loss_step(drafter, lengths, grad=grad, num_anchors=16, seed=seed)
        drafter.eval()
        with torch.no_grad():
            for context in (3, 150):
                drafter.draft_block(
                    torch.randn(context, config.num_context_layers, config.target_hidden_size), 5
                )
        assert compiled_graphs() == first
