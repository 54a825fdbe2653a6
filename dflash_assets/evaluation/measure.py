"""The one speculative measurement: a drafter decoding a prompt set with the target in the loop, beside the
target's own greedy output. The trainer's curve (`training/checkpoint_evaluation.py`), `drafter_evaluations`,
the demo's summary and the benchmark scripts all measure through `measure`, so a run's last curve point and
its `held_out` evaluation at the same step, prompts and budget are the same number.

τ is the mean tokens a verification round produces, as the engines report it (`drafter/speculative.py`
decodes). `measure_beside_floor` adds prompt lookup (the training-free n-gram drafter vLLM and SGLang ship)
on the same prompts and loop: the ratio of the drafter's τ to the floor's is what training bought.

Every speculative output is compared with the target's own greedy output, token by token: an output that
differs is named with the prompt and the first position where it differs, never averaged away (greedy
speculative decoding is lossless: a difference is a tie in the target's logits or a verification bug).
The greedy reference depends only on the target, the prompts and the budget: it is decoded once
(`greedy_reference`) and passed to every measurement of the same prompts.
"""

from __future__ import annotations

import hashlib
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash_assets.drafter.speculative import (
    DecodeResult,
    PromptLookup,
    TargetVerifier,
    by_context_length,
    combine_buckets,
    greedy_decode,
    speculative_decode,
)
from dflash_assets.evaluation.prompt_sets import Prompt, PromptSet

EVALUATION_FORMAT = "dflash-assets.evaluation/1"
FLOOR = "prompt_lookup"


@dataclass(frozen=True)
class LoopFigures:
    """One drafter's decoding of a set of prompts: τ over every round of every prompt, acceptance per draft
    position, τ by context length, and which outputs equal the target's greedy one."""

    tau: float | None
    rounds: int
    tokens: int
    prompts: int
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
            "prompts": self.prompts,
            "acceptance_by_position": self.acceptance_by_position,
            "by_context_length": self.by_context_length,
            "lossless_prompts": self.lossless_prompts,
            "mismatched": self.mismatched,
            "seconds": round(self.seconds, 2),
        }


def loop_figures(
    prompts: Sequence[Prompt],
    results: Sequence[DecodeResult],
    greedy: Sequence[Sequence[int]],
    block_size: int,
    seconds: float,
) -> LoopFigures:
    """The figures of `results` (one per prompt, in order) against the greedy outputs."""
    lengths = [n for result in results for n in result.acceptance_lengths]
    mismatched = []
    for prompt, result, reference in zip(prompts, results, greedy, strict=True):
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
        prompts=len(results),
        acceptance_by_position=_by_position([n - 1 for n in lengths], len(lengths), block_size),
        by_context_length=by_context_length(
            [
                (len(prompt.token_ids), len(result.acceptance_lengths), sum(result.acceptance_lengths))
                for prompt, result in zip(prompts, results, strict=True)
            ]
        ),
        lossless_prompts=len(results) - len(mismatched),
        mismatched=mismatched,
        seconds=seconds,
    )


def _by_position(accepted_drafts: Sequence[int], rounds: int, block_size: int) -> list[float | None]:
    return [
        sum(1 for a in accepted_drafts if a >= p) / rounds if rounds else None for p in range(1, block_size)
    ]


def combine_figures(parts: Sequence[dict[str, Any] | None]) -> dict[str, Any] | None:
    """One `LoopFigures.as_dict()` from several measurements over disjoint prompts (each rank's share; None
    where a rank had none): τ over every round of every prompt, as one measurement of them all gives."""
    parts = [part for part in parts if part and part.get("prompts")]
    if not parts:
        return None
    rounds = sum(int(part["rounds"]) for part in parts)
    accepted = sum((part["tau"] or 0.0) * part["rounds"] for part in parts)
    positions = max(len(part["acceptance_by_position"]) for part in parts)
    by_position = [
        sum((part["acceptance_by_position"][p] or 0.0) * part["rounds"] for part in parts) / rounds
        if rounds
        else None
        for p in range(positions)
    ]
    return {
        "tau": accepted / rounds if rounds else None,
        "rounds": rounds,
        "tokens": sum(int(part["tokens"]) for part in parts),
        "prompts": sum(int(part["prompts"]) for part in parts),
        "acceptance_by_position": by_position,
        "by_context_length": combine_buckets([part.get("by_context_length") or {} for part in parts]),
        "lossless_prompts": sum(int(part["lossless_prompts"]) for part in parts),
        "mismatched": [item for part in parts for item in part["mismatched"]],
        "seconds": max(float(part["seconds"]) for part in parts),
    }


def greedy_reference(
    verifier: TargetVerifier, prompts: Sequence[Prompt], *, max_new_tokens: int, stop_token_ids: set[int]
) -> list[list[int]]:
    """The target's own greedy output of each prompt: what every speculative output must equal."""
    return [greedy_decode(verifier, prompt.token_ids, max_new_tokens, stop_token_ids) for prompt in prompts]


