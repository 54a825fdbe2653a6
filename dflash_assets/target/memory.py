"""What the target occupies on a device, from its checkpoint and config alone (nothing is loaded).

Weights are counted exactly from the safetensors headers (every tensor the checkpoint holds, at the
dtype the loader uses: bf16 on CUDA, float32 on the CPU). Activations, the KV cache and the recurrent
state of gated-delta-net layers are estimates from the config: what the capacity plan and the trainer's
check before a speculative evaluation need, not an allocator's exact peak.
"""

from __future__ import annotations

import functools
import json
import os
import struct
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dflash_assets.target.model import num_decoder_layers, text_config


@dataclass(frozen=True)
class CheckpointTensor:
    dtype: str  # safetensors dtype name, e.g. "BF16"
    shape: tuple[int, ...]

    @property
    def numel(self) -> int:
        count = 1
        for size in self.shape:
            count *= size
        return count


def _read_header(path: Path) -> dict[str, Any]:
    with path.open("rb") as handle:
        (length,) = struct.unpack("<Q", handle.read(8))
        return json.loads(handle.read(length))


def checkpoint_tensors(model_dir: str | Path) -> dict[str, CheckpointTensor]:
    """Name -> dtype and shape of every tensor in the directory's safetensors files (headers only)."""
    directory = Path(model_dir)
    tensors: dict[str, CheckpointTensor] = {}
    for path in sorted(directory.glob("*.safetensors")):
        for name, entry in _read_header(path).items():
            if name != "__metadata__":
                tensors[name] = CheckpointTensor(entry["dtype"], tuple(entry["shape"]))
    if not tensors:
        raise FileNotFoundError(
            f"{directory} holds no safetensors weights: the memory estimates read tensor shapes from "
            "*.safetensors headers (check DFLASH_TARGET_MODEL)"
        )
    return tensors


def parameter_count(model_dir: str | Path) -> int:
    """Every tensor of the checkpoint; for a directory that holds only a config (planning a run whose
    weights are elsewhere), the parameters of the architecture transformers builds from it."""
    directory = Path(model_dir)
    if not any(directory.glob("*.safetensors")) and (directory / "config.json").is_file():
        return _config_parameter_count(str(directory.resolve()), (directory / "config.json").read_text())
    return sum(tensor.numel for tensor in checkpoint_tensors(model_dir).values())


@functools.lru_cache(maxsize=8)
def _config_parameter_count(model_dir: str, config_text: str) -> int:
    """Parameters of the model `model_dir`'s config describes (`config_text`: the cache key), counted on
    the meta device: no memory, no weights."""
    from dflash_assets.target.flops import meta_target

    return sum(parameter.numel() for parameter in meta_target(model_dir).parameters())


def weight_bytes(model_dir: str | Path, device_type: str) -> int:
    """The weights as `load_target_model` puts them on a device: bf16 on CUDA, float32 on the CPU."""
    return parameter_count(model_dir) * (2 if device_type == "cuda" else 4)


def lm_head_parameters(config: dict[str, Any]) -> int:
    """The LM head's parameters when it is a tensor of its own (none when tied to the embedding)."""
    if config.get("tie_word_embeddings"):
        return 0
    return int(config["vocab_size"]) * int(config["hidden_size"])


def target_config(model_dir: str | Path) -> dict[str, Any]:
    """The target's text config as a dict (multimodal checkpoints: their `text_config`)."""
    return text_config(json.loads((Path(model_dir) / "config.json").read_text()))


def layer_types(config: dict[str, Any]) -> list[str]:
    """Per decoder layer: `full_attention`, `linear_attention` (gated delta net), `sliding_attention`."""
    count = num_decoder_layers(config)
    types = config.get("layer_types") or ["full_attention"] * count
    return list(types)[:count]


def kv_cache_bytes_per_token(config: dict[str, Any], dtype_bytes: int = 2) -> int:
    """Keys and values of every attention layer for one token (gated-delta-net layers keep none)."""
    heads = int(config.get("num_key_value_heads") or config.get("num_attention_heads") or 1)
    head_dim = int(config.get("head_dim") or int(config["hidden_size"]) // int(config["num_attention_heads"]))
    attention_layers = sum(1 for kind in layer_types(config) if kind != "linear_attention")
    return attention_layers * 2 * heads * head_dim * dtype_bytes


def recurrent_state_bytes(config: dict[str, Any]) -> int:
    """Per sequence: the float32 state and the conv1d window of every gated-delta-net layer."""
    linear_layers = sum(1 for kind in layer_types(config) if kind == "linear_attention")
    if not linear_layers:
        return 0
    value_heads = int(config.get("linear_num_value_heads") or 0)
    key_dim = int(config.get("linear_key_head_dim") or 0)
    value_dim = int(config.get("linear_value_head_dim") or 0)
    key_heads = int(config.get("linear_num_key_heads") or 0)
    kernel = int(config.get("linear_conv_kernel_dim") or 4)
    conv_channels = 2 * key_heads * key_dim + value_heads * value_dim
    return linear_layers * (value_heads * key_dim * value_dim * 4 + conv_channels * kernel * 2)


def forward_activation_bytes(config: dict[str, Any], tokens: int, dtype_bytes: int = 2, tp: int = 1) -> int:
    """Peak activations of one no-grad forward over `tokens` tokens (padding included): a layer's residual,
    norm output, projections and MLP intermediates live at once; layers free theirs before the next.
    Split over `tp` devices, each holds its share of the MLP intermediates; the residual stream and the
    layer outputs are whole on every device."""
    hidden = int(config["hidden_size"])
    intermediate = int(config.get("intermediate_size") or 4 * hidden)
    return tokens * (6 * hidden + 3 * intermediate // max(1, tp)) * dtype_bytes


def logits_bytes(config: dict[str, Any], tokens: int) -> int:
    """LM-head output for `tokens` positions, counted at 4 bytes a logit (bf16 logits and the working
    copies of the reduction over them)."""
    return tokens * int(config["vocab_size"]) * 4


def host_available_bytes() -> int:
    """Memory the host can still give (Linux `MemAvailable`), for runs on the CPU."""
    try:
        with open("/proc/meminfo") as meminfo:
            for line in meminfo:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")


def host_total_bytes() -> int:
    return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
