"""An independent reader of the public DFlash drafter layout, for tests.

Built only from what the serving side publishes: a Qwen3 `config.json` read by transformers'
`Qwen3Config`, weights looked up by the reference names (`layers.N.self_attn.q_proj.weight`, `fc.weight`,
`hidden_norm.weight`, ...), transformers' own Qwen3 building blocks (RMSNorm, MLP, rotary embedding), and
inference as the engines run it: the block's queries attend over [context keys ; block keys], the
context keys projected by each layer from `hidden_norm(fc(concat of target layers))`. Full-attention
layers see the whole block; sliding layers are causal with the configured window. Nothing here imports
the project's drafter, so an export that drifts from the layout fails the tests instead of passing them
by construction.
"""

from __future__ import annotations

from pathlib import Path

import torch
from safetensors.torch import load_file
from torch import nn
from transformers import Qwen3Config
from transformers.models.qwen3.modeling_qwen3 import Qwen3MLP, Qwen3RMSNorm, Qwen3RotaryEmbedding, rotate_half


class ReferenceLayer(nn.Module):
    def __init__(self, config: Qwen3Config, index: int) -> None:
        super().__init__()
        heads, kv_heads, head_dim = config.num_attention_heads, config.num_key_value_heads, config.head_dim
        self.heads, self.kv_heads, self.head_dim = heads, kv_heads, head_dim
        self.q_proj = nn.Linear(config.hidden_size, heads * head_dim, bias=False)
        self.k_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=False)
        self.v_proj = nn.Linear(config.hidden_size, kv_heads * head_dim, bias=False)
        self.o_proj = nn.Linear(heads * head_dim, config.hidden_size, bias=False)
        self.q_norm = Qwen3RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.k_norm = Qwen3RMSNorm(head_dim, eps=config.rms_norm_eps)
        self.input_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_attention_layernorm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.mlp = Qwen3MLP(config)
        sliding = config.layer_types[index] == "sliding_attention"
        self.window = config.sliding_window if sliding else None

    def attend(
        self, x: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        """x [S, D] block, context [C, D]; cos/sin [C + S, head_dim] for positions 0 .. C+S-1."""
        s, c = x.shape[0], context.shape[0]
        q = self.q_norm(self.q_proj(x).view(s, self.heads, self.head_dim))
        keys_in = torch.cat([context, x])
        k = self.k_norm(self.k_proj(keys_in).view(c + s, self.kv_heads, self.head_dim))
        v = self.v_proj(keys_in).view(c + s, self.kv_heads, self.head_dim)
        q = q * cos[c:, None] + rotate_half(q) * sin[c:, None]
        k = k * cos[:, None] + rotate_half(k) * sin[:, None]
        groups = self.heads // self.kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        scores = torch.einsum("qhd,khd->hqk", q, k) / self.head_dim**0.5  # [h, S, C+S]
        query_pos = torch.arange(c, c + s)[:, None]
        key_pos = torch.arange(c + s)[None, :]
        if self.window is not None:
            visible = (key_pos <= query_pos) & (query_pos - key_pos < self.window)
            scores = scores.masked_fill(~visible, float("-inf"))
        out = torch.einsum("hqk,khd->qhd", scores.softmax(dim=-1), v).reshape(s, -1)
        return self.o_proj(out)

    def forward(
        self, x: torch.Tensor, context: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor
    ) -> torch.Tensor:
        x = x + self.attend(self.input_layernorm(x), context, cos, sin)
        return x + self.mlp(self.post_attention_layernorm(x))


class ReferenceDrafter(nn.Module):
    """`config.json` + `model.safetensors` of a DFlash drafter directory, every weight required."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        config = Qwen3Config.from_pretrained(directory)
        if config.architectures != ["DFlashDraftModel"]:
            raise ValueError(f"architectures {config.architectures}")
        self.config = config
        self.block_size = int(config.block_size)
        self.target_layer_ids = list(config.dflash_config["target_layer_ids"])
        self.mask_token_id = int(config.dflash_config["mask_token_id"])
        width = len(self.target_layer_ids) * config.hidden_size
        self.fc = nn.Linear(width, config.hidden_size, bias=False)
        self.hidden_norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.layers = nn.ModuleList(ReferenceLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = Qwen3RMSNorm(config.hidden_size, eps=config.rms_norm_eps)
        self.rotary = Qwen3RotaryEmbedding(config)
        weights = load_file(str(directory / "model.safetensors"))
        self.weight_dtypes = {name: tensor.dtype for name, tensor in weights.items()}
        # The reference names attention weights under `self_attn`; this module holds them directly.
        state = {name.replace(".self_attn.", "."): tensor.float() for name, tensor in weights.items()}
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [m for m in missing if not m.startswith("rotary.")]
        if missing or unexpected:
            raise ValueError(f"missing weights {missing}, unexpected {unexpected}")

    @torch.no_grad()
    def draft_logits(
        self,
        target_hidden: torch.Tensor,  # [C, K, H]: target layers at positions 0..C-1
        anchor: int,
        embed_tokens: nn.Module,
        lm_head: nn.Module,
        start: int = 0,
    ) -> torch.Tensor:
        """Logits for the block's drafted positions C+1 .. C+S-1, `[S-1, V]` (every position shifted by
        `start`: a context that begins there)."""
        c = target_hidden.shape[0]
        ids = torch.full((self.block_size,), self.mask_token_id, dtype=torch.long)
        ids[0] = anchor
        x = embed_tokens(ids).float()
        context = self.hidden_norm(self.fc(target_hidden.reshape(c, -1).float()))
        positions = start + torch.arange(c + self.block_size)[None]
        cos, sin = self.rotary(x[None], positions)
        for layer in self.layers:
            x = layer(x, context, cos[0].float(), sin[0].float())
        return lm_head(self.norm(x)[1:].to(lm_head.weight.dtype)).float()
