"""A Celery "cluster" on loopback for the multi-node tests: Redis or RabbitMQ as the broker, a fresh
PostgreSQL database as the instance, moto for the store, and `dflash-assets worker` nodes with their
own devices, staging and caches. Test modules take the fixtures by importing them."""

from __future__ import annotations

import contextlib
import functools
import os
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
from dflash_assets_tests.support.postgres import postgres_dagster_home

BROKER_SECRET = "broker-secret-do-not-print"  # Redis accepts any password for its passwordless user
SAMPLES = 8
BOTH = "tokenized_completions,hidden_state_partitions"


def range_key(i: int) -> str:
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
def running_cluster(root: Path, moto_endpoint: str, model_dir: Path, broker_url: str) -> Iterator[Cluster]:
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


def wait_ok(process, timeout_s: float = 240) -> str:
    output, _ = process.communicate(timeout=timeout_s)
    assert process.returncode == 0, output[-5000:]
    return output


def latest_materialization(instance, asset: str, partition: str) -> dict:
    records = instance.fetch_materializations(
        AssetRecordsFilter(asset_key=AssetKey(asset), asset_partitions=[partition]), limit=1
    ).records
    assert records, f"{asset} {partition} was not materialised"
    metadata = records[0].asset_materialization.metadata
    return {"run_id": records[0].run_id, **{k: v.value for k, v in metadata.items()}}


def message_of(entry) -> str:
    return (entry.dagster_event.message if entry.dagster_event else None) or entry.user_message


@functools.cache
def _store(store_url: str):
    """One client per store for the whole test run: the tests poll listings while the product runs,
    and a new boto3 client per poll would take most of a core from the processes under test."""
    return open_store(store_url)


def hidden_state_objects(store_url: str, key: str) -> list[str]:
    return [i.key.rsplit("/", 1)[-1] for i in _store(store_url).list(f"hidden-states/{key}/hs_")]


def wait_until_tokenized(store_url: str, key: str, run, timeout_s: float = 180) -> None:
    """Until the range's tokenized manifest is in the store (its first step done), while `run` lives.
    Tests slow a node's link only then: a tokenisation through it would cost the suite a minute."""
    deadline = time.monotonic() + timeout_s
    while read_manifest(_store(store_url), f"tokenized-completions/{key}") is None:
        assert run.poll() is None, run.stdout.read()[-4000:]
        assert time.monotonic() < deadline, f"range {key} was never tokenized"
        time.sleep(0.1)


def assert_range_complete(store_url: str, key: str) -> None:
    """Every sample of the tokenized range stored exactly once, and the range committed."""
    store = _store(store_url)
    tokenized = read_manifest(store, f"tokenized-completions/{key}")
    manifest = read_manifest(store, f"hidden-states/{key}")
    assert tokenized is not None and manifest is not None, key
    expected = sorted(f"hs_{i:08d}.safetensors" for i in tokenized["sample_indices"])
    assert sorted(hidden_state_objects(store_url, key)) == expected == sorted(manifest["objects"])


def no_run_left_in_progress(instance) -> None:
    statuses = [DagsterRunStatus.STARTED, DagsterRunStatus.STARTING, DagsterRunStatus.CANCELING]
    assert not instance.get_runs(filters=RunsFilter(statuses=statuses))


def list_with_etags(cluster: Cluster, prefix: str) -> dict[str, tuple[str, object]]:
    client = boto3.client("s3", endpoint_url=cluster.moto_endpoint, region_name=TEST_REGION)
    pages = client.get_paginator("list_objects_v2").paginate(Bucket=cluster.bucket, Prefix=f"dflash/{prefix}")
    return {o["Key"]: (o["ETag"], o["LastModified"]) for page in pages for o in page.get("Contents", [])}
