"""The DFlash training objective: anchors, block labels, the position-weighted loss, its memory.

Label rule (the same sources): block slot j predicts the token at `anchor + j` (the same position, not
the next one); slot 0 (the anchor) carries no loss; every slot whose position is inside the sequence
and the assistant mask carries a label, even after a non-assistant token earlier in the block.

Position weights (`position_weights`, chosen by `Objective.loss`): the paper's fixed `exp(-(p-1)/gamma)`
(`decay`), or D-PACE's (`dpace`, arXiv 2605.18810): each position weighs what it adds to the expected
accepted length, computed, detached, from the drafter's own confidences `q = exp(-CE)` smoothed by alpha.
Either way the loss's denominator depends on the labels alone (`loss_normaliser`: the decay weights'
sum, or the number of labels) and is summed over the whole global batch, so the update is the same
however the samples are split over ranks and micro-batches. DFlash2's selector adds a K-way
cross-entropy over each slot's unary top-k (the true token put in where it is missing), weighted the same
way from the selector's own confidences.

Distillation (`Objective.distill_weight` w > 0): at each labelled position the target's own distribution,
its LM head on its final hidden state at the position before (the state that predicted that token), is
the teacher, and a position's term is `(1 - w) CE + w KL(teacher || drafter)` under the same position
weights and normaliser. The teacher's logits are computed in the step, a chunk of rows at a time beside
the drafter's (never `[labels, V]` at once), without gradient. DFlash2's selector keeps learning from the
labels: its candidates are the drafter's own top-k, which the distilled unary term shapes already.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_assets.drafter.config import (
    DrafterConfig,
)
from dflash_assets.drafter.model import DFlashDrafter, materialised_chunk_blocks


@dataclass
class DrafterBatch:
    """Right-padded samples with their captured target layers: what offline and online modes both yield.
    With `final_state` the states hold one more slot after the K layers: the target's final hidden state
    (after its final norm), which distillation reads the target's own distribution from."""

    input_ids: torch.Tensor  # [B, T] long (padding: 0)
    loss_mask: torch.Tensor  # [B, T] bool, False on padding
    hidden_states: torch.Tensor  # [B, T, K(+1), H] as stored: bfloat16, or float8_e4m3fn (padding: 0)
    lengths: torch.Tensor  # [B] long
    sample_indices: list[int]
    hidden_states_scale: torch.Tensor | None = None  # [B, T, K(+1)] float32 for fp8 states, else None
    final_state: bool = False  # the last slot of `hidden_states` is the target's final hidden state

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def device_states(self, device: torch.device) -> torch.Tensor:
        """Every stored slot on `device` `[B, T, K(+1), H]`: bf16 as stored, or fp8 dequantised there
        (float32), so what crosses to the device is the stored bytes (see `extraction/fp8.py` for the
        format). The copy is queued without the host waiting for it (collation pins the states:
        `training/data.py`)."""
        if self.hidden_states_scale is None:
            return self.hidden_states.to(device, non_blocking=True)
        values = self.hidden_states.to(device, non_blocking=True)
        scale = self.hidden_states_scale.to(device, non_blocking=True)
        return values.float() * scale.unsqueeze(-1)

    def context_states(self, device: torch.device) -> torch.Tensor:
        """The captured target layers on `device`, `[B, T, K, H]` (the final state left out)."""
        states = self.device_states(device)
        return states[:, :, :-1] if self.final_state else states


@dataclass
class BlockAnchors:
    positions: torch.Tensor  # [B, N] long; 0 where `keep` is False
    keep: torch.Tensor  # [B, N] bool; rows with fewer candidates than N have dropped blocks at the end


def anchor_generator(seed: int, *parts: object) -> torch.Generator:
    """A CPU generator seeded from `(seed, *parts)`, e.g. (seed, epoch, sample index): anchors then
    depend only on the sample and the epoch, never on what ran before or on how samples are grouped into
    batches, so a resumed run, an uninterrupted one and any micro-batch split draw the same anchors."""
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def anchors_per_sequence(labelled_tokens: int, num_anchors: int, tokens_per_anchor: float = 1.0) -> int:
    """How many anchors a sequence with `labelled_tokens` assistant tokens gets (before the cap of the
    positions that qualify): one per `tokens_per_anchor` labelled tokens, rounded up, at most
    `num_anchors`. So each labelled token is about as often in a block whatever its sequence's length,
    and a 300-token answer no longer weighs in the (global) loss as much as an 8 K one. 1: every
    qualifying position up to `num_anchors` (the fixed count of the paper's recipe)."""
    return min(num_anchors, math.ceil(labelled_tokens / tokens_per_anchor)) if labelled_tokens > 0 else 0


