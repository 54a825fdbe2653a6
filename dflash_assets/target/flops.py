"""Model FLOPs of a target's forward, and devices' dense bf16 peaks: what MFU is measured against
(`bench --gpu`) and what the capacity plan turns into extraction hours.

The count reads the model's modules, so it holds for any architecture transformers builds; for a
target that is not loaded, `meta_target` builds it on the meta device (no memory, no weights), and
`target_forward_shape` keeps what the count needs in the cache directory.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import os
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from torch import nn

# Dense bf16 peak of one device (tensor cores, no sparsity), from the vendors' data sheets.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "L40S": 362e12}
PEAK_SETTING = "DFLASH_PEAK_TFLOPS"


def _linear_weights(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


@dataclass(frozen=True)
class ForwardShape:
    """What a forward's FLOPs depend on, read off the model's modules once: each decoder layer's linear
    weights and kind, the attention and gated-delta-net widths, and the output head's weights."""

    layer_weights: tuple[int, ...]
    attention_layers: tuple[bool, ...]  # per layer: attention (else gated-delta-net)
    attention_width: int  # heads * head_dim (0 without attention layers)
    state_width: int  # value heads * key dim * value dim (0 without gated-delta-net layers)
    head_weights: int

    def flops(self, lengths: Sequence[int], through_layer: int | None, lm_head: bool) -> float:
        """Model FLOPs of a forward over sequences of `lengths` (real tokens only, padding excluded).

        2 per weight per token for every linear layer run; causal attention scores and values
        (2 * 2 * heads * head_dim per query-key pair, L(L+1)/2 pairs); gated-delta-net state reads and
        updates counted as 4 * value heads * key dim * value dim per token (the chunked kernel's extra
        work is not model work). `through_layer`: the forward stops after that decoder layer (None: all)."""
        run = len(self.layer_weights) if through_layer is None else through_layer + 1
        tokens = sum(lengths)
        pairs = sum(n * (n + 1) / 2 for n in lengths)
        flops = 0.0
        for weights, attention in zip(self.layer_weights[:run], self.attention_layers[:run], strict=True):
            flops += 2.0 * tokens * weights
            if attention:
                flops += 4.0 * pairs * self.attention_width
            else:
                flops += 4.0 * tokens * self.state_width
        if lm_head:
            flops += 2.0 * tokens * self.head_weights
        return flops


def forward_shape(model: nn.Module) -> ForwardShape:
    from dflash_assets.target.model import find_decoder

    _, layers = find_decoder(model)
    config = model.config
    attention = tuple(hasattr(layer, "self_attn") for layer in layers)
    state_width = 0
    if not all(attention):
        heads, key_dim = config.linear_num_value_heads, config.linear_key_head_dim
        state_width = heads * key_dim * config.linear_value_head_dim
    return ForwardShape(
        layer_weights=tuple(_linear_weights(layer) for layer in layers),
        attention_layers=attention,
        attention_width=config.num_attention_heads * config.head_dim if any(attention) else 0,
        state_width=state_width,
        head_weights=model.get_output_embeddings().weight.numel(),
    )


def forward_flops(
    model: nn.Module, lengths: Sequence[int], through_layer: int | None, lm_head: bool
) -> float:
    """Model FLOPs of a forward of `model` over sequences of `lengths` (see `ForwardShape.flops`)."""
    return forward_shape(model).flops(lengths, through_layer, lm_head)


def peak_flops_of(device_name: str, stated: float | None = None) -> float | None:
    """Dense bf16 peak for a device name such as `NVIDIA H200`: `stated` (the `DFLASH_PEAK_TFLOPS`
    setting), else the data sheet."""
    if stated:
        return stated
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in device_name.upper()), None)


def peak_flops(device: torch.device, stated: float | None = None) -> float | None:
    """The device's dense bf16 peak: `stated` (the `DFLASH_PEAK_TFLOPS` setting), else known data-sheet
    values, else None."""
    if stated:
        return stated
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def target_forward_shape(model_dir: str | Path, cache_dir: Path) -> ForwardShape:
    """The shape of the target in `model_dir`, counted once on the meta device and then read from
    `cache_dir` (keyed by its config.json and the transformers release, which builds the modules):
    every range's plan needs it, and building a 27B architecture takes seconds a range."""
    import transformers

    config_bytes = (Path(model_dir) / "config.json").read_bytes()
    key = hashlib.sha256(config_bytes + f"|{transformers.__version__}|v1".encode()).hexdigest()[:32]
    path = Path(cache_dir) / "forward-shapes" / f"{key}.json"
    with contextlib.suppress(OSError, ValueError, TypeError):  # absent or unreadable: counted again
        saved = json.loads(path.read_text())
        return ForwardShape(**{k: tuple(v) if isinstance(v, list) else v for k, v in saved.items()})
    shape = forward_shape(meta_target(model_dir))
    with contextlib.suppress(OSError):  # a cache that cannot be written costs the next count only
        path.parent.mkdir(parents=True, exist_ok=True)
        partial = path.with_name(f".{path.name}.{os.getpid()}")
        partial.write_text(json.dumps(asdict(shape)))
        os.replace(partial, path)  # whole or absent, whoever reads it
    return shape


def meta_target(model_dir: str | Path) -> nn.Module:
    """The target's architecture from its config.json, on the meta device: modules and shapes, no weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
