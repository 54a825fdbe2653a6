"""The store IO manager on a real Dagster instance and a real S3 server: upload-then-delete,
manifest last, committed partitions handed downstream."""

from pathlib import Path

import pytest
from dagster import AssetIn, DagsterInstance, StaticPartitionsDefinition, asset, materialize

from dflash_assets.orchestration.io_manager import PartitionOutput, StoreIOManager
from dflash_assets.orchestration.resources import StoreResource
from dflash_assets.storage.manifest import read_manifest
from dflash_assets.storage.open_store import open_store

PARTS = StaticPartitionsDefinition(["00000000-00000009", "00000010-00000019"])


def _assets(staging: Path, payload: bytes = b"columnar bytes"):
    @asset(name="tokenized_completions", partitions_def=PARTS, io_manager_key="store_io_manager")
    def upstream(context) -> PartitionOutput:
        path = staging / context.partition_key / "shard.parquet"
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(payload)
        return PartitionOutput(staged_files={"shard.parquet": path}, manifest_fields={"sample_indices": [1]})

    seen = {}

    @asset(
        name="hidden_state_partitions",
        partitions_def=PARTS,
        io_manager_key="store_io_manager",
        ins={"tokenized": AssetIn("tokenized_completions")},
    )
    def downstream(tokenized) -> PartitionOutput:
        seen["partition"] = tokenized
        return PartitionOutput()

    @asset(
        name="drafter_checkpoints",
        io_manager_key="store_io_manager",
        ins={"ranges": AssetIn("tokenized_completions")},
    )
    def whole(ranges) -> PartitionOutput:
        seen["ranges"] = ranges
        return PartitionOutput(prefix="checkpoints/test-run")

    return [upstream, downstream, whole], seen


def _resources(url: str, staging: Path):
    store = StoreResource(url=url, staging_dir=str(staging))
    return {"store": store, "store_io_manager": StoreIOManager(store=store)}


def test_outputs_are_uploaded_then_deleted_locally_and_committed_with_a_manifest(s3_store_url, tmp_path):
    staging = tmp_path / "staging"
    assets, _ = _assets(staging)
    instance = DagsterInstance.ephemeral()
    result = materialize(
        assets,
        selection=["tokenized_completions"],
        partition_key="00000000-00000009",
        resources=_resources(s3_store_url, staging),
        instance=instance,
    )
    assert result.success
    store = open_store(s3_store_url)
    prefix = "tokenized-completions/00000000-00000009"
    assert store.get_bytes(f"{prefix}/shard.parquet") == b"columnar bytes"
    assert not (staging / "00000000-00000009" / "shard.parquet").exists()
    manifest = read_manifest(store, prefix)
    assert manifest["objects"] == {"shard.parquet": len(b"columnar bytes")}
    assert manifest["partition"] == "00000000-00000009" and manifest["sample_indices"] == [1]
    metadata = result.asset_materializations_for_node("tokenized_completions")[0].metadata
    assert metadata["uri"].value == f"{s3_store_url}/{prefix}"


def test_downstream_receives_the_committed_partition_and_whole_asset_reads_get_only_committed_ranges(
    s3_store_url, tmp_path
):
    staging = tmp_path / "staging"
    assets, seen = _assets(staging)
    resources = _resources(s3_store_url, staging)
    instance = DagsterInstance.ephemeral()
    materialize(
        assets,
        selection=["tokenized_completions"],
        partition_key="00000010-00000019",
        resources=resources,
        instance=instance,
    )
    materialize(
        assets,
        selection=["hidden_state_partitions"],
        partition_key="00000010-00000019",
        resources=resources,
        instance=instance,
    )
    assert seen["partition"].prefix == "tokenized-completions/00000010-00000019"
    assert seen["partition"].object_keys() == [("tokenized-completions/00000010-00000019/shard.parquet", 14)]

    materialize(assets, selection=["drafter_checkpoints"], resources=resources, instance=instance)
    assert [p.partition for p in seen["ranges"]] == ["00000010-00000019"]
    assert read_manifest(open_store(s3_store_url), "checkpoints/test-run") is not None


def test_an_uncommitted_upstream_partition_is_a_clear_error_naming_what_to_materialise(
    s3_store_url, tmp_path
):
    assets, _ = _assets(tmp_path)
    result = materialize(
        assets,
        selection=["hidden_state_partitions"],
        partition_key="00000000-00000009",
        resources=_resources(s3_store_url, tmp_path),
        instance=DagsterInstance.ephemeral(),
        raise_on_error=False,
    )
    assert not result.success
    message = str(result.all_events)
    assert "Materialise tokenized_completions --partition 00000000-00000009 first" in message


def test_a_failed_upload_keeps_the_local_file_and_writes_no_manifest(
    moto_endpoint, s3_store_url, tmp_path, faulty_proxy, monkeypatch
):
    proxy = faulty_proxy()
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", proxy.endpoint_url)
    staging = tmp_path / "staging"
    assets, _ = _assets(staging)
    store = StoreResource(
        url=s3_store_url,
        staging_dir=str(staging),
        s3_max_attempts=1,
        upload_max_attempts=2,
        upload_backoff_s=0.05,
    )
    proxy.fail_share(1.0, "500", methods=["PUT"])
    result = materialize(
        assets,
        selection=["tokenized_completions"],
        partition_key="00000000-00000009",
        resources={"store": store, "store_io_manager": StoreIOManager(store=store)},
        instance=DagsterInstance.ephemeral(),
        raise_on_error=False,
    )
    assert not result.success
    assert (staging / "00000000-00000009" / "shard.parquet").read_bytes() == b"columnar bytes"
    monkeypatch.setenv("AWS_ENDPOINT_URL_S3", moto_endpoint)
    assert read_manifest(open_store(s3_store_url), "tokenized-completions/00000000-00000009") is None


@pytest.mark.parametrize("wrong", ["PartitionOutput"])
def test_returning_something_else_than_a_partition_output_is_a_type_error(tmp_path, wrong):
    @asset(io_manager_key="store_io_manager")
    def drafter_checkpoints():
        return {"not": "a partition output"}

    result = materialize(
        [drafter_checkpoints],
        resources=_resources(str(tmp_path / "s"), tmp_path),
        instance=DagsterInstance.ephemeral(),
        raise_on_error=False,
    )
    assert not result.success
    assert f"expects a {wrong}" in str(result.all_events)
