"""A running range's progress where the Dagster UI shows it at a glance.

- An `AssetObservation` of the range's partition (fraction done, samples, rate, ETA, staging bytes,
  uploads in flight, device) every `observe_every_s` and once at the end: the asset's page lists
  them per partition, and their numbers plot across a run.
- A `dflash/progress` tag on the run, rewritten at every snapshot: the Runs list shows it while the
  run goes on, and it keeps the final figures after.
The detailed progress lines go to the step's stderr (the run's compute logs), not to the event log:
a long range would otherwise write thousands of log events.
"""

from __future__ import annotations

import sys
import time
from dataclasses import asdict

from dagster import AssetExecutionContext, AssetObservation, MetadataValue

from dflash_assets import terminal
from dflash_assets.orchestration.metadata import dagster_metadata
from dflash_assets.orchestration.redaction import redact, redacted_tags
from dflash_assets.storage.range_progress import RangeProgress  # extraction's and regeneration's snapshots
from dflash_assets.storage.units import human_bytes, human_duration  # torch-free, unlike extraction/

PROGRESS_TAG = "dflash/progress"


def progress_line(progress: RangeProgress) -> str:
    """The short form the Runs list has room for, e.g. `42% 1,234/2,934 · 23.1/s · ETA 12m05s`
    (samples done of the range, samples per second)."""
    if progress.fraction_done >= 1.0:
        eta = "done"
    elif progress.eta_s is None:
        eta = "ETA unknown"
    else:
        eta = f"ETA {human_duration(progress.eta_s)}"
    line = (
        f"{progress.fraction_done:.0%} {progress.samples_done:,}/{progress.samples_total:,} · "
        f"{progress.samples_per_s:.1f}/s · {eta}"
    )
    return line + (f" · {progress.reason}" if progress.reason and progress.reason != "done" else "")


def progress_metadata(progress: RangeProgress, run_id: str) -> dict[str, MetadataValue]:
    """Every number of the snapshot (extraction's or regeneration's), plus the summary fields the UI
    shows at a glance: fraction done, staging as text, status, the progress line, the run."""
    figures = {
        name: round(value, 3) if isinstance(value, float) else value
        for name, value in asdict(progress).items()
        if name != "reason"
    }
    metadata = dagster_metadata({"fraction_done": round(progress.fraction_done, 4), **figures})
    metadata |= {
        "staging": MetadataValue.text(
            f"{human_bytes(progress.staging_bytes)} of {human_bytes(progress.staging_budget_bytes)}"
        ),
        "status": MetadataValue.text(progress.reason or "running"),
        "progress": MetadataValue.text(progress_line(progress)),
        "run": MetadataValue.dagster_run(run_id),
    }
    if progress.eta_s is not None and progress.fraction_done < 1.0:
        # A timestamp the UI renders as a local date and time: when the range should be done.
        metadata["expected_done_at"] = MetadataValue.timestamp(time.time() + progress.eta_s)
    return metadata


def terminal_snapshot(progress: RangeProgress, task: str) -> terminal.ProgressSnapshot:
    """The same snapshot for the terminal's status line (`dflash-assets demo`)."""
    status = progress.reason if progress.reason and progress.reason != "done" else ""
    return terminal.ProgressSnapshot(
        task=task,
        done=progress.samples_done,
        total=progress.samples_total,
        unit=progress.unit,
        rate=progress.samples_per_s if progress.done_this_run else None,
        eta_s=progress.eta_s,
        status=" · ".join(filter(None, [progress.status_figures(), status])),
    )


class RangeProgressReporter:
    """The `on_progress` callback of one range's extraction or regeneration (see the module docstring)."""

    def __init__(self, context: AssetExecutionContext, partition_key: str, observe_every_s: float):
        self._context = context
        self._partition_key = partition_key
        self._observe_every_s = observe_every_s
        self._last_observed: float | None = None
        self._task = f"{context.asset_key.to_user_string()} {partition_key}"

    def set_status(self, text: str) -> None:
        """The run's progress tag, for states before any snapshot (loading, waiting for a device)."""
        tags = redacted_tags({PROGRESS_TAG: text[:200]})
        self._context.instance.add_run_tags(self._context.run.run_id, tags)
        terminal.report(terminal.ProgressSnapshot(self._task, status=text))

    def note(self, message: str) -> None:
        """A state before any snapshot worth a log line too (whom a waiting run waits for)."""
        self._context.log.info(f"{self._partition_key}: {message}")
        self.set_status(message)

    def log_line(self, line: str) -> None:
        print(redact(line), file=sys.stderr, flush=True)  # the compute logs

    def __call__(self, progress: RangeProgress) -> None:
        self.set_status(progress_line(progress))
        now = time.monotonic()
        final = progress.reason == "done"
        if final:
            terminal.finish(self._task)
        else:
            terminal.report(terminal_snapshot(progress, self._task))
        if final or self._last_observed is None or now - self._last_observed >= self._observe_every_s:
            self._last_observed = now
            self._context.log_event(
                AssetObservation(
                    asset_key=self._context.asset_key,
                    partition=self._partition_key,
                    metadata=progress_metadata(progress, self._context.run.run_id),
                )
            )
