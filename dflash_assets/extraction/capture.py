"""Capturing the raw outputs of chosen target decoder layers, stopping the forward after the last one.

"Layer i" is the raw output of decoder layer i (0-based) = Hugging Face `output_hidden_states[i + 1]`.
The forward never reaches later layers, the final norm or the LM head, so no logits are ever computed.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from dflash_assets.target.devices import torch_device

LAYER_IDS_SETTING = "DFLASH_TARGET_LAYER_IDS"
MODEL_SETTING = "DFLASH_TARGET_MODEL"


class TargetModelError(ValueError):
    """The target model directory cannot be loaded."""


def dflash_target_layer_ids(num_hidden_layers: int, num_draft_layers: int = 5) -> list[int]:
    """DFlash's rule: k layers evenly spaced from layer 1 to N-3, `round(1 + i*(N-4)/(k-1))`, and the
    middle layer `N // 2` for k = 1.

    Python's `round` (half to even) on the same float expression as z-lab/dflash, SGLang and vLLM, so a
    drafter trained here reads the layers the engines capture: N=64, k=5 -> [1, 16, 31, 46, 61];
    N=10, k=5 -> [1, 2, 4, 6, 7] (2.5 and 5.5 round to even).
    """
    if num_draft_layers < 1:
        raise ValueError(f"num_draft_layers must be >= 1, got {num_draft_layers}")
    if num_draft_layers == 1:
        ids = [num_hidden_layers // 2]
    else:
        span = num_hidden_layers - 4
        ids = [int(round(1 + (i * span) / (num_draft_layers - 1))) for i in range(num_draft_layers)]
    if any(b <= a for a, b in zip(ids, ids[1:], strict=False)) or ids[-1] >= num_hidden_layers or ids[0] < 0:
        raise ValueError(
            f"a model with {num_hidden_layers} decoder layers is too shallow for {num_draft_layers} evenly "
            f"spaced target layers (the rule gives {ids}); set {LAYER_IDS_SETTING} explicitly or use fewer "
            "draft layers"
        )
    return ids


def parse_layer_ids(text: str) -> list[int]:
    """`"1,16,31"`, `"1 16 31"` or `"[1, 16, 31]"` -> `[1, 16, 31]`."""
    stripped = text.strip()
    if stripped.startswith("[") and stripped.endswith("]"):
        stripped = stripped[1:-1]
    parts = [part for part in re.split(r"[,\s]+", stripped) if part]
    if not parts:
        raise ValueError(f"{LAYER_IDS_SETTING}={text!r} names no layers; expected e.g. '1,16,31,46,61'")
    try:
        return [int(part) for part in parts]
    except ValueError:
        raise ValueError(
            f"{LAYER_IDS_SETTING}={text!r} is not a list of integers; expected e.g. '1,16,31,46,61'"
        ) from None


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


def resolve_target_layer_ids(
    model_config: Any, explicit: Sequence[int] | None, num_draft_layers: int = 5
) -> list[int]:
    """The layers to capture, checked against the model's depth before anything touches a device.

    `model_config` is a transformers config or the parsed `config.json` dict.
    """
    num_layers = num_decoder_layers(model_config)
    if explicit is None:
        return dflash_target_layer_ids(num_layers, num_draft_layers)
    layer_ids = [int(i) for i in explicit]
    if not layer_ids:
        raise ValueError(f"{LAYER_IDS_SETTING} names no layers")
    for layer_id in layer_ids:
        if not 0 <= layer_id < num_layers:
            raise ValueError(
                f"{LAYER_IDS_SETTING} names layer {layer_id}, but the target model has {num_layers} decoder "
                f"layers (valid ids 0..{num_layers - 1}; layer i is the raw output of decoder layer i)"
            )
    for previous, current in zip(layer_ids, layer_ids[1:], strict=False):
        if current <= previous:
            raise ValueError(
                f"{LAYER_IDS_SETTING}={layer_ids} must be strictly increasing without repeats (layer "
                f"{current} follows {previous}): the stored [:, j] order is the layer order, and the "
                "drafter's input width counts each layer once"
            )
    return layer_ids


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


class _StopForward(Exception):
    """Raised by the hook on the last needed layer so the forward goes no further."""


class HiddenStateCapture:
    """`capture(input_ids [B, T], attention_mask [B, T]) -> [B, T, K, H]`, in the model's dtype.

    Forward hooks copy each chosen layer's output into one preallocated buffer; the hook on the last
    chosen layer then raises, so later layers, the final norm and the LM head never run. Hooks are
    attached only for the duration of a call, so the model stays usable elsewhere.
    """

    def __init__(self, model: nn.Module, target_layer_ids: Sequence[int]) -> None:
        self.model = model
        self.base_model, self.layers = find_decoder(model)
        self.target_layer_ids = resolve_target_layer_ids(
            {"num_hidden_layers": len(self.layers)}, list(target_layer_ids)
        )
        self.hidden_size = hidden_size_of(model.config)

    @property
    def device(self) -> torch.device:
        return next(self.base_model.parameters()).device

    @property
    def dtype(self) -> torch.dtype:
        embeddings = self.base_model.get_input_embeddings()
        return embeddings.weight.dtype if embeddings is not None else next(self.base_model.parameters()).dtype

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        if input_ids.ndim != 2 or attention_mask.shape != input_ids.shape:
            raise ValueError(
                f"expected input_ids and attention_mask of the same shape [B, T], got "
                f"{tuple(input_ids.shape)} and {tuple(attention_mask.shape)}"
            )
        device = self.device
        batch, length = input_ids.shape
        # Allocated outside inference mode (and filled in place inside it), so the result is an ordinary
        # tensor that online training can feed to modules that save inputs for backward.
        captured = torch.empty(
            (batch, length, len(self.target_layer_ids), self.hidden_size), dtype=self.dtype, device=device
        )
        last = self.target_layer_ids[-1]
        seen: list[int] = []

        def make_hook(slot: int, layer_id: int):
            def hook(module: nn.Module, args: Any, output: Any) -> None:
                hidden = output[0] if isinstance(output, tuple | list) else output
                captured[:, :, slot].copy_(hidden)
                seen.append(layer_id)
                if layer_id == last:
                    raise _StopForward

            return hook

        handles = [
            self.layers[layer_id].register_forward_hook(make_hook(slot, layer_id))
            for slot, layer_id in enumerate(self.target_layer_ids)
        ]
        try:
            with torch.inference_mode():
                self.base_model(
                    input_ids=_to_device(input_ids, device),
                    attention_mask=_to_device(attention_mask, device),
                    use_cache=False,
                )
        except _StopForward:
            pass
        finally:
            for handle in handles:
                handle.remove()
        if seen != self.target_layer_ids:
            raise RuntimeError(
                f"captured layers {seen}, expected {self.target_layer_ids}: the model's forward did not run "
                "its decoder layers in order"
            )
        return captured


def _to_device(tensor: torch.Tensor, device: torch.device) -> torch.Tensor:
    # A plain copy from pageable host memory makes the host wait for the device's queue to drain, which
    # would stall the overlap of this forward with the previous batch's copy back; pinned memory doesn't.
    if device.type == "cuda" and tensor.device.type == "cpu":
        return tensor.pin_memory().to(device, non_blocking=True)
    return tensor.to(device)


class ReplicatedCapture:
    """The target on several devices feeding one trainer (online training: the seeds ran 7 target GPUs
    beside 1 drafter GPU). A batch's rows are split into one contiguous chunk per replica, the replicas
    run concurrently (each on its own device, so threads overlap), and the results are gathered on
    `output_device` in the original row order."""

    def __init__(self, captures: Sequence[HiddenStateCapture], output_device: str | torch.device) -> None:
        if not captures:
            raise ValueError("ReplicatedCapture needs at least one target replica")
        self.captures = list(captures)
        self.output_device = torch.device(output_device)
        self.target_layer_ids = self.captures[0].target_layer_ids
        self.hidden_size = self.captures[0].hidden_size

    def __call__(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        from concurrent.futures import ThreadPoolExecutor

        chunks = [
            (capture, ids, mask)
            for capture, ids, mask in zip(
                self.captures,
                torch.tensor_split(input_ids, len(self.captures)),
                torch.tensor_split(attention_mask, len(self.captures)),
                strict=True,
            )
            if ids.shape[0] > 0
        ]
        if len(chunks) == 1:
            capture, ids, mask = chunks[0]
            return capture(ids, mask).to(self.output_device)
        with ThreadPoolExecutor(max_workers=len(chunks), thread_name_prefix="target-replica") as pool:
            futures = [pool.submit(capture, ids, mask) for capture, ids, mask in chunks]
            return torch.cat([future.result().to(self.output_device) for future in futures])
