"""DFlash2's two additions to the backbone, each against a hand-computed example: the convolution around
every sublayer (causal along a block, never across blocks, the identity when fresh) and the candidate
selector's walk (unary logit plus the pair term, from the anchor)."""

from __future__ import annotations

import torch

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.model import (
    CandidateSelector,
    DFlash2Drafter,
    DFlashDrafter,
    GroupedDynamicConv,
    drafter_parameter_count,
)


def test_the_convolution_mixes_each_slot_with_the_one_before_it_by_a_static_and_a_dynamic_weight():
    conv = GroupedDynamicConv(hidden_size=4, kernel_size=2, group_size=2)
    with torch.no_grad():
        conv.base_kernel[0, 0] = torch.tensor([1.0, 2.0, 3.0, 4.0])  # tap 0 (the slot itself), per channel
        conv.base_kernel[0, 1] = torch.tensor([0.5, 0.5, 0.0, 0.0])  # tap 1 (the slot before it)
    x = torch.tensor(
        [[[1.0, 1.0, 1.0, 1.0], [2.0, 2.0, 2.0, 2.0], [0.0, 0.0, 0.0, 0.0]]]
    )  # [1 block, S=3, D=4]
    dynamic = torch.zeros(1, 3, 2, 2)  # [block, slot, tap, group]
    dynamic[0, 1, 1, 1] = 10.0  # slot 1 takes 10 x slot 0 into its second group (channels 2, 3)
    out = conv._convolve(x, dynamic, conv.base_kernel[0])
    expected = torch.tensor(
        [
            [1.0, 2.0, 3.0, 4.0],  # slot 0: nothing before it in its block
            [2.0 + 0.5, 4.0 + 0.5, 6.0 + 10.0, 8.0 + 10.0],
            [0.0 + 1.0, 0.0 + 1.0, 0.0, 0.0],
        ]
    )
    torch.testing.assert_close(out[0], expected)


def test_the_convolution_is_causal_along_a_block_and_blocks_never_mix():
    torch.manual_seed(0)
    conv = GroupedDynamicConv(hidden_size=32, kernel_size=2, group_size=16)
    with torch.no_grad():
        conv.base_kernel.normal_()
        conv.kernel_projection.weight.normal_()
    x = torch.randn(1, 3, 8, 32)  # [B, N blocks, S slots, D]
    before, _ = conv.prepare(x)
    changed = x.clone()
    changed[0, 1, 4] += 1.0  # slot 4 of block 1
    after, _ = conv.prepare(changed)
    moved = (after - before).abs().amax(dim=-1)[0]  # [N, S]
    assert moved[1, 4] > 0 and moved[1, 5] > 0  # itself and the slot after it (two taps)
    assert moved[1, :4].max() == 0 and moved[1, 6:].max() == 0  # nothing before it, nothing further on
    assert moved[0].max() == 0 and moved[2].max() == 0  # other blocks untouched: block 2's slot 0 included


def test_a_fresh_dflash2_drafter_computes_what_a_fresh_dflash_drafter_with_the_same_seed_does(
    config: DrafterConfig,
):
    torch.manual_seed(3)
    dflash = DFlashDrafter.from_target(config)
    dflash2_config = DrafterConfig(**{**config.__dict__, "arch": "dflash2", "selector_rank": 16})
    torch.manual_seed(3)
    dflash2 = DFlashDrafter.from_target(dflash2_config)
    assert isinstance(dflash2, DFlash2Drafter)
    size, length = config.block_size, 20
    inputs = (
        torch.full((1, 1, size), config.mask_token_id), (length + torch.arange(size)).view(1, 1, size),
        torch.randn(1, length, config.num_context_layers, config.hidden_size), torch.arange(length)[None],
        torch.tensor([[length]]),
    )  # fmt: skip
    with torch.no_grad():
        torch.testing.assert_close(dflash2(*inputs), dflash(*inputs), rtol=0, atol=0)
    own = sum(p.numel() for p in dflash2.parameters())
    assert own == drafter_parameter_count(dflash2_config) > drafter_parameter_count(config)


def test_the_selector_walks_from_the_anchor_taking_the_best_unary_plus_pair_score_at_each_slot():
    selector = CandidateSelector(hidden_size=2, vocab_size=5, rank=1, top_k=2)
    with torch.no_grad():
        selector.hidden_projection.weight.fill_(1.0)  # W h = h0 + h1
        selector.predecessor_codebook.copy_(torch.tensor([[0.0], [0.0], [2.0], [0.0], [1.0]]))
        selector.successor_codebook.copy_(torch.tensor([[0.0], [3.0], [0.0], [-1.0], [0.0]]))
    hidden = torch.tensor([[1.0, 0.0], [1.0, 0.0]])  # W h = 1 at both slots
    logits = torch.tensor([[0.0, 1.0, 0.0, 1.5, 0.0], [0.0, 1.0, 0.0, 1.5, 0.0]])  # top-2: tokens 3, 1
    # Slot 1, after anchor 4 (P = 1): token 3 scores 1.5 + 1*1*(-1) = 0.5, token 1 scores 1 + 3 = 4: 1.
    # Slot 2, after token 1 (P = 0): the pair term vanishes, so the unary argmax, token 3.
    assert selector.walk(hidden, logits, anchor=4).tolist() == [1, 3]
    # After anchor 0 (P = 0) the pair term vanishes at slot 1 too: the unary argmax at both slots.
    assert selector.walk(hidden, logits, anchor=0).tolist() == [3, 3]
