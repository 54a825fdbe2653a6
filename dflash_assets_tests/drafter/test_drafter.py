"""The DFlash drafter: what a block may attend to, what it is scored on, and that exports load back."""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from safetensors.torch import save_file

from dflash_assets.drafter.config import DrafterConfig, load_target_embeddings
from dflash_assets.drafter.model import DFlashDrafter, rotary_cos_sin, rotary_frequencies
from dflash_assets.drafter.objective import (
    BlockAnchors,
    DrafterBatch,
    anchor_generator,
    decay_weights,
    dflash_loss,
    sample_anchors,
)
from dflash_assets.drafter.teacher_forced import evaluate_drafter
from dflash_assets_tests.support.drafter_fixtures import (
    MASK_TOKEN_ID,
    TARGET_LAYER_IDS,
)


@pytest.fixture
def drafter(config: DrafterConfig) -> DFlashDrafter:
    torch.manual_seed(0)
    return DFlashDrafter.from_target(config).eval()


def random_batch(
    config: DrafterConfig, lengths: list[int], *, prompt: int = 4, seed: int = 0
) -> DrafterBatch:
    generator = torch.Generator().manual_seed(seed)
    longest = max(lengths)
    input_ids = torch.randint(0, MASK_TOKEN_ID, (len(lengths), longest), generator=generator)
    loss_mask = torch.zeros(len(lengths), longest, dtype=torch.bool)
    for row, length in enumerate(lengths):
        loss_mask[row, prompt:length] = True
    shape = (len(lengths), longest, len(config.target_layer_ids), config.target_hidden_size)
    hidden_states = torch.randn(shape, generator=generator).to(torch.bfloat16)
    return DrafterBatch(input_ids, loss_mask, hidden_states, torch.tensor(lengths), list(range(len(lengths))))


def block_inputs(
    drafter: DFlashDrafter, batch: DrafterBatch, anchors: BlockAnchors
) -> tuple[torch.Tensor, ...]:
    """What `dflash_loss` feeds the drafter: block ids and positions [B, N, S], the context and its
    positions, and where each block's visible context ends [B, N] (its anchor; 0 when dropped)."""
    positions = anchors.positions[:, :, None] + torch.arange(drafter.config.block_size)
    ids = torch.full_like(positions, drafter.config.mask_token_id)
    ids[:, :, 0] = batch.input_ids.gather(1, anchors.positions)
    length = batch.input_ids.shape[1]
    context_positions = torch.arange(length).expand(len(batch.sample_indices), -1)
    context_end = torch.where(anchors.keep, anchors.positions, 0)
    return ids, positions, batch.hidden_states, context_positions, context_end


def block_hidden(drafter: DFlashDrafter, batch: DrafterBatch, anchors: BlockAnchors) -> torch.Tensor:
    """The drafter's output for every slot of every block, [B, N, S, D]."""
    with torch.no_grad():
        return drafter(*block_inputs(drafter, batch, anchors))


