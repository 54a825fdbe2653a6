"""The DFlash drafter model, top to bottom: norms, rotary embeddings, block attention, the layers, and
DFlash2's two additions around that backbone (a convolution around each sublayer, a candidate selector).

The config and its shape presets are in `config.py`, the block objective in `objective.py`, the
export in `export.py`.

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

DFlash2 (z-lab / Inco AI) is the same backbone: `DFlash2Drafter` wraps every attention and MLP sublayer
in a grouped dynamic causal convolution along the block (`GroupedDynamicConv`, started as the identity),
and drafts through a `CandidateSelector` instead of each slot's argmax: the top-k of every slot under
the target's head, rescored with a low-rank bilinear term on the token chosen before it, walked greedily
from the anchor.

Names: modules are named as the reference checkpoints name their weights (`layers.N.self_attn.q_proj`,
`input_layernorm`, `fc`, `hidden_norm`, ...), so `state_dict()` is the published layout itself and an
export needs no renaming table that could drift.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_assets.drafter.config import (
    SLIDING_ATTENTION,
    DrafterConfig,
    load_target_embeddings,
)
from dflash_assets.target.bf16_matmul import bf16_linear

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


def rotary_frequencies(config: DrafterConfig) -> tuple[torch.Tensor, float]:
    """Inverse frequencies `[head_dim/2]` (float32) and the attention factor cos/sin are scaled by: the
    plain rotary embedding at `rope_theta`, or the target's scaling computed as transformers computes the
    target's (`ROPE_INIT_FUNCTIONS`: YaRN's frequencies and its attention factor, linear, Llama 3)."""
    head_dim, theta = config.head_dim, config.rope_theta
    if not config.rope_scaling:
        return 1.0 / theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim), 1.0
    from transformers import Qwen3Config
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    reference = Qwen3Config(
        hidden_size=config.hidden_size,
        num_attention_heads=config.num_heads,
        head_dim=head_dim,
        max_position_embeddings=config.max_position_embeddings,
        rope_parameters=config.rope_parameters(),
    )
    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[config.rope_scaling["rope_type"]](reference, "cpu")
    return inv_freq.float(), float(attention_factor)


def rotary_cos_sin(positions: torch.Tensor, frequencies: tuple[torch.Tensor, float]) -> Rope:
    """cos/sin tables `[..., head_dim]` for integer `positions [...]` (rotate-half convention), from
    `rotary_frequencies`."""
    inv_freq, attention_factor = frequencies
    angles = positions.float()[..., None] * inv_freq.to(positions.device)  # [..., head_dim/2]
    angles = torch.cat([angles, angles], dim=-1)
    if attention_factor == 1.0:
        return angles.cos(), angles.sin()
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def apply_rotary(x: torch.Tensor, rope: Rope) -> torch.Tensor:
    """x `[..., heads, head_dim]`, cos/sin `[..., head_dim]` (the same leading shape, no heads axis)."""
    cos, sin = (table.unsqueeze(-2).to(x.dtype) for table in rope)
    x1, x2 = x.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    return x * cos + rotated * sin


@dataclass
class BlockMasks:
    """What each block slot may attend to, for one layer type, built for a range of blocks at a time: a
    windowed layer's mask over a long context ([B, N, S, C]) is as large as the scores. True = visible."""

    context_end: torch.Tensor  # [B, N]: a block sees context positions < this (its anchor; 0 if dropped)
    block_positions: torch.Tensor  # [B, N, S]
    context_positions: torch.Tensor  # [B, C]
    sliding_window: int | None

    def context(self, start: int = 0, end: int | None = None) -> torch.Tensor:
        """`[B, n, S or 1, C]`: the context positions blocks `start:end` see (and each slot, if windowed)."""
        ends = self.context_end[:, start:end]
        before_anchor = self.context_positions[:, None, None, :] < ends[:, :, None, None]  # [B, n, 1, C]
        if self.sliding_window is None:
            return before_anchor
        distance = self.block_positions[:, start:end, :, None] - self.context_positions[:, None, None, :]
        return before_anchor & (distance < self.sliding_window)  # [B, n, S, C]

    @property
    def block(self) -> torch.Tensor | None:
        """`[S, S]` among a block's own slots (query, key); None: all visible."""
        if self.sliding_window is None:
            return None
        slots = torch.arange(self.block_positions.shape[-1], device=self.block_positions.device)
        offset = slots[:, None] - slots[None, :]  # query slot - key slot
        return (offset >= 0) & (offset < self.sliding_window)


