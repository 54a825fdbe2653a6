"""A finished training run's drafter, exported with its provenance and model card."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from dflash_assets.drafter.config import DrafterConfig
from dflash_assets.drafter.export import export_drafter
from dflash_assets.drafter.model_card import drafter_model_card
from dflash_assets.training.train import TrainResult


def export_trained_drafter(
    result: TrainResult,
    config: DrafterConfig,
    directory: Path,
    *,
    run: str,
    target_model_name: str,
    data_source: dict[str, Any] | None = None,
) -> tuple[Path, dict[str, Any]]:
    """Export a training run's drafter with its provenance and model card; returns (directory, the
    metrics the card shows: measured tau, the fresh drafter's, teacher-forced tau, held-out loss...).
    `data_source` says whose answers it trained on (see `model_card.describe_data_source`)."""
    metrics = {
        **(result.eval or {}),
        "acceptance_length_tau": result.acceptance_length_tau,
        "baseline_acceptance_length_tau": ((result.baseline or {}).get("speculative") or {}).get("tau"),
        "tau_by_context_length": (result.speculative or {}).get("by_context_length"),
        "teacher_forced_tau": result.teacher_forced_tau,
        "per_position_accuracy": result.per_position_accuracy,
    }
    card = drafter_model_card(
        config,
        run=run,
        target_model_name=target_model_name,
        trained_sample_ranges=result.trained_sample_ranges,
        partitions=result.partitions,
        steps=result.steps,
        metrics=metrics,
        data_source=data_source,
        world_sizes=result.world_sizes,
        objective=result.objective,
    )
    provenance = {
        "run": run,
        "steps": result.steps,
        "exported_step": result.exported_step,  # until flat: the best checkpoint's, else the last step
        "stop_reason": result.stop_reason,
        "trained_sample_ranges": result.trained_sample_ranges,
        "trained_partitions": result.partitions,
        "data_source": data_source or {"completions": "dataset"},
        "world_sizes": result.world_sizes,
        "objective": result.objective,
        "metrics": {k: v for k, v in metrics.items() if k != "per_position_accuracy"},
    }
    return export_drafter(result.model, directory, provenance=provenance, model_card=card), metrics
