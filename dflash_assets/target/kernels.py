"""Which kernels a target's forward runs on, so a slow fallback is said out loud instead of suspected.

Hybrid targets (Qwen3.5/3.6, Qwen3-Next: gated-delta-net layers beside full attention) take their
linear-attention kernels from optional packages. transformers picks them when its modeling module is
imported: since 5.16 each kernel function (`chunk_gated_delta_rule`, `causal_conv1d_fn`) is wrapped by
`use_kernel_func_from_hub_with_fallback`, which imports `fla` / `causal_conv1d` and keeps the found
implementation in the wrapper's closure, else a pure-PyTorch one (and logs once that it fell back); where
the `kernels` package is installed, that wrapper sits inside a `Func` module;
earlier releases stored the chosen function on each layer (`self.chunk_gated_delta_rule`,
`self.causal_conv1d_fn`). Installing the `gpu` extra is all it takes; nothing needs to be switched on.
The PyTorch fallback is correct but slow: on an H200, a Qwen3.6-27B-shaped target captured 1.47x
faster with flash-linear-attention installed.
"""

from __future__ import annotations

import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

FALLBACK = "PyTorch fallback"
GPU_EXTRA_INSTALL = (
    "pip install -e '.[gpu]' (flash-linear-attention, causal-conv1d) beside a CUDA build of torch"
)
# Package (import name) -> what to install; the roots transformers imports the fast kernels from.
_FAST_PACKAGES = {"fla": "flash-linear-attention", "causal_conv1d": "causal-conv1d"}
# Kernel -> the names modeling files have given it (module-level wrapper, or attribute on the layer).
_KERNELS = {
    "chunk_gated_delta_rule": ("torch_chunk_gated_delta_rule", "chunk_gated_delta_rule"),
    "causal_conv1d_fn": ("causal_conv1d_fn",),
}


@dataclass(frozen=True)
class KernelPaths:
    """What a target's forward runs on: its attention implementation, and per linear-attention kernel of
    a hybrid target the package it comes from (or `FALLBACK`)."""

    model_type: str
    attention: str
    gated_delta_net_layers: int = 0
    linear_attention: dict[str, str] = field(default_factory=dict)

    @property
    def hybrid(self) -> bool:
        return self.gated_delta_net_layers > 0

    @property
    def fallbacks(self) -> list[str]:
        """Linear-attention kernels running on the PyTorch fallback."""
        return [name for name, origin in self.linear_attention.items() if origin == FALLBACK]

    def describe(self) -> str:
        text = f"kernels: {self.model_type} attention={self.attention}"
        if self.hybrid:
            kernels = ", ".join(f"{name}={origin}" for name, origin in self.linear_attention.items())
            text += f"; {self.gated_delta_net_layers} gated-delta-net layers: {kernels}"
        return text


def kernel_paths(model: nn.Module) -> KernelPaths:
    """The kernel paths of `model` as loaded now (the modeling module's choice is fixed at import)."""
    config = getattr(model, "config", None)
    text = getattr(config, "text_config", None) or config
    model_type = str(getattr(text, "model_type", None) or type(model).__name__)
    attention = str(
        getattr(text, "_attn_implementation", None)
        or getattr(config, "_attn_implementation", None)
        or "unknown"
    )
    layers = [m for m in model.modules() if type(m).__name__.endswith("GatedDeltaNet")]
    if not layers:
        return KernelPaths(model_type, attention)
    return KernelPaths(
        model_type,
        attention,
        gated_delta_net_layers=len(layers),
        linear_attention={name: _origin(_kernel_of(layers[0], names)) for name, names in _KERNELS.items()},
    )


def fallback_warning(paths: KernelPaths, device: str | torch.device) -> str | None:
    """What to tell the user when a CUDA run of a hybrid target is on the slow fallback; else None."""
    if torch.device(device).type != "cuda" or not paths.fallbacks:
        return None
    missing = sorted({_PACKAGE_OF_KERNEL[name] for name in paths.fallbacks})
    return (
        f"the target's {paths.gated_delta_net_layers} gated-delta-net layers run "
        f"{', '.join(paths.fallbacks)} on transformers' {FALLBACK} on {device} because "
        f"{' and '.join(missing)} {'is' if len(missing) == 1 else 'are'} not installed: correct but slow "
        f"(an H200 captured a 27B-shaped hybrid target 1.47x faster with the kernels). Install them: "
        f"{GPU_EXTRA_INSTALL}"
    )


def report_kernel_paths(
    model: nn.Module,
    device: str | torch.device,
    log: Callable[[str], None],
    warn: Callable[[str], None] | None = None,
) -> KernelPaths:
    """Log which kernel path `model` runs on, and warn when a CUDA run of a hybrid target falls back.

    Called by extraction; online training calls it for its target replicas."""
    paths = kernel_paths(model)
    log(f"{device}: {paths.describe()}")
    message = fallback_warning(paths, device)
    if message is not None:
        (warn or (lambda text: log(f"WARNING: {text}")))(message)
    return paths


_PACKAGE_OF_KERNEL = {"chunk_gated_delta_rule": "flash-linear-attention", "causal_conv1d_fn": "causal-conv1d"}


def _kernel_of(layer: nn.Module, names: tuple[str, ...]) -> Any:
    """The function `layer` calls for a kernel: a per-layer attribute (older transformers), else the
    modeling module's global. None: the layer has no such kernel (and runs plain torch instead)."""
    for name in names:
        if name in vars(layer):
            return vars(layer)[name]
    module = sys.modules.get(type(layer).__module__)
    for name in names:
        if module is not None and hasattr(module, name):
            return getattr(module, name)
    return None


def _origin(function: Any) -> str:
    """The package a kernel function comes from, looking through transformers' fallback wrapper."""
    if function is None:
        return FALLBACK
    # With the `kernels` package installed, the wrapper is itself wrapped: a `Func` module whose forward
    # calls it (`func` in the forward's closure).
    if isinstance(function, nn.Module):
        function = _closure_value(type(function).forward, "func") or function
    chosen = _closure_value(function, "implementation")
    if chosen is not None:
        function = chosen
    root = (getattr(function, "__module__", None) or "").split(".")[0]
    if root in _FAST_PACKAGES:
        return _FAST_PACKAGES[root]
    if root == "transformers" or not root:
        return FALLBACK
    return root  # e.g. a kernel from the Hugging Face kernels hub


def _closure_value(function: Any, name: str) -> Any:
    code = getattr(function, "__code__", None)
    closure = getattr(function, "__closure__", None)
    if code is None or not closure or name not in code.co_freevars:
        return None
    try:
        return closure[code.co_freevars.index(name)].cell_contents
    except ValueError:  # an empty cell
        return None
