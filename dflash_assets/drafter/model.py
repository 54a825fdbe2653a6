"""The DFlash drafter, top to bottom: config and shape presets, layers, the block objective, export.

A drafter proposes a block of `block_size` tokens at once. Slot 0 of a block is the real anchor token
(the last token the target produced), slots 1.. are the mask token; the drafter fills them in one
forward pass, conditioned on a context feature built from k hidden layers of the target.

Attention rule (checked against z-lab/dflash `dflash_generate` and SpecForge's DFlash training mask):
a block sees the context feature at positions strictly BEFORE its anchor, plus slots of its own block.
At inference the anchor is the token the target has just sampled, so the target has not yet run on it
and there is no hidden state for it; training with `<= anchor` would teach the drafter to lean on a
feature it never gets. Blocks never see each other.

Layer types: a `full_attention` layer sees every slot of its block (non-causal) and the whole context
before the anchor. A `sliding_attention` layer is causal with a window, as SGLang and vLLM run the
published Qwen3.6 drafter's sliding layers (SGLang: decoder attention with `sliding_window - 1` to the
left; vLLM: causal for sliding layers): slot j at position q sees positions p with q - window < p <= q,
its own block included only up to itself.

Label rule (the same sources): block slot j predicts the token at `anchor + j` (the same position, not
the next one); slot 0 (the anchor) carries no loss; every slot whose position is inside the sequence
and the assistant mask carries a label, even after a non-assistant token earlier in the block.

Names: modules are named as the reference checkpoints name their weights (`layers.N.self_attn.q_proj`,
`input_layernorm`, `fc`, `hidden_norm`, ...), so `state_dict()` is the published layout itself and an
export needs no renaming table that could drift.
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_assets.drafter.config import (
    CONFIG_NAME,
    DRAFTER_SHAPES,
    SLIDING_ATTENTION,
    WEIGHTS_NAME,
    DrafterConfig,
    load_target_embeddings,
)

__all__ = ["CONFIG_NAME", "DRAFTER_SHAPES", "WEIGHTS_NAME", "DrafterConfig", "load_target_embeddings"]

MODEL_CARD_NAME = "README.md"

# --------------------------------------------------------------------------------------------------
# Layers
# --------------------------------------------------------------------------------------------------


class RMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # Normalise in float32: bf16 squares lose too much precision.
        x32 = x.float()
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


Rope = tuple[torch.Tensor, torch.Tensor]  # cos, sin


def rotary_cos_sin(positions: torch.Tensor, head_dim: int, theta: float) -> Rope:
    """cos/sin tables `[..., head_dim]` for integer `positions [...]` (rotate-half convention)."""
    inv_freq = 1.0 / theta ** (torch.arange(0, head_dim, 2, device=positions.device).float() / head_dim)
    angles = positions.float()[..., None] * inv_freq  # [..., head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos(), angles.sin()


def apply_rotary(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x `[..., heads, head_dim]`, cos/sin `[..., head_dim]` (the same leading shape, no heads axis)."""
    cos, sin = (table.unsqueeze(-2).to(x.dtype) for table in rope)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


@dataclass
class BlockMasks:
    """What each block slot may attend to, for one layer type. True = visible."""

    context: torch.Tensor  # [B, N, S or 1, C]: context positions per block (and per slot if windowed)
    block: torch.Tensor | None  # [S, S] among a block's own slots (query, key); None: all visible


def block_masks(
    context_end: torch.Tensor,  # [B, N]: a block sees context positions < this (its anchor; 0 if dropped)
    block_positions: torch.Tensor,  # [B, N, S]
    context_positions: torch.Tensor,  # [B, C]
    sliding_window: int | None,
) -> BlockMasks:
    before_anchor = context_positions[:, None, None, :] < context_end[:, :, None, None]  # [B, N, 1, C]
    if sliding_window is None:
        return BlockMasks(context=before_anchor, block=None)
    distance = block_positions[:, :, :, None] - context_positions[:, None, None, :]  # [B, N, S, C]
    slots = torch.arange(block_positions.shape[-1], device=block_positions.device)
    offset = slots[:, None] - slots[None, :]  # query slot - key slot
    return BlockMasks(
        context=before_anchor & (distance < sliding_window),
        block=(offset >= 0) & (offset < sliding_window),
    )


