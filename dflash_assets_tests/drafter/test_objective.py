"""The objective's position weights, each against a hand-computed example, and the property the training
loop relies on: a global batch's loss, summed over any split of its samples, is the whole batch's."""

from __future__ import annotations

import math

import pytest
import torch

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.model import DFlashDrafter
from dflash_assets.drafter.objective import (
    BlockAnchors,
    DrafterBatch,
    Objective,
    _label_rows,
    anchor_generator,
    anchors_per_sequence,
    cross_entropy_and_gather,
    decay_weights,
    dflash_loss,
    dpace_weights,
    loss_normaliser,
    position_weights,
    sample_anchors,
)


def test_the_fixed_decay_weighs_position_p_exp_minus_p_minus_1_over_gamma_and_unlabelled_ones_zero():
    valid = torch.tensor([[True, True, False, True]])
    weights = decay_weights(valid, gamma=2.0)
    assert weights[0].tolist() == pytest.approx([1.0, math.exp(-0.5), 0.0, math.exp(-1.5)])
    assert float(loss_normaliser(Objective(loss="decay", gamma=2.0), valid)) == pytest.approx(
        1.0 + math.exp(-0.5) + math.exp(-1.5)
    )


def test_d_pace_weighs_each_position_by_what_it_adds_to_the_expected_accepted_length():
    # q = exp(-ce) = [0.5, 0.25, 0.8]; alpha = 0 (no smoothing): prefix products 0.5, 0.125, 0.1; the
    # weight of p is the sum of the prefix products from p on: 0.725, 0.225, 0.1.
    ce = -torch.log(torch.tensor([[0.5, 0.25, 0.8]]))
    valid = torch.ones(1, 3, dtype=torch.bool)
    assert dpace_weights(valid, ce, alpha=0.0)[0].tolist() == pytest.approx([0.725, 0.225, 0.1])
    # alpha = 0.5: s = 0.5 q + 0.5 = [0.75, 0.625, 0.9]; prefixes 0.75, 0.46875, 0.421875.
    assert dpace_weights(valid, ce, alpha=0.5)[0].tolist() == pytest.approx(
        [0.75 + 0.46875 + 0.421875, 0.46875 + 0.421875, 0.421875]
    )
    # alpha = 1: every confidence smoothed to 1, so position p weighs the labels from p on (S-p).
    assert dpace_weights(valid, ce, alpha=1.0)[0].tolist() == pytest.approx([3.0, 2.0, 1.0])


def test_an_unlabelled_position_weighs_nothing_under_d_pace_and_does_not_break_the_chain():
    ce = -torch.log(torch.tensor([[0.5, 0.1, 0.5]]))
    valid = torch.tensor([[True, False, True]])
    # Position 2 is skipped (s = 1): prefixes 0.5, -, 0.25; weights 0.75, 0, 0.25.
    assert dpace_weights(valid, ce, alpha=0.0)[0].tolist() == pytest.approx([0.75, 0.0, 0.25])
    # The normaliser is the number of labels, whatever the weights came out as.
    assert float(loss_normaliser(Objective(loss="dpace"), valid)) == 2.0


def test_d_pace_weights_are_detached_from_the_confidences_they_come_from():
    ce = torch.tensor([[0.3, 0.7]], requires_grad=True)
    weights = position_weights(Objective(loss="dpace"), torch.ones(1, 2, dtype=torch.bool), ce)
    assert not weights.requires_grad
    (weights * ce).sum().backward()
    assert ce.grad[0].tolist() == pytest.approx(weights[0].tolist())  # d(w * ce)/d ce = w: no term through w


def test_an_unknown_loss_or_alpha_is_refused_naming_the_setting():
    with pytest.raises(ValueError, match="DFLASH_DRAFTER_LOSS"):
        Objective(loss="kl")
    with pytest.raises(ValueError, match="DFLASH_DPACE_ALPHA"):
        Objective(dpace_alpha=1.5)


def _batch(config: DrafterConfig, lengths: list[int], seed: int) -> DrafterBatch:
    generator = torch.Generator().manual_seed(seed)
    batch, length = len(lengths), max(lengths)
    ids = torch.randint(0, config.vocab_size - 1, (batch, length), generator=generator)
    mask = torch.zeros(batch, length, dtype=torch.bool)
    for row, n in enumerate(lengths):
        mask[row, 3:n] = True
    hidden = torch.randn(
        batch, length, config.num_context_layers, config.target_hidden_size, generator=generator
    )
    return DrafterBatch(ids, mask, hidden.bfloat16(), torch.tensor(lengths), list(range(batch)))


