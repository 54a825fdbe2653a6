"""Ranges spread over several nodes through Dagster's Celery executor, on the real parts: two
`dflash-assets worker` processes as two nodes on loopback (their own names, devices, staging and
caches), Redis as the broker (a database of its own), a fresh PostgreSQL database as the instance,
moto for S3, and every range materialised through the `dagster` CLI with `DFLASH_EXECUTOR=celery`.
Losing a node is `test_celery_node_loss.py`; the cluster and its nodes are `support/celery_cluster.py`."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
from dagster import DagsterRunStatus

from dflash_assets_tests.support.celery_cluster import (
    BOTH,
    BROKER_SECRET,
    SAMPLES,
    assert_range_complete,
    latest_materialization,
    message_of,
    no_run_left_in_progress,
    range_key,
    wait_ok,
)
from dflash_assets_tests.support.cli import dagster, materialize_args


@pytest.mark.slow
def test_four_ranges_spread_over_both_nodes_and_each_step_records_its_node(cluster, nodes):
    node_a = nodes("node-a", "cpu:0")
    node_b = nodes("node-b", "cpu:1")
    keys = [range_key(i) for i in range(4)]
    runs = [dagster(materialize_args(BOTH, key), cluster.env) for key in keys]
    outputs = [wait_ok(run) for run in runs]

    with cluster.instance() as instance:
        hidden = {key: latest_materialization(instance, "hidden_state_partitions", key) for key in keys}
        tokenized = {key: latest_materialization(instance, "tokenized_completions", key) for key in keys}
        no_run_left_in_progress(instance)
        run_ids = {m["run_id"] for m in hidden.values()}
        events = [e for run_id in run_ids for e in instance.all_logs(run_id)]
        stored_runs = [instance.get_run_by_id(run_id) for run_id in run_ids]
    assert {m["node"] for m in hidden.values()} == {"node-a", "node-b"}, hidden
    assert {m["node"] for m in tokenized.values()} <= {"node-a", "node-b"}
    for key in keys:
        assert_range_complete(cluster.store_url, key)
        assert hidden[key]["samples"] == SAMPLES
    # The UI shows where each step ran: an event on the step, and a line in its compute logs.
    on_node = [message_of(e) for e in events if e.step_key == "hidden_state_partitions"]
    assert sum("Executing step hidden_state_partitions on node node-" in m for m in on_node) == 4
    assert not [m for m in map(message_of, events) if " lost: " in m]  # a node at work is never counted lost
    compute_logs = "".join(
        p.read_text(errors="replace") for p in Path(cluster.env["DAGSTER_HOME"]).rglob("*.err")
    )
    assert "hidden_state_partitions runs on node node-a" in compute_logs
    assert "hidden_state_partitions runs on node node-b" in compute_logs

    # The broker's password is in no process argument, log, event, run config or tag.
    for node in (node_a, node_b):
        cmdlines = [Path(f"/proc/{pid}/cmdline").read_bytes() for pid in [node.pid, *node.step_processes()]]
        assert not any(BROKER_SECRET.encode() in c for c in cmdlines)
        assert BROKER_SECRET not in node.log
    assert not any(BROKER_SECRET in output for output in outputs)
    assert BROKER_SECRET not in "".join(str(e) for e in events)
    assert not any(BROKER_SECRET in str(run.run_config) + str(run.tags) for run in stored_runs)


def test_a_run_launched_while_no_worker_is_up_waits_and_completes_when_one_starts(cluster, nodes):
    key = range_key(5)
    run = dagster(materialize_args("tokenized_completions", key), cluster.env)
    output: list[str] = []
    reader = threading.Thread(target=lambda: output.extend(iter(run.stdout.readline, "")), daemon=True)
    reader.start()
    deadline = time.monotonic() + 120
    while 'Submitting celery task for step "tokenized_completions" to queue "default"' not in "".join(output):
        assert run.poll() is None, "".join(output)[-4000:]
        assert time.monotonic() < deadline, "the step was never queued"
        time.sleep(0.1)
    time.sleep(5)
    assert run.poll() is None, "".join(output)[-4000:]  # still waiting, not failed
    with cluster.instance() as instance:
        waiting = [r for r in instance.get_runs() if r.tags.get("dagster/partition") == key]
        assert [r.status for r in waiting] == [DagsterRunStatus.STARTED]

    nodes("node-c", "cpu:0")
    run.wait(timeout=180)
    reader.join(timeout=30)
    assert run.returncode == 0, "".join(output)[-4000:]
    with cluster.instance() as instance:
        assert latest_materialization(instance, "tokenized_completions", key)["node"] == "node-c"


def test_a_step_whose_process_keeps_dying_is_submitted_again_once_then_fails_the_run(cluster, nodes):
    key = range_key(6)
    nodes("node-d", "cpu:0", DFLASH_FAULT_POINTS="extract_forward@1")  # each step process dies mid-range
    run = dagster(materialize_args(BOTH, key), {**cluster.env, "DFLASH_CELERY_STEP_RESUBMITS": "1"})
    output, _ = run.communicate(timeout=240)
    assert run.returncode != 0, output[-4000:]
    with cluster.instance() as instance:
        (failed,) = [r for r in instance.get_runs() if r.tags.get("dagster/partition") == key]
        messages = [message_of(e) for e in instance.all_logs(failed.run_id)]
    assert failed.status == DagsterRunStatus.FAILURE  # failed, not left started
    # One re-launch for it: Dagster's run retries (the failed-range sensor leaves such runs alone).
    assert failed.tags["dagster/failure_reason"] == "RUN_EXCEPTION"
    assert failed.tags["dagster/will_retry"] == "true"
    again = [m for m in messages if "Submitted again" in m]
    assert len(again) == 1 and "its step process on node-d@" in again[0], messages
    gave_up = [m for m in messages if "so the run fails" in m]
    assert len(gave_up) == 1 and "DFLASH_CELERY_STEP_RESUBMITS" in gave_up[0]