def sample_anchors(
    loss_mask: torch.Tensor,
    num_anchors: int,
    generators: torch.Generator | Sequence[torch.Generator],
    tokens_per_anchor: float = 1.0,
) -> BlockAnchors:
    """Distinct random anchors per sequence, sorted by position: `anchors_per_sequence` of its labelled
    tokens, capped by the positions that qualify.

    An anchor must be an assistant token followed by another assistant token: at inference the anchor
    is a token the target just generated, and a block with no assistant label would teach nothing.
    Row b is drawn on the CPU from `generators[b]` (one generator: shared by all rows), so the choice is
    the same on any device and in either mode.
    """
    mask = loss_mask.detach().to("cpu", torch.bool)
    batch, length = mask.shape
    candidates = torch.zeros_like(mask)
    candidates[:, :-1] = mask[:, :-1] & mask[:, 1:]
    wanted = [anchors_per_sequence(int(n), num_anchors, tokens_per_anchor) for n in mask.sum(dim=1).tolist()]
    counts = torch.minimum(candidates.sum(dim=1), torch.tensor(wanted, dtype=torch.long))  # [B]
    num_blocks = int(counts.max()) if batch else 0
    if isinstance(generators, torch.Generator):
        scores = torch.rand(batch, length, generator=generators)
    else:
        if len(generators) != batch:
            raise ValueError(f"{len(generators)} anchor generators for a batch of {batch}")
        scores = torch.stack([torch.rand(length, generator=g) for g in generators]) if batch else mask.float()
    scores[~candidates] = 2.0  # never picked before a real candidate
    picked = scores.argsort(dim=1, stable=True)[:, :num_blocks]  # [B, N]
    keep = torch.arange(num_blocks)[None, :] < counts[:, None]
    positions = torch.where(keep, picked, length).sort(dim=1).values  # dropped ones sort last
    return BlockAnchors(positions=torch.where(keep, positions, 0), keep=keep)


LOSSES = ("dpace", "decay")  # DFLASH_DRAFTER_LOSS


@dataclass(frozen=True)
class Objective:
    """What the loss weighs: `loss` = `dpace` (D-PACE's weights from the drafter's confidences, smoothed
    by `dpace_alpha`) or `decay` (the paper's `exp(-(p-1)/gamma)`); DFlash2's selector term counts
    `selector_weight` times its own weighted cross-entropy."""

    loss: str = "dpace"
    gamma: float = 7.0
    dpace_alpha: float = 0.5
    selector_weight: float = 1.0
    distill_weight: float = 0.0  # w: (1 - w) CE + w KL from the target's distribution

    def __post_init__(self) -> None:
        if self.loss not in LOSSES:
            raise ValueError(f"drafter loss {self.loss!r} (DFLASH_DRAFTER_LOSS) is not one of {list(LOSSES)}")
        if not 0.0 <= self.distill_weight <= 1.0:
            raise ValueError(
                f"distill_weight (DFLASH_DISTILL_WEIGHT) must be in [0, 1], got {self.distill_weight}"
            )
        if self.gamma <= 0 or not 0.0 <= self.dpace_alpha <= 1.0:
            raise ValueError(
                f"gamma must be positive and dpace_alpha (DFLASH_DPACE_ALPHA) in [0, 1]; got {self.gamma}, "
                f"{self.dpace_alpha}"
            )


def as_objective(objective: Objective | float) -> Objective:
    """A number is the paper's fixed decay with that gamma."""
    return objective if isinstance(objective, Objective) else Objective(loss="decay", gamma=float(objective))


def decay_weights(label_valid: torch.Tensor, gamma: float) -> torch.Tensor:
    """`exp(-(p-1)/gamma)` at labelled drafted positions p = 1..S-1 of `label_valid [..., S-1]`, else 0."""
    offsets = torch.arange(label_valid.shape[-1], device=label_valid.device, dtype=torch.float32)
    return torch.exp(-offsets / gamma) * label_valid


