"""z-lab's `dflash` package (0.1.0 on PyPI) as the tests drive it: the real client of the export, its own
`from_pretrained` and `dflash_generate`, installed by `scripts/setup.sh` for the tests only.

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
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import torch
from torch import nn


@contextlib.contextmanager
def _runnable_here(block_size: int) -> Iterator[object]:
    import dflash.model as zlab
    from transformers import DynamicCache

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
    import json

    from dflash import DFlash2DraftModel, DFlashDraftModel

    architecture = json.loads((Path(directory) / "config.json").read_text())["architectures"][0]
    cls = {"DFlashDraftModel": DFlashDraftModel, "DFlash2DraftModel": DFlash2DraftModel}[architecture]
    model, info = cls.from_pretrained(str(directory), output_loading_info=True, dtype=dtype)
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
