"""The DFlash drafter, top to bottom: config, layers, the block-diffusion training objective, export.

A drafter proposes a block of `block_size` tokens at once. Slot 0 of a block is the real anchor token
(the last token the target produced), slots 1.. are the mask token; the drafter fills them in one
non-causal forward pass, conditioned on a context feature built from k hidden layers of the target.

Attention rule (checked against z-lab/dflash `dflash_generate` and SpecForge's DFlash training mask):
a block sees the context feature at positions strictly BEFORE its anchor, plus every slot of its own
block. At inference the anchor is the token the target has just sampled, so the target has not yet run
on it and there is no hidden state for it; training with `<= anchor` would teach the drafter to lean on
a feature it never gets. Blocks never see each other.

Label rule (the same sources): block slot j predicts the token at `anchor + j`, i.e. the same position,
not the next one; slot 0 (the anchor) carries no loss.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from dflash_assets.core.capture import resolve_target_layer_ids, text_config

CONFIG_NAME = "config.json"
WEIGHTS_NAME = "model.safetensors"
DRAFTER_FORMAT = "dflash-assets.drafter/1"

# Where the two shared tensors live in a target checkpoint: plain causal LMs, then multimodal wrappers
# (Qwen3.5/3.6 checkpoints are vision-language models whose text model sits under `language_model`).
EMBEDDING_KEYS = (
    "model.embed_tokens.weight",
    "model.language_model.embed_tokens.weight",
    "language_model.model.embed_tokens.weight",
    "embed_tokens.weight",
)
LM_HEAD_KEYS = ("lm_head.weight", "language_model.lm_head.weight", "model.lm_head.weight")


# --------------------------------------------------------------------------------------------------
# Config
# --------------------------------------------------------------------------------------------------


@dataclass
class DrafterConfig:
    """Everything needed to rebuild a drafter; saved as the export's `config.json`."""

    hidden_size: int  # = the target's hidden size: the drafter shares the target's embedding and LM head
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int
    mask_token_id: int
    target_layer_ids: list[int]  # K target decoder layers, 0-based; their raw outputs form the context
    target_hidden_size: int  # H of each captured target layer
    target_model: str = ""  # path or hub id the shared embedding / LM head are read from
    num_layers: int = 5
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10_000.0
    extra: dict[str, Any] = field(default_factory=dict)  # free-form provenance (tokenizer, run name...)

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty: the drafter needs at least one target layer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (an anchor plus drafted slots), got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the vocabulary (size {self.vocab_size})"
            )

    @property
    def num_target_layers(self) -> int:
        return len(self.target_layer_ids)

    def to_json(self) -> str:
        header = {"format": DRAFTER_FORMAT, "architecture": "DFlashDrafter"}
        return json.dumps({**header, **asdict(self)}, indent=2)

    @classmethod
    def from_json(cls, text: str) -> DrafterConfig:
        raw = json.loads(text)
        if raw.get("format", DRAFTER_FORMAT) != DRAFTER_FORMAT:
            raise ValueError(f"drafter config has format {raw.get('format')!r}, expected {DRAFTER_FORMAT!r}")
        known = {f.name for f in fields(cls)}
        return cls(**{key: value for key, value in raw.items() if key in known})

    def save(self, directory: str | Path) -> Path:
        path = Path(directory) / CONFIG_NAME
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(self.to_json() + "\n")
        return path

    @classmethod
    def load(cls, directory: str | Path) -> DrafterConfig:
        return cls.from_json((Path(directory) / CONFIG_NAME).read_text())

    @classmethod
    def from_target(
        cls,
        target_model: str | Path,
        *,
        num_layers: int = 5,
        target_layer_ids: list[int] | None = None,
        mask_token_id: int | None = None,
        block_size: int = 16,
    ) -> DrafterConfig:
        """A drafter shaped like the target's attention layers (as DFlash does), from its `config.json`.

        `mask_token_id=None` takes the target tokenizer's `mask_token`.
        """
        target = text_config(json.loads(_target_file(target_model, CONFIG_NAME).read_text()))
        hidden_size = int(target["hidden_size"])
        num_heads = int(target["num_attention_heads"])
        target_layer_ids = resolve_target_layer_ids(target, target_layer_ids, num_layers)
        if mask_token_id is None:
            mask_token_id = _tokenizer_mask_token_id(target_model)
        rope = target.get("rope_parameters") or target.get("rope_scaling") or {}
        return cls(
            hidden_size=hidden_size,
            num_heads=num_heads,
            num_kv_heads=int(target.get("num_key_value_heads") or num_heads),
            head_dim=int(target.get("head_dim") or hidden_size // num_heads),
            intermediate_size=int(target["intermediate_size"]),
            vocab_size=int(target["vocab_size"]),
            mask_token_id=mask_token_id,
            target_layer_ids=list(target_layer_ids),
            target_hidden_size=hidden_size,
            target_model=str(target_model),
            num_layers=num_layers,
            block_size=block_size,
            rms_norm_eps=float(target.get("rms_norm_eps", 1e-6)),
            rope_theta=float(rope.get("rope_theta", target.get("rope_theta", 10_000.0))),
        )


def _target_file(target_model: str | Path, filename: str) -> Path:
    """One file of the target checkpoint: from a local directory, else from the Hugging Face hub cache."""
    local = Path(target_model)
    if local.is_dir():
        path = local / filename
        if not path.exists():
            raise FileNotFoundError(f"target model directory {local} has no {filename}")
        return path
    from huggingface_hub import hf_hub_download  # only for hub ids; local directories never need it

    return Path(hf_hub_download(str(target_model), filename))


def _tokenizer_mask_token_id(target_model: str | Path) -> int:
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(str(target_model))
    if tokenizer.mask_token_id is None:
        raise ValueError(
            f"the tokenizer of {target_model} has no mask_token; add one to the tokenizer or pass "
            "mask_token_id explicitly (DFlash fills drafted slots with it)"
        )
    return int(tokenizer.mask_token_id)


def load_target_embeddings(target_model: str | Path) -> tuple[torch.Tensor, torch.Tensor]:
    """Only the input embedding and LM head of the target, `[V, H]` each, without loading the model.

    Reads the safetensors index to find the shard of each tensor and pulls just those two tensors; a
    checkpoint without `lm_head.weight` (tied embeddings) reuses the embedding.
    """
    try:
        index = json.loads(_target_file(target_model, "model.safetensors.index.json").read_text())
        weight_map: dict[str, str] = index["weight_map"]
    except FileNotFoundError:
        with safe_open(str(_target_file(target_model, WEIGHTS_NAME)), framework="pt") as handle:
            weight_map = dict.fromkeys(handle.keys(), WEIGHTS_NAME)  # noqa: SIM118 (not a dict)

    def read(key: str) -> torch.Tensor:
        with safe_open(str(_target_file(target_model, weight_map[key])), framework="pt") as handle:
            return handle.get_tensor(key)

    embed_key = next((key for key in EMBEDDING_KEYS if key in weight_map), None)
    if embed_key is None:
        raise KeyError(f"no input embedding in {target_model}: looked for {list(EMBEDDING_KEYS)}")
    embedding = read(embed_key)
    head_key = next((key for key in LM_HEAD_KEYS if key in weight_map), None)
    if head_key is not None:
        return embedding, read(head_key)
    config = json.loads(_target_file(target_model, CONFIG_NAME).read_text())
    if not (config.get("tie_word_embeddings") or text_config(config).get("tie_word_embeddings")):
        raise KeyError(
            f"no LM head in {target_model}: looked for {list(LM_HEAD_KEYS)} and the config does not tie "
            "word embeddings"
        )
    return embedding, embedding


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


class DrafterAttention(nn.Module):
    """Block slots query [context ; own block]; the context feature is projected by THIS layer's k/v.

    Each block's keys are the shared context plus its own `S` slots, so the scores come in two parts:
    every slot against the context, `[B, h, N, S, C]` (masked per block), and every slot against its own
    block, `[B, h, N, S, S]`. One softmax runs over both, as if they were one row of keys. Cost is linear
    in the number of blocks N; blocks never see each other, so there is nothing else to compute.
    """

    def __init__(self, config: DrafterConfig) -> None:
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
        context_visible: torch.Tensor,  # [B, N, C] bool: block n may attend to context position c
    ) -> torch.Tensor:
        batch, num_blocks, block_size, _ = x.shape
        context_length = context.shape[1]
        q = self.q_norm(self.q_proj(x).view(batch, num_blocks, block_size, self.num_heads, self.head_dim))
        q = apply_rotary(q, block_rope).movedim(-2, 1) * self.head_dim**-0.5  # [B, h, N, S, hd]
        k_block, v_block = self._keys_values(x, block_rope)  # [B, h, N, S, hd]
        k_context, v_context = self._keys_values(context, context_rope)  # [B, h, C, hd]

        # The context is the same for every block: one matmul for all N*S queries, then the block mask.
        context_scores = q.flatten(2, 3) @ k_context.transpose(-1, -2)  # [B, h, N*S, C]
        context_scores = context_scores.view(batch, self.num_heads, num_blocks, block_size, context_length)
        context_scores = context_scores.masked_fill(~context_visible[:, None, :, None, :], float("-inf"))
        block_scores = q @ k_block.transpose(-1, -2)  # [B, h, N, S, S]: non-causal within a block
        # One softmax over [context ; own block]. The own block is never masked: no row is all -inf.
        probs = torch.cat([context_scores, block_scores], dim=-1).softmax(dim=-1)  # [B, h, N, S, C+S]
        context_probs, block_probs = probs.split([context_length, block_size], dim=-1)
        out = (context_probs.flatten(2, 3) @ v_context).view_as(q) + block_probs @ v_block  # [B, h, N, S, hd]
        return self.o_proj(out.movedim(1, -2).flatten(-2))  # [B, N, S, h*hd] -> [B, N, S, D]


