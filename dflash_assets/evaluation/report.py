"""One set's evaluation as it is stored (`evaluations/<run>/<set>/evaluation.json`), shown (metadata, a
markdown table, one summary line) and judged (τ at least the floor's)."""

from __future__ import annotations

import time
from typing import Any

from dflash_assets.drafter.speculative import describe_by_context_length
from dflash_assets.evaluation.measure import EVALUATION_FORMAT
from dflash_assets.evaluation.prompt_sets import PromptSet


def build_record(
    *,
    run: str,
    prompt_set: PromptSet,
    measured: dict[str, Any],
    run_manifest: dict[str, Any],
    drafter_uri: str,
    export_identity: str | None,
    target_model: str,
    max_new_tokens: int,
    seconds: float,
) -> dict[str, Any]:
    """Everything one evaluation found, JSON: what was measured, on what, and how it compares."""
    drafter, floor = measured["drafter"], measured["floor"]
    return {
        "format": EVALUATION_FORMAT,
        "run": run,
        "prompt_set": prompt_set.name,
        "reference": prompt_set.reference,
        "measured_at": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "drafter_uri": drafter_uri,
        "export_identity": export_identity,
        "target_model": target_model,
        "training": {
            name: run_manifest.get(name)
            for name in (
                "drafter_arch",
                "block_size",
                "loss",
                "distill_weight",
                "parameters",
                "steps",
                "train_seconds",
                "train_device_seconds",
                "mode",
                "training_conversations",
                "training_answer_tokens",
            )
        },  # fmt: skip
        "prompts": len(prompt_set.prompts),
        "prompt_locations": [prompt.location for prompt in prompt_set.prompts],
        "prompt_tokens": [len(prompt.token_ids) for prompt in prompt_set.prompts],
        "rows_read": prompt_set.rows_read,
        "rows_skipped": dict(prompt_set.skipped),
        "rows_skipped_details": list(prompt_set.skipped_details),
        "max_new_tokens": max_new_tokens,
        "tau": drafter["tau"],
        "floor_tau": floor["tau"],
        "ratio": measured["ratio"],
        "lossless_prompts": drafter["lossless_prompts"],
        "floor_lossless_prompts": floor["lossless_prompts"],
        "drafter": drafter,
        "floor": floor,
        "greedy_seconds": measured["greedy_seconds"],
        # The target's greedy output (and the floor at this block) read from the stored reference.
        "reference_reused": bool(measured.get("reference_reused")),
        "seconds": round(seconds, 1),
    }


def above_floor(record: dict[str, Any]) -> bool:
    """The asset check's verdict: the drafter's τ at least the floor's (both measured)."""
    tau, floor = record.get("tau"), record.get("floor_tau")
    return tau is not None and floor is not None and tau >= floor


def check_description(record: dict[str, Any]) -> str:
    """The asset check's one line: the set's name and both figures."""
    tau, floor, name = record.get("tau"), record.get("floor_tau"), record["prompt_set"]
    if tau is None or floor is None:
        return f"{name}: not measured (no verification round: every prompt stopped at once)"
    ratio = f" ({tau / floor:.2f}x)" if floor else ""
    verdict = "at least" if tau >= floor else "BELOW"
    return (
        f"{name}: the drafter's τ {tau:.3f} is {verdict} the prompt-lookup floor's τ {floor:.3f}{ratio} "
        f"on {record['prompts']} prompts, {record['max_new_tokens']} new tokens each (run {record['run']})"
    )


def summary_line(record: dict[str, Any]) -> str:
    """`held_out: τ 3.71 against the floor's 3.20 (1.16x), 16/16 lossless`, for a terminal."""
    tau, floor = record.get("tau"), record.get("floor_tau")
    if tau is None or floor is None:
        return f"{record['prompt_set']}: not measured"
    ratio = f" ({record['ratio']:.2f}x)" if record.get("ratio") else ""
    lossless = f"{record['lossless_prompts']}/{record['prompts']} lossless"
    name = record["prompt_set"]
    return f"{name}: τ {tau:.3f} against the prompt-lookup floor's {floor:.3f}{ratio}, {lossless}"


def markdown_table(record: dict[str, Any]) -> str:
    """The drafter and the floor side by side, for the asset's page."""

    def figure(value: Any, digits: int = 3) -> str:
        return "—" if value is None else f"{value:.{digits}f}"

    drafter, floor = record["drafter"], record["floor"]
    prompts = record["prompts"]
    lines = [
        f"Prompt set `{record['prompt_set']}`"
        + (f" (`{record['reference']}`)" if record["reference"] else " (the run's held-out rows)")
        + f": {prompts} prompts, {record['max_new_tokens']} new tokens each; run `{record['run']}`.",
        "",
        "| drafter | τ | × floor | lossless | rounds | accepted at position 1 / 2 / 4 / 8 |",
        "|---|---|---|---|---|---|",
    ]
    for name, figures in (("trained", drafter), ("prompt lookup (floor)", floor)):
        by_position = figures["acceptance_by_position"]
        shown = " / ".join(
            figure(by_position[p - 1], 2) if p <= len(by_position) else "—" for p in (1, 2, 4, 8)
        )
        ratio = figure(figures["tau"] / floor["tau"], 2) if figures["tau"] and floor["tau"] else "—"
        lines.append(
            f"| {name} | {figure(figures['tau'])} | {ratio} | {figures['lossless_prompts']}/{prompts} | "
            f"{figures['rounds']} | {shown} |"
        )
    lines += ["", f"τ by context length: {describe_by_context_length(drafter)}"]
    for name, figures in (("the drafter", drafter), ("prompt lookup", floor)):
        for item in figures["mismatched"]:
            lines.append(
                f"- {name}'s output differs from the target's greedy output on {item['prompt']} from token "
                f"{item['first_difference']}"
            )
    if record["rows_skipped"]:
        counts = ", ".join(f"{k} {v}" for k, v in sorted(record["rows_skipped"].items()))
        lines += ["", f"Rows skipped while collecting prompts: {counts}."]
    return "\n".join(lines)
