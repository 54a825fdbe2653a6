"""The target's bf16 LM head applied on a CPU without bf16 matrix units, through float32 tiles.

PyTorch multiplies bf16 matrices on a CPU with oneDNN where the CPU has AVX-512 (or AMX); elsewhere (an
AVX2-only host) it falls back to its reference kernel (`cpublas_gemm_impl`), which on such a host ran
~5 GFLOP/s for `x @ W.T` and ~0.2 GFLOP/s for `g @ W`, the backward through the head: one training step
at a 248 K vocabulary took over ten minutes there. `bf16_linear` computes the same product (bf16 inputs,
float32 accumulation, a bf16 result) with float32 GEMMs over slices of the weight, a slice's float32
copy at a time (`TILE_ROWS` rows: 160 MiB at a 5,120 width), so the weight stays bf16 in memory. Where
PyTorch has a bf16 kernel (CUDA, oneDNN) it is plain `F.linear`.
"""

from __future__ import annotations

import functools

import torch
import torch.nn.functional as F

TILE_ROWS = 8192  # weight rows converted to float32 at a time


@functools.cache
def cpu_has_bf16_matmul() -> bool:
    """Whether PyTorch multiplies bf16 matrices on this CPU with oneDNN (not its reference kernel)."""
    try:
        return bool(torch.ops.mkldnn._is_mkldnn_bf16_supported())
    except (AttributeError, RuntimeError):  # a build without oneDNN: the reference kernel
        return False


def runs_through_float32_tiles(weight: torch.Tensor) -> bool:
    return weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and not cpu_has_bf16_matmul()


def bf16_linear(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """`F.linear(hidden.to(weight.dtype), weight)`: `[..., D] x [V, D] -> [..., V]`, through float32
    tiles where `runs_through_float32_tiles(weight)`, with the same gradients."""
    hidden = hidden.to(weight.dtype)
    if not runs_through_float32_tiles(weight):
        return F.linear(hidden, weight)
    shape = hidden.shape
    return _TiledLinear.apply(hidden.reshape(-1, shape[-1]), weight).reshape(*shape[:-1], weight.shape[0])


class _TiledLinear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:  # noqa: ANN001
        ctx.save_for_backward(hidden, weight)
        wide = hidden.float()
        out = torch.empty(hidden.shape[0], weight.shape[0], dtype=weight.dtype)
        for start in range(0, weight.shape[0], TILE_ROWS):
            tile = weight[start : start + TILE_ROWS].float()
            out[:, start : start + tile.shape[0]] = wide @ tile.T
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor) -> tuple[torch.Tensor | None, torch.Tensor | None]:  # noqa: ANN001
        hidden, weight = ctx.saved_tensors
        grad_hidden = grad_weight = None
        if ctx.needs_input_grad[0]:
            total = torch.zeros(hidden.shape, dtype=torch.float32)  # accumulated in float32, rounded once
            for start in range(0, weight.shape[0], TILE_ROWS):
                rows = slice(start, start + TILE_ROWS)
                total += grad[:, rows].float() @ weight[rows].float()
            grad_hidden = total.to(hidden.dtype)
        if ctx.needs_input_grad[1]:  # the LM head is frozen in training; here for completeness
            wide = hidden.float()
            grad_weight = torch.empty_like(weight)
            for start in range(0, weight.shape[0], TILE_ROWS):
                rows = slice(start, start + TILE_ROWS)
                grad_weight[rows] = grad[:, rows].float().T @ wide
        return grad_hidden, grad_weight
