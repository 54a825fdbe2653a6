"""Builders shared by the drafter tests: a tiny real target model directory and learnable samples."""

from __future__ import annotations

import random
from pathlib import Path

import torch

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.extraction.sample_format import sample_object_name, write_sample
from dflash_assets.storage.store import ObjectStore

VOCAB_SIZE = 300
MASK_TOKEN_ID = 299
TARGET_LAYER_IDS = [1, 2, 3, 4, 5]  # DFlash's rule for 8 decoder layers and 5 draft layers
CYCLE_START = 260  # assistant turns count through tokens 260..267


def _tiny_target_config(initializer_range: float):
    from transformers import Qwen3_5TextConfig

    return Qwen3_5TextConfig(
        vocab_size=VOCAB_SIZE,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=8,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        linear_num_key_heads=2,
        linear_num_value_heads=2,
        linear_key_head_dim=16,
        linear_value_head_dim=16,
        max_position_embeddings=1024,
        initializer_range=initializer_range,
    )


def build_tiny_target(directory: Path) -> Path:
    """A Qwen3.5-family (gated-delta-net + full attention) causal LM, saved with `save_pretrained`."""
    from transformers import AutoModelForCausalLM

    # Wider than the default 0.02 so the frozen LM head can express confident predictions: a trained
    # target has that range, a freshly initialised one would cap what a few drafter steps can reach.
    config = _tiny_target_config(initializer_range=0.2)
    torch.manual_seed(0)
    AutoModelForCausalLM.from_config(config).save_pretrained(directory)
    return directory


def build_counting_target(directory: Path) -> Path:
    """A tiny hybrid target that, after any token of the cycle 260..267, greedily continues the cycle
    (t -> the next one, 267 -> 260).

    Its decoder layers are left at a small init, so the residual stream stays close to the embedding of
    the current token, and its LM head scores cycle token j by the embedding of the one before it. What
    it generates is then learnable by a drafter in a few dozen steps, which is what a test of measured
    acceptance needs (a random target's continuations are not learnable from a few samples).
    """
    from transformers import AutoModelForCausalLM

    config = _tiny_target_config(initializer_range=0.02)
    torch.manual_seed(1)
    model = AutoModelForCausalLM.from_config(config)
    with torch.no_grad():
        embedding = torch.randn(VOCAB_SIZE, 64)
        head = 0.01 * torch.randn(VOCAB_SIZE, 64)
        for k in range(8):  # row of cycle token j: the embedding of the token before it in the cycle
            head[CYCLE_START + (k + 1) % 8] = 0.3 * embedding[CYCLE_START + k]
        model.get_input_embeddings().weight.copy_(embedding)
        model.lm_head.weight.copy_(head)
    model.save_pretrained(directory)
    return directory


def tiny_drafter_config(target_dir: Path, *, num_layers: int = 2) -> DrafterConfig:
    """Fewer drafter layers than target layers keeps the tests fast; the context still has all five."""
    return DrafterConfig.from_target(
        target_dir, num_layers=num_layers, target_layer_ids=TARGET_LAYER_IDS, mask_token_id=MASK_TOKEN_ID
    )


def counting_samples(count: int, *, seed: int = 0, start_index: int = 0) -> list[TokenizedSample]:
    """Conversations whose assistant turn counts around a cycle of 8 tokens (t, t+1, ... mod 8): easy to
    learn, so a few steps show a drafter learning. A prompt of random tokens precedes it (loss mask 0)."""
    rng = random.Random(seed)
    samples = []
    for offset in range(count):
        prompt = [rng.randrange(1, 250) for _ in range(rng.randrange(6, 12))]
        first = rng.randrange(8)
        answer = [CYCLE_START + (first + i) % 8 for i in range(rng.randrange(24, 40))]
        samples.append(
            TokenizedSample(
                sample_index=start_index + offset,
                input_ids=prompt + answer,
                loss_mask=[0] * len(prompt) + [1] * len(answer),
            )
        )
    return samples


def load_capture(target_dir: Path, *, final_state: bool = False) -> HiddenStateCapture:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    return HiddenStateCapture(model, TARGET_LAYER_IDS, final_state=final_state)


def write_hidden_state_partition(
    store: ObjectStore,
    partition: str,
    samples: list[TokenizedSample],
    capture: HiddenStateCapture,
    target_model: str,
    scratch: Path,
    *,
    target_layer_ids: list[int] | None = None,
    hidden_state_dtype: str = "bf16",
) -> list[tuple[str, int]]:
    """Capture each sample alone (as extraction does) and put it in the store, stored as
    `hidden_state_dtype` (with the target's final state when `capture` captures it); returns (key, size)."""
    scratch.mkdir(parents=True, exist_ok=True)
    objects = []
    for sample in samples:
        ids = torch.tensor([sample.input_ids])
        hidden = capture(ids, torch.ones_like(ids))[0]
        path = scratch / sample_object_name(sample.sample_index)
        write_sample(
            path,
            sample_index=sample.sample_index,
            input_ids=sample.input_ids,
            loss_mask=sample.loss_mask,
            hidden_states=hidden,
            target_layer_ids=target_layer_ids or TARGET_LAYER_IDS,
            target_model=target_model,
            hidden_state_dtype=hidden_state_dtype,
            final_state=capture.final_state,
        )
        key = f"hidden-states/{partition}/{path.name}"
        info = store.put_file(key, path)
        objects.append((key, info.size))
        path.unlink()
    return objects


def own_completion_samples(
    target_dir: Path, count: int = 40, answer_tokens: int = 32
) -> list[TokenizedSample]:
    """`count` conversations whose assistant turns the counting target generated itself (greedy): a
    prompt of random tokens ending in a cycle token, which the target continues around the cycle."""
    from transformers import AutoModelForCausalLM

    from dflash_assets.drafter.speculative import TargetVerifier, greedy_decode

    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32).eval()
    verifier = TargetVerifier(model, TARGET_LAYER_IDS)
    rng = random.Random(7)
    samples = []
    for index in range(count):
        prompt = [rng.randrange(1, 250) for _ in range(rng.randrange(4, 10))] + [CYCLE_START + index % 8]
        completion = greedy_decode(verifier, prompt, answer_tokens, set())
        samples.append(TokenizedSample(index, prompt + completion, [0] * len(prompt) + [1] * len(completion)))
    return samples
