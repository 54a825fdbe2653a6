"""A drafter measured on one prompt set, beside the free floor: the target decodes every prompt greedily
three times, alone (the reference), with the trained drafter and with prompt lookup (the training-free
n-gram drafter vLLM and SGLang ship), both by the product's speculative loop (`drafter/speculative.py`,
the target verifying every block). τ is the mean tokens a verification round produces, as the engines
report it; the ratio to the floor's τ is what training bought.

Every speculative output is compared with the target's own greedy output, token by token: an output that
differs is named with the prompt and the first position where it differs, never averaged away (greedy
speculative decoding is lossless: a difference is a tie in the target's logits or a verification bug).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dflash_assets.drafter.speculative import (
    DecodeResult,
    PromptLookup,
    TargetVerifier,
    by_context_length,
    greedy_decode,
    speculative_decode,
)
from dflash_assets.evaluation.prompt_sets import PromptSet

EVALUATION_FORMAT = "dflash-assets.evaluation/1"
FLOOR = "prompt_lookup"


@dataclass(frozen=True)
class LoopFigures:
    """One drafter's decoding of a set: τ over every round of every prompt, acceptance per draft
    position, τ by context length, and which outputs equal the target's greedy one."""

    tau: float | None
    rounds: int
    tokens: int
    acceptance_by_position: list[float | None]  # [p-1]: share of rounds that accepted at least p drafts
    by_context_length: dict[str, dict[str, Any]]
    lossless_prompts: int
    mismatched: list[dict[str, Any]]  # {"prompt", "first_difference"} per output unequal to greedy
    seconds: float

    def as_dict(self) -> dict[str, Any]:
        return {
            "tau": self.tau,
            "rounds": self.rounds,
            "tokens": self.tokens,
            "acceptance_by_position": self.acceptance_by_position,
            "by_context_length": self.by_context_length,
            "lossless_prompts": self.lossless_prompts,
            "mismatched": self.mismatched,
            "seconds": round(self.seconds, 2),
        }


def loop_figures(
    prompt_set: PromptSet,
    results: Sequence[DecodeResult],
    greedy: Sequence[Sequence[int]],
    block_size: int,
    seconds: float,
) -> LoopFigures:
    """The figures of `results` (one per prompt of `prompt_set`, in order) against the greedy outputs."""
    lengths = [n for result in results for n in result.acceptance_lengths]
    accepted_drafts = [n - 1 for n in lengths]
    by_position = [
        sum(1 for a in accepted_drafts if a >= p) / len(lengths) if lengths else None
        for p in range(1, block_size)
    ]
    mismatched = []
    for prompt, result, reference in zip(prompt_set.prompts, results, greedy, strict=True):
        if list(result.tokens) != list(reference):
            first = next(
                (i for i, (a, b) in enumerate(zip(result.tokens, reference, strict=False)) if a != b),
                min(len(result.tokens), len(reference)),
            )
            mismatched.append({"prompt": prompt.location, "first_difference": first})
    return LoopFigures(
        tau=sum(lengths) / len(lengths) if lengths else None,
        rounds=len(lengths),
        tokens=sum(len(result.tokens) for result in results),
        acceptance_by_position=by_position,
        by_context_length=by_context_length(
            [
                (len(prompt.token_ids), len(result.acceptance_lengths), sum(result.acceptance_lengths))
                for prompt, result in zip(prompt_set.prompts, results, strict=True)
            ]
        ),
        lossless_prompts=len(results) - len(mismatched),
        mismatched=mismatched,
        seconds=seconds,
    )


def measure_prompt_set(
    verifier: TargetVerifier,
    drafter: Any,  # a DFlashDrafter (its block size is the floor's)
    prompt_set: PromptSet,
    *,
    max_new_tokens: int,
    stop_token_ids: set[int],
    log: Callable[[str], None] = print,
) -> dict[str, Any]:
    """`{"drafter": LoopFigures, "floor": LoopFigures, "ratio", "greedy_seconds"}` (figures as dicts) of
    `drafter` and prompt lookup at its block size on every prompt of `prompt_set`."""
    block_size = int(drafter.config.block_size)
    prompts = [prompt.token_ids for prompt in prompt_set.prompts]
    started = time.monotonic()
    log(
        f"{prompt_set.name}: the target's greedy output of {len(prompts)} prompts, {max_new_tokens} tokens "
        "each"
    )
    greedy = [greedy_decode(verifier, prompt, max_new_tokens, stop_token_ids) for prompt in prompts]
    greedy_seconds = time.monotonic() - started

    def decode(who: str, proposer: Any) -> LoopFigures:
        log(f"{prompt_set.name}: decoding with {who}")
        began = time.monotonic()
        results = [
            speculative_decode(proposer, verifier, prompt, max_new_tokens, stop_token_ids)
            for prompt in prompts
        ]
        return loop_figures(prompt_set, results, greedy, block_size, time.monotonic() - began)

    was_training = drafter.training
    drafter.eval()
    try:
        trained = decode("the drafter", drafter)
    finally:
        drafter.train(was_training)
    floor = decode(f"prompt lookup (block {block_size})", PromptLookup(block_size=block_size))
    ratio = trained.tau / floor.tau if trained.tau is not None and floor.tau else None
    return {
        "drafter": trained.as_dict(),
        "floor": {"drafter": FLOOR, "block_size": block_size, **floor.as_dict()},
        "ratio": ratio,
        "greedy_seconds": round(greedy_seconds, 2),
    }
