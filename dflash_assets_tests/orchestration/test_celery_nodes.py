"""Ranges spread over several nodes through Dagster's Celery executor, on the real parts: two
`dflash-assets worker` processes as two nodes on loopback (their own names, devices, staging and
caches), Redis as the broker (a database of its own), a fresh PostgreSQL database as the instance,
moto for S3, and every range materialised through the `dagster` CLI with `DFLASH_EXECUTOR=celery`.

A node killed mid-range (its whole process group) costs nothing: its step is submitted again, another
node finishes the range from the store, and nothing it had uploaded is written again."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import boto3
import pytest
from dagster import AssetKey, AssetRecordsFilter, DagsterRunStatus, RunsFilter

from dflash_assets.storage.manifest import read_manifest
from dflash_assets.storage.open_store import open_store
from dflash_assets_tests.conftest import TEST_REGION, aws_env, aws_env_set, create_bucket, open_instance
from dflash_assets_tests.support.celery_nodes import Node, process_alive, rabbitmq_vhost, redis_database
from dflash_assets_tests.support.cli import dagster, materialize_args
from dflash_assets_tests.support.postgres import postgres_dagster_home

BROKER_SECRET = "broker-secret-do-not-print"  # Redis accepts any password for its passwordless user
SAMPLES = 8
BOTH = "tokenized_completions,hidden_state_partitions"


def _range(i: int) -> str:
    return f"{i * SAMPLES:08d}-{(i + 1) * SAMPLES - 1:08d}"


@dataclass
class Cluster:
    root: Path
    env: dict[str, str]  # what every process of this "cluster" shares: broker, instance, store
    store_url: str
    bucket: str
    moto_endpoint: str

    @contextlib.contextmanager
    def instance(self):
        """The cluster's Dagster instance, opened with its own DAGSTER_PG_* variables."""
        with pytest.MonkeyPatch.context() as patch:
            for name, value in self.env.items():
                if name.startswith("DAGSTER_PG_"):
                    patch.setenv(name, value)
            with open_instance(self.env["DAGSTER_HOME"]) as instance:
                yield instance

    def node_env(self, name: str, devices: str, **extra: str) -> dict[str, str]:
        """A node's own devices, staging and cache directories."""
        home = self.root / name
        return {
            **self.env,
            "DFLASH_DEVICES": devices,
            "DFLASH_STAGING_DIR": str(home / "staging"),
            "DFLASH_CACHE_DIR": str(home / "cache"),
            "DFLASH_HOME": str(home),
            **extra,
        }


@contextlib.contextmanager
def _cluster(root: Path, moto_endpoint: str, model_dir: Path, broker_url: str) -> Iterator[Cluster]:
    bucket = f"nodes-{uuid.uuid4().hex[:12]}"
    create_bucket(moto_endpoint, bucket)
    with postgres_dagster_home(root / "dagster-home") as instance_env:
        env = {
            **os.environ,
            **aws_env(moto_endpoint),
            **instance_env,
            "DFLASH_EXECUTOR": "celery",
            "DFLASH_CELERY_BROKER_URL": broker_url,
            "DFLASH_CELERY_NODE_LOST_AFTER_S": "5",
            "DFLASH_STORE_URL": f"s3://{bucket}/dflash",
            "DFLASH_TARGET_MODEL": str(model_dir),  # the same model directory on every node
            "DFLASH_SAMPLES_PER_PARTITION": str(SAMPLES),
            "DFLASH_HOME": str(root / "shell"),
            "OMP_NUM_THREADS": "1",
        }
        # The test process reads the store too, with the same variables (the instance: `instance()`).
        with aws_env_set(moto_endpoint):
            yield Cluster(root, env, f"s3://{bucket}/dflash", bucket, moto_endpoint)


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, moto_endpoint, demo_model_dir):
    """Redis as the broker, with a password in its URL that must never show up anywhere."""
    with redis_database() as db:
        broker = f"redis://default:{BROKER_SECRET}@127.0.0.1:6379/{db}"
        with _cluster(tmp_path_factory.mktemp("redis-nodes"), moto_endpoint, demo_model_dir, broker) as c:
            yield c


@pytest.fixture(scope="module")
def rabbitmq_cluster(tmp_path_factory, moto_endpoint, demo_model_dir):
    root = tmp_path_factory.mktemp("amqp-nodes")
    with rabbitmq_vhost() as broker, _cluster(root, moto_endpoint, demo_model_dir, broker) as c:
        yield c


@pytest.fixture
def nodes(request, tmp_path):
    """`nodes(name, devices, cluster=the Redis one, **env)` starts a worker node; every node is stopped
    after the test."""
    started: list[Node] = []

    def start(name: str, devices: str, cluster: Cluster | None = None, **extra: str) -> Node:
        cluster = cluster or request.getfixturevalue("cluster")
        node = Node(name, cluster.node_env(name, devices, **extra), tmp_path / f"{name}.log")
        started.append(node)
        return node.start()

    yield start
    for node in started:
        node.stop()