FLEX_TILE = 128  # flex attention's tile: lengths are padded to a multiple of it
_compiled_flex_attention: Any = None


def _flex_attention() -> Any:
    """flex attention, compiled on first use (the fused kernel; uncompiled it materialises the scores).

    Compiled with automatic dynamic shapes: the first shape compiles a static kernel, the second a
    dynamic one that serves every later length, so a run compiles twice, not once per batch shape."""
    global _compiled_flex_attention
    from torch.nn.attention.flex_attention import flex_attention

    if _compiled_flex_attention is None:
        _compiled_flex_attention = torch.compile(flex_attention)
    return _compiled_flex_attention


def flex_attention_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:  # torch < 2.5
        return False
    return True


def _round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


class FlexMask:
    """The attention rule as flex-attention block masks over queries [every slot of every block] and
    keys [context ; every slot of every block], one mask per layer type, built once per forward.

    Query q is slot `q % S` of block `q // S`; it sees context key c when c < its block's anchor (and,
    on a sliding layer, its position minus c is inside the window), and block key j when j is in its
    own block (on a sliding layer: at or before it, inside the window). Context positions are 0..C-1.
    """

    def __init__(
        self,
        context_end: torch.Tensor,  # [B, N]
        block_positions: torch.Tensor,  # [B, N, S]
        context_length: int,
        windows: set[int | None],
        *,
        compiled: bool,
    ) -> None:
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        batch, num_blocks, size = block_positions.shape
        queries = num_blocks * size
        self.query_length = _round_up(queries, FLEX_TILE)
        self.key_length = _round_up(context_length + queries, FLEX_TILE)
        self._attention = _flex_attention() if compiled else flex_attention
        last_block = num_blocks - 1
        ends = context_end.contiguous()
        positions = F.pad(block_positions.reshape(batch, queries), (0, self.query_length - queries))

        def make(window: int | None) -> Callable:
            def mask(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
                block = torch.clamp(q // size, max=last_block)  # padded queries: any valid index
                in_context = (kv < context_length) & (kv < ends[b, block])
                key_slot = kv - context_length
                own_block = (kv >= context_length) & (key_slot // size == q // size)
                if window is None:
                    return in_context | own_block
                in_context = in_context & (positions[b, q] - kv < window)
                behind = q % size - key_slot % size
                return in_context | (own_block & (behind >= 0) & (behind < window))

            return mask

        self.masks = {
            window: create_block_mask(
                make(window), batch, None, self.query_length, self.key_length,
                device=block_positions.device, _compile=compiled,
            )  # fmt: skip
            for window in windows
        }

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
        return self._attention(q, k, v, block_mask=self.masks[window], enable_gqa=True)


class DrafterAttention(nn.Module):
    """Block slots query [context ; own block]; the context feature is projected by THIS layer's k/v.

    Each block's keys are the shared context plus its own `S` slots, so the scores come in two parts:
    every slot against the context, `[B, h, N, S, C]` (masked per block), and every slot against its own
    block, `[B, h, N, S, S]`. One softmax runs over both, as if they were one row of keys. Cost is linear
    in the number of blocks N; blocks never see each other, so there is nothing else to compute.
    """

    def __init__(self, config: DrafterConfig, layer_index: int) -> None:
        super().__init__()
        self.num_heads, self.num_kv_heads = config.num_heads, config.num_kv_heads
        self.head_dim = config.head_dim
        self.q_proj = nn.Linear(config.hidden_size, config.num_heads * config.head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, config.num_kv_heads * config.head_dim, bias=False)
        self.o_proj = nn.Linear(config.num_heads * config.head_dim, config.hidden_size, bias=False)
        # Per-head q/k norms as in Qwen3 and the reference DFlash drafter.
        self.q_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        self.k_norm = RMSNorm(config.head_dim, config.rms_norm_eps)
        sliding = config.layer_types[layer_index] == SLIDING_ATTENTION
        self.sliding_window = config.sliding_window if sliding else None

    def _keys_values(self, inputs: torch.Tensor, rope: Rope) -> tuple[torch.Tensor, torch.Tensor]:
        """`[B, ..., D] -> k, v [B, heads, ..., head_dim]`, kv heads repeated for grouped-query attention."""
        shape = (*inputs.shape[:-1], self.num_kv_heads, self.head_dim)
        k = apply_rotary(self.k_norm(self.k_proj(inputs).view(shape)), rope)
        v = self.v_proj(inputs).view(shape)
        groups = self.num_heads // self.num_kv_heads  # query head i reads kv head i // groups
        k, v = k.repeat_interleave(groups, dim=-2), v.repeat_interleave(groups, dim=-2)
        return k.movedim(-2, 1), v.movedim(-2, 1)

    def forward(
        self,
        x: torch.Tensor,  # [B, N, S, D] block slots (after input norm)
        context: torch.Tensor,  # [B, C, D] context feature (shared by every layer)
        block_rope: Rope,  # cos/sin [B, N, S, head_dim]
        context_rope: Rope,  # cos/sin [B, C, head_dim]
        masks: BlockMasks,  # for this layer's type
        flex: FlexMask | None = None,  # set: the fused flex-attention kernel instead of materialised scores
    ) -> torch.Tensor:
        batch, num_blocks, block_size, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, num_blocks, block_size, self.num_heads, self.head_dim))
        q = apply_rotary(q, block_rope).movedim(-2, 1)  # [B, h, N, S, hd]
        if flex is not None:
            out = self._flex(q, x, context, block_rope, context_rope, flex)
        else:
            out = self._materialised(q * self.head_dim**-0.5, x, context, block_rope, context_rope, masks)
        return self.o_proj(out.movedim(1, -2).flatten(-2))  # [B, N, S, h*hd] -> [B, N, S, D]

    def _materialised(
        self,
        q: torch.Tensor,  # [B, h, N, S, hd], pre-scaled
        x: torch.Tensor,
        context: torch.Tensor,
        block_rope: Rope,
        context_rope: Rope,
        masks: BlockMasks,
    ) -> torch.Tensor:
        batch, _, num_blocks, block_size, _ = q.shape
        context_length = context.shape[1]
        k_block, v_block = self._keys_values(x, block_rope)  # [B, h, N, S, hd]
        k_context, v_context = self._keys_values(context, context_rope)  # [B, h, C, hd]

        # The context is the same for every block: one matmul for all N*S queries, then the block mask.
        context_scores = q.flatten(2, 3) @ k_context.transpose(-1, -2)  # [B, h, N*S, C]
        context_scores = context_scores.view(batch, self.num_heads, num_blocks, block_size, context_length)
        # In place: a matmul's output is not needed for its backward, so no copy of the largest tensor.
        context_scores.masked_fill_(~masks.context[:, None], float("-inf"))
        block_scores = q @ k_block.transpose(-1, -2)  # [B, h, N, S, S]
        if masks.block is not None:
            block_scores.masked_fill_(~masks.block, float("-inf"))
        # One softmax over [context ; own block]. A slot always sees itself: no row is all -inf.
        probs = torch.cat([context_scores, block_scores], dim=-1).softmax(dim=-1)  # [B, h, N, S, C+S]
        context_probs, block_probs = probs.split([context_length, block_size], dim=-1)
        out = (context_probs.flatten(2, 3) @ v_context).view_as(q)  # [B, h, N, S, hd]
        return out + block_probs @ v_block

    def _flex(
        self,
        q: torch.Tensor,  # [B, h, N, S, hd]
        x: torch.Tensor,
        context: torch.Tensor,
        block_rope: Rope,
        context_rope: Rope,
        flex: FlexMask,
    ) -> torch.Tensor:
        """Every slot of every block as one query sequence over keys [context ; all blocks], under a
        block-sparse mask: no score matrix is ever materialised (flex attention's fused kernel)."""
        batch, heads, num_blocks, block_size, head_dim = q.shape
        shape = (batch, -1, self.num_kv_heads, self.head_dim)
        keys_in = torch.cat([context, x.flatten(1, 2)], dim=1)  # [B, C + N*S, D]
        cos = torch.cat([context_rope[0], block_rope[0].flatten(1, 2)], dim=1)
        sin = torch.cat([context_rope[1], block_rope[1].flatten(1, 2)], dim=1)
        k = apply_rotary(self.k_norm(self.k_proj(keys_in).view(shape)), (cos, sin)).transpose(1, 2)
        v = self.v_proj(keys_in).view(shape).transpose(1, 2)  # [B, kv_h, C + N*S, hd]
        queries = q.flatten(2, 3)  # [B, h, N*S, hd]
        pad_q, pad_kv = flex.query_length - queries.shape[2], flex.key_length - k.shape[2]
        queries = F.pad(queries, (0, 0, 0, pad_q))
        k, v = F.pad(k, (0, 0, 0, pad_kv)), F.pad(v, (0, 0, 0, pad_kv))
        out = flex.attend(queries, k, v, self.sliding_window)[:, :, : num_blocks * block_size]
        return out.reshape(batch, heads, num_blocks, block_size, head_dim)


class SwiGLU(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DrafterAttention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(
        self,
        x: torch.Tensor,  # [B, N, S, D]
        context: torch.Tensor,  # [B, C, D]
        block_rope: Rope,
        context_rope: Rope,
        masks: BlockMasks | None,
        flex: FlexMask | None = None,
    ) -> torch.Tensor:
        x = x + self.self_attn(self.input_layernorm(x), context, block_rope, context_rope, masks, flex)
        return x + self.mlp(self.post_attention_layernorm(x))


class DFlashDrafter(nn.Module):
    """k drafter layers over the target's frozen embedding and LM head.

    The frozen tensors are non-persistent buffers: not parameters (the optimiser never sees them) and
    not in `state_dict()` (checkpoints and exports hold only what training changes, as the published
    drafters do).
    """

    def __init__(self, config: DrafterConfig, embedding: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__()
        expected = (config.vocab_size, config.hidden_size)
        for name, tensor in (("embedding", embedding), ("lm_head", lm_head)):
            if tuple(tensor.shape) != expected:
                raise ValueError(
                    f"target {name} has shape {tuple(tensor.shape)} but the drafter config expects "
                    f"{expected} (vocab_size, hidden_size); is target_model {config.target_model!r} "
                    "the captured target?"
                )
        self.config = config
        self.register_buffer("embed_weight", embedding.detach().clone(), persistent=False)  # [V, D]
        self.register_buffer("lm_head_weight", lm_head.detach().clone(), persistent=False)  # [V, D]
        # Context feature: RMSNorm(Linear(K*H -> D)) over the concatenated target layers.
        context_width = config.num_context_layers * config.target_hidden_size
        self.fc = nn.Linear(context_width, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = "auto"  # see `attention_backend`
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @classmethod
    def from_target(cls, config: DrafterConfig, target_model: str | Path | None = None) -> DFlashDrafter:
        """A freshly initialised drafter with the target's embedding and LM head."""
        embedding, lm_head = load_target_embeddings(target_model or config.target_model)
        return cls(config, embedding, lm_head)

    @property
    def device(self) -> torch.device:
        return self.fc.weight.device

    @property
    def attention_backend(self) -> str:
        """`flex` (fused kernel, block-sparse mask: CUDA) or `materialised` (scores as tensors: the CPU
        path, and the reference the flex path is tested against). `auto`: flex on CUDA."""
        if self.attention != "auto":
            return self.attention
        return "flex" if self.device.type == "cuda" and flex_attention_available() else "materialised"

    def set_attention_backend(self, name: str) -> DFlashDrafter:
        if name not in ("auto", "flex", "materialised"):
            raise ValueError(f"attention backend {name!r} is not 'auto', 'flex' or 'materialised'")
        self.attention = name
        return self

    def forward(
        self,
        block_input_ids: torch.Tensor,  # [B, N, S] long: N blocks of S = block_size slots
        block_position_ids: torch.Tensor,  # [B, N, S] long; absolute positions, anchor + slot
        context_hidden_states: torch.Tensor,  # [B, C, K, H] captured target layers (any float dtype)
        context_position_ids: torch.Tensor,  # [B, C] long
        context_end: torch.Tensor,  # [B, N] long: block n sees context positions < context_end[:, n]
    ) -> torch.Tensor:
        """Final-normed hidden states of the block slots, `[B, N, S, D]`.

        At inference: N = 1, the context is every position before the anchor and `context_end` is the
        anchor's position. In training, `context_end` is each block's anchor (0 for a dropped block).
        """
        dtype = self.fc.weight.dtype
        batch, context_length = context_hidden_states.shape[:2]
        x = F.embedding(block_input_ids, self.embed_weight).to(dtype)  # [B, N, S, D]
        flat = context_hidden_states.reshape(batch, context_length, -1).to(dtype)  # [B, C, K*H]
        context = self.hidden_norm(self.fc(flat))  # [B, C, D]
        head_dim, theta = self.config.head_dim, self.config.rope_theta
        block_rope = rotary_cos_sin(block_position_ids, head_dim, theta)  # [B, N, S, hd]
        context_rope = rotary_cos_sin(context_position_ids, head_dim, theta)  # [B, C, hd]
        windows = {layer.self_attn.sliding_window for layer in self.layers}
        flex = None
        if self.attention_backend == "flex":
            flex = FlexMask(
                context_end, block_position_ids, context_length, windows, compiled=self.device.type == "cuda"
            )
            masks = dict.fromkeys(windows)
        else:
            masks = {
                window: block_masks(context_end, block_position_ids, context_position_ids, window)
                for window in windows
            }
        for layer in self.layers:
            x = layer(x, context, block_rope, context_rope, masks[layer.self_attn.sliding_window], flex)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., D] -> [..., V]` float32 logits through the target's LM head."""
        return F.linear(hidden.to(self.lm_head_weight.dtype), self.lm_head_weight).float()

    @torch.no_grad()
    def draft_block(
        self,
        context_hidden_states: torch.Tensor,  # [C, K, H]: the target's layers at positions 0..C-1
        anchor_token: int,  # the token at position C, just produced by the target
    ) -> torch.Tensor:
        """Greedy drafts for positions C+1 .. C+block_size-1, `[block_size - 1]` long: inference as the
        engines run it (one block, the anchor then mask tokens, the whole context before the anchor)."""
        device, size = self.device, self.config.block_size
        context_length = context_hidden_states.shape[0]
        ids = torch.full((1, 1, size), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0, 0] = anchor_token
        positions = (context_length + torch.arange(size, device=device)).view(1, 1, size)
        hidden = self(
            ids,
            positions,
            context_hidden_states[None].to(device),
            torch.arange(context_length, device=device)[None],
            torch.tensor([[context_length]], device=device),
        )
        return self.logits(hidden[0, 0, 1:]).argmax(dim=-1)


# --------------------------------------------------------------------------------------------------
# Training objective
# --------------------------------------------------------------------------------------------------


@dataclass
class DrafterBatch:
    """Right-padded samples with their captured target layers: what offline and online modes both yield."""

    input_ids: torch.Tensor  # [B, T] long (padding: 0)
    loss_mask: torch.Tensor  # [B, T] bool, False on padding
    hidden_states: torch.Tensor  # [B, T, K, H] bfloat16, the stored format's precision (padding: 0)
    lengths: torch.Tensor  # [B] long
    sample_indices: list[int]

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


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
        batch.hidden_states.to(device),
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


# --------------------------------------------------------------------------------------------------
# Export: the reference layout
# --------------------------------------------------------------------------------------------------


def export_drafter(
    model: DFlashDrafter,
    directory: str | Path,
    *,
    dtype: torch.dtype = torch.bfloat16,
    provenance: dict[str, Any] | None = None,
    model_card: str | None = None,
) -> Path:
    """Write the drafter as the engines load it: `config.json` (Qwen3 config with `architectures:
    ["DFlashDraftModel"]`, `block_size`, `num_target_layers`, `dflash_config`), `model.safetensors` with
    the reference weight names in `dtype` (bfloat16), and a model card `README.md`.

    The weights are the drafter's own, like the published drafters: the shared embedding and LM head
    stay in the target checkpoint. `provenance` is merged into the config's `dflash_assets` block.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: tensor.detach().to("cpu", dtype).contiguous() for name, tensor in model.state_dict().items()
    }
    config = replace(model.config, extra={**model.config.extra, **(provenance or {})})
    save_file(tensors, str(directory / WEIGHTS_NAME), metadata={"format": "pt"})
    if model_card is not None:
        (directory / MODEL_CARD_NAME).write_text(model_card)
    config.save(directory)  # last: a directory with a config is complete
    return directory


def load_drafter(
    directory: str | Path,
    *,
    target_model: str | Path | None = None,
    device: str | torch.device = "cpu",
    dtype: torch.dtype = torch.float32,
) -> DFlashDrafter:
    """An exported drafter, ready to run. `target_model` overrides where the shared embedding and LM
    head come from (e.g. the target moved to another path); by default the export's recorded path."""
    directory = Path(directory)
    config = DrafterConfig.load(directory)
    source = target_model or config.target_model
    if not source:
        raise ValueError(
            f"{directory} names no target model for the shared embedding and LM head; pass target_model= "
            "(the target checkpoint the drafter was trained for)"
        )
    embedding, lm_head = load_target_embeddings(source)
    model = DFlashDrafter(config, embedding, lm_head)
    tensors = load_file(str(directory / WEIGHTS_NAME))
    missing = sorted(set(model.state_dict()) - set(tensors))
    unexpected = sorted(set(tensors) - set(model.state_dict()))
    if missing or unexpected:
        raise ValueError(
            f"{directory / WEIGHTS_NAME} does not match its config: missing {missing[:5]}, unexpected "
            f"{unexpected[:5]}"
        )
    model.load_state_dict({name: tensor.to(dtype) for name, tensor in tensors.items()}, strict=True)
    return model.to(device=device, dtype=dtype)


def drafter_parameter_count(config: DrafterConfig) -> int:
    """Parameters of the drafter's own weights (what an export holds)."""
    d, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = d * q * 2 + d * kv * 2 + 3 * d * i + 2 * d + 2 * config.head_dim
    return config.num_layers * per_layer + config.num_context_layers * config.target_hidden_size * d + 2 * d


def config_summary(config: DrafterConfig) -> dict[str, Any]:
    """A flat, JSON-friendly description for logs and metadata."""
    return {
        "layers": config.num_layers,
        "heads": f"{config.num_heads} query / {config.num_kv_heads} kv x {config.head_dim}",
        "intermediate_size": config.intermediate_size,
        "layer_types": config.layer_types,
        "sliding_window": config.sliding_window,
        "mask_token_id": config.mask_token_id,
        "parameters": drafter_parameter_count(config),
        "target_layer_ids": config.target_layer_ids,
        "block_size": config.block_size,
    }
