"""The drafter's config: its architecture and shape presets, the mask token, and the reference
`config.json` layout.

A drafter is described by `DrafterConfig`; `to_reference_dict` is the Qwen3-style config the engines
read (z-lab/dflash `DFlashDraftModel` / `DFlash2DraftModel`, SGLang `models/dflash.py`, vLLM
`qwen3_dflash.py`), so checkpoints and exports carry one format.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open

from dflash_assets.storage.layout import CONFIG_NAME, WEIGHTS_NAME
from dflash_assets.target.layer_ids import resolve_target_layer_ids
from dflash_assets.target.model import standard_names, text_config

DRAFTER_FORMAT = "dflash-assets.drafter/2"  # our provenance block inside the reference config
ARCHITECTURE = "DFlashDraftModel"  # what SGLang, vLLM and z-lab/dflash dispatch on
# DFLASH_DRAFTER_ARCH -> `architectures[0]`: DFlash2 is DFlash's backbone with a grouped dynamic
# convolution around every attention and MLP sublayer and a candidate selector over the unary top-k.
ARCHITECTURES = {"dflash": ARCHITECTURE, "dflash2": "DFlash2DraftModel"}
ARCH_SETTING = "DFLASH_DRAFTER_ARCH"
FULL_ATTENTION, SLIDING_ATTENTION = "full_attention", "sliding_attention"
MASK_TOKEN_SETTING = "DFLASH_MASK_TOKEN_ID"
# SGLang's name for the mask token when `dflash_config.mask_token` is absent; it looks the name up in the
# target's tokenizer (and refuses one the tokenizer has under another id), else adds it at len(tokenizer).
DEFAULT_MASK_TOKEN = "<|MASK|>"
SHAPE_SETTING = "DFLASH_DRAFTER_SHAPE"

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
    """Everything needed to rebuild a drafter. Saved as a Qwen3-style `config.json` in the layout the
    inference engines read (`to_reference_dict`), and read back from it."""

    hidden_size: int  # = the target's hidden size: the drafter shares the target's embedding and LM head
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    vocab_size: int  # rows of the target's embedding matrix
    mask_token_id: int
    target_layer_ids: list[int]  # K target decoder layers, 0-based; their raw outputs form the context
    target_num_hidden_layers: int  # the target's depth N (`num_target_layers` in the reference config)
    target_model: str = ""  # path or hub id the shared embedding / LM head are read from
    num_layers: int = 5
    block_size: int = 16
    rms_norm_eps: float = 1e-6
    rope_theta: float = 1_000_000.0
    max_position_embeddings: int = 32768  # the target's context (engines refuse a drafter shorter than it)
    # The target's rotary scaling past its theta (`rope_type` and its fields: YaRN, linear, Llama 3), so
    # the drafter's positions mean what the target's do at every length; None: the plain rotary embedding.
    rope_scaling: dict[str, Any] | None = None
    layer_types: list[str] = field(default_factory=list)  # per layer; empty: all full attention
    sliding_window: int | None = None  # tokens a sliding layer sees, its own included
    extra: dict[str, Any] = field(default_factory=dict)  # provenance: tokenizer, run, mask-token source...
    mask_token: str = DEFAULT_MASK_TOKEN  # its text, `dflash_config.mask_token`: see mask_token_text
    arch: str = "dflash"  # a key of ARCHITECTURES
    # DFlash2 only: taps of each sublayer's causal convolution along the block, channels sharing one
    # content-dependent tap weight, and the candidate selector's pair rank and candidates per slot.
    conv_kernel_size: int = 2
    conv_group_size: int = 16
    selector_rank: int = 256
    selector_top_k: int = 16
    # The target's own transform of its LM head's output, applied to the drafter's logits too (z-lab's
    # `dflash_config.output_multiplier` / `final_logit_softcapping`): 1.0 and None for Qwen targets.
    output_multiplier: float = 1.0
    final_logit_softcapping: float | None = None

    def __post_init__(self) -> None:
        self.target_layer_ids = [int(i) for i in self.target_layer_ids]
        if not self.target_layer_ids:
            raise ValueError("target_layer_ids is empty: the drafter needs at least one target layer")
        if self.num_heads % self.num_kv_heads:
            raise ValueError(
                f"num_heads {self.num_heads} is not a multiple of num_kv_heads {self.num_kv_heads}"
            )
        if self.head_dim % 2:
            raise ValueError(f"head_dim must be even for rotary embeddings, got {self.head_dim}")
        if self.block_size < 2:
            raise ValueError(f"block_size must be >= 2 (an anchor plus drafted slots), got {self.block_size}")
        if not 0 <= self.mask_token_id < self.vocab_size:
            raise ValueError(
                f"mask_token_id {self.mask_token_id} is outside the target's embedding matrix "
                f"({self.vocab_size} rows); set {MASK_TOKEN_SETTING} to an id below {self.vocab_size}"
            )
        if max(self.target_layer_ids) >= self.target_num_hidden_layers:
            raise ValueError(
                f"target_layer_ids {self.target_layer_ids} name a layer the {self.target_num_hidden_layers}-"
                "layer target lacks"
            )
        self.layer_types = list(self.layer_types) or [FULL_ATTENTION] * self.num_layers
        if len(self.layer_types) != self.num_layers:
            raise ValueError(
                f"layer_types has {len(self.layer_types)} entries for {self.num_layers} drafter layers"
            )
        unknown = sorted(set(self.layer_types) - {FULL_ATTENTION, SLIDING_ATTENTION})
        if unknown:
            raise ValueError(
                f"unknown drafter layer types {unknown}: use {FULL_ATTENTION!r} or {SLIDING_ATTENTION!r}"
            )
        if SLIDING_ATTENTION in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
            raise ValueError("sliding_attention layers need a positive sliding_window")
        if self.arch not in ARCHITECTURES:
            raise ValueError(
                f"drafter architecture {self.arch!r} ({ARCH_SETTING}) is not one of {list(ARCHITECTURES)}"
            )
        if self.rope_scaling is not None:
            self.rope_scaling = dict(self.rope_scaling)
            if self.rope_scaling.get("rope_type") not in SCALED_ROPE_TYPES:
                raise ValueError(
                    f"rope_scaling {self.rope_scaling} has no rope_type among {list(SCALED_ROPE_TYPES)}"
                )
        if self.arch == "dflash2":
            self._check_dflash2()

    def _check_dflash2(self) -> None:
        if self.hidden_size % self.conv_group_size:
            raise ValueError(
                f"conv_group_size {self.conv_group_size} does not divide the hidden size {self.hidden_size}"
            )
        if not 1 <= self.conv_kernel_size <= self.block_size:
            raise ValueError(
                f"conv_kernel_size {self.conv_kernel_size} must be between 1 and the block size "
                f"{self.block_size}"
            )
        if not 1 <= self.selector_top_k <= self.vocab_size or self.selector_rank < 1:
            raise ValueError(
                f"selector_top_k {self.selector_top_k} must be between 1 and the vocabulary "
                f"({self.vocab_size}) and selector_rank {self.selector_rank} positive"
            )

    def rope_parameters(self) -> dict[str, Any]:
        """`config.json`'s `rope_parameters`: the theta, and the target's scaling where it has one."""
        return {"rope_type": "default", "rope_theta": self.rope_theta, **(self.rope_scaling or {})}

    @property
    def architecture(self) -> str:
        """`architectures[0]` of the reference config: what the engines dispatch on."""
        return ARCHITECTURES[self.arch]

    @property
    def has_selector(self) -> bool:
        return self.arch == "dflash2"

    @property
    def num_context_layers(self) -> int:
        """K: target layers concatenated into the context feature."""
        return len(self.target_layer_ids)

    @property
    def target_hidden_size(self) -> int:
        """H of each captured target layer; equal to `hidden_size` (the embedding is shared)."""
        return self.hidden_size

    # -- the reference layout

    def reference_dflash_config(self) -> dict[str, Any]:
        """`dflash_config`: what z-lab's `_draft_value` reads first (DFlash2's fields only for DFlash2, the
        logit transform only where the target has one)."""
        dflash: dict[str, Any] = {
            "target_layer_ids": list(self.target_layer_ids),
            "mask_token_id": self.mask_token_id,
            "mask_token": self.mask_token,
            "block_size": self.block_size,
        }
        if self.arch == "dflash2":
            dflash.update(
                conv_kernel_size=self.conv_kernel_size,
                conv_group_size=self.conv_group_size,
                selector_rank=self.selector_rank,
                selector_top_k=self.selector_top_k,
            )
        if self.output_multiplier != 1.0:
            dflash["output_multiplier"] = self.output_multiplier
        if self.final_logit_softcapping:
            dflash["final_logit_softcapping"] = self.final_logit_softcapping
        return dflash

    def to_reference_dict(self) -> dict[str, Any]:
        """A Qwen3 `config.json` plus DFlash's fields, as z-lab/dflash, SGLang and vLLM read it."""
        sliding = SLIDING_ATTENTION in self.layer_types
        return {
            "architectures": [self.architecture],
            "model_type": "qwen3",
            "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size,
            "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads,
            "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim,
            "hidden_act": "silu",
            "rms_norm_eps": self.rms_norm_eps,
            "vocab_size": self.vocab_size,
            "max_position_embeddings": self.max_position_embeddings,
            # Both spellings: transformers 5 and vLLM read rope_parameters, older readers rope_theta and
            # rope_scaling (with `type`, its old name for rope_type).
            "rope_theta": self.rope_theta,
            "rope_parameters": self.rope_parameters(),
            **(
                {"rope_scaling": {**self.rope_scaling, "type": self.rope_scaling["rope_type"]}}
                if self.rope_scaling
                else {}
            ),
            "attention_bias": False,
            "attention_dropout": 0.0,
            "tie_word_embeddings": False,
            # Qwen3Config drops `sliding_window` unless use_sliding_window is true.
            "use_sliding_window": sliding,
            "sliding_window": self.sliding_window if sliding else None,
            "max_window_layers": self.num_layers,
            "layer_types": list(self.layer_types),
            "block_size": self.block_size,
            "num_target_layers": self.target_num_hidden_layers,
            "target_hidden_size": self.target_hidden_size,
            "dflash_config": self.reference_dflash_config(),
            "torch_dtype": "bfloat16",
            "dflash_assets": {"format": DRAFTER_FORMAT, "target_model": self.target_model, **self.extra},
        }

    @classmethod
    def from_reference_dict(cls, raw: dict[str, Any]) -> DrafterConfig:
        archs = [
            name
            for name, architecture in ARCHITECTURES.items()
            if architecture in (raw.get("architectures") or [])
        ]
        if not archs:
            raise ValueError(
                f"config architectures {raw.get('architectures')!r} are not one of "
                f"{[[a] for a in ARCHITECTURES.values()]}: not a DFlash drafter config"
            )
        dflash = raw.get("dflash_config") or {}

        def value(name: str, default: Any) -> Any:  # as z-lab's `_draft_value`: dflash_config, then top level
            return dflash.get(name, raw.get(name, default))

        softcap = value("final_logit_softcapping", None)
        provenance = dict(raw.get("dflash_assets") or {})
        provenance.pop("format", None)
        theta, scaling = rope_settings(raw)
        return cls(
            hidden_size=int(raw["hidden_size"]),
            num_heads=int(raw["num_attention_heads"]),
            num_kv_heads=int(raw.get("num_key_value_heads") or raw["num_attention_heads"]),
            head_dim=int(raw.get("head_dim") or raw["hidden_size"] // raw["num_attention_heads"]),
            intermediate_size=int(raw["intermediate_size"]),
            vocab_size=int(raw["vocab_size"]),
            mask_token_id=int(dflash["mask_token_id"]),
            target_layer_ids=[int(i) for i in dflash["target_layer_ids"]],
            target_num_hidden_layers=int(raw["num_target_layers"]),
            target_model=str(provenance.pop("target_model", "")),
            num_layers=int(raw["num_hidden_layers"]),
            block_size=int(dflash.get("block_size", raw.get("block_size", 16))),
            rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(raw.get("max_position_embeddings", 32768)),
            rope_scaling=scaling,
            layer_types=list(raw.get("layer_types") or []),
            sliding_window=raw.get("sliding_window") if raw.get("use_sliding_window", True) else None,
            extra=provenance,
            mask_token=str(dflash.get("mask_token") or DEFAULT_MASK_TOKEN),
            arch=archs[-1],
            conv_kernel_size=int(value("conv_kernel_size", 2)),
            conv_group_size=int(value("conv_group_size", 16)),
            selector_rank=int(value("selector_rank", 256)),
            selector_top_k=int(value("selector_top_k", 16)),
            output_multiplier=float(value("output_multiplier", 1.0)),
            final_logit_softcapping=float(softcap) if softcap else None,
        )

    def to_json(self) -> str:
        return json.dumps(self.to_reference_dict(), indent=2)

    @classmethod
    def from_json(cls, text: str) -> DrafterConfig:
        return cls.from_reference_dict(json.loads(text))

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
        shape: str = "auto",
        arch: str = "dflash",
    ) -> DrafterConfig:
        """A drafter for `target_model` (a Hugging Face model directory), shaped by a preset.

        `shape`: a name in `DRAFTER_SHAPES` (`auto` = `dflash`), or `target` for the target's own
        attention shape. `arch`: `dflash` or `dflash2` (`ARCHITECTURES`). `mask_token_id=None` resolves
        one with `resolve_mask_token` (the reason goes to `extra["mask_token_source"]`).
        """
        target = standard_names(text_config(json.loads(_target_file(target_model, CONFIG_NAME).read_text())))
        hidden_size = int(target["hidden_size"])
        num_target_layers = int(target["num_hidden_layers"])
        target_layer_ids = resolve_target_layer_ids(target, target_layer_ids, num_layers)
        vocab_size = int(target["vocab_size"])
        mask_token_id, mask_source = resolve_mask_token(target_model, mask_token_id, vocab_size)
        mask_token = mask_token_text(target_model, mask_token_id) or DEFAULT_MASK_TOKEN
        theta, scaling = rope_settings(target)
        return cls(
            hidden_size=hidden_size,
            vocab_size=vocab_size,
            mask_token_id=mask_token_id,
            target_layer_ids=list(target_layer_ids),
            target_num_hidden_layers=num_target_layers,
            target_model=str(target_model),
            num_layers=num_layers,
            block_size=block_size,
            rms_norm_eps=float(target.get("rms_norm_eps", 1e-6)),
            rope_theta=theta,
            max_position_embeddings=int(target.get("max_position_embeddings") or 32768),
            rope_scaling=scaling,
            extra={"mask_token_source": mask_source, "shape": shape, **rope_note(target)},
            mask_token=mask_token,
            arch=arch,
            **drafter_shape(target, shape, num_layers),
            **(dflash2_shape(hidden_size) if arch == "dflash2" else {}),
            **logit_transform(target),
        )