def _wait(process, timeout_s: float = 240) -> str:
    output, _ = process.communicate(timeout=timeout_s)
    assert process.returncode == 0, output[-5000:]
    return output


def _latest(instance, asset: str, partition: str) -> dict:
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=AssetKey(asset), asset_partitions=[partition]), limit=1
    ).records
    assert records, f"{asset} {partition} was not materialised"
    metadata = records[0].asset_materialization.metadata
    return {"run_id": records[0].run_id, **{k: v.value for k, v in metadata.items()}}


def _gone_within(pid: int, seconds: float) -> bool:
    deadline = time.monotonic() + seconds
    while process_alive(pid):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.1)
    return True


def _message(entry) -> str:
    return (entry.dagster_event.message if entry.dagster_event else None) or entry.user_message


def _hidden_state_objects(store_url: str, key: str) -> list[str]:
    return [i.key.rsplit("/", 1)[-1] for i in open_store(store_url).list(f"hidden-states/{key}/hs_")]


def _assert_range_complete(store_url: str, key: str) -> None:
    """Every sample of the tokenized range stored exactly once, and the range committed."""
    store = open_store(store_url)
    tokenized = read_manifest(store, f"tokenized-completions/{key}")
    manifest = read_manifest(store, f"hidden-states/{key}")
    assert tokenized is not None and manifest is not None, key
    expected = sorted(f"hs_{i:08d}.safetensors" for i in tokenized["sample_indices"])
    assert sorted(_hidden_state_objects(store_url, key)) == expected == sorted(manifest["objects"])


def _no_run_left_in_progress(instance) -> None:
    statuses = [DagsterRunStatus.STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.CANCELING]
    assert not instance.get_runs(filters=RunsFilter(statuses=statuses))


@pytest.mark.slow
def test_four_ranges_spread_over_both_nodes_and_each_step_records_its_node(cluster, nodes):
    node_a = nodes("node-a", "cpu:0")
    node_b = nodes("node-b", "cpu:1")
    keys = [_range(i) for i in range(4)]
    runs = [dagster(materialize_args(BOTH, key), cluster.env) for key in keys]
    outputs = [_wait(run) for run in runs]

    with cluster.instance() as instance:
        hidden = {key: _latest(instance, "hidden_state_partitions", key) for key in keys}
        tokenized = {key: _latest(instance, "tokenized_completions", key) for key in keys}
        _no_run_left_in_progress(instance)
        run_ids = {m["run_id"] for m in hidden.values()}
        events = [e for run_id in run_ids for e in instance.all_logs(run_id)]
        stored_runs = [instance.get_run_by_id(run_id) for run_id in run_ids]
    assert {m["node"] for m in hidden.values()} == {"node-a", "node-b"}, hidden
    assert {m["node"] for m in tokenized.values()} <= {"node-a", "node-b"}
    for key in keys:
        _assert_range_complete(cluster.store_url, key)
        assert hidden[key]["samples"] == SAMPLES
    # The UI shows where each step ran: an event on the step, and a line in its compute logs.
    on_node = [_message(e) for e in events if e.step_key == "hidden_state_partitions"]
    assert sum("Executing step hidden_state_partitions on node node-" in m for m in on_node) == 4
    assert not [m for m in map(_message, events) if " lost: " in m]  # a node at work is never counted lost
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


def _list_with_etags(cluster: Cluster, prefix: str) -> dict[str, tuple[str, object]]:
    client = boto3.client("s3", endpoint_url=cluster.moto_endpoint, region_name=TEST_REGION)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=cluster.bucket, Prefix=f"dflash/{prefix}")
    return {o["Key"]: (o["ETag"], o["LastModified"]) for page in pages for o in page.get("Contents", [])}