def _rows(batch: DrafterBatch, rows: list[int]) -> DrafterBatch:
    length = int(batch.lengths[rows].max())
    return DrafterBatch(
        batch.input_ids[rows, :length], batch.loss_mask[rows, :length], batch.hidden_states[rows, :length],
        batch.lengths[rows], [batch.sample_indices[r] for r in rows],
    )  # fmt: skip


@pytest.mark.parametrize("arch", ["dflash", "dflash2"])
@pytest.mark.parametrize("loss", ["dpace", "decay"])
def test_the_loss_of_a_batch_split_in_two_sums_to_the_whole_batch_s_numerator_and_normaliser(
    config: DrafterConfig, arch: str, loss: str
):
    """What makes two ranks (or any micro-batch split) take one process's step: numerators and
    normalisers add up, and so do the gradients of the numerators."""
    config = DrafterConfig(**{**config.__dict__, "arch": arch, "selector_rank": 16})
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target(config)
    objective = Objective(loss=loss)
    batch = _batch(config, [40, 31, 26, 37], seed=1)

    def run(part: DrafterBatch):
        generators = [anchor_generator(0, 0, i) for i in part.sample_indices]
        drafter.zero_grad()
        output = dflash_loss(drafter, part, sample_anchors(part.loss_mask, 8, generators), objective)
        output.weighted_ce.backward()
        return output, {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}

    whole, whole_grads = run(batch)
    first, first_grads = run(_rows(batch, [0, 2]))
    second, second_grads = run(_rows(batch, [1, 3]))
    assert float(first.weight_sum + second.weight_sum) == pytest.approx(float(whole.weight_sum), rel=1e-6)
    total = float(first.weighted_ce_sum + second.weighted_ce_sum)
    assert total == pytest.approx(float(whole.weighted_ce_sum), rel=1e-5)
    assert whole.num_labels == first.num_labels + second.num_labels > 0
    for name, grad in whole_grads.items():
        torch.testing.assert_close(first_grads[name] + second_grads[name], grad, rtol=1e-4, atol=1e-5)
    if arch == "dflash2":  # the selector's term is in the loss, and trains the selector
        assert (
            whole.selector_ce_sum > 0 and whole_grads["candidate_selector.successor_codebook"].abs().sum() > 0
        )