# Rotary scalings that fix the frequencies once, whatever the sequence's length (transformers'
# `ROPE_INIT_FUNCTIONS`): the drafter computes them as the target does and the export names them, so an
# engine serving it rotates positions as training did. `dynamic` and `longrope` change with the length
# inside a forward; a target with one keeps the plain rotary embedding at its theta (said in `extra`).
SCALED_ROPE_TYPES = ("linear", "yarn", "llama3")
# Fields of a rope dict that describe the target's own attention, not a scaling a drafter could share:
# Qwen3.5's partial rotary and multimodal sections (the drafter rotates its whole head).
_TARGET_ONLY_ROPE_FIELDS = (
    "partial_rotary_factor",
    "mrope_section",
    "mrope_interleaved",
    "type",
    "rope_theta",
)


def _rope_dict(config: dict[str, Any]) -> dict[str, Any]:
    return dict(config.get("rope_parameters") or config.get("rope_scaling") or {})


def rope_settings(config: dict[str, Any]) -> tuple[float, dict[str, Any] | None]:
    """The theta and the scaling (`rope_type` and its fields, or None) of a model's text config, in either
    spelling (transformers 5's `rope_parameters`, the older `rope_theta` + `rope_scaling` with `type`)."""
    rope = _rope_dict(config)
    theta = float(rope.get("rope_theta") or config.get("rope_theta") or 1_000_000.0)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in SCALED_ROPE_TYPES:
        return theta, None
    scaling = {"rope_type": kind}
    scaling.update((k, v) for k, v in rope.items() if k not in (*_TARGET_ONLY_ROPE_FIELDS, "rope_type"))
    return theta, scaling


