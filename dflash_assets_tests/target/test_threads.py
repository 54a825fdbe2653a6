"""A small target decodes on one CPU thread (a second only adds a hand-over to every operator), a target of
real width keeps every thread, and the count the process had is given back after decoding."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from dflash_assets.generation.in_process import generate_rows
from dflash_assets.target.model import load_target_model
from dflash_assets.target.threads import decodes_on_one_thread, decoding_threads


@pytest.fixture
def two_threads() -> Iterator[None]:
    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        yield
    finally:
        torch.set_num_threads(before)


def threads_seen_by(model: torch.nn.Module) -> tuple[list[int], torch.utils.hooks.RemovableHandle]:
    seen: list[int] = []
    return seen, model.register_forward_pre_hook(lambda module, args: seen.append(torch.get_num_threads()))


def test_the_demo_target_generates_on_one_cpu_thread_and_gives_the_count_back(
    demo_model_dir: Path, two_threads
):
    from transformers import GenerationConfig

    model = load_target_model(demo_model_dir, "cpu")
    seen, hook = threads_seen_by(model)
    try:
        config = GenerationConfig(max_new_tokens=3, do_sample=False, pad_token_id=0, eos_token_id=[])
        generate_rows(model, [[5, 6, 7], [8, 9]], 0, config, None, "cpu")
    finally:
        hook.remove()
    assert seen and set(seen) == {1}  # every forward of the prefill and the decoding steps
    assert torch.get_num_threads() == 2


def test_a_target_of_real_width_keeps_every_thread(two_threads):
    from transformers import Qwen3Config, Qwen3ForCausalLM

    wide = Qwen3ForCausalLM(
        Qwen3Config(
            hidden_size=1024, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
            num_key_value_heads=1, head_dim=8, vocab_size=32,
        )
    )  # fmt: skip
    assert not decodes_on_one_thread(wide)
    with decoding_threads(wide):
        assert torch.get_num_threads() == 2


def test_a_model_on_another_device_or_without_parameters_keeps_every_thread(two_threads):
    assert not decodes_on_one_thread(torch.nn.Identity())
    with decoding_threads(torch.nn.Identity()):
        assert torch.get_num_threads() == 2
