"""Loading the target LLM on a device, and reading its shape: decoder layers, hidden size, the decoder.

The real loading path (`AutoModelForCausalLM.from_pretrained`) serves the demo target and a 27B one alike.
"""

from __future__ import annotations

import contextlib
import json
import logging
import re
import sys
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_assets.target.devices import torch_device

MODEL_SETTING = "DFLASH_TARGET_MODEL"
# transformers' loading report: logged by `log_state_dict_report` on the modeling logger.
_LOADING_LOGGER = "transformers.modeling_utils"
_LOADING_REPORT = "log_state_dict_report"
_LM_HEAD_KEY = re.compile(r"(^|\.)lm_head\.(weight|bias)$")


class TargetModelError(ValueError):
    """The target model directory cannot be loaded."""


def config_value(config: Any, key: str) -> Any:
    if isinstance(config, Mapping):
        return config.get(key)
    return getattr(config, key, None)


def text_config(config: Any) -> Any:
    """The language-model part of a config: itself, or its nested `text_config` (multimodal checkpoints)."""
    if config_value(config, "num_hidden_layers") is None:
        nested = config_value(config, "text_config")
        if nested is not None:
            return nested
    return config


def standard_names(target: dict) -> dict:
    """A target config with transformers' standard names filled in from its class's own aliases (its
    `attribute_map`: gpt2 writes `n_embd` for `hidden_size`, `n_layer` for `num_hidden_layers`)."""
    from transformers import CONFIG_MAPPING

    try:
        aliases = CONFIG_MAPPING[target.get("model_type")].attribute_map
    except KeyError:
        return target
    filled = {name: target[alias] for name, alias in aliases.items() if alias in target}
    return {**filled, **target}


def num_decoder_layers(config: Any) -> int:
    value = config_value(text_config(config), "num_hidden_layers")
    if not isinstance(value, int) or value <= 0:
        raise ValueError(
            "the target model config has no decoder layer count (`num_hidden_layers`, also looked in "
            f"`text_config`); check that {MODEL_SETTING} points at a causal language model"
        )
    return value


def hidden_size_of(config: Any) -> int:
    value = config_value(text_config(config), "hidden_size")
    if not isinstance(value, int) or value <= 0:
        raise ValueError(f"the target model config has no `hidden_size`; check {MODEL_SETTING}")
    return value


def context_length_of(config: Any) -> int | None:
    """Positions the target reads, prompt and answer together (`max_position_embeddings`); None when the
    config does not say."""
    value = config_value(text_config(config), "max_position_embeddings")
    return value if isinstance(value, int) and value > 0 else None


def cache_is_plain_attention(model_config: Any) -> bool:
    """Whether every layer of the cache `DynamicCache` builds for a model of `model_config` is plain keys and
    values (a `DynamicLayer`: no sliding window, no linear-attention state): a cache that can be decoded
    into in place and cut back past a rejected draft."""
    from transformers import DynamicCache
    from transformers.cache_utils import DynamicLayer

    if model_config is None or getattr(model_config, "is_encoder_decoder", False):
        return False
    layers = DynamicCache(config=model_config).layers
    return bool(layers) and all(type(layer) is DynamicLayer for layer in layers)


def load_target_model(
    model_dir: str | Path,
    device: str | torch.device | Sequence[str | torch.device],
    dtype: torch.dtype | None = None,
    *,
    lm_head: bool = True,
) -> nn.Module:
    """`AutoModelForCausalLM.from_pretrained` in eval mode, loaded straight onto its device (no copy of the
    whole target in host memory first: eight ranks of one host each loading a 55 GB target would hold
    eight): bf16 on CUDA, float32 on the CPU unless `dtype`. `lm_head=False` loads the model without its
    LM head (`AutoModel`): capturing hidden states never reads the logits, and at a 248 K vocabulary the
    head is 2.5 GB of a device in bf16 (5 GB of a CPU host in float32).

    `device` may list several devices: the replica then spans them, its decoder layers split into
    contiguous blocks, one per device (a layer split inside this process: the memory of one device each,
    the speed of one device; see `target/tensor_parallel.py` for a split over processes)."""
    from transformers import AutoModel, AutoModelForCausalLM

    auto = AutoModelForCausalLM if lm_head else AutoModel
    devices = _distinct_devices(device)
    if dtype is None:
        dtype = torch.bfloat16 if devices[0].type == "cuda" else torch.float32
    path = Path(model_dir).expanduser()
    if not path.is_dir() or not (path / "config.json").is_file():
        problem = "does not exist" if not path.exists() else "is not a model directory (no config.json)"
        raise TargetModelError(
            f"target model directory {str(path)!r} {problem}; set {MODEL_SETTING} to a Hugging Face model "
            "directory (config.json + weights)"
        )
    device_map: Any = devices[0] if len(devices) == 1 else layer_split_device_map(path, devices, auto)
    try:
        with contextlib.nullcontext() if lm_head else quiet_left_out_lm_head():
            model = auto.from_pretrained(path, dtype=dtype, device_map=device_map)
    except (OSError, ValueError, KeyError, json.JSONDecodeError) as error:
        raise TargetModelError(
            f"cannot load the target model from {str(path)!r}: {error} (check {MODEL_SETTING})"
        ) from error
    return model.eval()