def rope_note(target: dict[str, Any]) -> dict[str, str]:
    """`extra["rope_note"]` when the target's rotary scaling is one the drafter does not carry."""
    rope = _rope_dict(target)
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind in ("default", *SCALED_ROPE_TYPES):
        return {}
    return {
        "rope_note": f"the target's {kind!r} rotary scaling changes with the length inside a forward; the "
        "drafter keeps the plain rotary embedding at the target's theta"
    }


@dataclass(frozen=True)
class DrafterShape:
    """An attention shape and layer pattern taken from a published DFlash drafter config."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    sliding_window: int | None  # None: every layer full attention
    source: str


# The published drafters keep 32 query / 8 KV heads of 128 whatever the target's own attention
# (Qwen3-8B-DFlash-b16 and Qwen3.5 drafters: all full attention; Qwen3.6-27B-DFlash: four sliding layers
# with a 2048-token window, then one full layer), and the target's MLP width.
DRAFTER_SHAPES: dict[str, DrafterShape] = {
    "dflash": DrafterShape(32, 8, 128, None, "z-lab Qwen3 / Qwen3.5 DFlash drafters"),
    "dflash-swa": DrafterShape(32, 8, 128, 2048, "z-lab Qwen3.6-27B-DFlash"),
}
# Targets narrower than this are toy or test models: the preset's 4096-wide attention would dwarf them,
# so the same 4:1 grouping is scaled to the target's width (see `drafter_shape`).
FULL_PRESET_MIN_HIDDEN = 2048


def drafter_shape(target: dict[str, Any], shape: str, num_layers: int) -> dict[str, Any]:
    """Attention and MLP fields of `DrafterConfig` for `target` (its text config) under `shape`."""
    hidden = int(target["hidden_size"])
    intermediate = int(target.get("intermediate_size") or 0) or 3 * hidden
    if shape == "target":
        heads = int(target["num_attention_heads"])
        return {
            "num_heads": heads,
            "num_kv_heads": int(target.get("num_key_value_heads") or heads),
            "head_dim": int(target.get("head_dim") or hidden // heads),
            "intermediate_size": intermediate,
            "layer_types": [FULL_ATTENTION] * num_layers,
            "sliding_window": None,
        }
    preset = DRAFTER_SHAPES.get("dflash" if shape == "auto" else shape)
    if preset is None:
        raise ValueError(
            f"unknown drafter shape {shape!r} ({SHAPE_SETTING}); choose one of "
            f"{['auto', *DRAFTER_SHAPES, 'target']}"
        )
    heads, kv_heads, head_dim = preset.num_heads, preset.num_kv_heads, preset.head_dim
    if hidden < FULL_PRESET_MIN_HIDDEN:
        head_dim = max(8, min(preset.head_dim, hidden // 4) // 2 * 2)
        heads = max(1, hidden // head_dim)
        kv_heads = max(1, heads // (preset.num_heads // preset.num_kv_heads))
        while heads % kv_heads:
            kv_heads -= 1
    if preset.sliding_window is None or num_layers == 1:
        layer_types = [FULL_ATTENTION] * num_layers
    else:
        layer_types = [SLIDING_ATTENTION] * (num_layers - 1) + [FULL_ATTENTION]
    return {
        "num_heads": heads,
        "num_kv_heads": kv_heads,
        "head_dim": head_dim,
        "intermediate_size": intermediate,
        "layer_types": layer_types,
        "sliding_window": preset.sliding_window if SLIDING_ATTENTION in layer_types else None,
    }


# DFlash2's published shape (z-lab's fixture and the speculators trainer): two taps, 16 channels a tap
# weight, 16 candidates a slot, pair rank 256. A toy target narrower than FULL_PRESET_MIN_HIDDEN gets a
# rank no wider than itself: 256 would outweigh the rest of a 64-wide drafter.
DFLASH2_CONV_KERNEL_SIZE, DFLASH2_CONV_GROUP_SIZE = 2, 16
DFLASH2_SELECTOR_RANK, DFLASH2_SELECTOR_TOP_K = 256, 16


def dflash2_shape(hidden_size: int) -> dict[str, int]:
    """DFlash2's convolution and selector fields of `DrafterConfig` for a target of `hidden_size`."""
    rank = (
        DFLASH2_SELECTOR_RANK
        if hidden_size >= FULL_PRESET_MIN_HIDDEN
        else min(DFLASH2_SELECTOR_RANK, hidden_size)
    )
    group = DFLASH2_CONV_GROUP_SIZE
    while hidden_size % group:  # odd toy widths: the largest power of two that divides them
        group //= 2
    return {
        "conv_kernel_size": DFLASH2_CONV_KERNEL_SIZE,
        "conv_group_size": group,
        "selector_rank": rank,
        "selector_top_k": DFLASH2_SELECTOR_TOP_K,
    }


