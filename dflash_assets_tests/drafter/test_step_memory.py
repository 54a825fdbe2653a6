"""The activation memory micro-batches are planned with (`estimate_step_bytes`): by the attention that
runs, against what a step measurably holds on the CPU, and what it gives at the real drafter shapes."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from dflash_assets.bench.drafter_step import cpu_peak_bytes
from dflash_assets.drafter import model as model_module
from dflash_assets.drafter.config import DrafterConfig, drafter_shape
from dflash_assets.drafter.model import drafter_class, drafter_parameter_count
from dflash_assets.drafter.objective import (
    DrafterBatch,
    Objective,
    anchor_generator,
    dflash_loss,
    estimate_step_bytes,
    sample_anchors,
)
from dflash_assets.target.layer_ids import dflash_target_layer_ids
from dflash_assets.training.memory import drafter_frozen_bytes, planned_attention, training_memory
from dflash_assets.training.plan import micro_batches
from dflash_assets.training.settings import TrainSettings


def drafter_config(hidden: int = 256, vocab: int = 20_000, **shape: object) -> DrafterConfig:
    fields = {"num_heads": 8, "num_kv_heads": 2, "head_dim": 32, "intermediate_size": 3 * hidden, **shape}
    return DrafterConfig(
        hidden_size=hidden,
        vocab_size=vocab,
        mask_token_id=vocab - 1,
        target_layer_ids=[1, 2, 3, 4, 5],
        target_num_hidden_layers=8,
        num_layers=2,
        **fields,
    )


def step_inputs(config: DrafterConfig, batch_size: int, length: int, num_anchors: int):
    torch.manual_seed(0)
    embedding = torch.randn(config.vocab_size, config.hidden_size) * 0.02
    drafter = drafter_class(config)(config, embedding, embedding.clone())
    input_ids = torch.randint(0, config.vocab_size - 1, (batch_size, length))
    loss_mask = torch.ones(batch_size, length, dtype=torch.bool)
    states = torch.randn(batch_size, length, config.num_context_layers, config.target_hidden_size).bfloat16()
    batch = DrafterBatch(
        input_ids, loss_mask, states, torch.full((batch_size,), length), list(range(batch_size))
    )
    anchors = sample_anchors(loss_mask, num_anchors, [anchor_generator(0, 0, i) for i in range(batch_size)])
    return drafter, batch, anchors


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
@pytest.mark.parametrize(
    ("batch_size", "length", "num_anchors", "chunk_bytes"),
    [(1, 512, 32, None), (2, 256, 64, None), (1, 4096, 96, 8 * 2**20)],  # the last: scores in 12 chunks
)
def test_the_materialised_estimate_covers_a_cpu_step_s_measured_peak_without_doubling_it(
    batch_size: int, length: int, num_anchors: int, chunk_bytes: int | None, arch: str, monkeypatch
) -> None:
    if chunk_bytes is not None:
        monkeypatch.setattr(model_module, "MATERIALISED_CHUNK_BYTES", chunk_bytes)
        assert model_module.materialised_chunk_blocks(batch_size, 8, 16, length) < num_anchors
    # DFlash2: its convolutions and selector (at a rank that weighs here as 256 does at a 248 K vocabulary).
    config = drafter_config(arch=arch, selector_rank=64)
    drafter, batch, anchors = step_inputs(config, batch_size, length, num_anchors)
    objective = Objective()
    dflash_loss(drafter, batch, anchors, objective).weighted_ce.backward()  # the gradients exist: not counted

    measured = cpu_peak_bytes(lambda: dflash_loss(drafter, batch, anchors, objective).weighted_ce.backward())
    estimate = estimate_step_bytes(config, batch_size, length, num_anchors, attention="materialised")
    assert measured <= estimate <= 1.6 * measured, (measured, estimate)


def test_flex_is_planned_by_what_it_saves_for_backward_with_no_score_matrix(monkeypatch) -> None:
    import torch.nn.attention.flex_attention as flex_module

    # torch refuses flex attention's backward on the CPU (its reference is slow), not its graph: what the
    # forward saves for backward is what the GPU kernel's autograd saves (q, k, v, output, log-sum-exp).
    monkeypatch.setattr(flex_module, "_validate_device", lambda query, key, value: None)
    config = drafter_config(vocab=1_000)
    drafter, batch, anchors = step_inputs(config, 1, 512, 32)
    drafter.set_attention_backend("flex")
    kept: dict[int, int] = {}
    weights = {t.untyped_storage().data_ptr() for t in [*drafter.parameters(), *drafter.buffers()]}

    def keep(tensor: torch.Tensor) -> torch.Tensor:
        storage = tensor.untyped_storage()
        if storage.data_ptr() not in weights:
            kept[storage.data_ptr()] = storage.nbytes()
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(keep, lambda tensor: tensor):
        dflash_loss(drafter, batch, anchors, 7.0)
    saved = sum(kept.values())
    flex = estimate_step_bytes(config, 1, 512, 32, attention="flex")
    assert saved <= flex <= 1.8 * saved, (saved, flex)

    # No score matrix: more context costs flex its keys, the materialised scores a row for every slot.
    def growth(attention: str) -> int:
        return estimate_step_bytes(config, 1, 1024, 32, attention=attention) - estimate_step_bytes(
            config, 1, 512, 32, attention=attention
        )

    assert growth("flex") < growth("materialised") / 4


def qwen_drafter(hidden: int, intermediate: int, vocab: int, layers: int, shape: str) -> DrafterConfig:
    target = {"hidden_size": hidden, "intermediate_size": intermediate}
    return DrafterConfig(
        hidden_size=hidden,
        vocab_size=vocab,
        mask_token_id=vocab - 1,
        target_layer_ids=dflash_target_layer_ids(layers, 5),
        target_num_hidden_layers=layers,
        **drafter_shape(target, shape, 5),
    )


@pytest.mark.parametrize(
    ("name", "config", "sequences"),
    [
        ("Qwen3-8B", qwen_drafter(4096, 12288, 151_936, 36, "dflash"), 3),
        ("Qwen3.6-27B", qwen_drafter(5120, 17408, 248_320, 64, "dflash-swa"), 2),
        # DFlash2 (the default): its convolutions and selector take 28.7 and 35.3 GiB a sequence.
        ("Qwen3-8B DFlash2", replace(qwen_drafter(4096, 12288, 151_936, 36, "dflash"), arch="dflash2"), 2),
        (
            "Qwen3.6-27B DFlash2",
            replace(qwen_drafter(5120, 17408, 248_320, 64, "dflash-swa"), arch="dflash2"),
            1,
        ),
    ],
)
def test_on_an_h200_flex_attention_fits_several_3072_token_sequences_a_micro_batch(
    name: str, config: DrafterConfig, sequences: int
) -> None:
    # The trainer's default budget on a 141 GB device: 70 % of what is free once the drafter's float32
    # weights and the frozen embedding and head are there, less 16 bytes a parameter for its state.
    parameters = drafter_parameter_count(config)
    free = 141 * 10**9 - 4 * parameters - drafter_frozen_bytes(config)
    budget = int((free - 16 * parameters) * 0.7)
    settings = TrainSettings(num_anchors=512, max_length=3072)
    ids, lengths = list(range(8)), [3072] * 8

    assert planned_attention("cuda") == "flex" and planned_attention("cpu") == "materialised"
    flex = micro_batches(ids, lengths, config, settings, budget, planned_attention("cuda"))
    assert len(flex[0]) == sequences, name
    # The plan's training memory counts the same activations.
    planned = training_memory(config, 3072, 512, attention="flex").activations
    assert planned == estimate_step_bytes(config, 1, 3072, 512, attention="flex")


def test_an_8k_sequence_and_many_short_ones_are_planned_within_the_budget_the_short_ones_densely() -> None:
    # The Qwen3-8B DFlash2 drafter on an H200's budget: an 8,192-token reasoning answer and thirty
    # 300-token ones in one global batch (longest first, as a step orders them).
    config = replace(qwen_drafter(4096, 12288, 151_936, 36, "dflash"), arch="dflash2")
    parameters = drafter_parameter_count(config)
    budget = int((141 * 10**9 - 20 * parameters - drafter_frozen_bytes(config)) * 0.7)
    lengths = [8192] + [300] * 30
    ids = list(range(len(lengths)))
    recipe = TrainSettings(tokens_per_anchor=6)  # 512 anchors at most, one per 6 labelled tokens
    fixed = TrainSettings()  # the fixed count: a 300-token sequence takes 299 anchors

    by_tokens = micro_batches(ids, lengths, config, recipe, budget, "flex")
    assert by_tokens[0][0] == 0 and sorted(i for batch in by_tokens for i in batch) == ids
    for batch in by_tokens:  # every micro-batch within the budget, padded to its longest
        longest = max(lengths[i] for i in batch)
        blocks = min(512, -(-longest // 6), longest - 1)
        assert estimate_step_bytes(config, len(batch), longest, blocks, attention="flex") <= budget
    # Short sequences' anchors follow their tokens, so they share micro-batches six times as densely.
    fixed_count = micro_batches(ids, lengths, config, fixed, budget, "flex")
    assert max(map(len, by_tokens[1:])) >= 5 * max(map(len, fixed_count[1:]))


def test_a_long_contexts_blocks_are_attended_a_chunk_at_a_time_with_the_same_result_and_gradients(
    monkeypatch,
) -> None:
    config = drafter_config(hidden=64, vocab=500, num_heads=4, num_kv_heads=1, head_dim=16)
    drafter, batch, anchors = step_inputs(config, 2, 300, 40)

    def step() -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        drafter.zero_grad()
        output = dflash_loss(drafter, batch, anchors, Objective())
        output.weighted_ce.backward()
        return output.weighted_ce.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()}

    whole, whole_grads = step()
    monkeypatch.setattr(model_module, "MATERIALISED_CHUNK_BYTES", 1)  # one block a chunk: 40 chunks
    assert model_module.materialised_chunk_blocks(2, 4, 16, 300) == 1
    chunked, chunked_grads = step()
    torch.testing.assert_close(chunked, whole, rtol=1e-5, atol=1e-5)
    for name, grad in whole_grads.items():
        torch.testing.assert_close(chunked_grads[name], grad, rtol=1e-4, atol=1e-6)
