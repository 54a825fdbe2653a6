"""The DFlash drafter model, top to bottom: norms, rotary embeddings, block attention, the layers.

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

from dflash_assets.drafter.config import (
    SLIDING_ATTENTION,
    DrafterConfig,
    load_target_embeddings,
)

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
                make(window),
                batch,
                None,
                self.query_length,
                self.key_length,
                device=block_positions.device,
                _compile=compiled,
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