def logit_transform(target: dict[str, Any]) -> dict[str, Any]:
    """The target's own scaling and soft cap of its LM head's output (its text config), which the
    drafter's logits get too: Gemma's `final_logit_softcapping`, Granite's `logits_scaling` (a divisor),
    Cohere's `logit_scale` (a multiplier). Qwen targets have none."""
    multiplier = 1.0
    if target.get("logits_scaling"):
        multiplier = 1.0 / float(target["logits_scaling"])
    elif target.get("logit_scale"):
        multiplier = float(target["logit_scale"])
    softcap = target.get("final_logit_softcapping")
    return {"output_multiplier": multiplier, "final_logit_softcapping": float(softcap) if softcap else None}


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


def target_tokenizer(target_model: str | Path) -> Any:
    """The target's tokenizer, loaded once a process for each version of its files (a 262 K vocabulary's
    takes seconds to load, and every data stage resolves the mask token before it starts)."""
    directory = Path(target_model)
    files = sorted(directory.glob("tokenizer*")) if directory.is_dir() else []
    stamp = tuple((path.name, path.stat().st_mtime_ns) for path in files if path.is_file())
    return _load_tokenizer(str(target_model), stamp)


@functools.lru_cache(maxsize=4)
def _load_tokenizer(target_model: str, stamp: tuple) -> Any:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(target_model)


