"""Sensors: register the dataset's ranges, and re-launch ranges whose assets failed.

One re-launch mechanism per kind of failure, so one failure never yields two new runs:
- the run worker crashed or was lost (killed, OOM, node gone; Dagster's run monitoring or our
  reaper marks such runs failed with reason UNEXPECTED_TERMINATION, START_TIMEOUT, ...): Dagster's run
  retries re-launch the run (`run_retries` in the instance, `retry_on_asset_or_op_failure: false`);
- an asset failed (a store outage, bad data, a preempted device): `failed_range_sensor` re-launches
  the range with exponential backoff, up to `DFLASH_RETRIGGER_MAX_ATTEMPTS` runs in all. It acts only
  on runs that failed by a step (`dagster/failure_reason` = STEP_FAILURE) and that Dagster has not
  marked to retry itself (`dagster/will_retry`), and never on a range that already has a newer run.
"""

from __future__ import annotations

import json
import time
from collections.abc import Sequence
from datetime import datetime, timezone

from dagster import (
    AssetKey,
    AssetsDefinition,
    DagsterEventType,
    DagsterRun,
    DagsterRunStatus,
    DefaultSensorStatus,
    RunRequest,
    RunsFilter,
    SensorDefinition,
    SensorEvaluationContext,
    SensorResult,
    SkipReason,
    sensor,
)
from dagster._core.events import RunFailureReason
from dagster._core.storage.tags import PARTITION_NAME_TAG, RUN_FAILURE_REASON_TAG, WILL_RETRY_TAG

from dflash_assets import settings
from dflash_assets.orchestration.execution.recovery import reap_dead_runs
from dflash_assets.orchestration.partitions import SAMPLE_RANGES, dataset_range_keys, unregistered_ranges

ATTEMPT_TAG = "dflash/attempt"
RETRIGGER_OF_TAG = "dflash/retrigger_of"
# The partitioned assets (target_completions is in the graph only when the target regenerates answers:
# without it, no run of it fails).
WATCHED_ASSETS = frozenset(
    AssetKey(name) for name in ("target_completions", "tokenized_completions", "hidden_state_partitions")
)


def _run_assets(context: SensorEvaluationContext, run: DagsterRun) -> frozenset[AssetKey]:
    """The assets a run set out to materialise (a run of a whole-graph job has no explicit selection)."""
    if run.asset_selection:
        return frozenset(run.asset_selection)
    records = context.instance.get_records_for_run(
        run.run_id, of_type=DagsterEventType.ASSET_MATERIALIZATION_PLANNED
    ).records
    return frozenset(r.event_log_entry.dagster_event.asset_key for r in records)


def backoff_s(attempt: int) -> float:
    """Seconds to wait before re-launching a range whose `attempt`-th run failed."""
    return settings.RETRIGGER_BACKOFF_S.get_float() * 2 ** max(0, attempt - 1)


def _is_ours(run: DagsterRun) -> bool:
    """Failed by an asset, and not about to be retried by Dagster's run retries."""
    failed_by_a_step = run.tags.get(RUN_FAILURE_REASON_TAG) == RunFailureReason.STEP_FAILURE.value
    return failed_by_a_step and run.tags.get(WILL_RETRY_TAG) != "true"


def _superseded(context: SensorEvaluationContext, run: DagsterRun, created: float, selection) -> bool:
    later = context.instance.get_run_records(
        filters=RunsFilter(
            tags={PARTITION_NAME_TAG: run.tags[PARTITION_NAME_TAG]},
            created_after=datetime.fromtimestamp(created, tz=timezone.utc),
        ),
        limit=50,
    )
    return any(
        r.dagster_run.run_id != run.run_id and _run_assets(context, r.dagster_run) & selection for r in later
    )


