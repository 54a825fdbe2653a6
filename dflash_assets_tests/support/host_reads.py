"""Test support: where code reads, on the host, a value computed on the device, counted on a CPU.

On a GPU each such read makes the host wait until the device has computed it (a sync): `float(t)`,
`t.item()`, `bool(t)` (an `if` on a tensor), `t.tolist()`, `t.cpu()`, and boolean-mask indexing or
`nonzero`, whose result size the host must learn. (`t.to("cpu")` is not told from a copy to the device
here, where both are the CPU.) On a CPU nothing waits, so `HostReads` tracks which
tensors would be on the device: the model's parameters and buffers, the tensors a test names, and every
tensor computed from them (in-place updates included); then it notes each read of one. `t.cpu()` of such a
tensor is a read, and what it returns is on the host: reading that afterwards is free, as on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_flatten
from torch.utils.weak import WeakTensorKeyDictionary

# Methods and functions that hand the host a device value (or make it learn a device-dependent size).
_READS = {
    "item",
    "tolist",
    "__float__",
    "__int__",
    "__bool__",
    "__index__",
    "numpy",
    "cpu",
    "nonzero",
    "argwhere",
    "masked_select",
    "unique",
}
_INDEXING = {"__getitem__", "__setitem__", "index_put_", "index_put"}


def _caller() -> str:
    """The innermost frame outside torch and this module: the code that read."""
    import traceback

    for frame in reversed(traceback.extract_stack()[:-2]):
        if "/torch/" not in frame.filename and not frame.filename.endswith("host_reads.py"):
            return f"{frame.filename}:{frame.lineno} {frame.line}"
    return "?"


def _name(func: Any) -> str:
    return getattr(func, "__name__", str(func))


class HostReads(TorchFunctionMode):
    """Inside: every read on the host of a device-side tensor is appended to `reads` (the function's
    name), e.g. `["__float__", "cpu"]`."""

    def __init__(self, device_tensors: Iterable[torch.Tensor] = (), modules: Iterable[torch.nn.Module] = ()):
        super().__init__()
        self._device = WeakTensorKeyDictionary()
        for tensor in device_tensors:
            self._device[tensor] = True
        for module in modules:
            for tensor in [*module.parameters(), *module.buffers()]:
                self._device[tensor] = True
        self.reads: list[str] = []
        self.where: list[str] = []  # the line of code behind each read, for a failing test's message

    def _on_device(self, value: Any) -> bool:
        return isinstance(value, torch.Tensor) and value in self._device

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        kwargs = kwargs or {}
        name = _name(func)
        inputs, _ = tree_flatten((args, kwargs))
        from_device = any(self._on_device(value) for value in inputs)
        bool_index = name in _INDEXING and any(
            isinstance(value, torch.Tensor) and value.dtype == torch.bool for value in inputs[1:]
        )
        if from_device and (name in _READS or bool_index):
            self.reads.append(name if not bool_index else f"{name} with a boolean mask")
            self.where.append(_caller())
        result = func(*args, **kwargs)
        if name == "cpu" and isinstance(result, torch.Tensor):
            # A copy on the host (on a CPU, the same tensor: it counts as the host's from now on).
            self._device.pop(result, None)
        elif from_device and name not in ("tolist", "item"):
            outputs, _ = tree_flatten(result)
            for value in outputs:
                if isinstance(value, torch.Tensor):
                    self._device[value] = True
            # In place: the updated tensor now holds device values too.
            if (name.endswith("_") or name.startswith("__i")) and isinstance(args[0], torch.Tensor):
                self._device[args[0]] = True
        return result
