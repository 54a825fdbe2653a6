"""Device memory of each stage of a run, as estimates from the target's checkpoint and config: what the
plan holds against the device's memory (`training/memory.py` is the training side, and the check the
trainer itself makes before a speculative evaluation), and over how many devices the target must be
split for each stage that runs it (`target_split`).

A target split over k devices (`DFLASH_TARGET_TP`) holds on each device: a k-th of the weights (the plan
shards every linear layer, the embedding and the LM head; the small norms and gated-delta-net parameters
are counted as sharded too), a k-th of the MLP intermediates and of the attention KV cache (heads are
sharded), and whole copies of the residual stream, the gated-delta-net state (its layers gather their
outputs) and the logits. Rank 0 also holds the whole capture buffer.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.planning.capacity import DeviceProfile, TargetFacts
from dflash_assets.storage.units import human_bytes
from dflash_assets.target.memory import (
    forward_activation_bytes,
    kv_cache_bytes_per_token,
    lm_head_parameters,
    logits_bytes,
    recurrent_state_bytes,
    target_config,
)
from dflash_assets.training.memory import (
    evaluation_target_bytes,
    planned_attention,
    training_memory,
    with_headroom,
)


def stage_memory(
    *,
    target: TargetFacts,
    device: DeviceProfile,
    drafter: DrafterConfig,
    hidden_state_dtype: str,
    max_tokens_per_batch: int,
    max_length: int,
    num_anchors: int = 512,
    generation_batch: int = 64,
    spec_eval_max_new_tokens: int = 64,
    target_tp: int = 1,
) -> dict[str, int]:
    """Bytes on one device per stage:

    - extraction: the weights, one forward's activations at the token budget (or the longest sample,
      which runs alone), the capture buffer in the model's dtype and its encoded copy (bf16 cast, or
      fp8's float32 working copy + e4m3 + scales);
    - regeneration (in-process generation with a KV cache): the weights, the cache and recurrent state of
      `generation_batch` sequences of `max_length` tokens, a prefill's activations at the token budget;
    - training: the drafter's float32 weights, gradients and AdamW state, the frozen embedding and LM head,
      and one sequence's activations;
    - evaluation (offline speculative decoding): the drafter between steps beside the whole target and a
      held-out prompt's decoding.

    Extraction and regeneration are counted on the busiest device of a target split over `target_tp`.
    """
    # A sample longer than the token budget is a batch of its own (`target/batching.py`): a 32 K sample
    # runs a 32 K forward whatever DFLASH_MAX_TOKENS_PER_BATCH says.
    forward_tokens = max(max_tokens_per_batch, max_length)
    extraction = extraction_bytes(target, device, hidden_state_dtype, forward_tokens, target_tp)
    regeneration = regeneration_bytes(
        target, device, max_tokens_per_batch, max_length, generation_batch, target_tp
    )
    training = training_memory(drafter, max_length, num_anchors, attention=planned_attention(device.kind))
    prompt = max(1, max_length - spec_eval_max_new_tokens)
    evaluation = training.between_steps_bytes + evaluation_target_bytes(
        target.model_dir, device.kind, prompt, spec_eval_max_new_tokens
    )
    return {
        "extraction": extraction,
        "regeneration": regeneration,
        "training": training.step_bytes,
        "evaluation": evaluation,
    }


def _element(device: DeviceProfile) -> int:
    return 2 if device.kind == "cuda" else 4  # bf16 on CUDA, float32 on the CPU (as the loader does)


def extraction_bytes(
    target: TargetFacts,
    device: DeviceProfile,
    hidden_state_dtype: str,
    max_tokens_per_batch: int,
    tp: int = 1,
) -> int:
    """Extraction on one device of a target split over `tp` (rank 0, the busiest): its share of the
    weights without the LM head (capture never loads it, split or not), one forward's activations at
    the token budget, the capture buffer in the model's dtype and its encoded copy (bf16 cast, or fp8's
    float32 working copy + e4m3 + scales)."""
    config = target_config(target.model_dir)
    element = _element(device)
    captured = max_tokens_per_batch * len(target.layer_ids) * target.hidden_size
    encoded = captured * (4 + 1) if hidden_state_dtype == "fp8" else (0 if element == 2 else captured * 2)
    parameters = target.weight_bytes_bf16 // 2 - lm_head_parameters(config)
    return (
        parameters * element // tp
        + forward_activation_bytes(config, max_tokens_per_batch, element, tp)
        + captured * element
        + encoded
    )


def regeneration_bytes(
    target: TargetFacts,
    device: DeviceProfile,
    max_tokens_per_batch: int,
    max_length: int,
    generation_batch: int,
    tp: int = 1,
) -> int:
    """In-process generation with a KV cache on one device of a target split over `tp`: its share of the
    weights and of the attention cache of `generation_batch` sequences of `max_length` tokens, their whole
    recurrent state, a prefill's activations at the token budget, the logits."""
    config = target_config(target.model_dir)
    element = _element(device)
    return (
        target.weight_bytes_bf16 // 2 * element // tp
        + generation_batch
        * (max_length * kv_cache_bytes_per_token(config, element) // tp + recurrent_state_bytes(config))
        + forward_activation_bytes(config, max_tokens_per_batch, element, tp)
        + logits_bytes(config, generation_batch)
    )


def online_target_bytes(target: TargetFacts, device: DeviceProfile, tokens: int, span: int = 1) -> int:
    """One target replica of online training, on the busiest of the `span` devices it spans (its decoder
    layers split into contiguous blocks, one per device: `target.model.load_target_model`): its share of
    the weights, one micro-batch's no-grad forward over `tokens` tokens (one sequence at the least; a
    layer at a time, so the same on any span) and the captured layers it hands over (on its first
    device). The LM head counts: the first replica keeps it, for the verifier of the speculative
    evaluation (later replicas load without it, `training/job.py`), and the busiest device is planned."""
    config = target_config(target.model_dir)
    element = _element(device)
    captured = tokens * len(target.layer_ids) * target.hidden_size * element
    weights = target.weight_bytes_bf16 // 2 * element
    return -(-weights // span) + forward_activation_bytes(config, tokens, element) + captured


# ------------------------------------------------------------------------------------------ the split

MAX_TARGET_TP = 8  # the ranks of one split run on one node


@dataclass
class TargetSplit:
    """Over how many devices the target must be split for each stage that runs it: the smallest k (a
    count that divides its heads) at which the busiest device's estimate, with the trainer's headroom
    (10 % + 256 MiB), fits the device; None when no k up to `MAX_TARGET_TP` does."""

    configured: int  # DFLASH_TARGET_TP; 0: `auto` (each stage takes its smallest)
    # "online target" counts a replica spanning k devices by layer blocks; the others split by the plan
    smallest: dict[str, int | None]
    bytes_by_tp: dict[str, dict[int, int]]  # stage -> k -> bytes on the busiest device
    sizes: list[int]  # the counts the target's heads allow
    has_plan: bool  # transformers has a tensor-parallel plan for the family
    model_type: str
    device_memory_bytes: int
    warnings: list[str] = field(default_factory=list)

    def chosen(self, stage: str) -> int:
        """The k the stage runs at: the configured one, or with `auto` the smallest that fits (else 1)."""
        return self.configured or self.smallest.get(stage) or 1

    def as_dict(self) -> dict[str, Any]:
        return {
            "configured": self.configured or "auto",
            "smallest": dict(self.smallest),
            "bytes_by_tp": {stage: dict(sizes) for stage, sizes in self.bytes_by_tp.items()},
            "sizes": list(self.sizes),
            "tensor_parallel_plan": self.has_plan,
            "model_type": self.model_type,
            "warnings": list(self.warnings),
        }


def target_split(
    *,
    target: TargetFacts,
    device: DeviceProfile,
    hidden_state_dtype: str,
    max_tokens_per_batch: int,
    max_length: int,
    configured_tp: int = 1,
    generation_batch: int = 64,
    online_tokens: int | None = None,
) -> TargetSplit:
    """The smallest k for extraction, regeneration and one online replica, and warnings when the
    configured k (`configured_tp`, 0 for `auto`) does not fit or cannot be used."""
    from dflash_assets.target.tensor_parallel import read_config, tensor_parallel_plan, valid_tp_sizes

    config = read_config(target.model_dir)
    sizes = valid_tp_sizes(config, limit=MAX_TARGET_TP)
    has_plan = tensor_parallel_plan(config) is not None
    model_type = target.model_type or str(getattr(config, "model_type", ""))
    online = online_tokens or max_length
    bytes_by_tp: dict[str, dict[int, int]] = {
        "extraction": {
            k: extraction_bytes(target, device, hidden_state_dtype, max_tokens_per_batch, k) for k in sizes
        },
        "regeneration": {
            k: regeneration_bytes(target, device, max_tokens_per_batch, max_length, generation_batch, k)
            for k in sizes
        },
        # a replica spans its devices by layer blocks (any count would do; one setting serves every stage)
        "online target": {k: online_target_bytes(target, device, online, k) for k in sizes},
    }
    memory = device.total_memory_bytes
    smallest = {
        stage: next((k for k, nbytes in by_k.items() if with_headroom(nbytes) <= memory), None)
        for stage, by_k in bytes_by_tp.items()
    }
    split = TargetSplit(configured_tp, smallest, bytes_by_tp, sizes, has_plan, model_type, memory)
    split.warnings = _split_warnings(split, device.name)
    return split


def _split_warnings(split: TargetSplit, device_name: str) -> list[str]:
    warnings = []
    setting = "DFLASH_TARGET_TP"
    k = split.configured
    if k and k not in split.sizes:
        warnings.append(
            f"{setting}={k} does not divide the target's heads: choose one of "
            + ", ".join(map(str, split.sizes))
        )
    for stage, needed in split.smallest.items():
        if needed is None:
            instead = (
                ", or serve it from vLLM/SGLang (DFLASH_GENERATE_URL)" if stage == "regeneration" else ""
            )
            warnings.append(
                f"{stage}: the target does not fit {device_name} even over {max(split.bytes_by_tp[stage])} "
                "devices "
                f"({setting}); use a larger device{instead}"
            )
        elif k and k in split.bytes_by_tp[stage] and needed > k:
            warnings.append(
                f"{stage} needs the target over {needed} devices on {device_name} "
                f"(~{human_bytes(split.bytes_by_tp[stage][needed])} on each), more than {setting}={k} "
                f"(~{human_bytes(split.bytes_by_tp[stage][k])} on each): set {setting}={needed} or `auto`"
            )
    # Capture and regeneration split the target with transformers' plan; an online replica splits its
    # layers and needs none.
    split_stages = [split.chosen(stage) for stage in ("extraction", "regeneration")]
    if max(split_stages) > 1 and not split.has_plan:
        warnings.append(
            f"transformers has no tensor-parallel plan for model type {split.model_type!r}, so {setting} "
            "above 1 cannot split its capture or regeneration: regenerate through vLLM/SGLang "
            "(DFLASH_GENERATE_URL) and capture on a device that holds the whole target"
        )
    return warnings
