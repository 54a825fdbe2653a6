"""The two ways of capturing hidden states every benchmark compares: the public pipelines' (full
forward with `output_hidden_states=True`, fixed batches in dataset order) and ours (length-bucketed
batches, early stop, extraction's own host transfer)."""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import nn

from dflash_assets.conversations.samples import TokenizedSample
from dflash_assets.extraction.capture import HiddenStateCapture
from dflash_assets.extraction.host_transfer import HostTransfer
from dflash_assets.target.batching import pad_batch, padding_fraction, plan_batches

ANCHOR_BATCH_SIZE = 8  # the public pipelines' way: fixed-size batches in dataset order


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def run_anchors_way(model: nn.Module, samples: Sequence[TokenizedSample], layer_ids: list[int]) -> float:
    """The public pipelines' capture: full forward, LM head included, `output_hidden_states=True`,
    fixed batches in dataset order, each sample's layers stacked and copied to the host. Returns the
    padding fraction."""
    device = next(model.parameters()).device
    with torch.inference_mode():
        for start in range(0, len(samples), ANCHOR_BATCH_SIZE):
            batch = samples[start : start + ANCHOR_BATCH_SIZE]
            input_ids, mask = pad_batch([s.input_ids for s in batch], 0)
            out = model(input_ids.to(device), attention_mask=mask.to(device), output_hidden_states=True)
            stacked = torch.stack([out.hidden_states[i + 1] for i in layer_ids], dim=2)
            for row, sample in enumerate(batch):
                stacked[row, : sample.num_tokens].to(torch.bfloat16).cpu()
            del out, stacked
    lengths = [s.num_tokens for s in samples]
    batches = [
        list(range(i, min(i + ANCHOR_BATCH_SIZE, len(samples))))
        for i in range(0, len(samples), ANCHOR_BATCH_SIZE)
    ]
    return padding_fraction(batches, lengths)


def run_capture(
    model: nn.Module, samples: Sequence[TokenizedSample], layer_ids: list[int], to_host: bool, budget: int
) -> float:
    """Ours, as extraction captures: length-bucketed batches, early stop; with `to_host` every batch
    also goes to the host through `HostTransfer`. Returns the padding fraction."""
    capture = HiddenStateCapture(model, layer_ids)
    transfer = HostTransfer(capture.device)
    lengths = [s.num_tokens for s in samples]
    batches = plan_batches(lengths, budget)
    pending = None
    for batch in batches:
        input_ids, mask = pad_batch([samples[i].input_ids for i in batch], 0)
        captured = capture(input_ids, mask)
        if to_host:
            started = transfer.start(captured, [lengths[i] for i in batch])
            if pending is not None:
                pending.wait()
            pending = started
        del captured
    if pending is not None:
        pending.wait()
    synchronize(capture.device)
    return padding_fraction(batches, lengths)