@pytest.mark.parametrize("chunk_rows", [1_000_000, 7])
def test_the_head_runs_once_a_step_when_the_rows_fit_one_chunk_and_the_gradients_are_those_of_a_recompute(
    config: DrafterConfig, monkeypatch: pytest.MonkeyPatch, chunk_rows: int
):
    """A chunk's logits are recomputed in backward only when there are several chunks (a production
    vocabulary's `[R, V]` would not fit at once); rows that fit one chunk pass through the head once, with
    the same loss and gradients."""
    from dflash_assets.drafter import objective as objective_module

    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target(
        DrafterConfig(**{**config.__dict__, "arch": "dflash2", "selector_rank": 16})
    )
    batch = _batch(drafter.config, [40, 31], seed=3)
    anchors = sample_anchors(batch.loss_mask, 8, [anchor_generator(0, 0, i) for i in batch.sample_indices])

    def step(chunk: int) -> tuple[int, float, dict[str, torch.Tensor]]:
        monkeypatch.setattr(objective_module, "logits_chunk_rows", lambda vocab, distill=False: chunk)
        calls = []
        real = DFlashDrafter.logits
        monkeypatch.setattr(
            DFlashDrafter, "logits", lambda self, h, **kw: calls.append(len(h)) or real(self, h, **kw)
        )
        drafter.zero_grad()
        output = dflash_loss(drafter, batch, anchors, Objective())
        output.weighted_ce.backward()
        grads = {n: p.grad.clone() for n, p in drafter.named_parameters() if p.grad is not None}
        return sum(calls), float(output.weighted_ce.detach()), grads

    rows, loss, grads = step(chunk_rows)
    labels = int(dflash_loss(drafter, batch, anchors, Objective()).num_labels)
    # One chunk: each row through the head once; several: each row twice (forward, then recomputed).
    assert rows == (labels if chunk_rows >= labels else 2 * labels)
    reference_rows, reference_loss, reference_grads = step(1_000_000 if chunk_rows == 7 else 7)
    assert loss == pytest.approx(reference_loss, rel=1e-6)
    for name, grad in grads.items():
        torch.testing.assert_close(grad, reference_grads[name], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("cached_rows", [1, 4, 1000])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("gathered", [0, 1, 4])
def test_the_fused_cross_entropy_gives_the_values_and_gradients_of_log_softmax_nll_and_gather(
    gathered: int, dtype: torch.dtype, cached_rows: int, monkeypatch: pytest.MonkeyPatch
):
    """`cross_entropy_and_gather` writes one gradient where `F.cross_entropy` and `gather` write three: the
    same per-row values and the same gradient, whichever outputs the loss uses (a label among the gathered
    columns included, as the selector puts it there); bf16 logits (the head under autocast) give float32's
    values on the same numbers and the gradient float32's would round to; a few rows at a time
    (`cache_rows`) or all at once alike."""
    from dflash_assets.drafter import objective as objective_module

    monkeypatch.setattr(objective_module, "cache_rows", lambda logits: cached_rows)
    torch.manual_seed(gathered)
    logits = (torch.randn(6, 50) * 4).to(dtype).requires_grad_()
    before = logits.detach().clone()
    labels = torch.randint(0, 50, (6,))
    columns = torch.randint(0, 50, (6, gathered))
    if gathered:
        columns[:, -1] = labels
    weights, mix = torch.rand(6), torch.randn(6, gathered)
    reference = logits.detach().float().requires_grad_()  # the same numbers in float32
    for uses in ("both", "ce", "columns"):
        fused_ce, fused_columns = cross_entropy_and_gather(logits, labels, columns)
        plain_ce = torch.nn.functional.cross_entropy(reference, labels, reduction="none")
        plain_columns = reference.gather(1, columns)
        assert fused_ce.dtype == fused_columns.dtype == torch.float32
        torch.testing.assert_close(fused_ce, plain_ce)
        torch.testing.assert_close(fused_columns, plain_columns)
        grads = []
        for ce, gathered_logits, source in (
            (fused_ce, fused_columns, logits),
            (plain_ce, plain_columns, reference),
        ):
            loss = (ce * weights).sum() if uses != "columns" else 0.0
            if uses != "ce" and gathered:
                loss = loss + (gathered_logits * mix).sum()
            if not torch.is_tensor(loss):
                continue
            grads.append(torch.autograd.grad(loss, source)[0])
        for grad in grads[1:]:
            assert grads[0].dtype == dtype
            torch.testing.assert_close(grads[0], grad.to(dtype))  # float32's gradient, rounded once
    assert torch.equal(logits.detach(), before)  # the backward reads the saved logits, never writes them


@pytest.mark.parametrize("cached_rows", [1, 3, 1000])
def test_row_statistics_give_log_sum_exp_argmax_and_top_k_of_each_row(
    cached_rows: int, monkeypatch: pytest.MonkeyPatch
):
    from dflash_assets.drafter import objective as objective_module

    monkeypatch.setattr(objective_module, "cache_rows", lambda logits: cached_rows)
    torch.manual_seed(0)
    logits = torch.randn(7, 300).to(torch.bfloat16)
    lse, argmax = objective_module.row_statistics(logits)
    torch.testing.assert_close(lse, torch.logsumexp(logits.float(), dim=-1))
    assert torch.equal(argmax, logits.float().argmax(dim=-1))
    lse_k, top = objective_module.row_statistics(logits, top_k=5)
    assert torch.equal(lse_k, lse)
    assert torch.equal(logits.float().gather(1, top), logits.float().topk(5, dim=-1).values)


def test_the_selector_s_candidates_are_the_unary_top_k_with_the_label_put_in_where_it_is_missing(
    config: DrafterConfig,
):
    config = DrafterConfig(**{**config.__dict__, "arch": "dflash2", "selector_rank": 8, "selector_top_k": 4})
    drafter = DFlashDrafter.from_target(config)
    with torch.no_grad():  # no pair term: the selector's scores are the unary logits at its candidates
        drafter.candidate_selector.successor_codebook.zero_()
    hidden = torch.randn(2, config.hidden_size)
    logits = drafter.logits(hidden)
    top = logits.topk(4, dim=-1).indices
    labels = torch.stack([top[0, 1], logits[1].argsort()[0]])  # row 0: in the top-4; row 1: the weakest token
    ce, pick, selector_ce, in_top_k = _label_rows(drafter, hidden, labels, torch.tensor([5, 6]))
    assert in_top_k.tolist() == [True, False]
    assert pick[0] == top[0, 0]  # the unary argmax wins without a pair term
    # Row 0: K-way CE of the label's own logit among the top-4's. Row 1: the label replaces the 4th.
    expected_0 = -torch.log_softmax(logits[0, top[0]], dim=-1)[1]
    candidates_1 = torch.cat([top[1, :3], labels[1:]])
    expected_1 = -torch.log_softmax(logits[1, candidates_1], dim=-1)[3]
    torch.testing.assert_close(selector_ce, torch.stack([expected_0, expected_1]))


def test_every_anchor_s_block_is_weighted_alike_whichever_batch_it_is_in(config: DrafterConfig):
    """D-PACE's weights depend on the block alone (its positions' confidences): one block's weights are
    the same evaluated alone or beside other sequences."""
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target(config)
    batch = _batch(config, [40, 35], seed=2)
    anchors = BlockAnchors(positions=torch.tensor([[10], [12]]), keep=torch.tensor([[True], [True]]))
    with torch.no_grad():
        both = dflash_loss(drafter, batch, anchors, Objective())
        alone = dflash_loss(
            drafter, _rows(batch, [0]), BlockAnchors(anchors.positions[:1], anchors.keep[:1]), Objective()
        )
        other = dflash_loss(
            drafter, _rows(batch, [1]), BlockAnchors(anchors.positions[1:], anchors.keep[1:]), Objective()
        )
    total = float(alone.weighted_ce_sum + other.weighted_ce_sum)
    assert total == pytest.approx(float(both.weighted_ce_sum), rel=1e-5)


def test_a_sequence_gets_one_anchor_per_tokens_per_anchor_labelled_tokens_up_to_the_cap():
    # The recipe: one per 6 labelled tokens, at most 512. A 300-token answer gets 50 (the fixed count gave
    # it 299, every position), an 8 K one the cap, 3,072 exactly the cap (the recipe's own length).
    assert [anchors_per_sequence(n, 512, 6) for n in (0, 1, 10, 300, 3072, 8000)] == [0, 1, 2, 50, 512, 512]
    assert [anchors_per_sequence(n, 512, 1) for n in (10, 300, 8000)] == [10, 300, 512]  # the fixed count


def test_anchors_scale_with_each_sequences_labelled_tokens_whichever_batch_it_is_drawn_in():
    mask = torch.zeros(3, 400, dtype=torch.bool)
    mask[0, 10:310] = True  # 300 labelled: 50 anchors
    mask[1, 5:65] = True  # 60 labelled: 10
    mask[2, 0:4] = True  # 4 labelled, 3 that qualify: 1
    generators = [anchor_generator(7, 0, i) for i in range(3)]
    together = sample_anchors(mask, 512, generators, tokens_per_anchor=6)
    assert together.keep.sum(dim=1).tolist() == [50, 10, 1]
    for row in range(3):  # the same anchors drawn alone (another micro-batch, another rank)
        alone = sample_anchors(mask[row : row + 1], 512, [anchor_generator(7, 0, row)], tokens_per_anchor=6)
        kept = together.positions[row][together.keep[row]]
        assert torch.equal(alone.positions[0][alone.keep[0]], kept)
        assert bool(mask[row][kept].all() and mask[row][kept + 1].all())  # each an assistant token before one


def test_with_anchors_by_labelled_tokens_a_batch_split_in_two_still_sums_to_the_whole(config: DrafterConfig):
    torch.manual_seed(0)
    drafter = DFlashDrafter.from_target(config)
    batch = _batch(config, [40, 31, 26, 37], seed=1)

    def run(part: DrafterBatch):
        generators = [anchor_generator(0, 0, i) for i in part.sample_indices]
        anchors = sample_anchors(part.loss_mask, 8, generators, tokens_per_anchor=4)
        with torch.no_grad():
            return dflash_loss(drafter, part, anchors, Objective()), anchors

    (whole, anchors), (first, _), (second, _) = (
        run(batch),
        run(_rows(batch, [0, 2])),
        run(_rows(batch, [1, 3])),
    )
    assert anchors.keep.sum(dim=1).tolist() == [8, 7, 6, 8]  # ceil(labelled / 4), at most 8
    assert float(first.weight_sum + second.weight_sum) == pytest.approx(float(whole.weight_sum), rel=1e-6)
    total = float(first.weighted_ce_sum + second.weighted_ce_sum)
    assert total == pytest.approx(float(whole.weighted_ce_sum), rel=1e-5)
