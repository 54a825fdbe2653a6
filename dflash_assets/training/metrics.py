"""What one optimiser step measured, summed over the ranks; and the training loss and throughput over each
logging window and the whole run, with the log line."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from dflash_assets.drafter.objective import BlockLossOutput, DrafterBatch
from dflash_assets.drafter.teacher_forced import BlockMetrics


def _duration(seconds: float) -> str:
    seconds = int(seconds)
    hours, rest = divmod(seconds, 3600)
    return f"{hours}h{rest // 60:02d}m" if hours else f"{rest // 60}m{rest % 60:02d}s"


@dataclass
class StepStats:
    """One optimiser step over the whole global batch: each rank fills in its share, one all-reduce sums
    them (`pack_local` / `unpack`), so every rank knows the global loss normaliser and whether to skip."""

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
    redo_ranks: int  # ranks out of memory in their reducing micro-batch: every rank redoes the step
    unfit_ranks: int  # ranks where one sequence alone does not fit: every rank stops
    checkpoint_due: bool  # rank 0's clock decides for all
    rank_seconds: list[float]  # each rank's compute time for the step (stragglers)
    ce_sum: float = 0.0  # plain cross-entropy over every label, whatever the objective weighs
    num_labels: int = 0
    expected_accepted_sum: float = 0.0  # sum over blocks of sum_j prod_{i<=j} q_i (D-PACE's target)
    selector_ce_sum: float = 0.0  # DFlash2's selector
    selector_recall: int = 0  # labels inside their slot's unary top-k
    kl_sum: float = 0.0  # KL from the target's distribution (distillation)

    @classmethod
    def pack_local(
        cls,
        outputs: Sequence[tuple[BlockLossOutput, DrafterBatch]],
        *,
        block_size: int,
        rank: int,
        world_size: int,
        seconds: float,
        checkpoint_due: bool,
        device: torch.device,
        out_of_memory: int = 0,
    ) -> torch.Tensor:
        """This rank's share of the step as one float64 tensor on `device`, for the all-reduce that sums
        the ranks' (`unpack` reads the sum); `out_of_memory`: 1 to redo the step, 2 to stop it. The
        drafter's figures are summed where they are, on its device, and the host's cross in one copy it
        does not wait for: nothing here waits for the device. A non-finite loss anywhere skips the step,
        so the figures are summed as they are."""
        drafter = torch.zeros(DRAFTER_HEAD + block_size - 1, dtype=torch.float64, device=device)
        for output, _ in outputs:
            figures = torch.stack(
                [
                    output.weighted_ce_sum.double(),
                    output.weight_sum.double(),
                    output.accepted_sum.double(),
                    (~torch.isfinite(output.loss.detach())).double(),
                    output.ce_sum.double(),
                    output.expected_accepted_sum.double(),
                    output.selector_ce_sum.double(),
                    output.selector_recall.double(),
                    output.kl_sum.double(),
                ]
            )
            drafter += torch.cat([figures, output.correct.double()]).to(device)
        drafter[3] = drafter[3].clamp(max=1)  # whether this rank's loss was not finite: 0 or 1
        counted = torch.zeros(block_size - 1, dtype=torch.float64)
        for output, _ in outputs:
            counted += output.counted.double().cpu()  # planned on the host
        rank_seconds = [0.0] * world_size
        rank_seconds[rank] = seconds
        counts = [
            sum(o.num_blocks for o, _ in outputs),
            sum(len(b.sample_indices) for _, b in outputs),
            sum(b.num_tokens for _, b in outputs),
            len(outputs),
            float(checkpoint_due),
            float(out_of_memory == 1),
            float(out_of_memory == 2),
            sum(o.num_labels for o, _ in outputs),
            *rank_seconds,
        ]
        host = torch.cat([torch.tensor(counts, dtype=torch.float64), counted])
        if device.type == "cuda":
            host = host.pin_memory()
        return torch.cat([drafter, host.to(device, non_blocking=True)])

    @classmethod
    def unpack(cls, packed: torch.Tensor, block_size: int, world_size: int) -> StepStats:
        """The ranks' summed `pack_local`, read on the host (the step's one wait for the device)."""
        values = packed.detach().cpu()
        drafter, host = values[: DRAFTER_HEAD + block_size - 1], values[DRAFTER_HEAD + block_size - 1 :]
        head, correct = drafter[:DRAFTER_HEAD].tolist(), drafter[DRAFTER_HEAD:]
        counts, seconds = host[:HOST_HEAD].tolist(), host[HOST_HEAD : HOST_HEAD + world_size]
        counted = host[HOST_HEAD + world_size :]
        return cls(
            weighted_ce_sum=head[0],
            weight_sum=head[1],
            correct=correct.round().long(),
            counted=counted.round().long(),
            accepted_sum=head[2],
            num_blocks=round(counts[0]),
            sequences=round(counts[1]),
            tokens=round(counts[2]),
            micro_batches=round(counts[3]),
            nonfinite_ranks=round(head[3]),
            checkpoint_due=counts[4] > 0,
            redo_ranks=round(counts[5]),
            unfit_ranks=round(counts[6]),
            rank_seconds=seconds.tolist(),
            ce_sum=head[4],
            num_labels=round(counts[7]),
            expected_accepted_sum=head[5],
            selector_ce_sum=head[6],
            selector_recall=round(head[7]),
            kl_sum=head[8],
        )

    @property
    def loss(self) -> float | None:
        return self.weighted_ce_sum / self.weight_sum if self.weight_sum > 0 else None

    def objective_scalars(self, *, selector: bool, distill: bool = False) -> dict[str, float | None]:
        """Beside the loss the objective optimises: the plain cross-entropy (comparable across objectives),
        the expected accepted length D-PACE maximises (1 + sum_j prod q), DFlash2's selector, and the KL
        from the target's distribution when distilling."""
        labels, blocks = self.num_labels, self.num_blocks
        scalars = {
            "ce": self.ce_sum / labels if labels else None,
            "expected_tau": 1.0 + self.expected_accepted_sum / blocks if blocks else None,
        }
        if selector:
            scalars["selector_ce"] = self.selector_ce_sum / labels if labels else None
            scalars["selector_recall"] = self.selector_recall / labels if labels else None
        if distill:
            scalars["kl"] = self.kl_sum / labels if labels else None
        return scalars


# `pack_local`'s layout: the drafter's figures (on its device), then the host's counts.
# weighted CE, normaliser, accepted, non-finite, CE, expected accepted, selector CE, recall, KL
DRAFTER_HEAD = 9
HOST_HEAD = 8  # blocks, sequences, tokens, micro-batches, checkpoint due, redo, unfit, labels


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