@pytest.mark.slow
@pytest.mark.parametrize(
    ("broker", "finisher"), [("redis", "another node"), ("rabbitmq", "the same node, restarted")]
)
def test_a_node_killed_mid_range_costs_nothing_and_the_range_is_finished_from_the_store(
    broker, finisher, request, nodes, faulty_proxy
):
    cluster = request.getfixturevalue("cluster" if broker == "redis" else "rabbitmq_cluster")
    key = _range(4)
    prefix = f"hidden-states/{key}/"
    # Node A uploads through a slow link, so it is killed with some samples uploaded and some not.
    slow = faulty_proxy()
    slow.throttle(latency_s=0.3)
    node_a = nodes(
        "node-a", "cpu:0", cluster, AWS_ENDPOINT_URL_S3=slow.endpoint_url, DFLASH_UPLOAD_MAX_IN_FLIGHT="1"
    )
    run = dagster(materialize_args(BOTH, key), cluster.env)
    deadline = time.monotonic() + 180
    while len(_hidden_state_objects(cluster.store_url, key)) < 3:
        assert run.poll() is None, run.stdout.read()[-4000:]
        assert time.monotonic() < deadline, "node A never started uploading"
        time.sleep(0.05)
    # The finishing node reaches the store through a proxy that records its requests.
    watched = faulty_proxy()
    if finisher == "another node":  # node B, started later, idle
        nodes("node-b", "cpu:0", cluster, AWS_ENDPOINT_URL_S3=watched.endpoint_url)
    node_a.kill_group()
    killed_at = time.monotonic()
    time.sleep(1.0)  # a request node A's link had already taken lands now, or never
    before = {k: v for k, v in _list_with_etags(cluster, prefix).items() if "/hs_" in k}
    staged_on_a = list((cluster.root / "node-a" / "staging" / prefix).glob("hs_*.safetensors"))
    assert 0 < len(before) < SAMPLES and staged_on_a, "node A was not killed mid-range"
    if finisher != "another node":  # node A again, under its own name, with its staging
        node_a.env = {**node_a.env, "AWS_ENDPOINT_URL_S3": watched.endpoint_url}
        node_a.start()

    output = _wait(run)
    took_s = time.monotonic() - killed_at

    with cluster.instance() as instance:
        hidden = _latest(instance, "hidden_state_partitions", key)
        messages = [_message(e) for e in instance.all_logs(hidden["run_id"])]
        _no_run_left_in_progress(instance)
        assert instance.get_run_by_id(hidden["run_id"]).is_success
    _assert_range_complete(cluster.store_url, key)
    assert hidden["reused_from_store"] == len(before)  # every object node A uploaded was kept
    if finisher == "another node":
        assert hidden["node"] == "node-b"
        assert hidden["extracted_now"] == SAMPLES - len(before)  # what A held only in staging: redone
        assert hidden["reused_from_staging"] == 0  # node B never needs node A's staging
    else:
        assert hidden["node"] == "node-a"
        assert hidden["extracted_now"] + hidden["reused_from_staging"] == SAMPLES - len(before)
    after = _list_with_etags(cluster, prefix)
    assert all(after[k] == v for k, v in before.items())  # same ETag, same LastModified
    rewritten = {p for p in watched.forwarded_paths("PUT") if any(p.endswith(k) for k in before)}
    assert not rewritten
    # One loss, one new submission, said on the step.
    lost = [m for m in messages if "lost: node node-a@" in m]
    assert len(lost) == 1 and "Submitted again to queue 'gpu'" in lost[0], messages
    assert took_s < 120, f"the range took {took_s:.0f}s to finish after the kill"
    assert BROKER_SECRET not in output


def test_a_run_launched_while_no_worker_is_up_waits_and_completes_when_one_starts(cluster, nodes):
    key = _range(5)
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
        assert _latest(instance, "tokenized_completions", key)["node"] == "node-c"


def test_a_step_whose_process_keeps_dying_is_submitted_again_once_then_fails_the_run(cluster, nodes):
    key = _range(6)
    nodes("node-d", "cpu:0", DFLASH_FAULT_POINTS="extract_forward@1")  # each step process dies mid-range
    run = dagster(materialize_args(BOTH, key), {**cluster.env, "DFLASH_CELERY_STEP_RESUBMITS": "1"})
    output, _ = run.communicate(timeout=240)
    assert run.returncode != 0, output[-4000:]
    with cluster.instance() as instance:
        (failed,) = [r for r in instance.get_runs() if r.tags.get("dagster/partition") == key]
        messages = [_message(e) for e in instance.all_logs(failed.run_id)]
    assert failed.status == DagsterRunStatus.FAILURE  # failed, not left started
    # One re-launch for it: Dagster's run retries (the failed-range sensor leaves such runs alone).
    assert failed.tags["dagster/failure_reason"] == "RUN_EXCEPTION"
    assert failed.tags["dagster/will_retry"] == "true"
    again = [m for m in messages if "Submitted again" in m]
    assert len(again) == 1 and "its step process on node-d@" in again[0], messages
    gave_up = [m for m in messages if "so the run fails" in m]
    assert len(gave_up) == 1 and "DFLASH_CELERY_STEP_RESUBMITS" in gave_up[0]


@pytest.mark.slow
def test_a_step_on_a_node_stops_once_its_dead_run_worker_s_run_is_reaped(cluster, nodes, faulty_proxy):
    key = _range(7)
    slow = faulty_proxy()
    slow.throttle(latency_s=1.0)  # the step would go on for many seconds
    node = nodes(
        "node-e",
        "cpu:0",
        AWS_ENDPOINT_URL_S3=slow.endpoint_url,
        DFLASH_UPLOAD_MAX_IN_FLIGHT="1",
        DFLASH_CELERY_RUN_CHECK_S="1",
    )
    run = dagster(materialize_args(BOTH, key), cluster.env)
    deadline = time.monotonic() + 180
    while not _hidden_state_objects(cluster.store_url, key):
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
    assert _gone_within(step_process, 5), "the step ran on for a run nobody waits for"
    assert "is FAILURE; stopping its step hidden_state_partitions" in node.log
    assert node.process.poll() is None  # the node itself lives on for the next step
    assert read_manifest(open_store(cluster.store_url), f"hidden-states/{key}") is None
