"""`hidden_state_partitions`: the target's chosen decoder-layer outputs, one object per sample."""

from pathlib import Path

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetIn,
    Config,
    MetadataValue,
    Output,
    asset,
)
from pydantic import Field

from dflash_assets import settings
from dflash_assets.assets.tokenized_completions import SAMPLE_RANGES, SHARD_NAME
from dflash_assets.core.manifest import StoredPartition, partition_prefix
from dflash_assets.core.sample_range import SampleRange
from dflash_assets.core.tokenize import read_shard
from dflash_assets.core.verify import verify_hidden_state_partition
from dflash_assets.io_manager import PartitionOutput
from dflash_assets.recovery import record_worker
from dflash_assets.resources import DeviceLeaseResource, StoreResource, TargetModelResource


class ExtractConfig(Config):
    max_tokens_per_batch: int = Field(
        default=settings.MAX_TOKENS_PER_BATCH.get_int(),
        description="Token budget per forward pass, padding included.",
    )
    max_batch_size: int = Field(default=64, description="Most samples in one forward pass.")
    progress_every_s: float = Field(default=5.0, description="Seconds between progress log lines.")
    check_decode_samples: int = Field(default=8, description="Objects the asset check decodes fully.")


def load_tokenized(partition: StoredPartition, cache_dir: Path):
    local = cache_dir / partition.prefix / SHARD_NAME
    local.parent.mkdir(parents=True, exist_ok=True)
    partition.store.download(f"{partition.prefix}/{SHARD_NAME}", local)
    return read_shard(local)


@asset(
    partitions_def=SAMPLE_RANGES,
    ins={"tokenized": AssetIn("tokenized_completions")},
    io_manager_key="store_io_manager",
    group_name="dflash",
    pool="gpu",
    kinds={"pytorch", "safetensors", "s3"},
    check_specs=[AssetCheckSpec("range_complete", asset="hidden_state_partitions", blocking=True)],
    description="Raw outputs of the target's chosen decoder layers, one safetensors object per sample.",
)
def hidden_state_partitions(
    context: AssetExecutionContext,
    config: ExtractConfig,
    tokenized: StoredPartition,
    store: StoreResource,
    target_model: TargetModelResource,
    devices: DeviceLeaseResource,
):
    from dflash_assets.core.capture import load_target_model
    from dflash_assets.core.extract import extract_range

    record_worker(context)
    sample_range = SampleRange.parse(context.partition_key)
    object_store = store.check()
    layer_ids = target_model.layer_ids()  # validated before anything touches a device
    samples = load_tokenized(tokenized, Path(target_model.cache_dir).expanduser() / "read-cache")
    if not samples:
        raise ValueError(
            f"tokenized_completions {sample_range.key} holds no samples "
            f"({len(tokenized.manifest.get('dropped', {}))} rows dropped upstream): nothing to extract"
        )
    prefix = partition_prefix("hidden_state_partitions", sample_range.key)

    with devices.lease() as device:
        context.log.info(f"{sample_range.key}: leased device {device}; target layers {layer_ids}")
        model = load_target_model(target_model.model_dir(), device)
        with store.uploader() as uploader:
            result = extract_range(
                model=model,
                target_model_name=target_model.name,
                samples=samples,
                target_layer_ids=layer_ids,
                store=object_store,
                prefix=prefix,
                staging_dir=store.staging_path(prefix),
                uploader=uploader,
                device=device,
                max_tokens_per_batch=config.max_tokens_per_batch,
                max_batch_size=config.max_batch_size,
                log=context.log.info,
                progress_every_s=config.progress_every_s,
            )

    yield Output(
        PartitionOutput(
            stored_objects=result.objects,
            manifest_fields={
                "sample_indices": [s.sample_index for s in samples],
                "dropped": tokenized.manifest.get("dropped", {}),
                "target_model": target_model.name,
                "target_layer_ids": layer_ids,
                "tokens": result.tokens,
            },
        ),
        metadata={
            "samples": result.samples,
            "tokens": result.tokens,
            "bytes_stored": result.bytes_stored,
            "extracted_now": result.extracted_now,
            "reused_from_store": result.reused_from_store,
            "reused_from_staging": result.reused_from_staging,
            "duration_s": MetadataValue.float(result.duration_s),
            "samples_per_s": MetadataValue.float(result.samples_per_s),
            "tokens_per_s": MetadataValue.float(result.tokens_per_s),
            "peak_staging_bytes": result.peak_staging_bytes,
            "staging_budget_bytes": store.staging_max_bytes,
            "padding_fraction": MetadataValue.float(result.padding_fraction),
            "device": device,
            "target_layer_ids": MetadataValue.json(layer_ids),
        },
    )

    report = verify_hidden_state_partition(
        object_store,
        prefix,
        expected_indices=[s.sample_index for s in samples],
        target_layer_ids=layer_ids,
        decode_samples=config.check_decode_samples,
    )
    yield AssetCheckResult(
        check_name="range_complete",
        passed=report.passed,
        severity=AssetCheckSeverity.ERROR,
        metadata=report.metadata(),
        description=report.summary,
    )
