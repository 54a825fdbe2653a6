"""Drafter quality on held-out batches, teacher-forced: weighted loss, accuracy per drafted position,
and the acceptance length those predict.

Teacher-forced tau = 1 + E[sum_p prod_{q<=p} correct_q] against the held-out samples' own tokens: the
drafted tokens a greedy target would accept per block if it wrote exactly those samples, plus its bonus
token. It equals what a user sees only when the data is the target's own greedy output; the measured tau
comes from `speculative.py`, with the target in the loop. Positions past the sequence or the assistant
span end the run, so a block cut short by the end of a turn counts only what it could draft.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

import torch

from dflash_assets.drafter.model import DFlashDrafter
from dflash_assets.drafter.objective import (
    BlockLossOutput,
    DrafterBatch,
    Objective,
    anchor_generator,
    dflash_loss,
    sample_anchors,
)


class BlockMetrics:
    """Sums `BlockLossOutput`s over batches; the averages are exact, not means of batch means."""

    def __init__(self, block_size: int) -> None:
        self.weighted_ce_sum = 0.0
        self.weight_sum = 0.0
        self.correct = torch.zeros(block_size - 1, dtype=torch.long)
        self.counted = torch.zeros(block_size - 1, dtype=torch.long)
        self.accepted_sum = 0.0
        self.num_blocks = 0
        self.num_samples = 0
        self.num_tokens = 0
        self.ce_sum = 0.0  # plain cross-entropy over the labels, whatever the objective weighs
        self.num_labels = 0

    def add(self, output: BlockLossOutput, batch: DrafterBatch) -> None:
        # The figures come as device tensors (the trainer sums them there); an evaluation reads them here.
        self.add_totals(
            weighted_ce_sum=float(output.weighted_ce_sum),
            weight_sum=float(output.weight_sum),
            correct=output.correct.cpu(),
            counted=output.counted.cpu(),
            accepted_sum=float(output.accepted_sum),
            num_blocks=output.num_blocks,
            num_samples=len(batch.sample_indices),
            num_tokens=batch.num_tokens,
            ce_sum=float(output.ce_sum),
            num_labels=output.num_labels,
        )

    def add_totals(
        self,
        *,
        weighted_ce_sum: float,
        weight_sum: float,
        correct: torch.Tensor,
        counted: torch.Tensor,
        accepted_sum: float,
        num_blocks: int,
        num_samples: int,
        num_tokens: int,
        ce_sum: float = 0.0,
        num_labels: int = 0,
    ) -> None:
        """Sums already made elsewhere (e.g. over the ranks of a data-parallel step)."""
        self.weighted_ce_sum += weighted_ce_sum
        self.weight_sum += weight_sum
        self.correct += correct.long()
        self.counted += counted.long()
        self.accepted_sum += accepted_sum
        self.num_blocks += int(num_blocks)
        self.num_samples += int(num_samples)
        self.num_tokens += int(num_tokens)
        self.ce_sum += ce_sum
        self.num_labels += int(num_labels)

    @property
    def loss(self) -> float | None:
        return self.weighted_ce_sum / self.weight_sum if self.weight_sum else None

    @property
    def per_position_accuracy(self) -> list[float | None]:
        return [int(c) / int(n) if int(n) else None for c, n in zip(self.correct, self.counted, strict=True)]

    @property
    def teacher_forced_tau(self) -> float | None:
        return 1.0 + self.accepted_sum / self.num_blocks if self.num_blocks else None

    def totals(self) -> dict[str, Any]:
        """The sums, plain values (to send to other ranks and add there with `add_totals`)."""
        return {
            "weighted_ce_sum": self.weighted_ce_sum,
            "weight_sum": self.weight_sum,
            "correct": self.correct.tolist(),
            "counted": self.counted.tolist(),
            "accepted_sum": self.accepted_sum,
            "num_blocks": self.num_blocks,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
            "ce_sum": self.ce_sum,
            "num_labels": self.num_labels,
        }

    @classmethod
    def summed(cls, block_size: int, parts: Iterable[dict[str, Any]]) -> BlockMetrics:
        """The metrics of several parts' `totals()` (e.g. each rank's share of the held-out samples)."""
        metrics = cls(block_size)
        for part in parts:
            metrics.add_totals(
                **{**part, "correct": torch.tensor(part["correct"]), "counted": torch.tensor(part["counted"])}
            )
        return metrics

    def as_dict(self) -> dict[str, Any]:
        return {
            "loss": self.loss,
            "ce": self.ce_sum / self.num_labels if self.num_labels else None,
            "per_position_accuracy": self.per_position_accuracy,
            "teacher_forced_tau": self.teacher_forced_tau,
            "num_blocks": self.num_blocks,
            "num_samples": self.num_samples,
            "num_tokens": self.num_tokens,
        }


def evaluate_drafter(
    model: DFlashDrafter,
    batches: Iterable[DrafterBatch],
    *,
    objective: Objective | float = Objective(),
    num_anchors: int = 512,
    seed: int = 0,
    tokens_per_anchor: float = 1.0,
) -> dict[str, Any]:
    """`{loss, per_position_accuracy, acceptance_length_tau, num_blocks, num_samples, num_tokens}`.

    Anchors come from a generator fixed by `seed` and the sample's index, so successive evaluations
    of one run score the same blocks and are comparable, however the samples are batched or shared.
    """
    return block_metrics(
        model,
        batches,
        objective=objective,
        num_anchors=num_anchors,
        seed=seed,
        tokens_per_anchor=tokens_per_anchor,
    ).as_dict()


def block_metrics(
    model: DFlashDrafter,
    batches: Iterable[DrafterBatch],
    *,
    objective: Objective | float = Objective(),
    num_anchors: int = 512,
    seed: int = 0,
    tokens_per_anchor: float = 1.0,
) -> BlockMetrics:
    """`evaluate_drafter`'s sums, before they are turned into averages."""
    metrics = BlockMetrics(model.config.block_size)
    was_training = model.training
    model.eval()
    try:
        with torch.no_grad():
            for batch in batches:
                generators = [anchor_generator(seed, "eval", index) for index in batch.sample_indices]
                anchors = sample_anchors(batch.loss_mask, num_anchors, generators, tokens_per_anchor)
                metrics.add(dflash_loss(model, batch, anchors, objective), batch)
    finally:
        model.train(was_training)
    return metrics