class MaskTokenError(ValueError):
    """No id can be the drafter's mask token, and none was given: one line naming the setting."""


def resolve_mask_token(target_model: str | Path, explicit: int | None, vocab_size: int) -> tuple[int, str]:
    """The mask token id and why it was chosen, by the first rule that gives one:

    1. an explicit id (`DFLASH_MASK_TOKEN_ID`, run config `mask_token_id`);
    2. the tokenizer's `mask_token`;
    3. the first id past the tokenizer's vocabulary that still has a row in the embedding matrix (what the
       published drafters do: 151669 for Qwen3 is exactly `len(tokenizer)`);
    4. for a tokenizer that names every row (SmolLM2, Llama 3), its last reserved special token: one that
       is no role of the tokenizer and that its chat template never writes (`reserved_special_token`).
    """
    if explicit is not None:
        if not 0 <= explicit < vocab_size:
            raise MaskTokenError(
                f"{MASK_TOKEN_SETTING}={explicit} is outside the target's embedding matrix "
                f"({vocab_size} rows, ids 0..{vocab_size - 1})"
            )
        return int(explicit), f"explicit setting ({MASK_TOKEN_SETTING} / run config mask_token_id)"
    tokenizer = target_tokenizer(target_model)
    if tokenizer.mask_token_id is not None:
        return int(tokenizer.mask_token_id), f"the tokenizer's mask_token {tokenizer.mask_token!r}"
    named = len(tokenizer)
    if named < vocab_size:
        return named, (
            f"first id past the tokenizer's {named} named tokens, inside the {vocab_size}-row embedding "
            "matrix (the tokenizer has no mask_token)"
        )
    reserved = reserved_special_token(tokenizer)
    if reserved is not None and reserved < vocab_size:
        return reserved, (
            f"the tokenizer names all {vocab_size} embedding rows and has no mask_token: its last special "
            "token that is none of its roles and that the chat template never writes"
        )
    raise MaskTokenError(
        f"the tokenizer of {target_model} has no mask_token, names all {vocab_size} embedding rows and has "
        f"no special token its chat template leaves unused, so no id is free for the drafter's mask "
        f"slots; set {MASK_TOKEN_SETTING} (or run config mask_token_id) to an id whose embedding the "
        "drafter may use"
    )


