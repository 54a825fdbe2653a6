"""`tokenized_completions`: chat conversations -> chat template -> token ids + assistant loss mask."""

from dagster import AssetExecutionContext, Config, MetadataValue, asset
from pydantic import Field

from dflash_assets import settings
from dflash_assets.conversations.sample_range import SampleRange
from dflash_assets.conversations.tokenize import tokenize_range, write_shard
from dflash_assets.io_manager import PartitionOutput
from dflash_assets.k8s import cpu_step_tags
from dflash_assets.nodes import step_node
from dflash_assets.partitions import SAMPLE_RANGES
from dflash_assets.resources import DatasetResource, StoreResource, TargetModelResource
from dflash_assets.storage.manifest import partition_prefix

SHARD_NAME = "shard.parquet"


class TokenizeConfig(Config):
    max_length: int = Field(default=settings.MAX_LENGTH.get_int(), description="Token limit per sample.")
    overlong: str = Field(default="truncate", description="`truncate` or `drop` samples over max_length.")
    max_bad_fraction: float = Field(
        default=0.5, description="Fail the range when more than this share of its rows is unusable."
    )


@asset(
    partitions_def=SAMPLE_RANGES,
    io_manager_key="store_io_manager",
    group_name="dflash",
    op_tags=cpu_step_tags(),
    kinds={"parquet", "s3"},
    description="Chat conversations tokenized with the target's chat template; loss mask = assistant tokens.",
)
def tokenized_completions(
    context: AssetExecutionContext,
    config: TokenizeConfig,
    store: StoreResource,
    dataset: DatasetResource,
    target_model: TargetModelResource,
) -> PartitionOutput:
    sample_range = SampleRange.parse(context.partition_key)
    node = step_node(context)
    store.check()
    tokenizer = target_model.load_tokenizer()

    result = tokenize_range(
        tokenizer,
        dataset.uri(),
        sample_range,
        max_length=config.max_length,
        overlong=config.overlong,
        max_bad_fraction=config.max_bad_fraction,
    )
    if result.rows == 0:
        # Keys are validated by shape, not against the dataset (that would read it when the code
        # location loads); an empty range must not be committed as if it were done.
        raise ValueError(
            f"sample range {sample_range.key} has no rows in {dataset.uri()}: the dataset ends before row "
            f"{sample_range.start}. Check {settings.DATASET.name} and {settings.SAMPLES_PER_PARTITION.name}, "
            "or materialise this range once the dataset has grown."
        )
    shard_path = store.staging_path(partition_prefix("tokenized_completions", sample_range.key)) / SHARD_NAME
    write_shard(result.samples, shard_path)

    context.log.info(
        f"{sample_range.key}: {len(result.samples)} samples, {result.tokens} tokens, "
        f"{len(result.dropped)} rows dropped {dict(result.dropped_by_reason)}"
    )
    context.add_output_metadata(
        {
            "samples": len(result.samples),
            "tokens": result.tokens,
            "mean_length": MetadataValue.float(result.mean_length),
            "max_length": result.max_length,
            "truncated": result.truncated,
            "dropped": len(result.dropped),
            "node": node,
            **{f"dropped_{reason}": count for reason, count in sorted(result.dropped_by_reason.items())},
        }
    )
    return PartitionOutput(
        staged_files={SHARD_NAME: shard_path},
        manifest_fields={
            "sample_indices": [s.sample_index for s in result.samples],
            "dropped": {str(index): reason for index, reason in sorted(result.dropped.items())},
            "tokens": result.tokens,
            "tokenizer": target_model.name,
            "max_length": config.max_length,
        },
    )
