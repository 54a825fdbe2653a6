"""Evaluation records as `drafter_evaluations` stores them, made by hand for the tests of what reads them
(the check, the summary, `dflash-assets compare`)."""

from __future__ import annotations

from typing import Any

from dflash_assets.evaluation.prompt_sets import Prompt, PromptSet
from dflash_assets.evaluation.report import build_record


def figures(tau: float | None, lossless: int = 2) -> dict[str, Any]:
    return {
        "tau": tau,
        "rounds": 10,
        "tokens": 40,
        "acceptance_by_position": [0.9, 0.5, 0.2],
        "by_context_length": {},
        "lossless_prompts": lossless,
        "mismatched": [],
        "seconds": 1.0,
    }


def evaluation(tau: float | None, floor: float | None, *, name: str = "chat", run: str = "r1") -> dict:
    """A record as the asset stores it, of two prompts decoded 64 tokens each."""
    prompts = PromptSet(name, "chats.jsonl", [Prompt("line 1", [1, 2]), Prompt("line 2", [3])])
    measured = {
        "drafter": figures(tau),
        "floor": {"drafter": "prompt_lookup", "block_size": 4, **figures(floor)},
        "ratio": tau / floor if tau and floor else None,
        "greedy_seconds": 0.5,
    }
    return build_record(
        run=run,
        prompt_set=prompts,
        measured=measured,
        run_manifest={"drafter_arch": "dflash2", "block_size": 4, "steps": 6, "loss": "dpace"},
        drafter_uri=f"s3://bucket/drafter/{run}",
        export_identity="etag-1",
        target_model="demo",
        max_new_tokens=64,
        seconds=3.0,
    )
