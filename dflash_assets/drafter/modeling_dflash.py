"""The DFlash drafter (and DFlash2) as `AutoModel.from_pretrained(directory, trust_remote_code=True)`
loads it.

dflash-assets copies this file into every exported drafter directory (`config.json`'s `auto_map` points
here), so the export loads the way z-lab/dflash's README loads a drafter. It needs torch and transformers
only, never dflash-assets; the project's own reader is `dflash_assets.drafter.export.load_drafter`, and
a test checks both give the same output on the same inputs.

What it computes (the interface z-lab/dflash's `DFlashDraftModel` has):

    hidden = drafter(
        position_ids=...,      # [B, C + S]: the context's positions, then the block's (or [B, S]: the
                               # context is taken to end right before the block)
        noise_embedding=...,   # [B, S, H]: the TARGET's embedding of [anchor, mask, mask, ...]
        target_hidden=...,     # [B, C, K*H]: the target's decoder layers `dflash_config.target_layer_ids`
                               # (raw outputs = Hugging Face hidden_states[i + 1]), concatenated
    )                          # -> [B, S, H]: the block's final-normed hidden states
    logits = target.lm_head(hidden[:, 1:])   # the drafts for the positions after the anchor

The embedding and LM head stay the target's: the directory holds only the drafter's own weights
(`layers.N...`, `fc`, `hidden_norm`, `norm`). Every query of the block sees all of the context (the
target's states of the positions before the anchor) and, on a full-attention layer, every slot of its
block; a `sliding_attention` layer is causal with a window of `sliding_window` positions, its own
included. `past_key_values` (a transformers `DynamicCache`) keeps the context's keys between blocks as
z-lab's `dflash_generate` uses it: the caller crops it back to the committed length after each block.

`spec_generate(target, input_ids, max_new_tokens, stop_token_ids, temperature)` decodes with the target
in the loop: the drafter proposes a block, the target verifies it in one forward, the leading run of
drafts the target agrees with is accepted plus the target's own next token. Nothing is ever rolled
back: the target's cache holds committed tokens only and each block is verified on a copy of it, so a
hybrid target's recurrent state (Qwen3.5/3.6 gated delta net), which cannot be cropped, stays right.
With `temperature=0` the output is exactly the target's own greedy decoding.

`DFlash2DraftModel` (`architectures: ["DFlash2DraftModel"]`) is the same backbone with a grouped dynamic
causal convolution along the block around every attention and MLP sublayer (`layers.N.attention_conv`,
`layers.N.mlp_conv`: `base_kernel [2, taps, H]`, `kernel_projection`), and drafts through its
`candidate_selector`: each slot's `selector_top_k` tokens under the target's head, rescored by
`<predecessor_codebook[previous] * hidden_projection(h), successor_codebook[candidate]>` and walked
greedily from the anchor.
"""

from __future__ import annotations

import copy
import inspect
from types import SimpleNamespace

import torch
import torch.nn.functional as F
from torch import nn
from transformers import DynamicCache, PreTrainedModel, Qwen3Config


class DFlashRMSNorm(nn.Module):
    def __init__(self, size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(size))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()  # bf16 squares lose too much precision
        x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x32 * self.weight.float()).to(x.dtype)


def _rope_frequencies(config: Qwen3Config, head_dim: int) -> tuple[torch.Tensor, float]:
    """Inverse frequencies and attention factor: the plain rotary embedding, or the scaling the config
    names (YaRN, linear, Llama 3), computed by transformers as for the target."""
    rope = getattr(config, "rope_parameters", None) or getattr(config, "rope_scaling", None) or {}
    kind = rope.get("rope_type", rope.get("type", "default"))
    theta = float(rope.get("rope_theta", getattr(config, "rope_theta", 1_000_000.0)))
    if kind == "default":
        return 1.0 / theta ** (torch.arange(0, head_dim, 2, device="cpu").float() / head_dim), 1.0
    if kind not in ("linear", "yarn", "llama3"):
        raise NotImplementedError(
            f"rope_type {kind!r}: this drafter implements default, linear, yarn, llama3"
        )
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    inv_freq, attention_factor = ROPE_INIT_FUNCTIONS[kind](config, "cpu")
    return inv_freq.float(), float(attention_factor)


