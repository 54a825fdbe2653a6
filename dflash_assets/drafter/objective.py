"""The DFlash training objective: anchors, block labels, the position-weighted loss, its memory.

Label rule (the same sources): block slot j predicts the token at `anchor + j` (the same position, not
the next one); slot 0 (the anchor) carries no loss; every slot whose position is inside the sequence
and the assistant mask carries a label, even after a non-assistant token earlier in the block.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.utils.checkpoint import checkpoint

from dflash_assets.drafter.config import (
    DrafterConfig,
)
from dflash_assets.drafter.model import DFlashDrafter


@dataclass
class DrafterBatch:
    """Right-padded samples with their captured target layers: what offline and online modes both yield."""

    input_ids: torch.Tensor  # [B, T] long (padding: 0)
    loss_mask: torch.Tensor  # [B, T] bool, False on padding
    hidden_states: torch.Tensor  # [B, T, K, H] as stored: bfloat16, or float8_e4m3fn (padding: 0)
    lengths: torch.Tensor  # [B] long
    sample_indices: list[int]
    hidden_states_scale: torch.Tensor | None = None  # [B, T, K] float32 for fp8 states, else None

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())

    def context_states(self, device: torch.device) -> torch.Tensor:
        """The captured target layers on `device`: bf16 as stored, or fp8 dequantised there (float32),
        so what crosses to the device is the stored bytes (see `extraction/fp8.py` for the format)."""
        if self.hidden_states_scale is None:
            return self.hidden_states.to(device)
        values = self.hidden_states.to(device, non_blocking=True)
        scale = self.hidden_states_scale.to(device, non_blocking=True)
        return values.float() * scale.unsqueeze(-1)


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


def sample_anchors(
    loss_mask: torch.Tensor, num_anchors: int, generators: torch.Generator | Sequence[torch.Generator]
) -> BlockAnchors:
    """Up to `num_anchors` distinct random anchors per sequence, sorted by position.

    An anchor must be an assistant token followed by another assistant token: at inference the anchor
    is a token the target just generated, and a block with no assistant label would teach nothing.
    Row b is drawn on the CPU from `generators[b]` (one generator: shared by all rows), so the choice is
    the same on any device and in either mode.
    """
    mask = loss_mask.detach().to("cpu", torch.bool)
    batch, length = mask.shape
    candidates = torch.zeros_like(mask)
    candidates[:, :-1] = mask[:, :-1] & mask[:, 1:]
    counts = candidates.sum(dim=1)  # [B]
    num_blocks = min(num_anchors, int(counts.max())) if batch else 0
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


def position_weights(block_size: int, gamma: float, device: torch.device | None = None) -> torch.Tensor:
    """`exp(-(p-1)/gamma)` for drafted positions p = 1..block_size-1, `[block_size - 1]`."""
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)


@dataclass
class BlockLossOutput:
    loss: torch.Tensor  # scalar: position-weighted mean cross-entropy of this batch
    weighted_ce: torch.Tensor  # scalar with grad: the numerator of `loss`, for exact sums over batches
    weighted_ce_sum: float  # `weighted_ce` as a number
    weight_sum: float  # denominator of `loss`
    correct: torch.Tensor  # [block_size - 1] long: argmax hits per drafted position
    counted: torch.Tensor  # [block_size - 1] long: labels per drafted position
    accepted_sum: float  # sum over blocks of the leading run of hits (teacher-forced acceptance)
    num_blocks: int


def _cross_entropy_and_argmax(
    model: DFlashDrafter, hidden: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model.logits(hidden)  # [R, V] float32
    return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(dim=-1)


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


def dflash_loss(
    model: DFlashDrafter, batch: DrafterBatch, anchors: BlockAnchors, gamma: float
) -> BlockLossOutput:
    """All blocks of all sequences in one forward pass (position weights `exp(-(p-1)/gamma)`)."""
    config, device = model.config, model.device
    block_size = config.block_size
    on_device = DrafterBatch(
        batch.input_ids.to(device), batch.loss_mask.to(device), batch.hidden_states,
        batch.lengths.to(device), batch.sample_indices,
    )  # fmt: skip
    slot_positions, tokens, label_valid = block_labels(on_device, anchors, block_size)
    batch_size, length = on_device.input_ids.shape
    keep = anchors.keep.to(device)

    block_input_ids = torch.full_like(tokens, config.mask_token_id)
    block_input_ids[:, :, 0] = tokens[:, :, 0]
    hidden = model(
        block_input_ids,
        slot_positions,
        batch.context_states(device),
        torch.arange(length, device=device).expand(batch_size, -1),
        torch.where(keep, anchors.positions.to(device), 0),
    )[:, :, 1:]  # [B, N, S-1, D]

    rows, labels = hidden[label_valid], tokens[:, :, 1:][label_valid]  # [R, D], [R]
    weights = position_weights(block_size, gamma, device).expand_as(label_valid)[label_valid]  # [R]
    ce_chunks, argmax_chunks = [], []
    # Logits for a production vocabulary are large ([R, 248K]); compute them in chunks and recompute in
    # backward instead of keeping them all alive.
    chunk = max(1, 2**27 // config.vocab_size)
    for start in range(0, rows.shape[0], chunk):
        part = (model, rows[start : start + chunk], labels[start : start + chunk])
        if torch.is_grad_enabled():
            ce, argmax = checkpoint(_cross_entropy_and_argmax, *part, use_reentrant=False)
        else:
            ce, argmax = _cross_entropy_and_argmax(*part)
        ce_chunks.append(ce)
        argmax_chunks.append(argmax)
    ce = torch.cat(ce_chunks) if ce_chunks else hidden.new_zeros(0, dtype=torch.float32)
    argmax = torch.cat(argmax_chunks) if argmax_chunks else labels

    weight_sum = weights.sum()
    # A batch with no label keeps a (zero) graph so backward() and the optimiser step stay uniform.
    weighted_ce = (ce * weights).sum() if rows.shape[0] else hidden.sum() * 0.0
    loss = weighted_ce / weight_sum if rows.shape[0] else weighted_ce

    with torch.no_grad():
        correct = torch.zeros_like(label_valid)
        correct[label_valid] = argmax == labels
        accepted = correct.long().cumprod(dim=2).sum(dim=2)  # [B, N]; an unlabelled slot ends the run
    return BlockLossOutput(
        loss=loss,
        weighted_ce=weighted_ce,
        weighted_ce_sum=float(weighted_ce.detach()),
        weight_sum=float(weight_sum),
        correct=correct.sum(dim=(0, 1)).cpu(),
        counted=label_valid.sum(dim=(0, 1)).cpu(),
        accepted_sum=float(accepted[keep].sum()),
        num_blocks=int(keep.sum()),
    )


def estimate_step_bytes(
    config: DrafterConfig, batch_size: int, context_length: int, num_blocks: int, bytes_per_element: int = 4
) -> int:
    """Activation memory one training forward+backward keeps for a micro-batch (padded shapes), from
    the tensors the materialised attention and the MLP save for backward; weights and optimiser state
    are not included. An estimate for planning micro-batches: a step that still runs out of memory is
    split further (see the trainer)."""
    slots = batch_size * num_blocks * config.block_size
    width = config.hidden_size
    attention = config.num_heads * slots * (context_length + config.block_size) * 3  # scores, probs, mask
    kv = 4 * batch_size * config.num_heads * context_length * config.head_dim  # repeated k/v + rotary
    linear = slots * (8 * width + 2 * config.num_heads * config.head_dim + 3 * config.intermediate_size)
    per_layer = attention + kv + linear
    context = batch_size * context_length * (config.num_context_layers * width + 2 * width)
    logits_chunk = 2**27  # one checkpointed logits chunk at a time
    return (config.num_layers * per_layer + context + logits_chunk) * bytes_per_element
