"""The failed-range sensor on a real Dagster instance: re-launch a failed range, with bounded attempts."""

import pytest
from dagster import (
    AssetKey,
    DagsterInstance,
    StaticPartitionsDefinition,
    asset,
    build_sensor_context,
    materialize,
)

from dflash_assets.sensors import ATTEMPT_TAG, RETRIGGER_OF_TAG, failed_range_sensor

PARTS = StaticPartitionsDefinition(["00000000-00000099", "00000100-00000199"])


@asset(name="hidden_state_partitions", partitions_def=PARTS)
def failing_range(context):
    raise RuntimeError(f"store down while extracting {context.partition_key}")


@pytest.fixture
def instance():
    with DagsterInstance.ephemeral() as instance:
        yield instance


def _fail(instance, partition: str, attempt: int | None = None):
    tags = {ATTEMPT_TAG: str(attempt)} if attempt else None
    result = materialize(
        [failing_range], partition_key=partition, instance=instance, tags=tags, raise_on_error=False
    )
    assert not result.success
    return result.run_id


def _evaluate(instance, cursor=None):
    context = build_sensor_context(instance=instance, cursor=cursor)
    result = failed_range_sensor(context)
    return (result if isinstance(result, list) else []), context.cursor


def test_a_failed_range_is_relaunched_for_the_same_partition_and_assets_with_the_attempt_counted(instance):
    run_id = _fail(instance, "00000100-00000199")
    requests, _ = _evaluate(instance)
    assert len(requests) == 1
    request = requests[0]
    assert request.partition_key == "00000100-00000199"
    assert list(request.asset_selection) == [AssetKey("hidden_state_partitions")]
    assert request.tags[ATTEMPT_TAG] == "2" and request.tags[RETRIGGER_OF_TAG] == run_id


def test_the_cursor_means_a_failure_is_relaunched_once(instance):
    _fail(instance, "00000000-00000099")
    first, cursor = _evaluate(instance)
    again, _ = _evaluate(instance, cursor)
    assert len(first) == 1 and again == []


def test_a_range_that_keeps_failing_is_given_up_after_the_attempt_limit(instance, monkeypatch):
    monkeypatch.setenv("DFLASH_RETRIGGER_MAX_ATTEMPTS", "3")
    _fail(instance, "00000000-00000099", attempt=3)
    requests, _ = _evaluate(instance)
    assert requests == []


def test_a_range_that_was_already_run_again_is_not_relaunched(instance):
    _fail(instance, "00000000-00000099")
    _fail(instance, "00000000-00000099")  # e.g. a user re-ran it by hand (and it failed again)
    requests, _ = _evaluate(instance)
    # only the newest failure is acted on; the older one already has a newer run
    assert len(requests) == 1