def _rotary(
    positions: torch.Tensor, frequencies: tuple[torch.Tensor, float]
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos, sin `[B, L, head_dim]` for positions `[B, L]` (rotate-half convention, as Qwen3)."""
    inv_freq, attention_factor = frequencies
    angles = positions.float()[..., None] * inv_freq.to(positions.device)
    angles = torch.cat([angles, angles], dim=-1)
    return angles.cos() * attention_factor, angles.sin() * attention_factor


def _apply_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x `[B, heads, L, head_dim]`, cos/sin `[B, L, head_dim]`."""
    cos, sin = cos[:, None].to(x.dtype), sin[:, None].to(x.dtype)
    x1, x2 = x.chunk(2, dim=-1)
    return x * cos + torch.cat([-x2, x1], dim=-1) * sin


class DFlashAttention(nn.Module):
    """The block's queries over [context ; block] keys, both projected by this layer's k/v."""

    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_heads = config.num_attention_heads
        self.num_kv_heads = config.num_key_value_heads
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // self.num_heads
        bias = bool(getattr(config, "attention_bias", False))
        self.q_proj = nn.Linear(config.hidden_size, self.num_heads * self.head_dim, bias=bias)
        self.k_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.v_proj = nn.Linear(config.hidden_size, self.num_kv_heads * self.head_dim, bias=bias)
        self.o_proj = nn.Linear(self.num_heads * self.head_dim, config.hidden_size, bias=bias)
        self.q_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        self.k_norm = DFlashRMSNorm(self.head_dim, config.rms_norm_eps)
        layer_types = getattr(config, "layer_types", None) or ["full_attention"] * config.num_hidden_layers
        sliding = layer_types[layer_idx] == "sliding_attention"
        self.sliding_window = config.sliding_window if sliding else None

    def forward(
        self,
        x: torch.Tensor,  # [B, S, H] block (after the input norm)
        context: torch.Tensor,  # [B, C, H] hidden_norm(fc(target_hidden))
        query_rope: tuple[torch.Tensor, torch.Tensor],  # [B, S, hd]
        key_rope: tuple[torch.Tensor, torch.Tensor],  # [B, C + S, hd]
        query_positions: torch.Tensor,  # [B, S]
        key_positions: torch.Tensor,  # [B, C + S]
        past_key_values: DynamicCache | None,
    ) -> torch.Tensor:
        batch, size, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(batch, size, self.num_heads, self.head_dim)).transpose(1, 2)
        q = _apply_rotary(q, *query_rope)  # [B, h, S, hd]
        keys_in = torch.cat([context, x], dim=1)
        length = keys_in.shape[1]
        k = self.k_norm(self.k_proj(keys_in).view(batch, length, self.num_kv_heads, self.head_dim))
        k = _apply_rotary(k.transpose(1, 2), *key_rope)  # [B, kv, C + S, hd]
        v = self.v_proj(keys_in).view(batch, length, self.num_kv_heads, self.head_dim).transpose(1, 2)
        if past_key_values is not None:
            past = past_key_values.get_seq_length(self.layer_idx)
            k, v = past_key_values.update(k, v, self.layer_idx)
            # The cache holds the positions just before the new ones (the caller crops it to them).
            before = key_positions[:, :1] - past + torch.arange(past, device=x.device)[None]
            key_positions = torch.cat([before, key_positions], dim=1)
        mask = None
        if self.sliding_window is not None:
            distance = query_positions[:, :, None] - key_positions[:, None, :]  # [B, S, keys]
            mask = ((distance >= 0) & (distance < self.sliding_window))[:, None]
        groups = self.num_heads // self.num_kv_heads
        k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, h, S, hd]
        return self.o_proj(out.transpose(1, 2).reshape(batch, size, self.num_heads * self.head_dim))