class SwiGLU(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.gate_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.up_proj = nn.Linear(config.hidden_size, config.intermediate_size, bias=False)
        self.down_proj = nn.Linear(config.intermediate_size, config.hidden_size, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class DrafterLayer(nn.Module):
    def __init__(self, config: DrafterConfig) -> None:
        super().__init__()
        self.input_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.attention = DrafterAttention(config)
        self.post_attention_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.mlp = SwiGLU(config)

    def forward(
        self,
        x: torch.Tensor,  # [B, N, S, D]
        context: torch.Tensor,  # [B, C, D]
        block_rope: Rope,
        context_rope: Rope,
        context_visible: torch.Tensor,  # [B, N, C] bool
    ) -> torch.Tensor:
        x = x + self.attention(self.input_norm(x), context, block_rope, context_rope, context_visible)
        return x + self.mlp(self.post_attention_norm(x))


class DFlashDrafter(nn.Module):
    """k drafter layers over the target's frozen embedding and LM head.

    The frozen tensors are non-persistent buffers: not parameters (the optimiser never sees them) and
    not in `state_dict()` (checkpoints hold only what training changes).
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
        context_width = config.num_target_layers * config.target_hidden_size
        self.context_proj = nn.Linear(context_width, config.hidden_size, bias=False)
        self.context_norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.layers = nn.ModuleList(DrafterLayer(config) for _ in range(config.num_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)
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
        return self.context_proj.weight.device

    def forward(
        self,
        block_input_ids: torch.Tensor,  # [B, N, S] long: N blocks of S = block_size slots
        block_position_ids: torch.Tensor,  # [B, N, S] long; absolute positions, anchor + slot
        context_hidden_states: torch.Tensor,  # [B, C, K, H] captured target layers (any float dtype)
        context_position_ids: torch.Tensor,  # [B, C] long
        context_visible: torch.Tensor,  # [B, N, C] bool: block n may attend to context position c
    ) -> torch.Tensor:
        """Final-normed hidden states of the block slots, `[B, N, S, D]`.

        At inference: N = 1, the context is everything before the anchor and `context_visible` is all
        True (or False on padding). In training, `block_context_mask` builds it from the anchors.
        """
        dtype = self.context_proj.weight.dtype
        batch, context_length = context_hidden_states.shape[:2]
        x = F.embedding(block_input_ids, self.embed_weight).to(dtype)  # [B, N, S, D]
        flat = context_hidden_states.reshape(batch, context_length, -1).to(dtype)  # [B, C, K*H]
        context = self.context_norm(self.context_proj(flat))  # [B, C, D]
        head_dim, theta = self.config.head_dim, self.config.rope_theta
        block_rope = rotary_cos_sin(block_position_ids, head_dim, theta)  # [B, N, S, hd]
        context_rope = rotary_cos_sin(context_position_ids, head_dim, theta)  # [B, C, hd]
        for layer in self.layers:
            x = layer(x, context, block_rope, context_rope, context_visible)
        return self.norm(x)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """`[..., D] -> [..., V]` float32 logits through the target's LM head."""
        return F.linear(hidden.to(self.lm_head_weight.dtype), self.lm_head_weight).float()


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


def sample_anchors(loss_mask: torch.Tensor, num_anchors: int, generator: torch.Generator) -> BlockAnchors:
    """Up to `num_anchors` distinct random anchors per sequence, sorted by position.

    An anchor must be an assistant token followed by another assistant token: at inference the anchor
    is a token the target just generated, and a block with no assistant label would teach nothing.
    Drawn on the CPU from `generator`, so the choice is the same on any device and in either mode.
    """
    mask = loss_mask.detach().to("cpu", torch.bool)
    batch, length = mask.shape
    candidates = torch.zeros_like(mask)
    candidates[:, :-1] = mask[:, :-1] & mask[:, 1:]
    counts = candidates.sum(dim=1)  # [B]
    num_blocks = min(num_anchors, int(counts.max())) if batch else 0
    scores = torch.rand(batch, length, generator=generator)
    scores[~candidates] = 2.0  # never picked before a real candidate
    picked = scores.argsort(dim=1, stable=True)[:, :num_blocks]  # [B, N]
    keep = torch.arange(num_blocks)[None, :] < counts[:, None]
    positions = torch.where(keep, picked, length).sort(dim=1).values  # dropped ones sort last
    return BlockAnchors(positions=torch.where(keep, positions, 0), keep=keep)


def anchor_generator(seed: int, *parts: object) -> torch.Generator:
    """A CPU generator seeded from `(seed, *parts)`, e.g. (seed, epoch, batch index): anchors then
    depend only on where a batch sits in the data order, never on what ran before, so a resumed run
    and an uninterrupted one draw the same anchors."""
    digest = hashlib.sha256(repr((seed, *parts)).encode()).digest()
    return torch.Generator().manual_seed(int.from_bytes(digest[:8], "little") >> 1)


def block_context_mask(anchors: BlockAnchors, context_length: int) -> torch.Tensor:
    """`[B, N, C]` bool: block n sees the context positions strictly before its anchor.

    Every block also sees all of its own slots (the attention adds those), so a dropped block, which
    sees no context here, still attends to something and carries no loss.
    """
    context_end = torch.where(anchors.keep, anchors.positions, 0)  # [B, N]
    positions = torch.arange(context_length, device=context_end.device)
    return positions[None, None, :] < context_end[:, :, None]


def position_weights(block_size: int, gamma: float, device: torch.device | None = None) -> torch.Tensor:
    """`exp(-(p-1)/gamma)` for drafted positions p = 1..block_size-1, `[block_size - 1]`."""
    return torch.exp(-torch.arange(block_size - 1, device=device, dtype=torch.float32) / gamma)


@dataclass
class BlockLossOutput:
    loss: torch.Tensor  # scalar: position-weighted mean cross-entropy (what training minimises)
    weighted_ce_sum: float  # numerator of `loss`, for exact aggregation over batches
    weight_sum: float  # denominator of `loss`
    correct: torch.Tensor  # [block_size - 1] long: argmax hits per drafted position
    counted: torch.Tensor  # [block_size - 1] long: labels per drafted position
    accepted_sum: float  # sum over blocks of the leading run of hits (greedy acceptance)
    num_blocks: int


def _cross_entropy_and_argmax(
    model: DFlashDrafter, hidden: torch.Tensor, labels: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    logits = model.logits(hidden)  # [R, V] float32
    return F.cross_entropy(logits, labels, reduction="none"), logits.argmax(dim=-1)


def dflash_loss(
    model: DFlashDrafter, batch: DrafterBatch, anchors: BlockAnchors, gamma: float
) -> BlockLossOutput:
    """All blocks of all sequences in one forward pass.

    A drafted position p counts only while `anchor+1 .. anchor+p` are all inside the sequence and the
    assistant span: drafting stops at the end of a turn, and acceptance is a leading run anyway.
    """
    config, device = model.config, model.device
    block_size = config.block_size
    input_ids = batch.input_ids.to(device)
    batch_size, length = input_ids.shape
    positions = anchors.positions.to(device)
    keep = anchors.keep.to(device)
    num_blocks = positions.shape[1]

    slot_positions = positions[:, :, None] + torch.arange(block_size, device=device)  # [B, N, S]
    in_sequence = slot_positions < batch.lengths.to(device)[:, None, None]
    safe_positions = slot_positions.clamp(max=length - 1).view(batch_size, -1)
    tokens = input_ids.gather(1, safe_positions).view(batch_size, num_blocks, block_size)  # [B, N, S]
    in_span = batch.loss_mask.to(device).gather(1, safe_positions).view_as(tokens) & in_sequence
    label_valid = in_span[:, :, 1:].long().cumprod(dim=2).bool() & keep[:, :, None]  # [B, N, S-1]

    block_input_ids = torch.full_like(tokens, config.mask_token_id)
    block_input_ids[:, :, 0] = tokens[:, :, 0]
    hidden = model(
        block_input_ids,
        slot_positions,
        batch.hidden_states.to(device),
        torch.arange(length, device=device).expand(batch_size, -1),
        block_context_mask(BlockAnchors(positions, keep), length),
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
    weighted_ce = (ce * weights).sum()
    # A batch with no label keeps a (zero) graph so backward() and the optimiser step stay uniform.
    loss = weighted_ce / weight_sum if rows.shape[0] else hidden.sum() * 0.0

    with torch.no_grad():
        correct = torch.zeros_like(label_valid)
        correct[label_valid] = argmax == labels
        accepted = correct.long().cumprod(dim=2).sum(dim=2)  # [B, N]; an invalid position ends the run
    return BlockLossOutput(
        loss=loss,
        weighted_ce_sum=float(weighted_ce.detach()),
        weight_sum=float(weight_sum),
        correct=correct.sum(dim=(0, 1)).cpu(),
        counted=label_valid.sum(dim=(0, 1)).cpu(),
        accepted_sum=float(accepted[keep].sum()),
        num_blocks=int(keep.sum()),
    )


# --------------------------------------------------------------------------------------------------
# Export
# --------------------------------------------------------------------------------------------------


def export_drafter(
    model: DFlashDrafter,
    directory: str | Path,
    *,
    include_target_embeddings: bool = False,
    dtype: torch.dtype | None = None,
) -> Path:
    """Write `config.json` + `model.safetensors`, a directory `load_drafter` reads back in one call.

    By default the weights are the drafter's own (what training changed), like the published DFlash
    drafters: the shared embedding and LM head stay in the target checkpoint named by `target_model`
    (at Qwen3.6-27B scale they are ~2.5 GB each). `include_target_embeddings=True` also stores them,
    for a directory that runs without the target checkpoint. `dtype` (e.g. bfloat16) casts the drafter's
    own weights, which train in float32.
    """
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    tensors = {
        name: tensor.detach().to("cpu", dtype or tensor.dtype).contiguous()
        for name, tensor in model.state_dict().items()
    }
    if include_target_embeddings:
        tensors["embed_weight"] = model.embed_weight.detach().cpu().contiguous()
        tensors["lm_head_weight"] = model.lm_head_weight.detach().cpu().contiguous()
    config = model.config
    save_file(
        tensors,
        str(directory / WEIGHTS_NAME),
        metadata={
            "format": DRAFTER_FORMAT,
            "block_size": str(config.block_size),
            "mask_token_id": str(config.mask_token_id),
            "target_layer_ids": json.dumps(config.target_layer_ids),
            "target_model": config.target_model,
        },
    )
    config.save(directory)
    return directory


def load_drafter(
    directory: str | Path,
    *,
    target_model: str | Path | None = None,
    device: str | torch.device = "cpu",
) -> DFlashDrafter:
    """An exported drafter, ready to run. `target_model` overrides where the shared embedding and LM
    head come from when the export does not hold them (e.g. the target moved to another path)."""
    directory = Path(directory)
    config = DrafterConfig.load(directory)
    tensors = load_file(str(directory / WEIGHTS_NAME))
    embedding, lm_head = tensors.pop("embed_weight", None), tensors.pop("lm_head_weight", None)
    if embedding is None or lm_head is None:
        source = target_model or config.target_model
        if not source:
            raise ValueError(
                f"{directory} holds no embedding/LM head and its config names no target_model; "
                "pass target_model= (the target checkpoint the drafter was trained for)"
            )
        embedding, lm_head = load_target_embeddings(source)
    model = DFlashDrafter(config, embedding, lm_head)
    model.load_state_dict(tensors, strict=True)
    return model.to(device)
