"""The drafter trained over two Celery worker nodes (`DFLASH_EXECUTOR=celery`, `DFLASH_TRAIN_NNODES=2`,
one rank per node): the training step runs its node's rank and places the other on the second node,
whose rank leases that node's own device; a node killed after a committed checkpoint and brought back
rejoins, and the run finishes from that checkpoint. The cluster is `support/celery_cluster.py`."""

from __future__ import annotations

import json
import os
import signal
import time
from pathlib import Path

import pytest
from dagster import AssetKey

from dflash_assets.storage.open_store import open_store
from dflash_assets_tests.support.celery_cluster import message_of, no_run_left_in_progress
from dflash_assets_tests.support.celery_nodes import process_alive, process_children
from dflash_assets_tests.support.cli import dagster, materialize_args

TRAIN = {
    "max_steps": 10,
    "checkpoint_every_steps": 2,
    "global_batch_size": 4,
    "num_anchors": 16,
    "eval_samples": 0,  # nothing held out: the evaluations are another test's
    "spec_eval_prompts": 0,
    "log_every_steps": 1,
    "max_length": 256,
    "run_name": "two-nodes",
}
# The shared demo ranges hold 24 samples a range; both nodes and the shell agree on it. Both "nodes" run
# on this one host, whose name resolves to loopback: they talk over `lo` (a multi-node run refuses a
# loopback host name unless an interface is chosen).
RANGES = {"DFLASH_SAMPLES_PER_PARTITION": "24", "DFLASH_TRAIN_NETWORK_INTERFACE": "lo"}
# Set in the launching shell alone: how a run trains travels with the run to the node its step runs on.
TWO_NODES = {**RANGES, "DFLASH_TRAIN_NNODES": "2", "DFLASH_TRAIN_NPROC_PER_NODE": "1"}


def _descendants(pid: int) -> list[int]:
    found, todo = [], [pid]
    while todo:
        children = process_children(todo.pop())
        found += children
        todo += children
    return found


def _ranks_of(node) -> list[int]:
    """The training ranks running under this node's worker."""
    found = []
    for pid in _descendants(node.pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes()
        except OSError:
            continue
        if b"dflash_assets.training.rank" in command and b"dflash_assets.training.launcher" not in command:
            found.append(pid)
    return found


def _launcher_of(node) -> str | None:
    """`host` or `join` for the launcher running under this node's worker, None without one."""
    for pid in _descendants(node.pid):
        try:
            command = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "dflash_assets.training.launcher" in command:
            return "host" if "is_host=1" in command else "join"
    return None


@pytest.mark.slow
def test_two_nodes_train_one_rank_each_and_a_node_killed_after_a_checkpoint_rejoins_when_back(
    cluster, nodes, demo_ranges
):
    demo_ranges.copy_to(open_store(cluster.store_url))
    node_a = nodes("node-a", "cpu:0", **RANGES)
    node_b = nodes("node-b", "cpu:0", **RANGES)  # each node's own device, leased in its own directory
    run = dagster(materialize_args("drafter_checkpoints", None, TRAIN), {**cluster.env, **TWO_NODES})
    store = open_store(cluster.store_url)
    deadline = time.monotonic() + 400
    while store.head("checkpoints/two-nodes/step_00000002/_complete.json") is None:
        assert run.poll() is None, run.stdout.read()[-5000:]
        assert time.monotonic() < deadline, "no checkpoint was committed"
        time.sleep(0.1)
    launchers = {node: _launcher_of(node) for node in (node_a, node_b)}
    joined = node_a if launchers[node_a] == "join" else node_b
    host = node_b if joined is node_a else node_a
    # The host's ranks are held still while the other node goes, so the run cannot finish in between
    # however fast this machine is; they meet the lost peer at their next collective.
    held = _ranks_of(host)
    assert held, "no training rank runs under the host node"
    for pid in held:
        os.kill(pid, signal.SIGSTOP)
    try:
        assert sorted(launchers.values(), key=str) == ["host", "join"], launchers
        ended = store.head("checkpoints/two-nodes/_manifest.json") is not None
        assert not ended, "the run ended before the node was lost"
        ranks_before = _descendants(joined.pid)
        joined.kill_group()  # the joined node lost: its worker, join task, launcher and rank at once
        time.sleep(2)
        assert not [pid for pid in ranks_before if process_alive(pid)]
    finally:
        for pid in held:
            os.kill(pid, signal.SIGCONT)
    committed = {
        info.key: store.get_bytes(info.key) for info in store.list("checkpoints/two-nodes/step_00000002/")
    }
    joined.start()  # back, under the same name

    output, _ = run.communicate(timeout=600)
    assert run.returncode == 0, output[-5000:]
    with cluster.instance() as instance:
        event = instance.get_latest_materialization_event(AssetKey("drafter_checkpoints"))
        metadata = {k: v.value for k, v in event.asset_materialization.metadata.items()}
        messages = "\n".join(message_of(e) or "" for e in instance.all_logs(event.run_id))
        no_run_left_in_progress(instance)
    assert f"node {joined.name} left the training" in messages, messages[-4000:]
    assert "launching every node again (1 of" in messages
    assert "resuming run two-nodes from" in messages
    assert metadata["world_size"] == 2 and metadata["steps"] == TRAIN["max_steps"]
    assert sorted(r["node"] for r in metadata["rank_devices"]) == ["node-a", "node-b"]
    assert {r["device"] for r in metadata["rank_devices"]} == {"cpu:0"}
    after = {
        info.key: store.get_bytes(info.key) for info in store.list("checkpoints/two-nodes/step_00000002/")
    }
    assert after == committed  # the committed checkpoint the run resumed from was not rewritten
    manifest = json.loads(store.get_bytes("checkpoints/two-nodes/_manifest.json"))
    assert manifest["steps"] == TRAIN["max_steps"]
    # Nothing keeps running on either node: only the workers' own pools remain.
    for node in (node_a, node_b):
        assert _launcher_of(node) is None