def masked_sdpa_reference(
    drafter: DFlashDrafter,
    block_ids: torch.Tensor,  # [B, N, S]
    block_positions: torch.Tensor,  # [B, N, S]
    context_hidden_states: torch.Tensor,  # [B, C, K, H]
    context_positions: torch.Tensor,  # [B, C]
    context_end: torch.Tensor,  # [B, N]
) -> torch.Tensor:
    """The drafter's forward as first written, with the same weights: all N*S slots of a row form one
    query sequence over keys [context ; every block] under a boolean mask (cost quadratic in N), the
    mask written from positions: a slot sees context before its block's anchor and its own block (up to
    itself and within the window on sliding layers)."""
    config = drafter.config
    batch, num_blocks, block_size = block_ids.shape
    context_length, num_queries = context_hidden_states.shape[1], num_blocks * block_size
    heads, kv_heads, head_dim = config.num_heads, config.num_kv_heads, config.head_dim
    query_pos = block_positions.flatten(1)  # [B, Q]
    query_end = context_end.repeat_interleave(block_size, dim=1)  # [B, Q]
    block_of = torch.arange(num_queries) // block_size

    def layer_mask(window: int | None) -> torch.Tensor:
        sees_context = context_positions[:, None, :] < query_end[:, :, None]  # [B, Q, C]
        sees_block = (block_of[:, None] == block_of[None, :]).expand(batch, -1, -1)  # [B, Q, Q]
        if window is not None:
            sees_context = sees_context & (query_pos[:, :, None] - context_positions[:, None, :] < window)
            delta = query_pos[:, :, None] - query_pos[:, None, :]
            sees_block = sees_block & (delta >= 0) & (delta < window)
        return torch.cat([sees_context, sees_block], dim=2)[:, None]  # [B, 1, Q, C+Q]

    dtype = drafter.fc.weight.dtype
    x = F.embedding(block_ids.flatten(1), drafter.embed_weight).to(dtype)  # [B, Q, D]
    flat = context_hidden_states.reshape(batch, context_length, -1).to(dtype)
    context = drafter.hidden_norm(drafter.fc(flat))  # [B, C, D]
    positions = torch.cat([context_positions, block_positions.flatten(1)], dim=1)
    cos, sin = rotary_cos_sin(positions, rotary_frequencies(config))  # [B, C+Q, hd]

    def rotate(t: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:  # [B, h, L, hd]
        t1, t2 = t.chunk(2, dim=-1)
        return t * cos[:, None].to(t.dtype) + torch.cat([-t2, t1], dim=-1) * sin[:, None].to(t.dtype)

    for layer in drafter.layers:
        attention, h = layer.self_attn, layer.input_layernorm(x)
        keys_in = torch.cat([context, h], dim=1)  # [B, C+Q, D]
        q = attention.q_norm(attention.q_proj(h).view(batch, num_queries, heads, head_dim)).transpose(1, 2)
        k = attention.k_norm(attention.k_proj(keys_in).view(batch, -1, kv_heads, head_dim)).transpose(1, 2)
        v = attention.v_proj(keys_in).view(batch, -1, kv_heads, head_dim).transpose(1, 2)
        q = rotate(q, cos[:, context_length:], sin[:, context_length:])
        k = rotate(k, cos, sin)
        mask = layer_mask(attention.sliding_window)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
        x = x + attention.o_proj(out.transpose(1, 2).reshape(batch, num_queries, -1))
        x = x + layer.mlp(layer.post_attention_layernorm(x))
    return drafter.norm(x).view(batch, num_blocks, block_size, -1)


def randomised(drafter: DFlashDrafter, seed: int = 0) -> DFlashDrafter:
    """Wide random weights (and norm gains), so attention, not the residual stream, shapes the output.

    In float64: two formulations of the same math then agree far inside the tolerance, whatever the seed.
    """
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in drafter.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.3 + (parameter.ndim == 1))
    return drafter.double()


def test_config_follows_the_target_and_round_trips_through_the_reference_layout(
    target_dir: Path, tmp_path: Path
) -> None:
    config = DrafterConfig.from_target(target_dir, mask_token_id=MASK_TOKEN_ID)
    assert config.target_layer_ids == TARGET_LAYER_IDS  # DFlash's rule for 8 decoder layers, k = 5
    assert (config.hidden_size, config.vocab_size, config.num_layers) == (64, 300, 5)
    assert config.target_num_hidden_layers == 8
    # A 64-wide test target gets the preset's 4:1 grouping scaled to its width, not 32 x 128 heads.
    assert (config.num_heads, config.num_kv_heads, config.head_dim) == (4, 1, 16)
    target_shaped = DrafterConfig.from_target(target_dir, mask_token_id=MASK_TOKEN_ID, shape="target")
    assert (target_shaped.num_heads, target_shaped.num_kv_heads, target_shaped.head_dim) == (4, 2, 16)
    config.save(tmp_path)
    assert DrafterConfig.load(tmp_path) == config