def block_masks(
    context_end: torch.Tensor,  # [B, N]: a block sees context positions < this (its anchor; 0 if dropped)
    block_positions: torch.Tensor,  # [B, N, S]
    context_positions: torch.Tensor,  # [B, C]
    sliding_window: int | None,
) -> BlockMasks:
    return BlockMasks(context_end, block_positions, context_positions, sliding_window)


# The materialised scores of one chunk of blocks, in float32: a micro-batch whose scores are larger runs
# its blocks a chunk at a time, each chunk recomputed in the backward (activation checkpointing), so a
# long context's [B, h, N, S, C] scores (2.6 GB a layer for 512 anchors over 20 K tokens and 4 heads)
# never exist at once. Blocks are independent given the context: the result is the same.
MATERIALISED_CHUNK_BYTES = 128 * 2**20


def materialised_chunk_blocks(batch: int, heads: int, block_size: int, context_length: int) -> int:
    """Blocks per chunk of the materialised attention (`MATERIALISED_CHUNK_BYTES`), at least 1."""
    per_block = 4 * batch * heads * block_size * (context_length + block_size)
    return max(1, MATERIALISED_CHUNK_BYTES // per_block)


def _block_attention(
    q: torch.Tensor,  # [B, h, n, S, hd], pre-scaled
    k_block: torch.Tensor,  # [B, h, n, S, hd]
    v_block: torch.Tensor,
    k_context: torch.Tensor,  # [B, h, C, hd]
    v_context: torch.Tensor,
    masks: BlockMasks,
    start: int,
    end: int,
) -> torch.Tensor:
    """Blocks `start:end` over [context ; own block], one softmax, scores materialised: `[B, h, n, S, hd]`."""
    batch, heads, num_blocks, block_size, _ = q.shape
    context_length = k_context.shape[2]
    # The context is the same for every block: one matmul for all n*S queries, then the block mask.
    context_scores = q.flatten(2, 3) @ k_context.transpose(-1, -2)  # [B, h, n*S, C]
    context_scores = context_scores.view(batch, heads, num_blocks, block_size, context_length)
    # In place: a matmul's output is not needed for its backward, so no copy of the largest tensor.
    context_scores.masked_fill_(~masks.context(start, end)[:, None], float("-inf"))
    block_scores = q @ k_block.transpose(-1, -2)  # [B, h, n, S, S]
    if (block_mask := masks.block) is not None:
        block_scores.masked_fill_(~block_mask, float("-inf"))
    # One softmax over [context ; own block]. A slot always sees itself: no row is all -inf.
    probs = torch.cat([context_scores, block_scores], dim=-1).softmax(dim=-1)  # [B, h, n, S, C+S]
    context_probs, block_probs = probs.split([context_length, block_size], dim=-1)
    out = (context_probs.flatten(2, 3) @ v_context).view_as(q)  # [B, h, n, S, hd]
    return out + block_probs @ v_block


FLEX_TILE = 128  # flex attention's tile: lengths are padded to a multiple of it
# Where flex attention and its block masks run compiled: Inductor's fused kernel on CUDA; elsewhere flex
# runs uncompiled (it then materialises the scores itself). FLEX_COMPILE_BACKEND None: torch.compile's
# default (Inductor). Tests compile on the CPU with "aot_eager" to count the compiled versions.
FLEX_COMPILED_DEVICES = {"cuda"}
FLEX_COMPILE_BACKEND: str | None = None
FULL_WINDOW = 2**62  # the window a full-attention layer's rule runs with: wider than any position
_compiled_flex: dict[str | None, tuple[Any, Any]] = {}


def _flex_functions(compiled: bool) -> tuple[Any, Any]:
    """(create_block_mask, flex_attention), compiled on first use (`FLEX_COMPILE_BACKEND`) or not.

    Compiled with dynamic shapes, so lengths and micro-batch sizes never recompile: what varies per
    micro-batch reaches the mask as tensors (`_block_rule`), the sequences of a micro-batch are packed into
    one row (`FlexMask`: no batch dimension for dynamo to specialise at 1), and the block mask is always
    built without gradients. What still compiles a version of its own is the attention with gradients
    and without: one version of the mask and two of the attention, whatever the layer mix, the lengths
    and the batch sizes (the trainer's warm-up compiles them before its first step)."""
    from torch.nn.attention.flex_attention import create_block_mask, flex_attention

    if not compiled:
        return create_block_mask, flex_attention
    backend = FLEX_COMPILE_BACKEND
    if backend not in _compiled_flex:
        chosen = {"backend": backend} if backend else {}
        _compiled_flex[backend] = tuple(
            _distinct_sizes(torch.compile(function, dynamic=True, **chosen))
            for function in (create_block_mask, flex_attention)
        )
    return _compiled_flex[backend]


def _distinct_sizes(compiled: Callable) -> Callable:
    """`compiled`, traced without duck sizing: by default sizes equal at the first call (a batch of 4 beside
    4 heads, as many key tiles as query tiles) share one symbol for good, and the first call where they
    differ compiles another version."""
    from torch.fx.experimental import _config as fx_config

    def call(*args: Any, **kwargs: Any) -> Any:
        with fx_config.patch(use_duck_shape=False):
            return compiled(*args, **kwargs)

    return call


def flex_compiled(device: torch.device) -> bool:
    """Whether flex attention runs compiled on `device`."""
    return device.type in FLEX_COMPILED_DEVICES


def flex_attention_available() -> bool:
    try:
        from torch.nn.attention.flex_attention import flex_attention  # noqa: F401
    except ImportError:  # torch < 2.5
        return False
    return True


def _tiles(n: int) -> int:
    """`n` padded to whole flex tiles, two at the least: dynamo specialises a size of 1, and a block mask
    one tile long (a drafted block over a short context) would compile versions of its own."""
    return max(2, -(-n // FLEX_TILE)) * FLEX_TILE


def _block_rule(
    size: torch.Tensor,  # 0-dim: slots per block
    context_length: torch.Tensor,  # 0-dim: C
    row_queries: torch.Tensor,  # 0-dim: queries a sequence holds in the packed row (whole tiles)
    row_keys: torch.Tensor,  # 0-dim: keys a sequence holds in the packed row (whole tiles)
    query_ends: torch.Tensor,  # [B * row_queries]: the context a query sees ends before this (its anchor)
    query_positions: torch.Tensor,  # [B * row_queries]: a query's absolute position
    window: torch.Tensor,  # 0-dim: FULL_WINDOW on a full-attention layer
    causal: torch.Tensor,  # 0-dim bool: inside the block, only slots at or before the query (sliding)
) -> Callable:
    """The attention rule as a flex mask function over one packed row: sequence r's queries are
    `r * row_queries ...` and its keys `r * row_keys ...`, and a query sees only its own sequence's keys.

    Every value it reads is a tensor, none a Python number: torch.compile guards on the Python values a
    function closes over (one compiled version per window, per length), while tensors are inputs of one
    compiled version."""

    def mask(b: torch.Tensor, h: torch.Tensor, q: torch.Tensor, kv: torch.Tensor) -> torch.Tensor:
        same_sequence = q // row_queries == kv // row_keys
        query, key = q % row_queries, kv % row_keys  # positions inside the sequence's own stretch
        in_context = (key < context_length) & (key < query_ends[q]) & (query_positions[q] - key < window)
        key_slot = key - context_length
        behind = query % size - key_slot % size  # query slot - key slot, within a block
        own_block = (key >= context_length) & (key_slot // size == query // size) & (behind < window)
        return same_sequence & (in_context | (own_block & ((behind >= 0) | ~causal)))

    return mask


class FlexMask:
    """The attention rule as flex-attention block masks over queries [every slot of every block] and
    keys [context ; every slot of every block], one mask per layer type, built once per forward.

    The micro-batch's sequences are packed into one row, each padded to whole tiles (`row_queries`,
    `row_keys`): the compiled functions never see a batch dimension, so a batch of one sequence and a
    batch of several run the same compiled version (dynamo would specialise a batch of 1), and the tiles
    between two sequences are empty, so the kernel skips them. Query q of a sequence is slot `q % S` of
    block `q // S`; it sees context key c when c < its block's anchor (and, on a sliding layer, its
    position minus c is inside the window), and block key j when j is in its own block (on a sliding
    layer: at or before it, inside the window). Padded queries read as the last block's; their outputs
    are dropped.
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
        batch, num_blocks, size = block_positions.shape
        device = block_positions.device
        queries = num_blocks * size
        self.batch = batch
        self.row_queries = _tiles(queries)
        self.row_keys = _tiles(context_length + queries)
        create_block_mask, self._attention = _flex_functions(compiled)
        pad = self.row_queries - queries
        query_ends = context_end.repeat_interleave(size, dim=1)  # [B, N*S]
        if num_blocks:
            query_ends = torch.cat([query_ends, query_ends[:, -1:].expand(batch, pad)], dim=1)
        positions = F.pad(block_positions.reshape(batch, queries), (0, pad))

        def scalar(value: int | bool) -> torch.Tensor:  # filled on the device: no copy from the host
            return torch.full((), value, device=device)

        with torch.no_grad():  # a mask has no gradient: one grad mode, so one compiled version
            self.masks = {
                window: create_block_mask(
                    _block_rule(
                        scalar(size),
                        scalar(context_length),
                        scalar(self.row_queries),
                        scalar(self.row_keys),
                        # Tensors of their own, not views: dynamo guards on a view's base (a batch of 1).
                        query_ends.reshape(-1).clone(),
                        positions.reshape(-1).clone(),
                        scalar(FULL_WINDOW if window is None else window),
                        scalar(window is not None),
                    ),
                    1,
                    None,
                    batch * self.row_queries,
                    batch * self.row_keys,
                    device=device,
                )
                for window in windows
            }

    def pack(self, x: torch.Tensor, length: int) -> torch.Tensor:
        """`[B, heads, L, hd]` -> `[1, heads, B * length, hd]`: each sequence padded to `length`, in one
        row. The row is a tensor of its own, contiguous, not a view: dynamo guards on a view's base too
        (its strides, and its sizes, a batch of 1 among them), which would compile versions apart."""
        batch, heads, filled, head_dim = x.shape
        row = x.new_zeros(1, heads, batch * length, head_dim)
        row.view(heads, batch, length, head_dim)[:, :, :filled].copy_(x.movedim(0, 1))
        return row

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int | None) -> torch.Tensor:
        """q `[B, h, Q, hd]`, k and v `[B, kv_h, K, hd]` -> `[B, h, Q, hd]`."""
        batch, heads, queries, head_dim = q.shape
        out = self._attention(
            self.pack(q, self.row_queries),
            self.pack(k, self.row_keys),
            self.pack(v, self.row_keys),
            block_mask=self.masks[window],
            enable_gqa=True,
        )
        return out.reshape(heads, batch, self.row_queries, head_dim)[:, :, :queries].movedim(1, 0)


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

    def attend_cached(
        self, x: torch.Tensor, block_rope: Rope, context_kv: tuple[torch.Tensor, torch.Tensor]
    ) -> torch.Tensor:
        """One block `x [1, 1, S, D]` over its context's keys and values as this layer projected them
        before (`context_kv`, `[1, h, C, hd]` each: `DraftCache`) and its own slots: what `forward` gives
        at inference on a full-attention layer, without projecting the whole context again."""
        batch, num_blocks, block_size, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, num_blocks, block_size, self.num_heads, self.head_dim))
        q = apply_rotary(q, block_rope).movedim(-2, 1)[:, :, 0]  # [1, h, S, hd]
        k_block, v_block = self._keys_values(x[:, 0], (block_rope[0][:, 0], block_rope[1][:, 0]))
        k = torch.cat([context_kv[0], k_block], dim=2)
        v = torch.cat([context_kv[1], v_block], dim=2)
        out = F.scaled_dot_product_attention(q, k, v)  # every slot sees the context and its whole block
        return self.o_proj(out.movedim(1, -2).flatten(-2))[:, None]  # [1, 1, S, D]

    def _materialised(
        self,
        q: torch.Tensor,  # [B, h, N, S, hd], pre-scaled
        x: torch.Tensor,
        context: torch.Tensor,
        block_rope: Rope,
        context_rope: Rope,
        masks: BlockMasks,
    ) -> torch.Tensor:
        batch, heads, num_blocks, block_size, _ = q.shape
        k_block, v_block = self._keys_values(x, block_rope)  # [B, h, N, S, hd]
        k_context, v_context = self._keys_values(context, context_rope)  # [B, h, C, hd]
        chunk = materialised_chunk_blocks(batch, heads, block_size, context.shape[1])
        if chunk >= num_blocks:
            return _block_attention(q, k_block, v_block, k_context, v_context, masks, 0, num_blocks)
        outputs = []
        for start in range(0, num_blocks, chunk):
            end = min(start + chunk, num_blocks)
            inputs = (q[:, :, start:end], k_block[:, :, start:end], v_block[:, :, start:end], k_context)
            arguments = (*inputs, v_context, masks, start, end)
            if torch.is_grad_enabled():
                outputs.append(checkpoint(_block_attention, *arguments, use_reentrant=False))
            else:
                outputs.append(_block_attention(*arguments))
        return torch.cat(outputs, dim=2)

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
        out = flex.attend(q.flatten(2, 3), k, v, self.sliding_window)  # [B, h, N*S, hd]
        return out.reshape(batch, heads, num_blocks, block_size, head_dim)


class SwiGLU(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class GroupedDynamicConv(nn.Module):
    """DFlash2's causal convolution along a block's slots, around one sublayer: `prepare` convolves the
    sublayer's input and returns the kernel `finish` applies to its output.

    Slot s of a block becomes `sum_o (base[o] + dynamic[s, o, group]) * x[s - o]` over taps o < kernel
    (slots before the block's first count as zero; blocks never mix): `base` is a static kernel per
    channel, `dynamic` a correction per group of `group_size` channels computed from the sublayer's
    (normed) input at slot s. One projection gives both sides' corrections. Started as the identity (tap 0
    weighs 1, the rest and the projection 0), so a fresh DFlash2 drafter computes what DFlash does.
    """

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size = kernel_size, group_size
        self.groups = hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.empty(2, kernel_size, hidden_size))  # [input/output, tap, D]
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)
        self.reset_to_identity()

    def reset_to_identity(self) -> None:
        with torch.no_grad():
            self.base_kernel.zero_()
            self.base_kernel[:, 0] = 1.0
            self.kernel_projection.weight.zero_()

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """x `[..., S, D]` (slots along -2) -> (convolved x, the output side's kernel `[..., S, taps, G]`)."""
        dynamic = self.kernel_projection(x).unflatten(-1, (2, self.kernel_size, self.groups))
        return self._convolve(x, dynamic[..., 0, :, :], self.base_kernel[0]), dynamic[..., 1, :, :]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return self._convolve(y, dynamic, self.base_kernel[1])

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        grouped = x.unflatten(-1, (self.groups, self.group_size))  # [..., S, G, g]
        out = None
        for tap in range(self.kernel_size):
            # The slot `tap` places earlier in the same block (zeros before its first slot).
            earlier = grouped if tap == 0 else F.pad(grouped[..., :-tap, :, :], (0, 0, 0, 0, tap, 0))
            # Two products, not one with the summed weight: that weight would be a [.., S, D] tensor per tap
            # kept for backward; these keep only `earlier` (and the small per-group `dynamic`).
            static = earlier * base[tap].view(self.groups, self.group_size).to(x.dtype)
            term = static + earlier * dynamic[..., tap, :, None]
            out = term if out is None else out + term
        return out.flatten(-2)


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig, layer_index: int) -> None:
        super().__init__()
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DrafterAttention(config, layer_index)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)
        # DFlash2 (`DFlash2Drafter`) sets these: a convolution around each sublayer.
        self.attention_conv: GroupedDynamicConv | None = None
        self.mlp_conv: GroupedDynamicConv | None = None

    def forward(
        self,
        x: torch.Tensor,  # [B, N, S, D]
        context: torch.Tensor,  # [B, C, D]
        block_rope: Rope,
        context_rope: Rope,
        masks: BlockMasks | None,
        flex: FlexMask | None = None,
        context_kv: tuple[torch.Tensor, torch.Tensor] | None = None,  # set: `attend_cached`
    ) -> torch.Tensor:
        def attend(h: torch.Tensor) -> torch.Tensor:
            if context_kv is not None:
                return self.self_attn.attend_cached(h, block_rope, context_kv)
            return self.self_attn(h, context, block_rope, context_rope, masks, flex)

        h = self.input_layernorm(x)
        if self.attention_conv is None:
            x = x + attend(h)
        else:
            h, kernel = self.attention_conv.prepare(h)
            x = x + self.attention_conv.finish(attend(h), kernel)
        h = self.post_attention_layernorm(x)
        if self.mlp_conv is None:
            return x + self.mlp(h)
        h, kernel = self.mlp_conv.prepare(h)
        return x + self.mlp_conv.finish(self.mlp(h), kernel)


class CandidateSelector(nn.Module):
    """DFlash2's drafting rule: keep each slot's `top_k` tokens under the target's head and pick, slot by
    slot from the anchor, the one maximising `unary logit + <P[previous] * W h_slot, Q[candidate]>`, a
    rank-`rank` bilinear score of the pair (previous token, candidate) given the slot's hidden state.

    The codebooks are plain parameters named as z-lab's checkpoints store them
    (`candidate_selector.predecessor_codebook`, no `.weight`); two V x rank tables are the selector's
    bulk (127 M parameters at a 248 K vocabulary and rank 256)."""

    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.empty(vocab_size, rank))
        for weight in (self.hidden_projection.weight, self.predecessor_codebook, self.successor_codebook):
            nn.init.normal_(weight, mean=0.0, std=0.02)

    def pair_scores(
        self,
        hidden: torch.Tensor,  # [R, D] slots' final-normed hidden states
        predecessors: torch.Tensor,  # [R] long: the token before each slot
        candidates: torch.Tensor,  # [R, K] long
    ) -> torch.Tensor:
        """The bilinear term `[R, K]` (float32) for each slot's candidates."""
        query = self.hidden_projection(hidden).float() * self.predecessor_codebook[predecessors].float()
        return torch.einsum("rd,rkd->rk", query, self.successor_codebook[candidates].float())

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: int) -> torch.Tensor:
        """Greedy path `[S-1]` through the slots (hidden `[S-1, D]`, logits `[S-1, V]`), from the anchor."""
        unary, candidates = logits.float().topk(self.top_k, dim=-1)  # [S-1, K]
        previous = torch.tensor([anchor], dtype=torch.long, device=hidden.device)
        path = []
        for slot in range(hidden.shape[0]):
            scores = (
                unary[slot]
                + self.pair_scores(hidden[slot : slot + 1], previous, candidates[slot : slot + 1])[0]
            )
            previous = candidates[slot, scores.argmax()].view(1)
            path.append(previous)
        return torch.cat(path) if path else candidates[:, 0]


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
        # The target's own tensors, not copies: frozen, never written, and at a 248 K vocabulary 2.5 GB each
        # in bf16 (a copy doubled the host memory a rank needs while it loads them).
        self.register_buffer("embed_weight", embedding.detach(), persistent=False)  # [V, D]
        self.register_buffer("lm_head_weight", lm_head.detach(), persistent=False)  # [V, D]
        # Context feature: RMSNorm(Linear(K*H -> D)) over the concatenated target layers.
        context_width = config.num_context_layers * config.target_hidden_size
        self.fc = nn.Linear(context_width, config.hidden_size, bias=False)
        self.hidden_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config, i) for i in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = "auto"  # see `attention_backend`
        self.rotary = rotary_frequencies(config)  # float32 on the host, not a buffer: never cast to bf16
        self.apply(self._init_weights)

    @staticmethod
    def _init_weights(module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, mean=0.0, std=0.02)

    @classmethod
    def from_target(cls, config: DrafterConfig, target_model: str | Path | None = None) -> DFlashDrafter:
        """A freshly initialised drafter of `config.arch` with the target's embedding and LM head."""
        embedding, lm_head = load_target_embeddings(target_model or config.target_model)
        return drafter_class(config)(config, embedding, lm_head)

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
        block_rope = rotary_cos_sin(block_position_ids, self.rotary)  # [B, N, S, hd]
        context_rope = rotary_cos_sin(context_position_ids, self.rotary)  # [B, C, hd]
        windows = {layer.self_attn.sliding_window for layer in self.layers}
        flex = None
        if self.attention_backend == "flex":
            flex = FlexMask(
                context_end,
                block_position_ids,
                context_length,
                windows,
                compiled=flex_compiled(self.device),
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

    def logits(self, hidden: torch.Tensor, float32: bool = True) -> torch.Tensor:
        """`[..., D] -> [..., V]` float32 logits through the target's LM head, with the target's own
        scaling and soft cap where it has them (as z-lab's `compute_logits`). `float32=False`: in the
        head's own output dtype (bf16 under autocast) where the target has neither, for a loss that reads
        them in float32 a few rows at a time."""
        # bf16_linear: F.linear, but through float32 tiles where a CPU has no bf16 matrix units (PyTorch's
        # reference bf16 kernel there made a 248 K vocabulary's head most of an hour a step).
        logits = bf16_linear(hidden.to(self.lm_head_weight.dtype), self.lm_head_weight)
        plain = self.config.output_multiplier == 1.0 and not self.config.final_logit_softcapping
        if plain and not float32:
            return logits
        logits = logits.float()
        if self.config.output_multiplier != 1.0:
            logits = logits * self.config.output_multiplier
        if cap := self.config.final_logit_softcapping:
            logits = torch.tanh(logits / cap) * cap
        return logits

    def propose(self, hidden: torch.Tensor, anchor_token: int) -> torch.Tensor:
        """The drafts `[S-1]` for a block's slots after the anchor (`hidden [S-1, D]`): each slot's argmax."""
        return self.logits(hidden).argmax(dim=-1)

    def new_draft_cache(self) -> DraftCache | None:
        """An empty `DraftCache` for one decoding, or None where a layer is sliding (its window moves with
        the anchor, so its context keys are not a prefix that only grows)."""
        if any(layer.self_attn.sliding_window is not None for layer in self.layers):
            return None
        return DraftCache()

    @torch.no_grad()
    def draft_block(
        self,
        context_hidden_states: torch.Tensor,  # [C, K, H]: the target's layers at positions 0..C-1
        anchor_token: int,  # the token at position C, just produced by the target
        cache: DraftCache | None = None,
    ) -> torch.Tensor:
        """Greedy drafts for positions C+1 .. C+block_size-1, `[block_size - 1]` long: inference as the
        engines run it (one block, the anchor then mask tokens, the whole context before the anchor).
        With `cache` (`new_draft_cache`, one a decoding) only the positions it has not seen are projected
        into each layer's context keys and values, as the engines keep them; without, all of them."""
        return self.propose(self.block_hidden(context_hidden_states, anchor_token, cache)[1:], anchor_token)

    @torch.no_grad()
    def block_hidden(
        self, context_hidden_states: torch.Tensor, anchor_token: int, cache: DraftCache | None = None
    ) -> torch.Tensor:
        """`draft_block`'s final-normed block `[block_size, D]`, the anchor's slot first."""
        device, size = self.device, self.config.block_size
        context_length = context_hidden_states.shape[0]
        ids = torch.full((1, 1, size), self.config.mask_token_id, dtype=torch.long, device=device)
        ids[0, 0, 0] = anchor_token
        positions = (context_length + torch.arange(size, device=device)).view(1, 1, size)
        if cache is None:
            hidden = self(
                ids,
                positions,
                context_hidden_states[None].to(device),
                torch.arange(context_length, device=device)[None],
                torch.tensor([[context_length]], device=device),
            )
            return hidden[0, 0]
        cache.extend(self, context_hidden_states)
        x = F.embedding(ids, self.embed_weight).to(self.fc.weight.dtype)
        block_rope = rotary_cos_sin(positions, self.rotary)
        for layer, context_kv in zip(self.layers, cache.keys_values, strict=True):
            x = layer(x, None, block_rope, None, None, context_kv=context_kv)
        return self.norm(x)[0, 0]


class DraftCache:
    """Each layer's keys and values of the context one decoding has drafted from so far: a position's
    context feature depends on that position's target states alone, so what an earlier round projected
    stands, and a round projects only the positions committed since (decoding never takes back a
    committed position). Without it every round projected the whole context again: at 1,500 tokens the
    draft cost as much as the target's verification."""

    def __init__(self) -> None:
        self.length = 0
        self.keys_values: list[tuple[torch.Tensor, torch.Tensor]] = []

    def extend(self, drafter: DFlashDrafter, context_hidden_states: torch.Tensor) -> None:
        """Project positions `length .. C-1` of `context_hidden_states [C, K, H]` (the whole context so
        far; the first `length` positions must be the ones projected before)."""
        context_length = context_hidden_states.shape[0]
        if context_length < self.length:
            raise ValueError(
                f"the context shrank from {self.length} to {context_length} positions: a draft cache serves "
                "one decoding, whose committed context only grows"
            )
        if context_length == self.length:
            return
        device = drafter.device
        new = context_hidden_states[self.length :].to(device)
        flat = new.reshape(1, new.shape[0], -1).to(drafter.fc.weight.dtype)  # [1, n, K*H]
        context = drafter.hidden_norm(drafter.fc(flat))
        rope = rotary_cos_sin(torch.arange(self.length, context_length, device=device)[None], drafter.rotary)
        projected = [layer.self_attn._keys_values(context, rope) for layer in drafter.layers]
        if self.keys_values:
            projected = [
                (torch.cat([k_old, k], dim=2), torch.cat([v_old, v], dim=2))
                for (k_old, v_old), (k, v) in zip(self.keys_values, projected, strict=True)
            ]
        self.keys_values, self.length = projected, context_length


class DFlash2Drafter(DFlashDrafter):
    """DFlash2: the DFlash backbone with a convolution around each attention and MLP sublayer, drafting
    through a `CandidateSelector`. The backbone is built, and initialised, exactly as DFlash's; the
    convolutions start as the identity, so only the selector differs from a fresh DFlash drafter."""

    def __init__(self, config: DrafterConfig, embedding: torch.Tensor, lm_head: torch.Tensor) -> None:
        super().__init__(config, embedding, lm_head)
        for layer in self.layers:
            layer.attention_conv = GroupedDynamicConv(
                config.hidden_size, config.conv_kernel_size, config.conv_group_size
            )
            layer.mlp_conv = GroupedDynamicConv(
                config.hidden_size, config.conv_kernel_size, config.conv_group_size
            )
        self.candidate_selector = CandidateSelector(
            config.hidden_size, config.vocab_size, config.selector_rank, config.selector_top_k
        )

    def propose(self, hidden: torch.Tensor, anchor_token: int) -> torch.Tensor:
        """The selector's greedy path from the anchor, as the engines draft with DFlash2."""
        return self.candidate_selector.walk(hidden, self.logits(hidden), anchor_token)


def drafter_class(config: DrafterConfig) -> type[DFlashDrafter]:
    """The module for `config.arch`."""
    return DFlash2Drafter if config.arch == "dflash2" else DFlashDrafter


def drafter_parameter_count(config: DrafterConfig) -> int:
    """Parameters of the drafter's own weights (what an export holds)."""
    d, i = config.hidden_size, config.intermediate_size
    q, kv = config.num_heads * config.head_dim, config.num_kv_heads * config.head_dim
    per_layer = d * q * 2 + d * kv * 2 + 3 * d * i + 2 * d + 2 * config.head_dim
    backbone = (
        config.num_layers * per_layer + config.num_context_layers * config.target_hidden_size * d + 2 * d
    )
    convolutions, selector = dflash2_parameter_counts(config)
    return backbone + convolutions + selector


def dflash2_parameter_counts(config: DrafterConfig) -> tuple[int, int]:
    """(the convolutions', the selector's) parameters: DFlash2's additions, (0, 0) for DFlash."""
    if config.arch != "dflash2":
        return 0, 0
    d, taps = config.hidden_size, config.conv_kernel_size
    conv = 2 * taps * d + d * 2 * taps * (d // config.conv_group_size)
    selector = d * config.selector_rank + 2 * config.vocab_size * config.selector_rank
    return config.num_layers * 2 * conv, selector


def config_summary(config: DrafterConfig) -> dict[str, Any]:
    """A flat, JSON-friendly description for logs and metadata."""
    summary = {
        "arch": config.arch,
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
    if config.arch == "dflash2":
        convolutions, selector = dflash2_parameter_counts(config)
        summary["convolutions"] = (
            f"{config.conv_kernel_size} taps, groups of {config.conv_group_size} ({convolutions:,})"
        )
        summary["selector"] = (
            f"top {config.selector_top_k}, rank {config.selector_rank} ({selector:,} parameters)"
        )
    return summary
