"""Training loss and throughput over each logging window and the whole run, and the log line."""

from __future__ import annotations

import time
from typing import Any

from dflash_assets.drafter.evaluate import BlockMetrics
from dflash_assets.drafter.objective import BlockLossOutput, DrafterBatch


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


class TrainMetrics:
    """Training loss and throughput over the current logging window and over the whole run."""

    def __init__(self, block_size: int, start_step: int, total_steps: int) -> None:
        self.block_size, self.start_step, self.total_steps = block_size, start_step, total_steps
        self.run_started = time.monotonic()
        self.run_tokens = 0
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

    def add(self, output: BlockLossOutput, batch: DrafterBatch) -> None:
        self.window.add(output, batch)
        self.run_tokens += batch.num_tokens

    def count_step(self, micro_batches: int) -> None:
        self.window_steps += 1
        self.window_micro_batches += micro_batches

    def steps_per_second(self, step: int) -> float | None:
        """Optimiser steps per second in this process so far (None before its first step)."""
        elapsed = time.monotonic() - self.run_started
        done = step - self.start_step
        return done / elapsed if done > 0 and elapsed > 0 else None

    @property
    def tokens_per_second(self) -> float:
        elapsed = time.monotonic() - self.run_started
        return self.run_tokens / elapsed if elapsed > 0 else 0.0

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
            "per_position_accuracy": self.window.per_position_accuracy,
            "teacher_forced_tau": self.window.teacher_forced_tau,
            "sequences_per_step": self.window.num_samples / max(1, self.window_steps),
            "micro_batches_per_step": self.window_micro_batches / max(1, self.window_steps),
            "eta_seconds": eta,
        }
        self._reset()
        loss_text = f"{loss:.4f}" if loss is not None else "n/a"
        return (
            f"step {step}/{self.total_steps} epoch {epoch + 1}/{epochs} loss {loss_text} lr {lr:.2e} "
            f"{self.last_window['sequences_per_step']:.1f} sequences/step in "
            f"{self.last_window['micro_batches_per_step']:.1f} micro-batches, "
            f"tokens/s {self.last_window['tokens_per_second']:,.0f} eta {_duration(eta)}"
        )