def reserved_special_token(tokenizer: Any) -> int | None:
    """The highest id among the tokenizer's special tokens that play no part in a conversation: not its
    bos, eos, pad, unk, sep or cls token, and not written by its chat template for a probe conversation
    (system, user, assistant, user, and the generation prompt). ChatML's `<|im_start|>`/`<|im_end|>` are
    written; SmolLM2's `<empty_output>` or Llama 3's `<|reserved_special_token_247|>` are not, so a
    rendered sample never holds them and their embedding row is free for the drafter's mask slots. None
    when every special token has a part."""
    roles = {
        getattr(tokenizer, f"{role}_token_id", None) for role in ("bos", "eos", "pad", "unk", "sep", "cls")
    }
    written = set(_template_token_ids(tokenizer))
    special = [
        int(token_id)
        for token_id, token in getattr(tokenizer, "added_tokens_decoder", {}).items()
        if getattr(token, "special", False) and token_id not in roles and token_id not in written
    ]
    return max(special, default=None)


def _template_token_ids(tokenizer: Any) -> list[int]:
    """The ids the chat template writes around a probe conversation (none without a template). A template
    that refuses a system turn is asked again without one."""
    if not getattr(tokenizer, "chat_template", None):
        return []
    turns = [
        {"role": "user", "content": "u"},
        {"role": "assistant", "content": "a"},
        {"role": "user", "content": "u"},
    ]
    for conversation in ([{"role": "system", "content": "s"}, *turns], turns):
        try:
            ids = tokenizer.apply_chat_template(
                conversation, add_generation_prompt=True, tokenize=True, return_dict=False
            )
        except Exception:  # a template's own refusal (raise_exception) of this shape of conversation
            continue
        ids = ids["input_ids"] if isinstance(ids, dict) else ids
        return [int(i) for i in ids]
    return []


