"""The optimiser (AdamW, no decay on norms) and the learning-rate schedule (warm-up, then decay)."""

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


def lr_factor(step: int, total_steps: int, settings: TrainSettings) -> float:
    """Multiplier of `settings.lr` for the update after `step` updates: linear warmup, then decay."""
    warmup = max(1, math.ceil(settings.warmup_ratio * total_steps)) if settings.warmup_ratio > 0 else 0
    if step < warmup:
        return (step + 1) / warmup
    if settings.lr_schedule == "constant":
        return 1.0
    progress = min(1.0, (step - warmup) / max(1, total_steps - warmup))
    shape = 0.5 * (1 + math.cos(math.pi * progress)) if settings.lr_schedule == "cosine" else 1 - progress
    return settings.min_lr_ratio + (1 - settings.min_lr_ratio) * shape
