"""Re-launching failed ranges on a real Dagster instance (the repo's dagster.yaml, run retries on):
one failure gives exactly one re-launch, whichever kind it is; the sensor backs off and gives up."""

import json
import signal
import socket
import subprocess
import sys
import time

import pytest
from dagster import (
    AssetKey,
    DagsterEvent,
    DagsterEventType,
    DagsterRunStatus,
    Definitions,
    StaticPartitionsDefinition,
    asset,
    build_sensor_context,
    materialize,
)
from dagster._core.storage.tags import RUN_FAILURE_REASON_TAG
from dagster._daemon.auto_run_reexecution.auto_run_reexecution import should_retry

from dflash_assets.orchestration.execution.recovery import (
    RUN_WORKER_TAG,
    RunWorker,
    _process_start_ticks,
    reap_dead_runs,
)
from dflash_assets.orchestration.sensors import (
    ATTEMPT_TAG,
    RETRIGGER_OF_TAG,
    failed_range_sensor,
    retrigger_requests,
)
from dflash_assets_tests.conftest import make_dagster_home, open_instance

PARTS = StaticPartitionsDefinition(["00000000-00000099", "00000100-00000199"])


@asset(name="hidden_state_partitions", partitions_def=PARTS)
def failing_range(context):
    raise RuntimeError(f"store down while extracting {context.partition_key}")


@pytest.fixture
def instance(tmp_path, monkeypatch):
    monkeypatch.setenv("DFLASH_RETRIGGER_BACKOFF_S", "0")
    with open_instance(make_dagster_home(tmp_path / "dagster-home")) as instance:
        yield instance


def _fail(instance, partition: str, attempt: int | None = None) -> str:
    tags = {ATTEMPT_TAG: str(attempt)} if attempt else None
    result = materialize(
        [failing_range], partition_key=partition, instance=instance, tags=tags, raise_on_error=False
    )
    assert not result.success
    return result.run_id


def _dead_worker() -> RunWorker:
    """The identity of a process that really ran on this host and is gone now."""
    process = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        worker = RunWorker(socket.gethostname(), process.pid, _process_start_ticks(process.pid))
        assert worker.is_alive()
    finally:
        process.send_signal(signal.SIGKILL)
        process.wait()
    assert not worker.is_alive()
    return worker


def _run_of_the_range(instance, partition: str, **tags: str):
    """A run of `hidden_state_partitions` for `partition`, created and started as a launcher would."""
    job_def = Definitions(assets=[failing_range]).resolve_implicit_global_asset_job_def()
    run = instance.create_run_for_job(
        job_def=job_def,
        run_config={},
        tags={"dagster/partition": partition, **tags},
        asset_selection=frozenset({AssetKey("hidden_state_partitions")}),
    )
    instance.handle_run_event(
        run.run_id, DagsterEvent(DagsterEventType.RUN_START.value, job_name=run.job_name)
    )
    return instance.get_run_by_id(run.run_id)


def _started_run_whose_worker_died(instance, partition: str) -> str:
    """A run left STARTED by a worker killed with its process group: what the reaper finds."""
    run = _run_of_the_range(instance, partition, **{RUN_WORKER_TAG: _dead_worker().tag})
    assert run.status == DagsterRunStatus.STARTED
    return run.run_id


def _evaluate(instance, cursor=None):
    context = build_sensor_context(instance=instance, cursor=cursor)
    result = failed_range_sensor([failing_range])(context)
    return (result if isinstance(result, list) else []), context.cursor


def _relaunches(instance, run_id: str, requests) -> int:
    """New runs one failure leads to: the sensor's requests for it plus Dagster's own run retry."""
    ours = sum(1 for r in requests if r.tags[RETRIGGER_OF_TAG] == run_id)
    return ours + int(should_retry(instance.get_run_by_id(run_id), instance))


def test_an_asset_failure_is_relaunched_once_by_the_sensor_and_not_by_run_retries(instance):
    run_id = _fail(instance, "00000100-00000199")
    assert instance.get_run_by_id(run_id).tags[RUN_FAILURE_REASON_TAG] == "STEP_FAILURE"
    requests, cursor = _evaluate(instance)
    assert _relaunches(instance, run_id, requests) == 1
    request = requests[0]
    assert request.partition_key == "00000100-00000199"
    assert list(request.asset_selection) == [AssetKey("hidden_state_partitions")]
    assert request.tags[ATTEMPT_TAG] == "2"
    again, _ = _evaluate(instance, cursor)
    assert again == []  # the cursor remembers it


def test_a_run_whose_worker_died_is_relaunched_once_by_run_retries_and_not_by_the_sensor(instance):
    run_id = _started_run_whose_worker_died(instance, "00000000-00000099")
    requests, _ = _evaluate(instance)  # the sensor reaps it first, then looks for failed ranges
    run = instance.get_run_by_id(run_id)
    assert run.is_failure and run.tags[RUN_FAILURE_REASON_TAG] == "UNEXPECTED_TERMINATION"
    assert _relaunches(instance, run_id, requests) == 1
    assert requests == []


