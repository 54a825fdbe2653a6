"""Decoding on a KV cache written in place: the answers of `generate` one prompt at a time, rows grouped by
length and leaving as they stop, sampled answers following the seed; other targets go to `generate`."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from dflash_assets.generation import in_process
from dflash_assets.generation.decoding import decodes_in_place, decoding_groups

STOP = (3, 7)


@pytest.fixture(scope="module")
def llama():
    """A tiny random Llama: every layer plain attention, grouped-query (4 heads, 2 key-value heads)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=97,
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=512,
        eos_token_id=3,
        pad_token_id=0,
    )
    return LlamaForCausalLM(config).eval()


def generation_config(**options):
    from transformers import GenerationConfig

    return GenerationConfig(max_new_tokens=24, eos_token_id=list(STOP), pad_token_id=0, **options)


def random_prompts(lengths: list[int]) -> list[list[int]]:
    generator = torch.Generator().manual_seed(1)
    return [torch.randint(8, 97, (n,), generator=generator).tolist() for n in lengths]


def cut(row: list[int]) -> list[int]:
    end = next((i for i, token in enumerate(row) if token in STOP), None)
    return row[: end + 1] if end is not None else row


def test_greedy_answers_equal_generate_one_prompt_at_a_time(llama):
    config = generation_config(do_sample=False)
    assert decodes_in_place(llama, config)
    prompts = random_prompts([5, 9, 30, 31, 70, 3, 120, 64])
    rows_a_step: list[int] = []  # rows of every decoding step (one position a row)
    hook = llama.register_forward_pre_hook(
        lambda module, args, kwargs: (
            rows_a_step.append(kwargs["input_ids"].shape[0]) if kwargs["input_ids"].shape[1] == 1 else None
        ),
        with_kwargs=True,
    )
    try:
        rows = in_process.generate_rows(llama, prompts, 0, config, None, "cpu")
    finally:
        hook.remove()
    for prompt, row in zip(prompts, rows, strict=True):
        with torch.inference_mode():
            alone = llama.generate(torch.tensor([prompt]), generation_config=config)
        assert row == cut(alone[0, len(prompt) :].tolist()), len(prompt)
    lengths = sorted(len(row) for row in rows)
    assert lengths[0] < 24 and lengths[-1] == 24  # some stop early, some run to the limit
    assert sum(rows_a_step) < len(prompts) * 23  # rows that stopped took no more steps


def test_prompts_decode_in_groups_of_near_lengths_when_a_step_costs_less_than_their_padding():
    lengths = [10, 1000, 12, 1010, 11]
    assert decoding_groups(lengths, step_cost=100) == [[3, 1], [2, 4, 0]]  # longest group, longest first
    assert decoding_groups(lengths, step_cost=10**6) == [[3, 1, 2, 4, 0]]  # padding is cheap beside a step
    assert decoding_groups([], step_cost=100) == []


def test_sampled_answers_follow_the_seed(llama):
    config = generation_config(do_sample=True, temperature=0.8, top_k=20, top_p=0.9)
    prompts = random_prompts([5, 40, 17])

    def sampled(seed: int) -> list[list[int]]:
        return in_process.generate_rows(llama, prompts, 0, config, seed, "cpu")

    first = sampled(1)
    assert sampled(1) == first and sampled(2) != first
    greedy = in_process.generate_rows(llama, prompts, 0, generation_config(do_sample=False), None, "cpu")
    assert first != greedy


def test_what_the_loop_does_not_implement_goes_to_generate(llama, demo_model_dir: Path):
    from dflash_assets.target.model import load_target_model

    assert not decodes_in_place(llama, generation_config(repetition_penalty=1.2))
    assert not decodes_in_place(llama, generation_config(num_beams=2))
    # The demo target's gated-delta-net layers keep a recurrent state, not keys and values.
    assert not decodes_in_place(load_target_model(demo_model_dir, "cpu"), generation_config())
