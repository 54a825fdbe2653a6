"""What one optimiser step measured, summed over the ranks; and the training loss and throughput over each
logging window and the whole run, with the log line."""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash_assets.drafter.evaluate import BlockMetrics
from dflash_assets.drafter.objective import BlockLossOutput, DrafterBatch


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


@dataclass
class StepStats:
    """One optimiser step over the whole global batch: each rank fills in its share, one all-reduce sums
    them (`pack` / `unpack`), so every rank knows the global loss normaliser and whether to skip."""

    weighted_ce_sum: float
    weight_sum: float
    correct: torch.Tensor  # [block_size - 1]
    counted: torch.Tensor  # [block_size - 1]
    accepted_sum: float
    num_blocks: int
    sequences: int
    tokens: int
    micro_batches: int
    nonfinite_ranks: int  # ranks whose loss was not finite: every rank skips the update
    checkpoint_due: bool  # rank 0's clock decides for all
    rank_seconds: list[float]  # each rank's compute time for the step (stragglers)

    @classmethod
    def local(
        cls,
        outputs: Sequence[tuple[BlockLossOutput, DrafterBatch]],
        *,
        block_size: int,
        rank: int,
        world_size: int,
        seconds: float,
        checkpoint_due: bool,
    ) -> StepStats:
        finite = [(o, b) for o, b in outputs if math.isfinite(float(o.loss.detach()))]
        correct = torch.zeros(block_size - 1, dtype=torch.float64)
        counted = torch.zeros(block_size - 1, dtype=torch.float64)
        for output, _ in finite:
            correct += output.correct.double()
            counted += output.counted.double()
        rank_seconds = [0.0] * world_size
        rank_seconds[rank] = seconds
        return cls(
            weighted_ce_sum=sum(o.weighted_ce_sum for o, _ in finite),
            weight_sum=sum(o.weight_sum for o, _ in finite),
            correct=correct,
            counted=counted,
            accepted_sum=sum(o.accepted_sum for o, _ in finite),
            num_blocks=sum(o.num_blocks for o, _ in finite),
            sequences=sum(len(b.sample_indices) for _, b in outputs),
            tokens=sum(b.num_tokens for _, b in outputs),
            micro_batches=len(outputs),
            nonfinite_ranks=int(len(finite) != len(outputs)),
            checkpoint_due=checkpoint_due,
            rank_seconds=rank_seconds,
        )

    def pack(self, device: torch.device) -> torch.Tensor:
        head = [
            self.weighted_ce_sum,
            self.weight_sum,
            self.accepted_sum,
            self.num_blocks,
            self.sequences,
            self.tokens,
            self.micro_batches,
            self.nonfinite_ranks,
            float(self.checkpoint_due),
        ]
        values = torch.tensor(head + self.rank_seconds, dtype=torch.float64)
        return torch.cat([values, self.correct.double(), self.counted.double()]).to(device)

    @classmethod
    def unpack(cls, packed: torch.Tensor, block_size: int, world_size: int) -> StepStats:
        values = packed.detach().cpu()
        head, rest = values[:9].tolist(), values[9:]
        seconds, correct, counted = torch.split(rest, [world_size, block_size - 1, block_size - 1])
        return cls(
            weighted_ce_sum=head[0],
            weight_sum=head[1],
            correct=correct.round().long(),
            counted=counted.round().long(),
            accepted_sum=head[2],
            num_blocks=round(head[3]),
            sequences=round(head[4]),
            tokens=round(head[5]),
            micro_batches=round(head[6]),
            nonfinite_ranks=round(head[7]),
            checkpoint_due=head[8] > 0,
            rank_seconds=seconds.tolist(),
        )

    @property
    def loss(self) -> float | None:
        return self.weighted_ce_sum / self.weight_sum if self.weight_sum > 0 else None


