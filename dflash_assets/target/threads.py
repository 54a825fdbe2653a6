"""How many CPU threads the target decodes with: one, for a model too small to share an operator.

Decoding (regeneration's `generate`, speculative decoding's verification) runs one short forward after
another, each a few hundred operators on tensors of a few rows. For a model as small as the demo target
(hidden size 64) a second intra-op thread only adds a hand-over to every operator: on a 2-core machine,
one demo range regenerated in 6.1 s on one thread, 7.0 s on two spinning (the second core burnt
throughout) and 14.5 s on two whose idle thread sleeps (docs/testing.md). Training's larger operators do
gain from the second thread, so the count is changed only around decoding and given back after it.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dflash_assets.target.model import config_value, text_config

# Below this hidden size an operator's work is smaller than a thread hand-over (the demo target: 64;
# a 0.6 B model's 1024 is well above it, and keeps every thread).
SMALL_HIDDEN_SIZE = 256


def decodes_on_one_thread(model: Any) -> bool:
    """Whether `model` decodes on one CPU thread: it is on the CPU and its hidden size is small."""
    try:
        device = next(model.parameters()).device
    except (AttributeError, StopIteration):
        return False
    hidden = config_value(text_config(getattr(model, "config", None)), "hidden_size")
    return device.type == "cpu" and isinstance(hidden, int) and hidden < SMALL_HIDDEN_SIZE


@contextlib.contextmanager
def decoding_threads(model: Any) -> Iterator[None]:
    """One intra-op thread inside the block where `decodes_on_one_thread(model)`, the count before after."""
    if not decodes_on_one_thread(model):
        yield
        return
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        yield
    finally:
        torch.set_num_threads(threads)
