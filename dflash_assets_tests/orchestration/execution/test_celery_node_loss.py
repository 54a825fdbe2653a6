"""A node lost mid-range costs nothing: its step is submitted again, another node (or the same one,
restarted) finishes the range from the store, and nothing it had uploaded is written again; and a
step whose run worker died stops instead of running on. The cluster is `support/celery_cluster.py`."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dflash_assets.storage.manifest import read_manifest
from dflash_assets.storage.open_store import open_store
from dflash_assets_tests.support.celery_cluster import (
    BOTH,
    BROKER_SECRET,
    SAMPLES,
    assert_range_complete,
    hidden_state_objects,
    latest_materialization,
    list_with_etags,
    message_of,
    no_run_left_in_progress,
    range_key,
    wait_ok,
    wait_until_tokenized,
)
from dflash_assets_tests.support.celery_nodes import gone_within
from dflash_assets_tests.support.cli import dagster, materialize_args
from dflash_assets_tests.support.stores import staging_of


@pytest.mark.slow
@pytest.mark.parametrize(
    ("broker", "finisher"), [("redis", "another node"), ("rabbitmq", "the same node, restarted")]
)
def test_a_node_killed_mid_range_costs_nothing_and_the_range_is_finished_from_the_store(
    broker, finisher, request, nodes, faulty_proxy
):
    cluster = request.getfixturevalue("cluster" if broker == "redis" else "rabbitmq_cluster")
    key = range_key(4)
    prefix = f"hidden-states/{key}/"
    # Node A uploads through a slow link, so it is killed with some samples uploaded and some not.
    slow = faulty_proxy()
    node_a = nodes(
        "node-a", "cpu:0", cluster, AWS_ENDPOINT_URL_S3=slow.endpoint_url, DFLASH_UPLOAD_MAX_IN_FLIGHT="1"
    )
    run = dagster(materialize_args(BOTH, key), cluster.env)
    wait_until_tokenized(cluster.store_url, key, run)
    slow.throttle(latency_s=0.3)
    deadline = time.monotonic() + 180
    while len(hidden_state_objects(cluster.store_url, key)) < 3:
        assert run.poll() is None, run.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "node A never started uploading"
        time.sleep(0.1)
    node_a.kill_group()  # at once: node A goes on uploading for as long as it lives
    killed_at = time.monotonic()
    time.sleep(1.0)  # a request node A's link had already taken lands now, or never
    before = {k: v for k, v in list_with_etags(cluster, prefix).items() if "/hs_" in k}
    staged_on_a = list(staging_of(node_a.env, prefix, cluster.store_url).glob("hs_*.safetensors"))
    assert 0 < len(before) < SAMPLES and staged_on_a, "node A was not killed mid-range"
    # The finishing node reaches the store through a proxy that records its requests.
    watched = faulty_proxy()
    if finisher == "another node":  # node B, started after the loss, takes the step submitted again
        nodes("node-b", "cpu:0", cluster, AWS_ENDPOINT_URL_S3=watched.endpoint_url)
    else:  # node A again, under its own name, with its staging
        node_a.env = {**node_a.env, "AWS_ENDPOINT_URL_S3": watched.endpoint_url}
        node_a.start()

    output = wait_ok(run)
    took_s = time.monotonic() - killed_at

    with cluster.instance() as instance:
        hidden = latest_materialization(instance, "hidden_state_partitions", key)
        messages = [message_of(e) for e in instance.all_logs(hidden["run_id"])]
        no_run_left_in_progress(instance)
        assert instance.get_run_by_id(hidden["run_id"]).is_success
    assert_range_complete(cluster.store_url, key)
    assert hidden["reused_from_store"] == len(before)  # every object node A uploaded was kept
    if finisher == "another node":
        assert hidden["node"] == "node-b"
        assert hidden["extracted_now"] == SAMPLES - len(before)  # what A held only in staging: redone
        assert hidden["reused_from_staging"] == 0  # node B never needs node A's staging
    else:
        assert hidden["node"] == "node-a"
        assert hidden["extracted_now"] + hidden["reused_from_staging"] == SAMPLES - len(before)
    after = list_with_etags(cluster, prefix)
    assert all(after[k] == v for k, v in before.items())  # same ETag, same LastModified
    rewritten = {p for p in watched.forwarded_paths("PUT") if any(p.endswith(k) for k in before)}
    assert not rewritten
    # One loss, one new submission, said on the step.
    lost = [m for m in messages if "lost: node node-a@" in m]
    assert len(lost) == 1 and "Submitted again to queue 'gpu'" in lost[0], messages
    assert took_s < 120, f"the range took {took_s:.0f}s to finish after the kill"
    assert BROKER_SECRET not in output


@pytest.mark.slow
def test_a_step_on_a_node_stops_once_its_dead_run_worker_s_run_is_reaped(cluster, nodes, faulty_proxy):
    key = range_key(7)
    slow = faulty_proxy()  # slowed once the range is tokenized: the extraction would go on for long
    node = nodes(
        "node-e",
        "cpu:0",
        AWS_ENDPOINT_URL_S3=slow.endpoint_url,
        DFLASH_UPLOAD_MAX_IN_FLIGHT="1",
        DFLASH_CELERY_RUN_CHECK_S="1",
    )
    run = dagster(materialize_args(BOTH, key), cluster.env)
    deadline = time.monotonic() + 180
    wait_until_tokenized(cluster.store_url, key, run)
    slow.throttle(latency_s=1.0)
    while not hidden_state_objects(cluster.store_url, key):
        assert run.poll() is None, run.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "the step never started uploading"
        time.sleep(0.1)
    (step_process,) = node.step_processes()
    os.killpg(run.pid, signal.SIGKILL)  # the shell's `dagster asset materialize`: the run worker
    run.wait(timeout=30)
    reaped = subprocess.run(
        [str(Path(sys.executable).with_name("dflash-assets")), "reap"],
        env=cluster.env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert "1 dead run(s) marked failed" in reaped.stdout, reaped.stdout + reaped.stderr
    assert gone_within(step_process, 5), "the step ran on for a run nobody waits for"
    assert "is FAILURE; stopping its step hidden_state_partitions" in node.log
    assert node.process.poll() is None  # the node itself lives on for the next step
    assert read_manifest(open_store(cluster.store_url), f"hidden-states/{key}") is None
