"""Quiet CPU runs: transformers' notice that a CUDA-only kernel package is missing, dropped for calls on
the CPU.

Since 5.16 transformers wraps each linear-attention kernel of hybrid targets (`chunk_gated_delta_rule`,
`causal_conv1d_fn`, ...) in `integrations.hub_kernels.use_kernel_func_from_hub_with_fallback`, whose
wrapper logs once per kernel, at its first call, "`<kernel>` is falling back to its reference PyTorch
implementation because `<package>` is not installed". flash-linear-attention and causal-conv1d are CUDA
kernels: on a CPU the reference implementation is the only one there is, and the notice is noise in
every demo and test run. On a CUDA device it matters, and stays (beside the project's own kernel-path
warning, `kernels.fallback_warning`).

The filter sits on that one logger, matches that one notice, and looks at the tensors the wrapper was
called with (its frame is on the stack while it logs): it drops the notice only when every tensor
argument is on the CPU. Anything else transformers logs is untouched. Torch-free at import (the package
`__init__` installs it), so the Dagster layer's import rule holds.
"""

from __future__ import annotations

import logging
import sys

HUB_KERNELS_LOGGER = "transformers.integrations.hub_kernels"
FALLBACK_NOTICE = "is falling back to its reference PyTorch implementation"
_WRAPPER = "wrapped"  # the function `use_kernel_func_from_hub_with_fallback` returns, which logs


def _wrapper_tensors() -> list | None:
    """The tensor arguments of the kernel wrapper that is logging now; None if it is not on the stack."""
    frame = sys._getframe(1)
    while frame is not None:
        if frame.f_code.co_name == _WRAPPER and frame.f_globals.get("__name__") == HUB_KERNELS_LOGGER:
            import torch  # loaded already: the wrapper is running a torch kernel

            arguments = [*frame.f_locals.get("args", ()), *frame.f_locals.get("kwargs", {}).values()]
            return [value for value in arguments if isinstance(value, torch.Tensor)]
        frame = frame.f_back
    return None


class CpuKernelFallbackFilter(logging.Filter):
    """Drops transformers' kernel-fallback notice when the kernel was called with CPU tensors only."""

    def filter(self, record: logging.LogRecord) -> bool:
        try:
            if FALLBACK_NOTICE not in record.getMessage():
                return True
            tensors = _wrapper_tensors()
        except Exception:  # never lose a log record to this filter
            return True
        if not tensors:  # not called from the wrapper, or without tensors: cannot tell, keep it
            return True
        return not all(tensor.device.type == "cpu" for tensor in tensors)


def quiet_cpu_kernel_fallbacks() -> None:
    """Install the filter on transformers' kernel logger (once per process)."""
    logger = logging.getLogger(HUB_KERNELS_LOGGER)
    if not any(isinstance(f, CpuKernelFallbackFilter) for f in logger.filters):
        logger.addFilter(CpuKernelFallbackFilter())