def _distinct_devices(device: str | torch.device | Sequence[str | torch.device]) -> list[torch.device]:
    """The torch devices a replica spans, each once (`cpu:0,cpu:1` are both the CPU)."""
    names = [device] if isinstance(device, str | torch.device) else list(device)
    if not names:
        raise ValueError("a target replica needs at least one device")
    distinct: list[torch.device] = []
    for name in names:
        target = torch_device(name)
        if target not in distinct:
            distinct.append(target)
    return distinct


def layer_split_device_map(
    model_dir: str | Path, devices: Sequence[torch.device], auto: Any = None
) -> dict[str, str]:
    """A `device_map` spreading the decoder layers over `devices` in contiguous blocks (the first device
    takes the remainder); every other module (embeddings, final norm, LM head) on the first device.
    `auto`: the transformers class the model loads with (default `AutoModelForCausalLM`)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    auto = auto or AutoModelForCausalLM
    with torch.device("meta"):  # the architecture alone: module names, no weights
        meta = auto.from_config(AutoConfig.from_pretrained(Path(model_dir).expanduser()))
    _, layers = find_decoder(meta)
    count, parts = len(layers), len(devices)
    blocks: list[str] = []
    for part, device in enumerate(devices):
        blocks += [str(device)] * (count // parts + (1 if part < count % parts else 0))
    device_map: dict[str, str] = {}

    def place(module: nn.Module, prefix: str) -> None:
        for name, child in module.named_children():
            qualified = f"{prefix}{name}"
            if child is layers:
                device_map.update({f"{qualified}.{i}": blocks[i] for i in range(count)})
            elif any(descendant is layers for descendant in child.modules()):
                place(child, f"{qualified}.")
            else:
                device_map[qualified] = str(devices[0])

    place(meta, "")
    return device_map


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


class LeftOutLmHeadFilter(logging.Filter):
    """Drops transformers' loading report when all it says is that the checkpoint's LM head went unused
    (`lm_head.weight UNEXPECTED`), loading a model without one on purpose. A report that says anything
    else (another unexpected key, a missing or mismatched one) is kept whole."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            info = _loading_report_info()
            if info is None:
                return True
            unexpected = set(info.unexpected_keys)
            others = info.missing_keys or info.mismatched_keys or info.conversion_errors
            return not unexpected or bool(others) or not all(_LM_HEAD_KEY.search(key) for key in unexpected)
        except Exception:  # never lose a log record to this filter
            return True


def _loading_report_info() -> Any:
    """The `LoadStateDictInfo` of the loading report being logged now (its frame is on the stack), or
    None when no report is."""
    frame = sys._getframe(1)
    while frame is not None:
        module = frame.f_globals.get("__name__", "")
        if frame.f_code.co_name == _LOADING_REPORT and module.startswith("transformers."):
            return frame.f_locals.get("loading_info")
        frame = frame.f_back
    return None


@contextlib.contextmanager
def quiet_left_out_lm_head() -> Iterator[None]:
    """For the block: no loading report for an LM head the model was loaded without on purpose."""
    logger = logging.getLogger(_LOADING_LOGGER)
    quiet = LeftOutLmHeadFilter()
    logger.addFilter(quiet)
    try:
        yield
    finally:
        logger.removeFilter(quiet)
