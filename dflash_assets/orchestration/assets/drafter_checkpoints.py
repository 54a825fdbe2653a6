"""`drafter_checkpoints`: train the DFlash drafter from the store (offline) or beside the target (online),
on one device or data-parallel over every device of one or more nodes."""

from dagster import AssetExecutionContext, AssetIn, AssetsDefinition, asset

from dflash_assets import settings
from dflash_assets.orchestration.capacity_plan import online_split_recommender
from dflash_assets.orchestration.execution.k8s import gpu_step_tags
from dflash_assets.orchestration.execution.nodes import step_node
from dflash_assets.orchestration.execution.train_launch import node_spec
from dflash_assets.orchestration.io_manager import PartitionOutput
from dflash_assets.orchestration.redaction import redacted
from dflash_assets.orchestration.resources import DeviceLeaseResource, StoreResource, TargetModelResource
from dflash_assets.orchestration.training import (
    StepReports,
    TrainConfig,
    launch_warnings,
    manifest_fields,
    outcome_metadata,
    run_training,
    training_data_size,
    training_job,
)
from dflash_assets.storage.layout import CHECKPOINTS_PREFIX
from dflash_assets.storage.manifest import StoredPartition


def drafter_checkpoints_asset() -> AssetsDefinition:
    """The asset, with its GPU step tags as the settings say when the code location is built."""

    @asset(
        ins={
            "hidden_states": AssetIn("hidden_state_partitions"),
            "tokenized": AssetIn("tokenized_completions"),
        },
        io_manager_key="store_io_manager",
        group_name="dflash",
        pool="gpu",
        op_tags=gpu_step_tags(gpus=settings.K8S_TRAIN_GPUS.get_int()),
        kinds={"pytorch", "s3"},
        description="DFlash drafter trained on the materialised ranges, data-parallel over the GPUs of one "
        "or more nodes; resumable checkpoints; exported model.",
    )
    @redacted  # every event, log line, tag and error of the step masks secrets
    def drafter_checkpoints(
        context: AssetExecutionContext,
        config: TrainConfig,
        hidden_states: list[StoredPartition],
        tokenized: list[StoredPartition],
        store: StoreResource,
        target_model: TargetModelResource,
        devices: DeviceLeaseResource,
    ) -> PartitionOutput:
        node = step_node(context)
        store.check()
        train = config.train_settings()
        spec = node_spec(store, target_model, devices, run=config.run, holder=f"run {context.run.run_id}")
        recommend = online_split_recommender(target_model, tokenized, train, context.log.info)
        launch, target_devices = config.launch(len(spec.devices), train.mode, recommend)
        job = training_job(
            config, store, target_model, hidden_states, tokenized,
            online_target_devices=target_devices, log=context.log.info,
        )  # fmt: skip
        context.log.info(
            f"training run {job.run!r} in {job.mode} mode: {launch.nproc_per_node} rank(s) per node on "
            f"{launch.nnodes} node(s), world size {launch.world_size}"
        )
        for warning in launch_warnings(train.global_batch_size, launch):
            context.log.warning(warning)
        outcome = run_training(job, launch, spec, StepReports(context), run_id=context.run.run_id)
        size = training_data_size(
            tokenized, outcome["trained_sample_ranges"], job.settings["max_length"], store.read_cache_dir()
        )
        context.add_output_metadata({**outcome_metadata(outcome, job, node), **size})
        return PartitionOutput(
            prefix=f"{CHECKPOINTS_PREFIX}/{job.run}",
            manifest_fields={**manifest_fields(outcome, job), **size},
        )

    return drafter_checkpoints
