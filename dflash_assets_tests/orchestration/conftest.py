"""Fixtures of the Dagster-layer tests that several modules share: the Celery cluster and its nodes
(the parts are `support/celery_cluster.py`)."""

from __future__ import annotations

import pytest

from dflash_assets_tests.support.celery_cluster import BROKER_SECRET, Cluster, running_cluster
from dflash_assets_tests.support.celery_nodes import Node, rabbitmq_vhost, redis_database


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, moto_endpoint, demo_model_dir):
    """Redis as the broker, with a password in its URL that must never show up anywhere."""
    with redis_database() as db:
        broker = f"redis://default:{BROKER_SECRET}@127.0.0.1:6379/{db}"
        with running_cluster(
            tmp_path_factory.mktemp("redis-nodes"), moto_endpoint, demo_model_dir, broker
        ) as c:
            yield c


@pytest.fixture(scope="module")
def rabbitmq_cluster(tmp_path_factory, moto_endpoint, demo_model_dir):
    root = tmp_path_factory.mktemp("amqp-nodes")
    with rabbitmq_vhost() as broker, running_cluster(root, moto_endpoint, demo_model_dir, broker) as c:
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
