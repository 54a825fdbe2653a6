"""Test support: the drafter's flex attention compiled on the CPU, as a GPU compiles it, so a test can count
what torch.compile makes of the shapes training meets.

`aot_eager` traces exactly what Inductor would be handed (dynamo's guards, and so its versions, are the
same), then runs the traced graph eagerly. torch refuses flex attention's backward on the CPU only because
its reference implementation is slow, so that check is lifted for the test's duration.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import pytest
import torch


@contextmanager
def flex_compiled_on_cpu(monkeypatch: pytest.MonkeyPatch, *, recompile_limit: int = 8) -> Iterator[None]:
    """Inside: the drafter's flex path on the CPU compiles (`aot_eager`) from a fresh dynamo cache, and
    reaching `recompile_limit` versions of one function is an error rather than a silent fallback to
    uncompiled flex attention (the full score matrix)."""
    import torch.nn.attention.flex_attention as flex_module

    import dflash_assets.drafter.model as model_module

    monkeypatch.setattr(model_module, "FLEX_COMPILED_DEVICES", {"cuda", "cpu"})
    monkeypatch.setattr(model_module, "FLEX_COMPILE_BACKEND", "aot_eager")
    monkeypatch.setattr(model_module, "_compiled_flex", {})
    monkeypatch.setattr(flex_module, "_validate_device", lambda query, key, value: None)
    torch._dynamo.reset()
    torch._dynamo.utils.counters.clear()
    try:
        with torch._dynamo.config.patch(recompile_limit=recompile_limit, fail_on_recompile_limit_hit=True):
            yield
    finally:
        torch._dynamo.reset()


def compiled_graphs() -> int:
    """Graphs dynamo has compiled since `flex_compiled_on_cpu` began: one per version of each function."""
    return int(torch._dynamo.utils.counters["stats"]["unique_graphs"])