def test_a_block_sees_the_context_strictly_before_its_anchor(
    drafter: DFlashDrafter, config: DrafterConfig
) -> None:
    batch = random_batch(config, [40])
    anchor = 20
    anchors = BlockAnchors(positions=torch.tensor([[anchor]]), keep=torch.tensor([[True]]))
    before = block_hidden(drafter, batch, anchors)

    # The target has not run on the anchor at inference time: its hidden state (and later ones) must
    # not influence the block.
    batch.hidden_states[:, anchor:] = torch.randn_like(batch.hidden_states[:, anchor:].float()).bfloat16()
    torch.testing.assert_close(block_hidden(drafter, batch, anchors), before, rtol=0, atol=0)

    batch.hidden_states[:, anchor - 1] = torch.randn_like(
        batch.hidden_states[:, anchor - 1].float()
    ).bfloat16()
    assert not torch.allclose(block_hidden(drafter, batch, anchors), before)


def test_blocks_attend_within_themselves_but_never_to_each_other(
    drafter: DFlashDrafter, config: DrafterConfig
) -> None:
    batch = random_batch(config, [60])
    anchors = BlockAnchors(positions=torch.tensor([[10, 30]]), keep=torch.tensor([[True, True]]))
    before = block_hidden(drafter, batch, anchors)

    batch.input_ids[0, 30] = (batch.input_ids[0, 30] + 1) % MASK_TOKEN_ID  # the second block's anchor
    after = block_hidden(drafter, batch, anchors)
    torch.testing.assert_close(after[:, 0], before[:, 0], rtol=0, atol=0)  # first block: untouched
    # Non-causal inside a block: every slot of the second block, the last included, sees its anchor.
    assert not torch.allclose(after[0, 1, -1], before[0, 1, -1])


def test_block_attention_equals_the_masked_attention_over_all_blocks_with_padding_and_dropped_blocks(
    drafter: DFlashDrafter, config: DrafterConfig
) -> None:
    drafter = randomised(drafter)
    batch = random_batch(config, [48, 30, 21], seed=3)
    batch.loss_mask[2] = False
    batch.loss_mask[2, 10:13] = True  # two candidate anchors: the row's other blocks are dropped
    anchors = sample_anchors(batch.loss_mask, 9, anchor_generator(0, 0, 0))
    anchors.positions[0, 0], anchors.keep[0, 0] = 0, True  # a kept anchor at 0 sees no context either
    assert anchors.keep.sum(dim=1).tolist() == [9, 9, 2]
    inputs = block_inputs(drafter, batch, anchors)
    direction = torch.randn(*anchors.positions.shape, config.block_size, config.hidden_size).double()

    hidden = drafter(*inputs)
    (hidden * direction).sum().backward()
    gradients = {name: p.grad.clone() for name, p in drafter.named_parameters()}
    drafter.zero_grad()
    expected = masked_sdpa_reference(drafter, *inputs)
    (expected * direction).sum().backward()

    torch.testing.assert_close(hidden, expected, rtol=1e-5, atol=1e-5)
    for name, parameter in drafter.named_parameters():
        # RMSNorm computes in float32 even here: gradients agree to float32 precision of their scale.
        scale = float(parameter.grad.abs().max())
        torch.testing.assert_close(gradients[name], parameter.grad, rtol=1e-5, atol=1e-6 * scale, msg=name)


