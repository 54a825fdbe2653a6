"""Model FLOPs of a target's forward, and devices' dense bf16 peaks: what MFU is measured against
(`bench --gpu`) and what the capacity plan turns into extraction hours.

The count reads the model's modules, so it holds for any architecture transformers builds; for a
target that is not loaded, `meta_target` builds it on the meta device (no memory, no weights).
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

import torch
from torch import nn

# Dense bf16 peak of one device (tensor cores, no sparsity), from the vendors' data sheets.
PEAK_BF16_FLOPS = {"H200": 989e12, "H100": 989e12, "H800": 989e12, "A100": 312e12, "L40S": 362e12}
PEAK_SETTING = "DFLASH_PEAK_TFLOPS"


def _linear_weights(module: nn.Module) -> int:
    return sum(m.weight.numel() for m in module.modules() if isinstance(m, nn.Linear))


def forward_flops(
    model: nn.Module, lengths: Sequence[int], through_layer: int | None, lm_head: bool
) -> float:
    """Model FLOPs of a forward over sequences of `lengths` (real tokens only, padding excluded).

    2 per weight per token for every linear layer run; causal attention scores and values
    (2 * 2 * heads * head_dim per query-key pair, L(L+1)/2 pairs); gated-delta-net state reads and updates
    counted as 4 * value heads * key dim * value dim per token (the chunked kernel's extra work is not
    model work). `through_layer`: the forward stops after that decoder layer (None: all of them)."""
    from dflash_assets.target.model import find_decoder

    _, layers = find_decoder(model)
    run = layers if through_layer is None else layers[: through_layer + 1]
    config = model.config
    tokens = sum(lengths)
    pairs = sum(n * (n + 1) / 2 for n in lengths)
    flops = 0.0
    for layer in run:
        flops += 2.0 * tokens * _linear_weights(layer)
        if hasattr(layer, "self_attn"):
            flops += 4.0 * pairs * config.num_attention_heads * config.head_dim
        else:  # gated-delta-net
            flops += (
                4.0
                * tokens
                * config.linear_num_value_heads
                * config.linear_key_head_dim
                * config.linear_value_head_dim
            )
    if lm_head:
        flops += 2.0 * tokens * model.get_output_embeddings().weight.numel()
    return flops


def peak_flops_of(device_name: str) -> float | None:
    """Dense bf16 peak for a device name such as `NVIDIA H200`: `DFLASH_PEAK_TFLOPS`, else the data sheet."""
    if os.environ.get(PEAK_SETTING):
        return float(os.environ[PEAK_SETTING]) * 1e12
    return next((flops for key, flops in PEAK_BF16_FLOPS.items() if key in device_name.upper()), None)


def peak_flops(device: torch.device) -> float | None:
    """The device's dense bf16 peak: `DFLASH_PEAK_TFLOPS`, else known data-sheet values, else None."""
    if os.environ.get(PEAK_SETTING):
        return float(os.environ[PEAK_SETTING]) * 1e12
    if device.type != "cuda":
        return None
    return peak_flops_of(torch.cuda.get_device_name(device))


def meta_target(model_dir: str | Path) -> nn.Module:
    """The target's architecture from its config.json, on the meta device: modules and shapes, no weights."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.from_pretrained(model_dir)
    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config)