def dpace_weights(label_valid: torch.Tensor, ce: torch.Tensor, alpha: float) -> torch.Tensor:
    """D-PACE's weights `[..., S-1]` from the per-position cross-entropy `ce` (same shape; detached here).

    With `s_i = (1 - alpha) q_i + alpha`, `q_i = exp(-ce_i)`, the weight of position p is
    `sum_{j >= p} prod_{i <= j} s_i` over labelled positions: d/d(log q_p) of the expected accepted length
    `sum_j prod_{i <= j} q_i`, the smoothing keeping early, unconfident training from starving the later
    positions. An unlabelled position weighs 0 and does not break the product (`s = 1`)."""
    with torch.no_grad():
        valid = label_valid.float()
        smooth = torch.where(label_valid, (1.0 - alpha) * torch.exp(-ce.detach().float()) + alpha, 1.0)
        prefix = torch.cumprod(smooth, dim=-1) * valid
        return prefix.flip(-1).cumsum(-1).flip(-1) * valid


def position_weights(objective: Objective, label_valid: torch.Tensor, ce: torch.Tensor) -> torch.Tensor:
    """The weight of every drafted position `[..., S-1]` under `objective` (no gradient)."""
    if objective.loss == "decay":
        return decay_weights(label_valid, objective.gamma)
    return dpace_weights(label_valid, ce, objective.dpace_alpha)


def loss_normaliser(objective: Objective, label_valid: torch.Tensor) -> torch.Tensor:
    """The loss's denominator for these labels, a function of the labels alone: summed over the whole
    global batch (never per rank or micro-batch) it divides every rank's summed gradients alike.
    Fixed decay: the weights' sum (the paper's weighted mean, unchanged). D-PACE: the number of labels (as
    speculators and ModelOpt normalise it, but global), which the selector's term shares: its weights
    come from the selector's own confidences, so a weights' sum would differ between the two terms."""
    if objective.loss == "decay":
        return decay_weights(label_valid, objective.gamma).sum()
    return label_valid.sum().float()


@dataclass
class BlockLossOutput:
    """One batch's loss and figures. Those computed by the drafter stay tensors on its device: reading
    one on the host waits for the device, so the trainer sums them there and reads them once a step."""

    loss: torch.Tensor  # scalar: this batch's weighted cross-entropy over its normaliser
    weighted_ce: torch.Tensor  # scalar with grad: the numerator of `loss`, for exact sums over batches
    weighted_ce_sum: torch.Tensor  # scalar, detached: `weighted_ce`'s value
    weight_sum: torch.Tensor  # scalar: denominator of `loss` (`loss_normaliser`: the labels' alone)
    correct: torch.Tensor  # [block_size - 1] long: hits per drafted position (DFlash2: the selector's)
    counted: torch.Tensor  # [block_size - 1] long: labels per drafted position (host: known beforehand)
    accepted_sum: torch.Tensor  # scalar: sum over blocks of the leading run of hits (teacher-forced tau)
    num_blocks: int  # from the anchors, on the host
    ce_sum: torch.Tensor  # scalar: plain cross-entropy summed over the labels (comparable across objectives)
    num_labels: int  # planned on the host
    expected_accepted_sum: torch.Tensor  # scalar: sum over blocks of sum_j prod_{i<=j} q_i (D-PACE's target)
    selector_ce_sum: torch.Tensor  # scalar: DFlash2's selector's K-way cross-entropy summed (0 for DFlash)
    selector_recall: torch.Tensor  # scalar: DFlash2's labels inside their slot's unary top-k (0 for DFlash)
    kl_sum: torch.Tensor  # scalar: KL from the target's distribution summed (0 without distillation)


@dataclass
class _Rows:
    """Per label row: unary cross-entropy (with grad), the drafted token, and DFlash2's selector terms."""

    ce: torch.Tensor  # [R]
    pick: torch.Tensor  # [R] long
    kl: torch.Tensor | None = None  # [R] with grad: KL from the target's distribution (distillation)
    selector_ce: torch.Tensor | None = None  # [R] with grad
    in_top_k: torch.Tensor | None = None  # [R] bool