def mask_token_text(target_model: str | Path, mask_token_id: int) -> str | None:
    """`dflash_config.mask_token`: what SGLang looks the mask token up by in the target's tokenizer.

    The tokenizer's own token at `mask_token_id` when it names that id (`<|mask|>`, or e.g.
    `<|audio_start|>` for Qwen3.6's 248070), so the lookup finds that very id. For an id past the named
    tokens (Qwen3's 151669 = len(tokenizer)) `<|MASK|>`, which SGLang adds at len(tokenizer): the id the
    first-unused-id rule picks. A tokenizer that already uses `<|MASK|>` for another id gets a name it does
    not have. None when the target has no loadable tokenizer (the config then keeps `<|MASK|>`).
    """
    try:
        tokenizer = target_tokenizer(target_model)
    except Exception:  # no tokenizer beside the weights (test targets): the text stays unknown
        return None
    if mask_token_id < len(tokenizer):
        token = tokenizer.convert_ids_to_tokens(int(mask_token_id))
        if isinstance(token, str) and token:
            return token
    vocab = tokenizer.get_vocab()
    for candidate in (DEFAULT_MASK_TOKEN, "<|dflash_mask|>", f"<|dflash_mask_{mask_token_id}|>"):
        if candidate not in vocab:
            return candidate
    return None


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