def measure(
    proposer: Any,  # a DFlashDrafter, or a PromptLookup
    verifier: TargetVerifier,
    prompts: Sequence[Prompt],
    greedy: Sequence[Sequence[int]],
    *,
    max_new_tokens: int,
    stop_token_ids: set[int],
    block_size: int,
) -> LoopFigures:
    """`proposer` decoding every prompt speculatively with the target (a drafter in eval mode, restored
    after), its figures against `greedy` (`greedy_reference` of the same prompts and budget)."""
    started = time.monotonic()
    was_training = getattr(proposer, "training", False)
    if was_training:
        proposer.eval()
    try:
        results = [
            speculative_decode(proposer, verifier, prompt.token_ids, max_new_tokens, stop_token_ids)
            for prompt in prompts
        ]
    finally:
        if was_training:
            proposer.train(True)
    return loop_figures(prompts, results, greedy, block_size, time.monotonic() - started)


def reference_precision(device: object) -> str:
    """The precision the target decodes at on `device` and the kernels it runs, as `reference_identity`
    names them: bf16 on CUDA with the card's compute capability, float32 elsewhere with the CPU's vector
    instructions (`AVX2`, `AVX512`). The greedy output differs between precisions, and sums taken in
    another order by another kernel can turn a near tie: a reference kept from another machine is used
    only where it was made the same way."""
    if str(device).startswith("cuda"):
        major, minor = torch.cuda.get_device_capability(torch.device(str(device)))
        return f"bf16 on sm{major}{minor}"
    return f"float32 on {torch.backends.cpu.get_cpu_capability()}"


def reference_identity(
    target: str, precision: str, prompts: Sequence[Prompt], *, max_new_tokens: int, stop_token_ids: set[int]
) -> str:
    """What the target's greedy output of `prompts` and prompt lookup's figures on them depend on, as a
    digest: the target (its name and revision), the precision it runs at (float32 on a CPU, bf16 on a
    GPU: the greedy output differs), every prompt's tokens, the budget and the stop tokens. Any change is
    another identity, so a stored reference is never used for what it was not made from."""
    made_of = {
        "target": target,
        "precision": precision,
        "prompts": [prompt.token_ids for prompt in prompts],
        "max_new_tokens": max_new_tokens,
        "stop_token_ids": sorted(stop_token_ids),
    }
    return hashlib.sha256(json.dumps(made_of, sort_keys=True).encode()).hexdigest()[:32]


def measure_beside_floor(
    verifier: TargetVerifier,
    drafter: Any,  # a DFlashDrafter (its block size is the floor's)
    prompt_set: PromptSet,
    *,
    max_new_tokens: int,
    stop_token_ids: set[int],
    log: Callable[[str], None] = print,
    reference: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """`{"drafter": LoopFigures, "floor": LoopFigures, "ratio", "greedy_seconds", "reference",
    "reference_reused"}` (figures as dicts) of `drafter` and prompt lookup at its block size on every
    prompt of `prompt_set`. `reference` (`{"greedy", "floors"}`, what an earlier evaluation of the same
    `reference_identity` returned) saves the target's greedy decoding and, at the same block size, the
    floor's: only the drafter's loop runs. The returned `reference` is what to keep for the next one."""
    block_size = int(drafter.config.block_size)
    reference = {"greedy": None, "floors": {}, **(reference or {})}
    greedy = reference["greedy"]
    reused = greedy is not None and len(greedy) == len(prompt_set.prompts)
    started = time.monotonic()
    if not reused:
        log(
            f"{prompt_set.name}: the target's greedy output of {len(prompt_set.prompts)} prompts, "
            f"{max_new_tokens} tokens each"
        )
        greedy = greedy_reference(
            verifier, prompt_set.prompts, max_new_tokens=max_new_tokens, stop_token_ids=stop_token_ids
        )
        reference = {"greedy": greedy, "floors": {}}
    else:
        log(f"{prompt_set.name}: the target's greedy output of these prompts, as decoded before")
    greedy_seconds = time.monotonic() - started

    def decode(who: str, proposer: Any) -> LoopFigures:
        log(f"{prompt_set.name}: decoding with {who}")
        return measure(
            proposer,
            verifier,
            prompt_set.prompts,
            greedy,
            max_new_tokens=max_new_tokens,
            stop_token_ids=stop_token_ids,
            block_size=block_size,
        )

    trained = decode("the drafter", drafter)
    floor = reference["floors"].get(str(block_size))
    if floor is None:
        floor = {"drafter": FLOOR, "block_size": block_size}
        floor |= decode(f"prompt lookup (block {block_size})", PromptLookup(block_size)).as_dict()
        reference["floors"] = {**reference["floors"], str(block_size): floor}
    else:
        log(f"{prompt_set.name}: prompt lookup (block {block_size}) as measured before on these prompts")
    ratio = trained.tau / floor["tau"] if trained.tau is not None and floor["tau"] else None
    return {
        "drafter": trained.as_dict(),
        "floor": floor,
        "ratio": ratio,
        "greedy_seconds": round(greedy_seconds, 2),
        "reference": reference,
        "reference_reused": reused,
    }