def cache_rows(logits: torch.Tensor) -> int:
    """Rows of `[r, V]` logits the loss's float32 passes take at once: on a CPU about 1 MiB of float32, so
    that each row's max, exponentials, sum and gradient are computed while it sits in the core's cache (each
    pass over the whole `[r, V]` tensor went to memory and back: most of a SmolLM2 drafter's loss); on an
    accelerator every row, in one kernel each."""
    if logits.device.type != "cpu":
        return max(1, logits.shape[0])
    return max(1, 2**18 // max(1, logits.shape[-1]))


def row_statistics(logits: torch.Tensor, top_k: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(log-sum-exp `[r]` float32, then either the argmax `[r]` (`top_k` 0) or the top `top_k` columns
    `[r, K]`, strongest first) of `logits` `[r, V]` in any float dtype, computed in float32 a few rows at a
    time (`cache_rows`)."""
    rows = logits.shape[0]
    lse = torch.empty(rows, dtype=torch.float32, device=logits.device)
    best = torch.empty((rows, top_k) if top_k else rows, dtype=torch.long, device=logits.device)
    step = cache_rows(logits)
    with torch.no_grad():
        for start in range(0, rows, step):
            window = slice(start, start + step)
            x = logits[window].detach().float()
            lse[window] = torch.logsumexp(x, dim=-1)
            best[window] = x.topk(top_k, dim=-1).indices if top_k else x.argmax(dim=-1)
    return lse, best


class _CrossEntropyGather(torch.autograd.Function):
    """Per-row cross-entropy of logits `[r, V]` (any float dtype, computed in float32) against `labels`, and
    the logits at `columns` `[r, K]` in float32, from the rows' log-sum-exp `lse` (`row_statistics`). The
    forward reads only the labels' and columns' logits; the backward writes the logits' gradient once, in
    their dtype, a few rows at a time (`cache_rows`): softmax times the cross-entropy's gradient, the
    label's column less it, the gathered columns' gradients added. `log_softmax`, `nll_loss` and `gather`
    each allocate, zero and sum a `[r, V]` gradient of their own, and bf16 logits cast to float32 made two
    more passes: together most of a SmolLM2 drafter's step on a CPU."""

    @staticmethod
    def forward(ctx, logits, labels, columns, lse):  # noqa: ANN001, ANN205
        ctx.save_for_backward(logits, labels, columns, lse)
        label_logits = logits.gather(1, labels[:, None])[:, 0].float()
        return lse - label_logits, logits.gather(1, columns).float()

    @staticmethod
    def backward(ctx, grad_ce: torch.Tensor | None, grad_columns: torch.Tensor | None):  # noqa: ANN001, ANN205
        logits, labels, columns, lse = ctx.saved_tensors
        grad = torch.empty_like(logits)
        gathered = grad_columns is not None and columns.shape[1] > 0
        step = cache_rows(logits)
        for start in range(0, logits.shape[0], step):
            window = slice(start, start + step)
            if grad_ce is None:
                part = torch.zeros(logits[window].shape, dtype=torch.float32, device=logits.device)
            else:
                g = grad_ce[window, None].float()
                part = (logits[window].float() - lse[window, None]).exp_().mul_(g)  # a new tensor
                part.scatter_add_(1, labels[window, None], -g)
            if gathered:
                part.scatter_add_(1, columns[window], grad_columns[window].float())
            grad[window] = part
        return grad, None, None, None


def cross_entropy_and_gather(
    logits: torch.Tensor, labels: torch.Tensor, columns: torch.Tensor, lse: torch.Tensor | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """(`F.cross_entropy(logits.float(), labels, reduction="none")`, `logits.gather(1, columns).float()`)
    with one `[r, V]` gradient in the logits' dtype (`_CrossEntropyGather`); `columns` `[r, 0]` gathers
    nothing. `lse`: the rows' log-sum-exp where `row_statistics` computed it already."""
    if lse is None:
        lse = row_statistics(logits)[0]
    return _CrossEntropyGather.apply(logits, labels, columns, lse.detach())


def _label_rows(
    model: DFlashDrafter,
    hidden: torch.Tensor,
    labels: torch.Tensor,
    predecessors: torch.Tensor | None,
    teacher: torch.Tensor | None = None,
) -> tuple[torch.Tensor, ...]:
    """One chunk of rows: unary CE and argmax; with `teacher` (the target's final states that predicted
    these labels, `[r, H]`) the KL from the target's distribution to the drafter's; with `predecessors`
    (DFlash2) also the selector's K-way CE over the unary top-k, with the label in place of the weakest
    candidate where the top-k misses it, its teacher-forced pick, and whether the label was in the top-k
    (a pick decoding could make)."""
    kl = None
    if teacher is not None:
        logits = model.logits(hidden)  # [r, V] float32
        ce = F.cross_entropy(logits, labels, reduction="none")
        with torch.no_grad():  # the target's head on its own state: the same logits its LM head gives
            target_log_p = torch.log_softmax(model.logits(teacher), dim=-1)
        kl = (target_log_p.exp() * (target_log_p - torch.log_softmax(logits, dim=-1))).sum(dim=-1)
        if predecessors is None:
            return ce, logits.argmax(dim=-1), kl
        candidates = logits.detach().topk(model.candidate_selector.top_k, dim=-1).indices
    else:  # the head's own dtype (bf16 under autocast): the loss reads it in float32 a few rows at a time
        logits = model.logits(hidden, float32=False)
        top_k = 0 if predecessors is None else model.candidate_selector.top_k
        lse, best = row_statistics(logits, top_k)
        if predecessors is None:
            ce, _ = cross_entropy_and_gather(logits, labels, labels.new_zeros(labels.shape[0], 0), lse)
            return ce, best  # the argmax
        candidates = best  # [r, K], strongest first
    selector = model.candidate_selector
    hits = candidates == labels[:, None]
    in_top_k = hits.any(dim=-1)
    weakest = torch.arange(selector.top_k, device=labels.device) == selector.top_k - 1
    candidates = torch.where(weakest & ~in_top_k[:, None], labels[:, None], candidates)
    target = torch.where(in_top_k, hits.float().argmax(dim=-1), selector.top_k - 1)
    if kl is None:
        ce, unary = cross_entropy_and_gather(logits, labels, candidates, lse)
    else:
        unary = logits.gather(1, candidates)
    scores = unary + selector.pair_scores(hidden, predecessors, candidates)
    selector_ce = F.cross_entropy(scores, target, reduction="none")
    pick = candidates.gather(1, scores.detach().argmax(dim=-1, keepdim=True))[:, 0]
    return (ce, pick, selector_ce, in_top_k) if kl is None else (ce, pick, selector_ce, in_top_k, kl)


def _chunked_rows(
    model: DFlashDrafter,
    rows: torch.Tensor,
    labels: torch.Tensor,
    predecessors: torch.Tensor | None,
    teacher: torch.Tensor | None = None,
) -> _Rows:
    """`_label_rows` over every row, in chunks recomputed in backward: a production vocabulary's logits
    (`[R, 248K]`) are too large to keep alive at once (with a teacher, its logits too: half the rows). Rows
    that fit one chunk are not recomputed: backward holds one chunk's logits either way, and the recompute
    was a second pass through the LM head (a quarter of a SmolLM2 drafter's step on a CPU)."""
    chunk = logits_chunk_rows(model.config.vocab_size, distill=teacher is not None)
    recompute = torch.is_grad_enabled() and rows.shape[0] > chunk
    parts = []
    for start in range(0, rows.shape[0], chunk):
        window = slice(start, start + chunk)
        args = (
            model,
            rows[window],
            labels[window],
            None if predecessors is None else predecessors[window],
            None if teacher is None else teacher[window],
        )
        if recompute:
            parts.append(checkpoint(_label_rows, *args, use_reentrant=False))
        else:
            parts.append(_label_rows(*args))
    if not parts:
        empty = rows.new_zeros(0, dtype=torch.float32)
        none = predecessors is None
        kl = None if teacher is None else empty
        return _Rows(empty, labels, kl, None if none else empty, None if none else labels.bool())
    columns = [torch.cat(column) for column in zip(*parts, strict=True)]
    if predecessors is None:
        ce, pick, *kl = columns
        return _Rows(ce, pick, kl[0] if kl else None)
    ce, pick, selector_ce, in_top_k, *kl = columns
    return _Rows(ce, pick, kl[0] if kl else None, selector_ce, in_top_k)


def _on_grid(values: torch.Tensor, label_index: torch.Tensor, shape: torch.Size) -> torch.Tensor:
    """Per-row values `[R]` back at their drafted slots `[B, N, S-1]` (0 where unlabelled), from the rows'
    flat indices into `shape` `[B, N, S]` (no boolean indexing: that waits for the device)."""
    grid = values.new_zeros(shape.numel()).index_copy_(0, label_index, values)
    return grid.view(shape)[:, :, 1:]


def block_labels(
    batch: DrafterBatch, anchors: BlockAnchors, block_size: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(slot positions [B, N, S], slot tokens [B, N, S], label_valid [B, N, S-1]) on the batch's device.

    A drafted slot carries a label when its position is inside the sequence and the assistant mask.
    """
    device = batch.input_ids.device
    batch_size, length = batch.input_ids.shape
    positions = anchors.positions.to(device)
    keep = anchors.keep.to(device)
    num_blocks = positions.shape[1]
    slot_positions = positions[:, :, None] + torch.arange(block_size, device=device)  # [B, N, S]
    in_sequence = slot_positions < batch.lengths.to(device)[:, None, None]
    safe_positions = slot_positions.clamp(max=length - 1).view(batch_size, -1)
    tokens = batch.input_ids.gather(1, safe_positions).view(batch_size, num_blocks, block_size)
    in_span = batch.loss_mask.to(device).gather(1, safe_positions).view_as(tokens) & in_sequence
    return slot_positions, tokens, in_span[:, :, 1:] & keep[:, :, None]


def logits_chunk_rows(vocab_size: int, distill: bool = False) -> int:
    """Rows of logits the loss computes at once: 2**27 elements (512 MiB in float32) at the most, half that
    with distillation (the target's logits and log-probabilities beside the drafter's)."""
    return max(1, (2**26 if distill else 2**27) // vocab_size)


def _on_device(device: torch.device, *tensors: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """Host integer tensors on `device` in one copy the host does not wait for: packed, and on CUDA from
    page-locked memory (a copy from pageable memory blocks)."""
    if device.type == "cpu":
        return tensors
    packed = torch.cat([t.reshape(-1).long() for t in tensors])
    if device.type == "cuda":
        packed = packed.pin_memory()
    parts = packed.to(device, non_blocking=True).split([t.numel() for t in tensors])
    return tuple(part.view(t.shape) for part, t in zip(parts, tensors, strict=True))


def dflash_loss(
    model: DFlashDrafter,
    batch: DrafterBatch,
    anchors: BlockAnchors,
    objective: Objective | float,
    *,
    forward: Callable[..., torch.Tensor] | None = None,
) -> BlockLossOutput:
    """All blocks of all sequences in one forward pass, weighted by `objective` (a number: the fixed
    decay with that gamma). DFlash2 drafters add their selector's term.

    `forward` is what the drafter's forward runs through (default: `model`; in data-parallel training its
    wrapper, whose hooks reduce the gradients during the backward). Which slots carry a label is planned
    on the host, where the batch and its anchors are, and crosses to the device in one copy: nothing in
    here makes the host wait for the device."""
    objective = as_objective(objective)
    config, device = model.config, model.device
    block_size = config.block_size
    distill = objective.distill_weight > 0
    if distill and not batch.final_state:
        raise ValueError(
            "distillation (DFLASH_DISTILL_WEIGHT > 0) needs the target's final hidden state beside its "
            "layers: objects captured with DFLASH_CAPTURE_FINAL_STATE=1, or online training"
        )
    host = DrafterBatch(
        batch.input_ids.cpu(), batch.loss_mask.cpu(), batch.hidden_states, batch.lengths.cpu(),
        batch.sample_indices,
    )  # fmt: skip
    slot_positions, tokens, label_valid = block_labels(host, anchors, block_size)
    batch_size, length = host.input_ids.shape
    labelled = F.pad(label_valid, (1, 0))  # [B, N, S]: slot 0, the anchor, carries none
    label_index = labelled.flatten().nonzero().squeeze(1)  # [R]: the labelled slots of [B, N, S], flat

    block_input_ids = torch.full_like(tokens, config.mask_token_id)
    block_input_ids[:, :, 0] = tokens[:, :, 0]
    # The target predicted the token at position p from its final state at p - 1: [R] flat into [B * T].
    per_sequence = labelled.shape[1] * block_size
    teacher_at = (label_index // per_sequence) * length + slot_positions.flatten()[label_index] - 1
    block_input_ids, slot_positions, context_end, labels, label_index, predecessors, teacher_at = _on_device(
        device,
        block_input_ids,
        slot_positions,
        torch.where(anchors.keep, anchors.positions, 0),
        tokens.flatten()[label_index],
        label_index,
        tokens.flatten()[label_index - 1],  # the token before each labelled slot (DFlash2's selector)
        teacher_at,
    )
    states = batch.device_states(device)  # [B, T, K(+1), H]: the layers, and the final state last
    hidden = (forward or model)(
        block_input_ids,
        slot_positions,
        states[:, :, :-1] if batch.final_state else states,
        torch.arange(length, device=device).expand(batch_size, -1),
        context_end,
    )  # [B, N, S, D]

    rows = hidden.flatten(0, 2).index_select(0, label_index)  # [R, D]; labels [R]
    teacher = (
        states[:, :, -1].reshape(batch_size * length, -1).index_select(0, teacher_at) if distill else None
    )
    # DFlash2's selector scores each slot's candidates given the true token before it (teacher forcing).
    terms = _chunked_rows(model, rows, labels, predecessors if config.has_selector else None, teacher)
    grid = labelled.shape  # [B, N, S]: per-row values go back to their slots to be weighed by block
    valid = _on_grid(torch.ones_like(labels, dtype=torch.bool), label_index, grid)

    def weights_of(ce: torch.Tensor) -> torch.Tensor:  # [R] -> [R]
        weights = position_weights(objective, valid, _on_grid(ce.detach(), label_index, grid))  # [B, N, S-1]
        return F.pad(weights, (1, 0)).flatten().index_select(0, label_index)  # back to the rows' slots

    weight_sum = loss_normaliser(objective, valid)
    # Each label's term: its cross-entropy, mixed with the KL from the target's distribution when distilling;
    # weighed by the position weights of its cross-entropy either way (D-PACE's confidences are the labels').
    term = terms.ce
    if terms.kl is not None:
        term = (1.0 - objective.distill_weight) * terms.ce + objective.distill_weight * terms.kl
    # A batch with no label keeps a (zero) graph so backward() and the optimiser step stay uniform.
    weighted_ce = (term * weights_of(terms.ce)).sum() if rows.shape[0] else hidden.sum() * 0.0
    selector_ce_sum = None
    if terms.selector_ce is not None and rows.shape[0]:
        selector_term = (terms.selector_ce * weights_of(terms.selector_ce)).sum()
        weighted_ce = weighted_ce + objective.selector_weight * selector_term
        selector_ce_sum = terms.selector_ce.detach().sum()
    loss = weighted_ce / weight_sum if rows.shape[0] else weighted_ce

    with torch.no_grad():
        hits = terms.pick == labels
        if terms.in_top_k is not None:
            hits = hits & terms.in_top_k  # a label the unary top-k misses is never drafted
        correct = _on_grid(hits, label_index, grid)
        # [B, N]: an unlabelled slot ends the run, so a dropped block (no labels) counts 0.
        accepted = correct.long().cumprod(dim=2).sum(dim=2)
        confidence = _on_grid(torch.exp(-terms.ce.detach()), label_index, grid)  # 0 unlabelled: ends a run
        expected = confidence.cumprod(dim=2).sum(dim=2)  # [B, N]
    zero = weighted_ce.detach().new_zeros(())
    return BlockLossOutput(
        loss=loss,
        weighted_ce=weighted_ce,
        weighted_ce_sum=weighted_ce.detach(),
        weight_sum=weight_sum,
        correct=correct.sum(dim=(0, 1)),
        counted=label_valid.sum(dim=(0, 1)),
        accepted_sum=accepted.sum(),
        num_blocks=int(anchors.keep.sum()),
        ce_sum=terms.ce.detach().sum(),
        num_labels=int(label_index.shape[0]),
        expected_accepted_sum=expected.sum(),
        selector_ce_sum=selector_ce_sum if selector_ce_sum is not None else zero,
        selector_recall=terms.in_top_k.sum() if terms.in_top_k is not None else zero,
        kl_sum=terms.kl.detach().sum() if terms.kl is not None else zero,
    )


ATTENTION_BACKENDS = ("materialised", "flex")


def estimate_step_bytes(
    config: DrafterConfig,
    batch_size: int,
    context_length: int,
    num_blocks: int,
    bytes_per_element: int = 4,
    *,
    attention: str = "materialised",
) -> int:
    """Activation memory one training forward+backward holds at its peak for a micro-batch (padded
    shapes), counted per tensor the layers save for backward and the largest ones the backward makes;
    weights and optimiser state are not included. By the attention that runs: `materialised` keeps each
    layer's score matrix (probabilities saved, their gradient and the softmax's beside them in backward);
    `flex` keeps no score matrix, only the keys it read, its output and log-sum-exp. An estimate for
    planning micro-batches (checked against measured peaks: `bench/drafter_step.py`, and on the CPU by
    the tests); a step that still runs out of memory is split further (see the trainer). At 4 bytes an
    element everything is counted in float32; under bf16 autocast the layers keep about 0.7x of that."""
    if attention not in ATTENTION_BACKENDS:
        raise ValueError(f"attention backend {attention!r} is not one of {ATTENTION_BACKENDS}")
    size = config.block_size
    slots = batch_size * num_blocks * size  # every block slot is a query
    width, q_width = config.hidden_size, config.num_heads * config.head_dim
    kv_width = config.num_kv_heads * config.head_dim
    # Per slot and layer: the norms' float32 copies and outputs, the residual stream, q (projected,
    # normed, rotated, laid out for the kernel), the attention's output and o_proj's input, the MLP's
    # gate, up, activation and product.
    per_layer = slots * (10 * width + 6 * q_width + 4 * config.intermediate_size)
    chunked = 0  # one chunk of blocks' scores at a time, where the materialised attention chunks them
    if attention == "materialised":
        chunk = materialised_chunk_blocks(batch_size, config.num_heads, size, context_length)
        scores = config.num_heads * batch_size * size * (context_length + size)  # a block's, every head
        if chunk >= num_blocks:
            per_layer += scores * num_blocks * 3  # probs; grads in backward
        else:  # each layer keeps only its chunks' inputs; one chunk's scores, probs and grads at a time
            chunked = scores * chunk * 4
        per_layer += 4 * batch_size * context_length * q_width  # context k/v repeated to every head, rotary
    else:
        keys = batch_size * (context_length + num_blocks * size)  # [context ; every block]
        # The keys' input, k (projected, normed, rotated, padded), v, their rotary tables; lse in float32.
        per_layer += keys * (width + 8 * kv_width + 2 * config.head_dim) + config.num_heads * slots
    per_layer += _architecture_layer_elements(config, batch_size, context_length, num_blocks)
    context = (
        batch_size * context_length * (config.num_context_layers * config.target_hidden_size + 3 * width)
    )
    final = 2 * slots * width  # the last norm, and the labelled rows the loss checkpoints
    # One checkpointed chunk of logits at a time (`dflash_loss`): its log-probabilities kept for backward
    # and the one gradient `cross_entropy_and_gather` writes (the logits themselves go after the forward).
    labelled = slots - batch_size * num_blocks  # at most: every slot but the anchors
    logits_chunk = 2 * min(labelled, logits_chunk_rows(config.vocab_size)) * config.vocab_size
    extra = _architecture_extra_elements(config, batch_size, context_length, num_blocks)
    return (
        config.num_layers * per_layer + context + final + logits_chunk + extra + chunked
    ) * bytes_per_element


def _architecture_layer_elements(
    config: DrafterConfig, batch_size: int, context_length: int, num_blocks: int
) -> int:
    """What one layer of the drafter's architecture keeps beyond the DFlash backbone's attention and MLP.
    DFlash2: its two convolutions, each applied before and after its sublayer, keep the slot-shifted input
    of each application and its sum, and the backward makes their gradients (about 9 slot-wide tensors a
    layer, measured on the CPU by `test_step_memory.py`). DFlash: nothing."""
    if config.arch != "dflash2":
        return 0
    return 9 * batch_size * num_blocks * config.block_size * config.hidden_size


def _architecture_extra_elements(
    config: DrafterConfig, batch_size: int, context_length: int, num_blocks: int
) -> int:
    """What the architecture keeps once per step beyond its layers. DFlash2's selector: the dense
    gradients of its two codebooks (vocabulary x rank each) and a chunk's candidates' codebook rows (the
    gradient of the unary logits it gathers from is the cross-entropy's own, written once). DFlash:
    nothing."""
    if config.arch != "dflash2":
        return 0
    labelled = batch_size * num_blocks * (config.block_size - 1)
    rows = min(labelled, logits_chunk_rows(config.vocab_size))
    rank, candidates = config.selector_rank, config.selector_top_k
    return 2 * config.vocab_size * rank + 2 * rows * candidates * rank