class TrainMetrics:
    """Training loss and throughput over the current logging window and over the whole run (global
    figures: every rank's share of every step)."""

    def __init__(self, block_size: int, start_step: int, total_steps: int, world_size: int = 1) -> None:
        self.block_size, self.start_step, self.total_steps = block_size, start_step, total_steps
        self.world_size = world_size
        self.run_started = time.monotonic()
        self.run_tokens = 0
        self.run_rank_seconds = [0.0] * world_size
        self.run_steps = 0
        self.last_window: dict[str, Any] = {}
        self._reset()

    def start_clock(self) -> None:
        """Rates and ETAs count from here: the first optimiser step, not the evaluation of the untrained
        weights before it (tens of seconds with the target, which made the first ETA read hours)."""
        self.run_started = self.window_started = time.monotonic()

    def _reset(self) -> None:
        self.window = BlockMetrics(self.block_size)
        self.window_started = time.monotonic()
        self.window_steps = 0
        self.window_micro_batches = 0

    def add_step(self, stats: StepStats) -> None:
        if stats.nonfinite_ranks == 0:
            self.window.add_totals(
                weighted_ce_sum=stats.weighted_ce_sum,
                weight_sum=stats.weight_sum,
                correct=stats.correct,
                counted=stats.counted,
                accepted_sum=stats.accepted_sum,
                num_blocks=stats.num_blocks,
                num_samples=stats.sequences,
                num_tokens=stats.tokens,
            )
            self.run_tokens += stats.tokens
        self.window_steps += 1
        self.window_micro_batches += stats.micro_batches
        self.run_steps += 1
        self.run_rank_seconds = [
            a + b for a, b in zip(self.run_rank_seconds, stats.rank_seconds, strict=True)
        ]

    def steps_per_second(self, step: int) -> float | None:
        """Optimiser steps per second in this run so far (None before its first step)."""
        elapsed = time.monotonic() - self.run_started
        done = step - self.start_step
        return done / elapsed if done > 0 and elapsed > 0 else None

    @property
    def tokens_per_second(self) -> float:
        """Tokens trained on per second, every rank's summed."""
        elapsed = time.monotonic() - self.run_started
        return self.run_tokens / elapsed if elapsed > 0 else 0.0

    @property
    def mean_rank_step_seconds(self) -> list[float]:
        """Each rank's mean compute time per step: a straggler shows as the largest."""
        return [seconds / max(1, self.run_steps) for seconds in self.run_rank_seconds]

    def report(self, step: int, epoch: int, epochs: int, lr: float) -> str:
        elapsed = time.monotonic() - self.window_started
        steps_done = step - self.start_step
        eta = (time.monotonic() - self.run_started) / max(1, steps_done) * (self.total_steps - step)
        loss = self.window.loss
        self.last_window = {
            "step": step,
            "loss": loss,
            "lr": lr,
            "tokens_per_second": self.window.num_tokens / elapsed if elapsed > 0 else 0.0,
            "sequences_per_second": self.window.num_samples / elapsed if elapsed > 0 else 0.0,
            "per_position_accuracy": self.window.per_position_accuracy,
            "teacher_forced_tau": self.window.teacher_forced_tau,
            "sequences_per_step": self.window.num_samples / max(1, self.window_steps),
            "micro_batches_per_step": self.window_micro_batches / max(1, self.window_steps),
            "eta_seconds": eta,
        }
        self._reset()
        loss_text = f"{loss:.4f}" if loss is not None else "n/a"
        ranks = f" over {self.world_size} ranks" if self.world_size > 1 else ""
        return (
            f"step {step}/{self.total_steps} epoch {epoch + 1}/{epochs} loss {loss_text} lr {lr:.2e} "
            f"{self.last_window['sequences_per_step']:.1f} sequences/step in "
            f"{self.last_window['micro_batches_per_step']:.1f} micro-batches{ranks}, "
            f"tokens/s {self.last_window['tokens_per_second']:,.0f} eta {_duration(eta)}"
        )