def test_each_training_block_equals_an_inference_call_on_the_prefix_before_its_anchor(
    drafter: DFlashDrafter, config: DrafterConfig
) -> None:
    drafter = randomised(drafter, seed=1)
    batch = random_batch(config, [50, 37], seed=4)
    keep = torch.tensor([[True, True, True], [True, True, False]])
    anchors = BlockAnchors(positions=torch.tensor([[7, 20, 33], [5, 30, 0]]), keep=keep)
    training = block_hidden(drafter, batch, anchors)

    for row, block in keep.nonzero().tolist():
        anchor = int(anchors.positions[row, block])
        positions = torch.arange(anchor, anchor + config.block_size)[None, None]  # [1, 1, S]
        ids = torch.full_like(positions, config.mask_token_id)
        ids[0, 0, 0] = batch.input_ids[row, anchor]
        # At inference the target has run on the tokens before the anchor: that prefix is the context.
        inference = (
            ids,
            positions,
            batch.hidden_states[row : row + 1, :anchor],
            torch.arange(anchor)[None],
            torch.tensor([[anchor]]),
        )
        with torch.no_grad():
            alone = drafter(*inference)
            reference = masked_sdpa_reference(drafter, *inference)
        torch.testing.assert_close(alone, reference, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(alone[0, 0], training[row, block], rtol=1e-5, atol=1e-5)


def test_anchors_are_distinct_assistant_tokens_followed_by_an_assistant_token() -> None:
    loss_mask = torch.zeros(3, 30, dtype=torch.bool)
    loss_mask[0, 5:30] = True  # 24 candidates (the last token has no label after it)
    loss_mask[1, 10:14] = True  # 3 candidates: fewer than asked for
    loss_mask[1, 20] = True  # a lone assistant token: no label follows, never an anchor
    anchors = sample_anchors(loss_mask, num_anchors=8, generators=anchor_generator(0, 0, 0))

    assert anchors.positions.shape == (3, 8)
    assert anchors.keep.sum(dim=1).tolist() == [8, 3, 0]
    kept = anchors.positions[0][anchors.keep[0]].tolist()
    assert kept == sorted(set(kept)) and all(5 <= p <= 28 for p in kept)
    assert anchors.positions[1][anchors.keep[1]].tolist() == [10, 11, 12]
    # Same generator seed, same anchors: resumed and uninterrupted runs draw identically.
    again = sample_anchors(loss_mask, num_anchors=8, generators=anchor_generator(0, 0, 0))
    assert torch.equal(again.positions, anchors.positions)


def test_position_weights_decay_as_exp_minus_p_minus_1_over_gamma() -> None:
    weights = decay_weights(torch.ones(15, dtype=torch.bool), 7.0)
    assert weights.shape == (15,)
    assert weights[0] == 1.0
    assert math.isclose(float(weights[7]), math.exp(-1.0), rel_tol=1e-6)


def test_labels_stop_at_the_end_of_the_assistant_span_and_of_the_sequence(
    drafter: DFlashDrafter, config: DrafterConfig
) -> None:
    batch = random_batch(config, [40, 26])
    batch.loss_mask[0, 30:] = False  # the assistant turn of sample 0 ends at position 29
    anchors = BlockAnchors(positions=torch.tensor([[25], [20]]), keep=torch.tensor([[True], [True]]))
    with torch.no_grad():
        output = dflash_loss(drafter, batch, anchors, 7.0)
    # Sample 0: positions 26..29 (p = 1..4); sample 1: positions 21..25 before its end (p = 1..5).
    assert output.counted.tolist() == [2, 2, 2, 2, 1] + [0] * 10
    expected_weight = 2 * sum(math.exp(-p / 7) for p in range(4)) + math.exp(-4 / 7)
    assert math.isclose(output.weight_sum, expected_weight, rel_tol=1e-5)


def test_acceptance_length_counts_the_leading_run_of_correct_drafts_plus_one(config: DrafterConfig) -> None:
    # A zero LM head makes every logit equal, so argmax always drafts token 0.
    vocab = torch.zeros(config.vocab_size, config.hidden_size)
    torch.manual_seed(0)
    drafter = DFlashDrafter(config, torch.randn_like(vocab), vocab)
    batch = random_batch(config, [40])
    batch.input_ids[0] = 0
    batch.input_ids[0, [14, 30]] = 5  # the only tokens the drafter gets wrong
    batch.loss_mask[0, 2:] = True

    anchors = BlockAnchors(positions=torch.tensor([[10]]), keep=torch.tensor([[True]]))
    with torch.no_grad():
        output = dflash_loss(drafter, batch, anchors, 7.0)
    # Drafts for positions 11.. are right, 14 is wrong, 15.. right again but never reached.
    assert output.accepted_sum == 3.0 and output.num_blocks == 1
    assert output.correct[:5].tolist() == [1, 1, 1, 0, 1]

    # Every candidate anchor (2..38) at once: tau = 1 + mean leading run, each run ending at a miss
    # (position 14 or 30), at the block's end or at the end of the sequence.
    metrics = evaluate_drafter(drafter, [batch], num_anchors=100)
    runs = []
    for anchor in range(2, 39):
        run = 0
        for position in range(anchor + 1, min(anchor + 16, 40)):
            if position in (14, 30):
                break
            run += 1
        runs.append(run)
    assert metrics["num_blocks"] == len(runs)
    assert math.isclose(metrics["teacher_forced_tau"], 1 + sum(runs) / len(runs))


def test_only_the_drafter_weights_train_the_target_embedding_and_head_stay_frozen(
    drafter: DFlashDrafter, target_dir: Path
) -> None:
    embedding, lm_head = load_target_embeddings(target_dir)
    trainable = dict(drafter.named_parameters())
    assert not any("embed" in name or "lm_head" in name for name in trainable)
    assert not any("embed" in name or "lm_head" in name for name in drafter.state_dict())
    assert torch.equal(drafter.embed_weight, embedding) and torch.equal(drafter.lm_head_weight, lm_head)
    assert trainable["fc.weight"].shape == (64, 5 * 64)  # Linear(K*H -> H)


def test_target_embeddings_load_from_sharded_multimodal_and_tied_checkpoints(tmp_path: Path) -> None:
    embedding = torch.randn(300, 64)
    save_file({"model.language_model.embed_tokens.weight": embedding}, str(tmp_path / "shard-1.safetensors"))
    save_file(
        {"model.language_model.layers.0.mlp.weight": torch.ones(2)}, str(tmp_path / "shard-2.safetensors")
    )
    weight_map = {
        "model.language_model.embed_tokens.weight": "shard-1.safetensors",
        "model.language_model.layers.0.mlp.weight": "shard-2.safetensors",
    }
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    (tmp_path / "config.json").write_text(json.dumps({"text_config": {"tie_word_embeddings": True}}))
    loaded_embedding, loaded_head = load_target_embeddings(tmp_path)
    assert torch.equal(loaded_embedding, embedding) and torch.equal(loaded_head, embedding)

    (tmp_path / "config.json").write_text(json.dumps({"tie_word_embeddings": False}))
    with pytest.raises(KeyError, match="no LM head"):
        load_target_embeddings(tmp_path)


def test_a_label_after_a_non_assistant_token_inside_the_block_still_counts(
    drafter: DFlashDrafter, config: DrafterConfig
) -> None:
    batch = random_batch(config, [40])
    batch.loss_mask[0, 24] = False  # e.g. a tool-call token the template does not train on
    anchors = BlockAnchors(positions=torch.tensor([[20]]), keep=torch.tensor([[True]]))
    with torch.no_grad():
        output = dflash_loss(drafter, batch, anchors, 7.0)
    # Slots 1..15 are positions 21..35: every one is an assistant token except 24 (p = 4).
    assert output.counted.tolist() == [1, 1, 1, 0] + [1] * 11


def sliding_config(config: DrafterConfig, window: int) -> DrafterConfig:
    fields = {**config.__dict__, "layer_types": ["sliding_attention", "full_attention"]}
    return DrafterConfig(**{**fields, "sliding_window": window})


def test_a_sliding_layer_is_causal_inside_the_block_and_sees_only_its_window_of_context(
    target_dir: Path, config: DrafterConfig
) -> None:
    torch.manual_seed(0)
    drafter = randomised(DFlashDrafter.from_target(sliding_config(config, window=20)), seed=2)
    batch = random_batch(config, [60])
    anchors = BlockAnchors(positions=torch.tensor([[40]]), keep=torch.tensor([[True]]))
    inputs = block_inputs(drafter, batch, anchors)
    with torch.no_grad():
        before = drafter(*inputs)
        torch.testing.assert_close(before, masked_sdpa_reference(drafter, *inputs), rtol=1e-5, atol=1e-5)

    # Slot 0 (position 40) sees context 21..39 through the sliding layer; slot 5 (position 45) 26..39.
    # The full layer after it sees all of 0..39, so compare the sliding layer's own output.
    def first_layer(inputs: tuple[torch.Tensor, ...]) -> torch.Tensor:
        captured = {}
        handle = drafter.layers[0].register_forward_hook(lambda m, a, out: captured.setdefault("x", out))
        with torch.no_grad():
            drafter(*inputs)
        handle.remove()
        return captured["x"]

    base = first_layer(inputs)
    changed = batch.hidden_states.clone()
    changed[:, 22] = torch.randn_like(changed[:, 22].float()).bfloat16()  # inside slot 0's window only
    after = first_layer((*inputs[:2], changed, *inputs[3:]))
    assert not torch.allclose(after[0, 0, 0], base[0, 0, 0])
    torch.testing.assert_close(after[0, 0, 5:], base[0, 0, 5:], rtol=0, atol=0)

    later_slot_token = inputs[0].clone()
    later_slot_token[0, 0, 0] = (later_slot_token[0, 0, 0] + 1) % MASK_TOKEN_ID  # the anchor token
    after = first_layer((later_slot_token, *inputs[1:]))
    assert not torch.allclose(after[0, 0, 15], base[0, 0, 15])  # causal: later slots see the anchor
    earlier = inputs[0].clone()
    earlier[0, 0, 9] = 7  # slot 9's input: slots before it must not see it
    after = first_layer((earlier, *inputs[1:]))
    torch.testing.assert_close(after[0, 0, :9], base[0, 0, :9], rtol=0, atol=0)


@pytest.mark.parametrize("window", [None, 10])
def test_flex_attention_computes_the_same_blocks_as_the_materialised_attention(
    config: DrafterConfig, window: int | None
) -> None:
    # flex attention has no CPU backward and runs uncompiled here (scores materialised by flex itself),
    # so on a CPU this checks the forward: the mask rule written for flex equals the tensors' rule.
    if window is not None:
        config = sliding_config(config, window)
    torch.manual_seed(0)
    drafter = randomised(DFlashDrafter.from_target(config), seed=5).float()
    batch = random_batch(config, [48, 30, 21], seed=3)
    batch.loss_mask[2] = False
    batch.loss_mask[2, 10:13] = True  # a row with dropped blocks
    anchors = sample_anchors(batch.loss_mask, 9, anchor_generator(0, 0, 0))
    inputs = block_inputs(drafter, batch, anchors)
    assert drafter.attention_backend == "materialised"  # the CPU default
    with torch.no_grad():
        expected = drafter(*inputs)
        flex = drafter.set_attention_backend("flex")(*inputs)
    torch.testing.assert_close(flex, expected, rtol=1e-4, atol=1e-4)


cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA (flex attention's kernels)")


@cuda
@pytest.mark.parametrize("window", [None, 24])
def test_on_cuda_flex_attention_gives_the_materialised_loss_and_gradients_under_bf16_autocast(
    config: DrafterConfig, window: int | None
) -> None:
    if window is not None:
        config = sliding_config(config, window)
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target(config).cuda()
    batch = random_batch(config, [120, 77, 40], seed=6)
    anchors = sample_anchors(batch.loss_mask, 32, [anchor_generator(0, 0, i) for i in range(3)])
    results = {}
    for backend in ("materialised", "flex"):
        drafter.zero_grad()
        drafter.set_attention_backend(backend)
        with torch.autocast("cuda", dtype=torch.bfloat16):
            output = dflash_loss(drafter, batch, anchors, 7.0)
        output.loss.backward()
        results[backend] = (output.loss.detach(), {n: p.grad.clone() for n, p in drafter.named_parameters()})
    assert torch.isfinite(results["flex"][0])
    torch.testing.assert_close(results["flex"][0], results["materialised"][0], rtol=2e-2, atol=2e-2)
    for name, grad in results["materialised"][1].items():
        scale = float(grad.abs().max()) + 1e-6
        torch.testing.assert_close(results["flex"][1][name], grad, rtol=0.1, atol=0.05 * scale, msg=name)
