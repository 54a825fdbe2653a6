"""z-lab's `dflash` package (0.1.0 on PyPI), the real client of an export: its own `from_pretrained` and
`dflash_generate`, run beside the product's loop by the tests and the benchmark scripts. Never a dependency
of the product: `scripts/setup.sh` installs it, and it is imported only when one of these is called.

Two things it cannot do on this machine as shipped, and what is given to it instead (nothing else):
- `dflash_generate(..., return_stats=True)` times itself with `torch.cuda.synchronize()`, which a CPU
  build of torch refuses: its timer is a plain `time.perf_counter` here.
- Its cache calls `activate_past_recording()` without a count; transformers 5.25's gated-delta-net layers
  (Qwen3.5/3.6, the demo target) then fail with a `None` where the number of recurrent states to keep
  goes. The cache is made the same way with that count, the block size, so its `crop` rolls a hybrid
  target back exactly as the package intends.
"""

from __future__ import annotations

import contextlib
import importlib.util
import json
import time
from collections.abc import Iterator, Sequence
from pathlib import Path
from types import ModuleType

import torch
from torch import nn

ZLAB_PACKAGE = "dflash==0.1.0"


class ZlabMissing(RuntimeError):
    """z-lab's `dflash` package is not installed: one line naming the command that installs it."""


def require_zlab() -> None:
    """Raise `ZlabMissing` unless z-lab's `dflash` package can be imported."""
    if importlib.util.find_spec("dflash") is None:
        raise ZlabMissing(
            "z-lab's `dflash` package is not installed: run "
            f"`python -m pip install --no-deps {ZLAB_PACKAGE}` (scripts/setup.sh installs it)"
        )


def _zlab_model() -> ModuleType:
    require_zlab()
    import dflash.model

    return dflash.model


@contextlib.contextmanager
def _runnable_here(block_size: int) -> Iterator[ModuleType]:
    from transformers import DynamicCache

    zlab = _zlab_model()

    def make_cache(config: object) -> DynamicCache:
        cache = DynamicCache(config=config)
        cache.activate_past_recording(recurrent_states_to_keep=block_size)
        return cache

    saved = zlab._cuda_time, zlab._make_cache
    zlab._cuda_time, zlab._make_cache = time.perf_counter, make_cache
    try:
        yield zlab
    finally:
        zlab._cuda_time, zlab._make_cache = saved


def load_zlab_drafter(
    directory: str | Path, *, device: str = "cpu", dtype: torch.dtype = torch.float32
) -> tuple[nn.Module, dict]:
    """The export as z-lab's own class for its architecture loads it, on `device` in `dtype` (the target's:
    the drafter reads its hidden states): (model, loading info)."""
    zlab = _zlab_model()
    architecture = json.loads((Path(directory) / "config.json").read_text())["architectures"][0]
    classes = {"DFlashDraftModel": zlab.DFlashDraftModel, "DFlash2DraftModel": zlab.DFlash2DraftModel}
    model, info = classes[architecture].from_pretrained(str(directory), output_loading_info=True, dtype=dtype)
    return model.to(device).eval(), info


def zlab_generate(
    drafter: nn.Module,
    target: nn.Module,
    prompt: Sequence[int],
    max_new_tokens: int,
    stop: Sequence[int] = (),
) -> tuple[list[int], list[int]]:
    """(tokens after the prompt, tokens produced per verification round) from `dflash_generate`, greedy."""
    with _runnable_here(drafter.block_size) as zlab:
        out = zlab.dflash_generate(
            drafter,
            target,
            torch.tensor([list(prompt)], device=next(target.parameters()).device),
            max_new_tokens,
            list(stop) or None,
            return_stats=True,
        )
    return out.output_ids[0, len(prompt) :].tolist(), list(out.acceptance_lengths)
