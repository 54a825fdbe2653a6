"""The drafter's weights as a safetensors file, written one tensor at a time.

`safetensors.torch.save_file` turns every tensor into bytes before it writes the first: the host holds
the weights twice over (a ~1.7 B drafter's float32 checkpoint is 6.8 GB, a copy of it on the host of a
node already full of ranks, every 30 minutes). Here each tensor goes to the host alone, is written, and is
let go; the file is the same layout `safetensors` reads (`load_file`, `safe_open`, the engines)."""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path

import torch

from dflash_assets.storage.safetensors_layout import TensorSpec, safetensors_header

SAFETENSORS_DTYPES = {
    torch.float64: "F64",
    torch.float32: "F32",
    torch.bfloat16: "BF16",
    torch.float16: "F16",
    torch.float8_e4m3fn: "F8_E4M3",
    torch.int64: "I64",
    torch.int32: "I32",
    torch.int16: "I16",
    torch.int8: "I8",
    torch.uint8: "U8",
    torch.bool: "BOOL",
}


def save_weights(
    tensors: Mapping[str, torch.Tensor],
    path: str | Path,
    *,
    dtype: torch.dtype | None = None,
    metadata: Mapping[str, str] | None = None,
) -> int:
    """Write `tensors` (on any device; cast to `dtype` when given) to `path`; returns the file's size.
    Wider elements come first, so every tensor starts aligned to its element size."""
    cast = {
        name: dtype if dtype is not None and t.is_floating_point() else t.dtype for name, t in tensors.items()
    }
    order = sorted(tensors, key=lambda name: (-_element_size(cast[name]), name))
    specs: list[TensorSpec] = []
    for name in order:
        tensor = tensors[name]
        if cast[name] not in SAFETENSORS_DTYPES:
            raise ValueError(f"weight {name} has dtype {cast[name]}, which safetensors has no name for")
        specs.append(
            (
                name,
                SAFETENSORS_DTYPES[cast[name]],
                list(tensor.shape),
                tensor.numel() * _element_size(cast[name]),
            )
        )
    header = safetensors_header(specs, dict(metadata or {}))
    with open(path, "wb") as file:
        file.write(header)
        for name in order:
            host = tensors[name].detach().to("cpu", cast[name]).contiguous()
            if host.numel():
                file.write(memoryview(host.reshape(-1).view(torch.uint8).numpy()).cast("B"))
            del host
    return Path(path).stat().st_size


def _element_size(dtype: torch.dtype) -> int:
    return torch.empty((), dtype=dtype).element_size()