def retrigger_requests(context: SensorEvaluationContext, now: float | None = None) -> list[RunRequest]:
    """The run requests for failed ranges whose backoff has passed; updates the sensor's cursor.

    Cursor: `updated_after` (failures seen so far) and `waiting` (run id -> when its backoff ends)."""
    now = time.time() if now is None else now
    max_attempts = settings.RETRIGGER_MAX_ATTEMPTS.get_int()
    cursor = json.loads(context.cursor) if context.cursor else {}
    since = cursor.get("updated_after", 0.0)
    waiting: dict[str, float] = dict(cursor.get("waiting", {}))

    newly_failed = context.instance.get_run_records(
        filters=RunsFilter(
            statuses=[DagsterRunStatus.FAILURE],
            updated_after=datetime.fromtimestamp(since, tz=timezone.utc) if since else None,
        ),
        order_by="update_timestamp",
        ascending=True,
        limit=200,
    )
    for record in newly_failed:
        since = max(since, record.update_timestamp.timestamp())
        run = record.dagster_run
        if not run.tags.get(PARTITION_NAME_TAG) or not _is_ours(run) or run.run_id in waiting:
            continue
        if not _run_assets(context, run) & WATCHED_ASSETS:
            continue
        attempt = int(run.tags.get(ATTEMPT_TAG, "1"))
        if attempt >= max_attempts:
            context.log.warning(
                f"range {run.tags[PARTITION_NAME_TAG]} failed {attempt} time(s) (last run {run.run_id}); "
                "not re-launching. Fix the cause and materialise it again."
            )
            continue
        waiting[run.run_id] = record.update_timestamp.timestamp() + backoff_s(attempt)

    requests: list[RunRequest] = []
    for run_id, due in sorted(waiting.items(), key=lambda item: item[1]):
        if due > now:
            continue
        del waiting[run_id]
        record = context.instance.get_run_record_by_id(run_id)
        if record is None:
            continue
        run = record.dagster_run
        selection = _run_assets(context, run) & WATCHED_ASSETS
        if _superseded(context, run, record.create_timestamp.timestamp(), selection):
            continue  # already run again (by a user, a retry or this sensor)
        attempt = int(run.tags.get(ATTEMPT_TAG, "1"))
        requests.append(
            RunRequest(
                run_key=f"retrigger-{run.run_id}",
                asset_selection=sorted(selection, key=lambda key: key.to_user_string()),
                partition_key=run.tags[PARTITION_NAME_TAG],
                tags={ATTEMPT_TAG: str(attempt + 1), RETRIGGER_OF_TAG: run.run_id},
            )
        )
    context.update_cursor(json.dumps({"updated_after": since, "waiting": waiting}))
    return requests


def failed_range_sensor(range_assets: Sequence[AssetsDefinition]) -> SensorDefinition:
    """The sensor re-launching the graph's `range_assets` (its target: the assets it may request)."""

    @sensor(
        name="failed_range_sensor",
        target=list(range_assets),
        minimum_interval_seconds=60,
        default_status=DefaultSensorStatus.RUNNING,
        description="Marks runs whose worker died as failed; re-launches ranges whose assets failed, with "
        "exponential backoff (DFLASH_RETRIGGER_BACKOFF_S), up to DFLASH_RETRIGGER_MAX_ATTEMPTS runs.",
    )
    def evaluate(context: SensorEvaluationContext):
        reap_dead_runs(context.instance, context.log.warning)  # for run retries to see them as crashed
        requests = retrigger_requests(context)
        return requests or SkipReason("no failed range is due for a re-launch")

    return evaluate


@sensor(
    minimum_interval_seconds=300,
    default_status=DefaultSensorStatus.RUNNING,
    description="Registers the sample ranges that cover the dataset (DFLASH_DATASET), so new rows show "
    "up as new partitions. Counts rows once per version of the file.",
)
def sample_range_sensor(context: SensorEvaluationContext):
    keys = dataset_range_keys()
    new = unregistered_ranges(context.instance, keys)
    if not new:
        return SkipReason(f"all {len(keys)} ranges of the dataset are registered")
    context.log.info(f"registering {len(new)} new sample range(s): {new[0]} .. {new[-1]}")
    return SensorResult(dynamic_partitions_requests=[SAMPLE_RANGES.build_add_request(new)])
