"""A decoding's figures, worked by hand: τ over every round of every prompt, acceptance per draft position,
τ by context length, and every output unequal to the target's greedy one named with where it first
differs."""

from __future__ import annotations

import pytest

from dflash_assets.drafter.speculative import DecodeResult
from dflash_assets.evaluation.measure import loop_figures
from dflash_assets.evaluation.prompt_sets import Prompt

SHORT, LONG = Prompt("line 1", [1, 2, 3]), Prompt("line 9", [7] * 3000)


def test_tau_acceptance_per_position_and_by_context_length_are_the_rounds_counted_by_hand():
    prompts = [SHORT, LONG]
    results = [
        # The prefill gives the first token; then rounds of 3, 1 and 2 tokens (2, 0 and 1 drafts accepted).
        DecodeResult(tokens=[10, 11, 12, 13, 14, 15, 16], acceptance_lengths=[3, 1, 2]),
        DecodeResult(tokens=[20, 21, 22, 23, 24], acceptance_lengths=[4]),  # every draft of a block of 4
    ]
    greedy = [[10, 11, 12, 13, 14, 15, 16], [20, 21, 22, 23, 24]]
    figures = loop_figures(prompts, results, greedy, block_size=4, seconds=1.234)

    assert figures.tau == pytest.approx((3 + 1 + 2 + 4) / 4)
    assert (figures.rounds, figures.tokens, figures.prompts) == (4, 12, 2)
    # Drafts accepted per round: 2, 0, 1, 3. Position p: the share of rounds accepting p drafts or more.
    assert figures.acceptance_by_position == pytest.approx([3 / 4, 2 / 4, 1 / 4])
    assert figures.by_context_length == {
        "under_2k": {"prompts": 1, "rounds": 3, "accepted": 6, "tau": 2.0,
                     "enough_prompts": False},
        "2k_8k": {"prompts": 1, "rounds": 1, "accepted": 4, "tau": 4.0,
                  "enough_prompts": False},
    }  # fmt: skip
    assert (figures.lossless_prompts, figures.mismatched) == (2, [])
    assert figures.as_dict()["seconds"] == 1.23


def test_an_output_unequal_to_the_targets_greedy_one_is_named_with_its_first_differing_position():
    third = Prompt("line 12", [4, 5])
    prompts = [SHORT, LONG, third]
    results = [
        DecodeResult(tokens=[10, 11, 12, 13], acceptance_lengths=[3]),
        DecodeResult(tokens=[20, 21, 99, 23, 24], acceptance_lengths=[2, 2]),
        DecodeResult(tokens=[30, 31], acceptance_lengths=[1]),  # stopped early: greedy goes on
    ]
    greedy = [[10, 11, 12, 13], [20, 21, 22, 23, 24], [30, 31, 32]]
    figures = loop_figures(prompts, results, greedy, block_size=4, seconds=0.0)
    assert figures.lossless_prompts == 1
    assert figures.mismatched == [
        {"prompt": "line 9", "first_difference": 2},
        {"prompt": "line 12", "first_difference": 2},
    ]
    assert figures.as_dict()["mismatched"] == figures.mismatched


def test_prompts_that_stop_at_once_leave_tau_unmeasured_not_zero():
    prompts = [SHORT]
    figures = loop_figures(prompts, [DecodeResult(tokens=[2], acceptance_lengths=[])], [[2]], 4, 0.0)
    assert figures.tau is None and figures.rounds == 0
    assert figures.acceptance_by_position == [None, None, None]
    assert figures.lossless_prompts == 1


def test_a_reference_is_named_by_the_precision_and_kernels_that_made_it(monkeypatch):
    """A greedy output kept from a CPU with other vector instructions, or from another card, is another
    identity: sums in another order can turn a near tie, and the lossless check would blame the drafter."""
    import torch

    from dflash_assets.evaluation.measure import reference_identity, reference_precision

    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX2")
    avx2 = reference_precision("cpu")
    monkeypatch.setattr(torch.backends.cpu, "get_cpu_capability", lambda: "AVX512")
    avx512 = reference_precision(torch.device("cpu"))
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device: (9, 0))
    assert (avx2, avx512, reference_precision("cuda:0")) == (
        "float32 on AVX2",
        "float32 on AVX512",
        "bf16 on sm90",
    )

    def identity(precision: str, prompts=(SHORT,), new_tokens: int = 64) -> str:
        return reference_identity("t", precision, prompts, max_new_tokens=new_tokens, stop_token_ids={2})

    assert identity(avx2) == identity("float32 on AVX2")  # the same making: the same name
    assert len({identity(avx2), identity(avx512), identity("bf16 on sm90"), identity(avx2, (LONG,)),
                identity(avx2, new_tokens=32)}) == 5  # fmt: skip
