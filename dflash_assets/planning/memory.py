"""Device memory of each stage of a run, as estimates from the target's checkpoint and config: what the
plan holds against the device's memory (`training/memory.py` is the training side, and the check the
trainer itself makes before a speculative evaluation)."""

from __future__ import annotations

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.planning.capacity import DeviceProfile, TargetFacts
from dflash_assets.target.memory import (
    forward_activation_bytes,
    kv_cache_bytes_per_token,
    logits_bytes,
    recurrent_state_bytes,
    target_config,
)
from dflash_assets.training.memory import evaluation_target_bytes, training_memory


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
) -> dict[str, int]:
    """Bytes on one device per stage:

    - extraction: the weights, one forward's activations at the token budget, the capture buffer in the
      model's dtype and its encoded copy (bf16 cast, or fp8's float32 working copy + e4m3 + scales);
    - regeneration (in-process generation with a KV cache): the weights, the cache and recurrent state of
      `generation_batch` sequences of `max_length` tokens, a prefill's activations at the token budget;
    - training: the drafter's float32 weights, gradients and AdamW state, the frozen embedding and LM head,
      and one sequence's activations;
    - evaluation (offline speculative decoding): the drafter between steps beside the whole target and a
      held-out prompt's decoding.
    """
    config = target_config(target.model_dir)
    element = 2 if device.kind == "cuda" else 4
    weights = target.weight_bytes_bf16 // 2 * element
    captured = max_tokens_per_batch * len(target.layer_ids) * target.hidden_size
    encoded = captured * (4 + 1) if hidden_state_dtype == "fp8" else (0 if element == 2 else captured * 2)
    extraction = (
        weights
        + forward_activation_bytes(config, max_tokens_per_batch, element)
        + captured * element
        + encoded
    )
    regeneration = (
        weights
        + generation_batch
        * (max_length * kv_cache_bytes_per_token(config, element) + recurrent_state_bytes(config))
        + forward_activation_bytes(config, max_tokens_per_batch, element)
        + logits_bytes(config, generation_batch)
    )
    training = training_memory(drafter, max_length, num_anchors)
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


def online_target_bytes(target: TargetFacts, device: DeviceProfile, tokens: int) -> int:
    """One target replica of online training on its device: the weights, one micro-batch's no-grad
    forward over `tokens` tokens (one sequence at the least) and the captured layers it hands over."""
    config = target_config(target.model_dir)
    element = 2 if device.kind == "cuda" else 4
    captured = tokens * len(target.layer_ids) * target.hidden_size * element
    return (
        target.weight_bytes_bf16 // 2 * element + forward_activation_bytes(config, tokens, element) + captured
    )