def test_a_dead_run_reaped_by_a_rerun_of_the_same_range_is_not_retried_again(instance):
    run_id = _started_run_whose_worker_died(instance, "00000000-00000099")
    rerun = _run_of_the_range(instance, "00000000-00000099")  # the same command again
    reaped = reap_dead_runs(instance, log=lambda _: None, rerun=rerun)
    assert reaped == [run_id]
    requests, _ = _evaluate(instance)
    # The rerun is the one re-launch: neither Dagster's retries nor the sensor add another.
    assert _relaunches(instance, run_id, requests) == 0


def test_the_reaper_never_touches_a_live_run_an_untagged_run_or_a_run_of_another_host(instance):
    alive = _run_of_the_range(instance, "00000000-00000099", **{RUN_WORKER_TAG: RunWorker.current().tag})
    untagged = _run_of_the_range(instance, "00000000-00000099")
    dead = _dead_worker()
    elsewhere = RunWorker("another-host", dead.pid, dead.start_ticks)  # its pid means nothing here
    remote = _run_of_the_range(instance, "00000100-00000199", **{RUN_WORKER_TAG: elsewhere.tag})
    # This process's pid, but another start time: the pid was reused, the recorded worker is gone.
    me = RunWorker.current()
    reused = RunWorker(me.host, me.pid, (me.start_ticks or 0) + 1)
    recycled = _run_of_the_range(instance, "00000100-00000199", **{RUN_WORKER_TAG: reused.tag})

    assert reap_dead_runs(instance, log=lambda _: None) == [recycled.run_id]
    for run in (alive, untagged, remote):
        assert instance.get_run_by_id(run.run_id).status == DagsterRunStatus.STARTED


def test_the_sensor_backs_off_exponentially_before_relaunching(instance, monkeypatch):
    monkeypatch.setenv("DFLASH_RETRIGGER_BACKOFF_S", "100")
    first = _fail(instance, "00000000-00000099")
    second = _fail(instance, "00000100-00000199", attempt=2)
    failed_at = {r: instance.get_run_record_by_id(r).update_timestamp.timestamp() for r in (first, second)}

    context = build_sensor_context(instance=instance)
    assert retrigger_requests(context, now=time.time()) == []  # both still backing off
    waiting = json.loads(context.cursor)["waiting"]
    assert waiting[first] == pytest.approx(failed_at[first] + 100)
    assert waiting[second] == pytest.approx(failed_at[second] + 200)  # doubled for the second attempt

    later = build_sensor_context(instance=instance, cursor=context.cursor)
    due = retrigger_requests(later, now=failed_at[first] + 150)
    assert [r.tags[RETRIGGER_OF_TAG] for r in due] == [first]
    last = build_sensor_context(instance=instance, cursor=later.cursor)
    due = retrigger_requests(last, now=failed_at[second] + 201)
    assert [r.tags[RETRIGGER_OF_TAG] for r in due] == [second]


def test_a_range_that_keeps_failing_is_given_up_after_the_attempt_limit(instance, monkeypatch):
    monkeypatch.setenv("DFLASH_RETRIGGER_MAX_ATTEMPTS", "3")
    _fail(instance, "00000000-00000099", attempt=3)
    requests, _ = _evaluate(instance)
    assert requests == []


def test_a_range_that_was_already_run_again_is_not_relaunched(instance):
    _fail(instance, "00000000-00000099")  # the older failure
    newer = _fail(instance, "00000000-00000099")  # e.g. a user re-ran it by hand (and it failed again)
    requests, _ = _evaluate(instance)
    # only the newest failure is acted on; the older one already has a newer run
    assert [r.tags[RETRIGGER_OF_TAG] for r in requests] == [newer]


def test_the_range_sensor_registers_the_ranges_covering_the_dataset_once(instance, tmp_path, monkeypatch):
    from dflash_assets.orchestration.sensors import sample_range_sensor

    row = {"messages": [{"role": "user", "content": "q"}, {"role": "assistant", "content": "a"}]}
    dataset = tmp_path / "conversations.jsonl"
    dataset.write_text((json.dumps(row) + "\n") * 250)
    monkeypatch.setenv("DFLASH_DATASET", str(dataset))
    monkeypatch.setenv("DFLASH_SAMPLES_PER_PARTITION", "100")

    result = sample_range_sensor(build_sensor_context(instance=instance))
    (request,) = result.dynamic_partitions_requests
    assert list(request.partition_keys) == ["00000000-00000099", "00000100-00000199", "00000200-00000299"]
    instance.add_dynamic_partitions(request.partitions_def_name, list(request.partition_keys))
    again = sample_range_sensor(build_sensor_context(instance=instance))
    assert "all 3 ranges of the dataset are registered" in again.skip_message
