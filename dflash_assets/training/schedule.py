"""The optimiser (AdamW, no decay on norms) and the learning-rate schedule (warm-up, then decay).

`wsd` (warm-up, stable, decay) holds the peak rate after warm-up and decays linearly to `min_lr_ratio`
over the last `lr_decay_ratio` of the run. Trained until flat, the trainer moves the decay to where the
held-rate curve went flat (`train.py`): a cosine to the cap reaches zero at the cap, so its curve
flattens there whatever the data still holds, and "flat" would only find the schedule's end.
"""

from __future__ import annotations

import math

import torch

from dflash_assets.drafter.model import DFlashDrafter
from dflash_assets.training.settings import TrainSettings


def build_optimizer(model: DFlashDrafter, settings: TrainSettings) -> torch.optim.AdamW:
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [
        {"params": decay, "weight_decay": settings.weight_decay},
        {"params": no_decay, "weight_decay": 0.0},
    ]
    # The fused kernel updates every parameter in one pass where torch has one for the device (CPU, CUDA):
    # the per-tensor loop spent a tenth of a SmolLM2 drafter's CPU step on the update alone.
    devices = {p.device.type for p in decay + no_decay}  # trained parameters: floating point already
    fused = bool(devices) and devices <= {"cpu", "cuda"}
    return torch.optim.AdamW(
        groups, lr=settings.lr, betas=settings.betas, eps=settings.adam_eps, fused=fused or None
    )


def warmup_steps(total_steps: int, settings: TrainSettings) -> int:
    return max(1, math.ceil(settings.warmup_ratio * total_steps)) if settings.warmup_ratio > 0 else 0


def decay_start(total_steps: int, settings: TrainSettings) -> int:
    """`wsd`: the step its decay starts at when the run goes to `total_steps` (the last `lr_decay_ratio`
    of them, never inside the warm-up)."""
    length = max(1, math.ceil(settings.lr_decay_ratio * total_steps))
    return max(warmup_steps(total_steps, settings), total_steps - length)


def decay_length(flat_at: int, settings: TrainSettings) -> int:
    """`wsd` until flat: the steps of a decay started at step `flat_at`, so that the decay is
    `lr_decay_ratio` of the whole run, as it is when the run goes to its cap."""
    return max(1, math.ceil(flat_at * settings.lr_decay_ratio / (1 - settings.lr_decay_ratio)))


def lr_factor(
    step: int, total_steps: int, settings: TrainSettings, decay: tuple[int, int] | None = None
) -> float:
    """Multiplier of `settings.lr` for the update after `step` updates: linear warmup, then decay.
    `decay` (`wsd` only): (the step the decay starts at, the step it ends at) where not the cap's
    (`decay_start` to `total_steps`); the rate stays at its floor after it."""
    warmup = warmup_steps(total_steps, settings)
    if step < warmup:
        return (step + 1) / warmup
    if settings.lr_schedule == "constant":
        return 1.0
    if settings.lr_schedule == "wsd":
        start, end = decay or (decay_start(total_steps, settings), total_steps)
        if step < start:
            return 1.0
        progress = min(1.0, (step - start) / max(1, end - start))
        return settings.min_lr_ratio + (1 - settings.min_lr_ratio) * (1 - progress)
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if settings.lr_schedule == "cosine" else 1 - progress
    return settings.min_lr_ratio + (1 - settings.min_lr_ratio) * shape
