"""Re-launch sample ranges whose latest run failed, a bounded number of times.

Dagster's run retries (dagster.yaml) re-run crashed run workers; this sensor covers the rest (a
store outage, a preempted node) with a per-range attempt count carried in run tags, and never
re-launches a range that already has a newer run.
"""

from __future__ import annotations

import json
from datetime import datetime, timezone

from dagster import (
    AssetKey,
    DagsterEventType,
    DagsterRunStatus,
    DefaultSensorStatus,
    RunRequest,
    RunsFilter,
    SensorEvaluationContext,
    SkipReason,
    sensor,
)

from dflash_assets import settings
from dflash_assets.assets.hidden_states import hidden_state_partitions
from dflash_assets.assets.tokenized_completions import tokenized_completions
from dflash_assets.recovery import reap_dead_runs

ATTEMPT_TAG = "dflash/attempt"
RETRIGGER_OF_TAG = "dflash/retrigger_of"
PARTITION_TAG = "dagster/partition"
WATCHED_ASSETS = {AssetKey("tokenized_completions"), AssetKey("hidden_state_partitions")}


def _run_assets(context: SensorEvaluationContext, run) -> frozenset[AssetKey]:
    """The assets a run set out to materialise (a run of a whole-graph job has no explicit selection)."""
    if run.asset_selection:
        return frozenset(run.asset_selection)
    records = context.instance.get_records_for_run(
        run.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION_PLANNED
    ).records
    return frozenset(r.event_log_entry.dagster_event.asset_key for r in records)


def _retrigger_requests(
    context: SensorEvaluationContext, max_attempts: int
) -> tuple[list[RunRequest], float]:
    cursor = json.loads(context.cursor) if context.cursor else {}
    since = cursor.get("updated_after", 0.0)
    failed = context.instance.get_run_records(
        filters=RunsFilter(
            statuses=[DagsterRunStatus.FAILURE],
            updated_after=datetime.fromtimestamp(since, tz=timezone.utc) if since else None,
        ),
        order_by="update_timestamp",
        ascending=True,
        limit=200,
    )
    newest = since
    requests: list[RunRequest] = []
    for record in failed:
        newest = max(newest, record.update_timestamp.timestamp())
        run = record.dagster_run
        partition = run.tags.get(PARTITION_TAG)
        selection = _run_assets(context, run) & WATCHED_ASSETS
        if not partition or not selection:
            continue
        attempt = int(run.tags.get(ATTEMPT_TAG, "1"))
        if attempt >= max_attempts:
            context.log.warning(
                f"range {partition} failed {attempt} time(s) (last run {run.run_id}); not re-launching. "
                "Fix the cause and materialise it again."
            )
            continue
        later = context.instance.get_run_records(
            filters=RunsFilter(tags={PARTITION_TAG: partition}, created_after=record.create_timestamp),
            limit=50,
        )
        if any(
            r.dagster_run.run_id != run.run_id and _run_assets(context, r.dagster_run) & selection
            for r in later
        ):
            continue  # already re-run (by Dagster's run retries, a user, or this sensor)
        requests.append(
            RunRequest(
                run_key=f"retrigger-{run.run_id}",
                asset_selection=sorted(selection, key=lambda key: key.to_user_string()),
                partition_key=partition,
                tags={ATTEMPT_TAG: str(attempt + 1), RETRIGGER_OF_TAG: run.run_id},
            )
        )
    return requests, newest


@sensor(
    target=[tokenized_completions, hidden_state_partitions],
    minimum_interval_seconds=60,
    default_status=DefaultSensorStatus.RUNNING,
    description="Re-launches sample ranges whose latest run failed, up to DFLASH_RETRIGGER_MAX_ATTEMPTS.",
)
def failed_range_sensor(context: SensorEvaluationContext):
    reap_dead_runs(context.instance, context.log.warning)  # so killed runs count as failed ranges
    requests, newest = _retrigger_requests(context, settings.RETRIGGER_MAX_ATTEMPTS.get_int())
    context.update_cursor(json.dumps({"updated_after": newest}))
    if not requests:
        return SkipReason("no failed ranges to re-launch")
    return requests