class DFlashMLP(nn.Module):
    def __init__(self, config: Qwen3Config) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DFlashBlockConv(nn.Module):
    """DFlash2: `out[s] = sum_o (base_kernel[side, o] + dynamic[s, o, group]) * x[s - o]` along the block
    (zero before its first slot), `dynamic` projected from the sublayer's normed input at slot s."""

    def __init__(self, hidden_size: int, kernel_size: int, group_size: int) -> None:
        super().__init__()
        self.kernel_size, self.group_size, self.groups = kernel_size, group_size, hidden_size // group_size
        self.base_kernel = nn.Parameter(torch.zeros(2, kernel_size, hidden_size))
        self.kernel_projection = nn.Linear(hidden_size, 2 * kernel_size * self.groups, bias=False)

    def _convolve(self, x: torch.Tensor, dynamic: torch.Tensor, base: torch.Tensor) -> torch.Tensor:
        grouped = x.unflatten(-1, (self.groups, self.group_size))  # [B, S, G, g]
        out = torch.zeros_like(grouped)
        for tap in range(self.kernel_size):
            earlier = grouped if tap == 0 else F.pad(grouped[:, :-tap], (0, 0, 0, 0, tap, 0))
            out = out + earlier * (
                base[tap].view(self.groups, self.group_size).to(x.dtype) + dynamic[:, :, tap, :, None]
            )
        return out.flatten(-2)

    def prepare(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        dynamic = self.kernel_projection(x).unflatten(
            -1, (2, self.kernel_size, self.groups)
        )  # [B, S, 2, k, G]
        return self._convolve(x, dynamic[:, :, 0], self.base_kernel[0]), dynamic[:, :, 1]

    def finish(self, y: torch.Tensor, dynamic: torch.Tensor) -> torch.Tensor:
        return self._convolve(y, dynamic, self.base_kernel[1])


class DFlashDecoderLayer(nn.Module):
    def __init__(self, config: Qwen3Config, layer_idx: int) -> None:
        super().__init__()
        self.input_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.self_attn = DFlashAttention(config, layer_idx)
        self.post_attention_layernorm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = DFlashMLP(config)
        self.attention_conv: DFlashBlockConv | None = None  # DFlash2's
        self.mlp_conv: DFlashBlockConv | None = None

    def forward(self, x: torch.Tensor, context: torch.Tensor, *attention: object) -> torch.Tensor:
        h = self.input_layernorm(x)
        if self.attention_conv is None:
            x = x + self.self_attn(h, context, *attention)
        else:
            h, kernel = self.attention_conv.prepare(h)
            x = x + self.attention_conv.finish(self.self_attn(h, context, *attention), kernel)
        h = self.post_attention_layernorm(x)
        if self.mlp_conv is None:
            return x + self.mlp(h)
        h, kernel = self.mlp_conv.prepare(h)
        return x + self.mlp_conv.finish(self.mlp(h), kernel)


class DFlashDraftModel(PreTrainedModel):
    """A DFlash drafter: k layers over a block, conditioned on the target's hidden states."""

    config_class = Qwen3Config
    base_model_prefix = "model"
    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        dflash = dict(getattr(config, "dflash_config", None) or {})
        self.target_layer_ids = [int(i) for i in dflash["target_layer_ids"]]
        self.mask_token_id = int(dflash["mask_token_id"])
        self.block_size = int(dflash.get("block_size") or config.block_size)
        self.head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        self.rope_frequencies = _rope_frequencies(config, self.head_dim)
        self.layers = nn.ModuleList(DFlashDecoderLayer(config, i) for i in range(config.num_hidden_layers))
        self.norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.fc = nn.Linear(len(self.target_layer_ids) * config.hidden_size, config.hidden_size, bias=False)
        self.hidden_norm = DFlashRMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_init()

    def _init_weights(self, module: nn.Module) -> None:
        if isinstance(module, nn.Linear):
            nn.init.normal_(module.weight, std=getattr(self.config, "initializer_range", 0.02))
            if module.bias is not None:
                nn.init.zeros_(module.bias)
        elif isinstance(module, DFlashRMSNorm):
            nn.init.ones_(module.weight)

    def forward(
        self,
        position_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        noise_embedding: torch.Tensor | None = None,
        target_hidden: torch.Tensor | None = None,
        past_key_values: DynamicCache | None = None,
        use_cache: bool = False,
        **kwargs: object,
    ) -> torch.Tensor:
        """The block's final-normed hidden states `[B, S, H]` (see the module docstring)."""
        if noise_embedding is None or target_hidden is None:
            raise ValueError("DFlashDraftModel needs noise_embedding [B, S, H] and target_hidden [B, C, K*H]")
        if attention_mask is not None:
            raise ValueError("attention_mask is not supported: the block attends by the DFlash rule")
        dtype = self.fc.weight.dtype
        x = noise_embedding.to(dtype)
        batch, size, _ = x.shape
        context_length = target_hidden.shape[1]
        position_ids = position_ids.to(x.device)
        if position_ids.dim() == 1:
            position_ids = position_ids[None].expand(batch, -1)
        if position_ids.shape[1] == size:  # only the block's: the context ends right before it
            before = position_ids[:, :1] - context_length + torch.arange(context_length, device=x.device)
            position_ids = torch.cat([before, position_ids], dim=1)
        if position_ids.shape[1] != context_length + size:
            raise ValueError(
                f"position_ids has {position_ids.shape[1]} positions for {context_length} context and {size} "
                "block positions: give the context's then the block's, or the block's only"
            )
        context = self.hidden_norm(self.fc(target_hidden.to(dtype)))
        query_positions = position_ids[:, context_length:]
        key_rope = _rotary(position_ids, self.rope_frequencies)
        query_rope = (key_rope[0][:, context_length:], key_rope[1][:, context_length:])
        for layer in self.layers:
            x = layer(
                x, context, query_rope, key_rope, query_positions, position_ids,
                past_key_values if use_cache or past_key_values is not None else None,
            )  # fmt: skip
        return self.norm(x)

    # -- decoding with the target

    def compute_logits(self, hidden: torch.Tensor, lm_head: nn.Module) -> torch.Tensor:
        """Float32 logits through the target's head, with its own scaling and soft cap if it has them."""
        dflash = dict(getattr(self.config, "dflash_config", None) or {})
        logits = lm_head(hidden.to(lm_head.weight.dtype)).float() * float(
            dflash.get("output_multiplier", 1.0)
        )
        if cap := dflash.get("final_logit_softcapping"):
            logits = torch.tanh(logits / float(cap)) * float(cap)
        return logits

    def propose(self, hidden: torch.Tensor, anchor: int, lm_head: nn.Module, temperature: float) -> list[int]:
        """The drafts for the slots after the anchor (`hidden [S-1, H]`)."""
        logits = self.compute_logits(hidden, lm_head)
        if temperature < 1e-5:
            return logits.argmax(dim=-1).tolist()
        return torch.multinomial(torch.softmax(logits / temperature, dim=-1), 1)[:, 0].tolist()

    def target_context(self, hidden_states: tuple[torch.Tensor, ...]) -> torch.Tensor:
        """`[B, L, K*H]` from a target forward's `hidden_states` (index 0 is the embeddings)."""
        return torch.cat([hidden_states[i + 1] for i in self.target_layer_ids], dim=-1)

    @torch.inference_mode()
    def spec_generate(
        self,
        target: nn.Module,
        input_ids: torch.LongTensor,
        max_new_tokens: int,
        stop_token_ids: list[int] | None = None,
        temperature: float = 0.0,
        return_stats: bool = False,
    ) -> torch.LongTensor | SimpleNamespace:
        """`[1, prompt + generated]` token ids (see the module docstring); with `return_stats`, a namespace
        with `output_ids`, `acceptance_lengths` (accepted drafts + 1 per verification round) and `tau`."""
        if input_ids.dim() != 2 or input_ids.shape[0] != 1:
            shape = list(input_ids.shape)
            raise ValueError(f"spec_generate decodes one sequence (input_ids [1, T]), got {shape}")
        self.eval()
        device = next(target.parameters()).device
        embed, lm_head = target.get_input_embeddings(), target.get_output_embeddings()
        stop = {int(t) for t in stop_token_ids or []}
        # transformers renamed the target's `past_key_values` argument to `cache`: take what it has.
        parameters = inspect.signature(target.forward).parameters
        cache_argument = "cache" if "cache" in parameters else "past_key_values"

        def choose(logits: torch.Tensor) -> torch.Tensor:  # [n, V] -> [n]
            if temperature < 1e-5:
                return logits.argmax(dim=-1)
            return torch.multinomial(torch.softmax(logits.float() / temperature, dim=-1), 1)[:, 0]

        def run(ids: list[int] | torch.Tensor, cache: DynamicCache):
            ids = torch.as_tensor(ids, dtype=torch.long, device=device).view(1, -1)
            return target(input_ids=ids, use_cache=True, output_hidden_states=True, **{cache_argument: cache})

        prompt = input_ids[0].tolist()
        committed = DynamicCache(config=target.config)
        output = run(prompt, committed)  # prefill: the first new token is the target's own
        generated = [int(choose(output.logits[0, -1:])[0])]
        context = self.target_context(output.hidden_states)  # [1, P, K*H]
        lengths: list[int] = []
        while len(generated) < max_new_tokens and generated[-1] not in stop:
            anchor = generated[-1]
            start = len(prompt) + len(generated) - 1  # the anchor's position
            block = torch.full((1, self.block_size), self.mask_token_id, dtype=torch.long, device=device)
            block[0, 0] = anchor
            positions = torch.arange(start + self.block_size, device=device)[None]
            hidden = self(position_ids=positions, noise_embedding=embed(block), target_hidden=context)
            drafts = self.propose(hidden[0, 1:], anchor, lm_head, temperature)
            verified = run([anchor, *drafts], copy.deepcopy(committed))
            posterior = choose(verified.logits[0].float()).tolist()
            accepted = 0
            while accepted < len(drafts) and drafts[accepted] == posterior[accepted]:
                accepted += 1
            new = [*drafts[:accepted], posterior[accepted]]
            before = len(generated)
            for token in new:
                generated.append(int(token))
                if len(generated) == max_new_tokens or token in stop:
                    break
            lengths.append(len(generated) - before)  # what this round produced, within budget and stop
            # Commit the anchor and the accepted drafts: their states become context for the next block.
            committed_output = run([anchor, *drafts[:accepted]], committed)
            context = torch.cat([context, self.target_context(committed_output.hidden_states)], dim=1)
        output_ids = torch.tensor([prompt + generated], dtype=torch.long, device=input_ids.device)
        if not return_stats:
            return output_ids
        tau = sum(lengths) / len(lengths) if lengths else None
        return SimpleNamespace(output_ids=output_ids, acceptance_lengths=lengths, tau=tau)


class DFlash2Selector(nn.Module):
    def __init__(self, hidden_size: int, vocab_size: int, rank: int, top_k: int) -> None:
        super().__init__()
        self.top_k = top_k
        self.hidden_projection = nn.Linear(hidden_size, rank, bias=False)
        self.predecessor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))
        self.successor_codebook = nn.Parameter(torch.zeros(vocab_size, rank))

    def walk(self, hidden: torch.Tensor, logits: torch.Tensor, anchor: int) -> list[int]:
        """The greedy path through the slots' top-k candidates, from the anchor (`hidden [S-1, H]`)."""
        unary, candidates = logits.float().topk(self.top_k, dim=-1)
        queries = self.hidden_projection(hidden).float()  # [S-1, rank]
        previous, path = int(anchor), []
        for slot in range(hidden.shape[0]):
            pair = (queries[slot] * self.predecessor_codebook[previous].float()) @ self.successor_codebook[
                candidates[slot]
            ].float().T
            previous = int(candidates[slot, (unary[slot] + pair).argmax()])
            path.append(previous)
        return path


class DFlash2DraftModel(DFlashDraftModel):
    """DFlash2: the DFlash backbone, a convolution around each sublayer, drafting through the selector
    (greedy decoding only: `temperature` must be 0)."""

    _no_split_modules = ["DFlashDecoderLayer"]

    def __init__(self, config: Qwen3Config) -> None:
        super().__init__(config)
        dflash = dict(getattr(config, "dflash_config", None) or {})
        taps, group = int(dflash["conv_kernel_size"]), int(dflash["conv_group_size"])
        for layer in self.layers:
            layer.attention_conv = DFlashBlockConv(config.hidden_size, taps, group)
            layer.mlp_conv = DFlashBlockConv(config.hidden_size, taps, group)
        self.candidate_selector = DFlash2Selector(
            config.hidden_size, config.vocab_size, int(dflash["selector_rank"]), int(dflash["selector_top_k"])
        )
        self.post_init()

    def propose(self, hidden: torch.Tensor, anchor: int, lm_head: nn.Module, temperature: float) -> list[int]:
        if temperature >= 1e-5:
            raise NotImplementedError("this DFlash2 reader drafts greedily only (temperature=0)")
        return self.candidate_selector.walk(hidden, self.compute_logits(hidden, lm_head), anchor)
