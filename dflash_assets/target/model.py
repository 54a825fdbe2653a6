"""Loading the target LLM on a device, and reading its shape: decoder layers, hidden size, the decoder.

The real loading path (`AutoModelForCausalLM.from_pretrained`) serves the demo target and a 27B one alike.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_assets.target.devices import torch_device

MODEL_SETTING = "DFLASH_TARGET_MODEL"


class TargetModelError(ValueError):
    """The target model directory cannot be loaded."""


def _config_get(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def text_config(config: Any) -> Any:
    """The language-model part of a config: itself, or its nested `text_config` (multimodal checkpoints)."""
    if _config_get(config, "num_hidden_layers") is None:
        nested = _config_get(config, "text_config")
        if nested is not None:
            return nested
    return config


def num_decoder_layers(config: Any) -> int:
    value = _config_get(text_config(config), "num_hidden_layers")
    if not isinstance(value, int) or value <= 0:
        raise ValueError(
            "the target model config has no decoder layer count (`num_hidden_layers`, also looked in "
            f"`text_config`); check that {MODEL_SETTING} points at a causal language model"
        )
    return value


def hidden_size_of(config: Any) -> int:
    value = _config_get(text_config(config), "hidden_size")
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"the target model config has no `hidden_size`; check {MODEL_SETTING}")
    return value


def context_length_of(config: Any) -> int | None:
    """Positions the target reads, prompt and answer together (`max_position_embeddings`); None when the
    config does not say."""
    value = _config_get(text_config(config), "max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


def load_target_model(
    model_dir: str | Path, device: str | torch.device, dtype: torch.dtype | None = None
) -> nn.Module:
    """`AutoModelForCausalLM.from_pretrained` in eval mode: bf16 on CUDA, float32 on CPU unless `dtype`."""
    from transformers import AutoModelForCausalLM

    target = torch_device(device)
    if dtype is None:
        dtype = torch.bfloat16 if target.type == "cuda" else torch.float32
    path = Path(model_dir).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        problem = "does not exist" if not path.exists() else "is not a model directory (no config.json)"
        raise TargetModelError(
            f"target model directory {str(path)!r} {problem}; set {MODEL_SETTING} to a Hugging Face model "
            "directory (config.json + weights)"
        )
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as error:
        raise TargetModelError(
            f"cannot load the target model from {str(path)!r}: {error} (check {MODEL_SETTING})"
        ) from error
    return model.to(target).eval()


def find_decoder(model: nn.Module) -> tuple[nn.Module, nn.ModuleList]:
    """The inner text model (embeddings + decoder layers, no LM head) and its decoder layers."""
    inner = getattr(model, "model", None)
    candidates = [
        getattr(inner, "language_model", None),  # multimodal Qwen3.5: model.model.language_model.layers
        inner,  # causal LMs: model.model.layers
        getattr(model, "language_model", None),
        model,  # already a base model
    ]
    for candidate in candidates:
        layers = getattr(candidate, "layers", None)
        if isinstance(layers, nn.ModuleList) and len(layers) > 0:
            return candidate, layers
    raise ValueError(
        f"cannot find decoder layers in {type(model).__name__} (looked for model.model.layers and "
        f"model.model.language_model.layers); check {MODEL_SETTING}"
    )
