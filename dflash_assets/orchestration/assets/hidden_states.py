"""`hidden_state_partitions`: the target's chosen decoder-layer outputs, one object per sample."""

import warnings
from types import SimpleNamespace

from dagster import (
    AssetCheckExecutionContext,
    AssetCheckResult,
    AssetCheckSeverity,
    AssetExecutionContext,
    AssetIn,
    AssetsDefinition,
    Config,
    Output,
    asset,
    asset_check,
)
from pydantic import Field

from dflash_assets import settings
from dflash_assets.conversations.sample_range import SampleRange
from dflash_assets.conversations.shard import load_shard
from dflash_assets.orchestration.capacity_plan import resolve_target_tp
from dflash_assets.orchestration.execution.k8s import gpu_step_tags
from dflash_assets.orchestration.execution.nodes import step_node
from dflash_assets.orchestration.io_manager import PartitionOutput
from dflash_assets.orchestration.metadata import dagster_metadata
from dflash_assets.orchestration.partitions import SAMPLE_RANGES
from dflash_assets.orchestration.progress import RangeProgressReporter
from dflash_assets.orchestration.redaction import redacted
from dflash_assets.orchestration.resources import DeviceLeaseResource, StoreResource, TargetModelResource
from dflash_assets.orchestration.training import announce_drafter
from dflash_assets.storage.manifest import StoredPartition, partition_prefix, read_manifest


class ExtractConfig(Config):
    max_tokens_per_batch: int | None = Field(
        default=None, description=settings.MAX_TOKENS_PER_BATCH.field_description()
    )
    max_batch_size: int = Field(default=64, description="Most samples in one forward pass.")
    progress_every_s: float = Field(
        default=15.0, description="Seconds between progress snapshots (run tag, compute-log line)."
    )
    observe_every_s: float = Field(
        default=60.0, description="Seconds between progress observations of the range (and one at the end)."
    )
    hidden_state_dtype: str | None = Field(
        default=None, description=settings.HIDDEN_STATE_DTYPE.field_description()
    )
    target_tp: str | None = Field(default=None, description=settings.TARGET_TP.field_description())
    capture_final_state: bool | None = Field(
        default=None, description=settings.CAPTURE_FINAL_STATE.field_description()
    )

    def token_budget(self) -> int:
        return settings.given_or(self.max_tokens_per_batch, settings.MAX_TOKENS_PER_BATCH.get_int)

    def stored_dtype(self) -> str:
        """`bf16` or `fp8`, checked."""
        from dflash_assets.extraction.object_size import check_hidden_state_dtype

        dtype = settings.given_or(self.hidden_state_dtype, settings.HIDDEN_STATE_DTYPE.get)
        return check_hidden_state_dtype(dtype)

    def final_state(self) -> bool:
        """Whether the objects hold the target's final hidden state too."""
        return settings.given_or(self.capture_final_state, settings.CAPTURE_FINAL_STATE.get_bool)


def hidden_state_partitions_asset() -> AssetsDefinition:
    """The asset, with its GPU step tags as the settings say when the code location is built."""

    @asset(
        partitions_def=SAMPLE_RANGES,
        ins={"tokenized": AssetIn("tokenized_completions")},
        io_manager_key="store_io_manager",
        group_name="dflash",
        pool="gpu",
        op_tags=gpu_step_tags(gpus=settings.target_tp() or 1),  # a pod gets every device the target spans
        kinds={"pytorch", "safetensors", "s3"},
        description="Raw outputs of the target's chosen decoder layers, one safetensors object per sample.",
    )
    @redacted  # every event, log line, tag and error of the step masks secrets
    def hidden_state_partitions(
        context: AssetExecutionContext,
        config: ExtractConfig,
        tokenized: StoredPartition,
        store: StoreResource,
        target_model: TargetModelResource,
        devices: DeviceLeaseResource,
    ) -> Output:
        from dflash_assets.extraction.extract import extract_range
        from dflash_assets.target.model import load_target_model

        sample_range = SampleRange.parse(context.partition_key)
        object_store = store.check()
        layer_ids = target_model.layer_ids()  # validated before anything touches a device
        announce_drafter(target_model, context.log.info)
        dtype = config.stored_dtype()
        samples = load_shard(tokenized, store.read_cache_dir())
        if not samples:
            raise ValueError(
                f"tokenized_completions {sample_range.key} holds no samples "
                f"({len(tokenized.manifest.get('dropped', {}))} rows dropped upstream): nothing to extract"
            )
        prefix = partition_prefix("hidden_state_partitions", sample_range.key)
        progress = RangeProgressReporter(context, sample_range.key, config.observe_every_s)
        tp = resolve_target_tp(config.target_tp, "capture", target_model, log=progress.note)  # before a lease
        progress.set_status("waiting for a device")
        extraction = {  # extract_range's arguments, wherever it runs
            "target_model_name": target_model.name,
            "target_layer_ids": layer_ids,
            "prefix": prefix,
            "staging_dir": store.staging_path(prefix),
            "max_tokens_per_batch": config.token_budget(),
            "max_batch_size": config.max_batch_size,
            "progress_every_s": config.progress_every_s,
            "hidden_state_dtype": dtype,
            "source": tokenized.prefix,  # relative: a store copied elsewhere keeps its objects
            "final_state": config.final_state(),
        }
        if tp > 1:
            job = _split_capture_job(context, store, target_model, devices, tokenized, extraction, tp)
            result = _capture_over_devices(context, progress, job)
        else:
            with devices.lease(holder=f"run {context.run.run_id}", log=progress.note) as device:
                progress.note(f"leased device {device}; loading the target, layers {layer_ids}")
                with store.uploader() as uploader:
                    result = extract_range(
                        model=load_target_model(target_model.model_dir(), device, lm_head=False),
                        samples=samples,
                        store=object_store,
                        uploader=uploader,
                        device=device,
                        log=progress.log_line,
                        warn=context.log.warning,
                        on_progress=progress,
                        **extraction,
                    )
        context.log.info(f"{sample_range.key}: {result.summary()}")
        manifest_fields = {
            "sample_indices": [s.sample_index for s in samples],
            "dropped": tokenized.manifest.get("dropped", {}),
            "target_model": target_model.name,
            "target_layer_ids": layer_ids,
            "tokens": result.tokens,
            "hidden_state_dtype": dtype,
            "final_hidden_states": extraction["final_state"],
        }
        return Output(
            PartitionOutput(stored_objects=result.objects, manifest_fields=manifest_fields),
            metadata=dagster_metadata({**result.metadata(), "node": step_node(context)}),
        )

    return hidden_state_partitions


class _SplitCapture:
    """What rank 0 of a split target reports about its range, with the same reading as `ExtractionResult`."""

    def __init__(self, outcome: dict) -> None:
        self.objects: dict[str, int] = outcome["objects"]
        self.tokens: int = outcome["tokens"]
        self._metadata: dict = outcome["metadata"]
        self._summary: str = outcome["summary"]

    def metadata(self) -> dict:
        return self._metadata

    def summary(self) -> str:
        return self._summary


def _split_capture_job(context, store, target_model, devices, tokenized, extraction, tp: int):
    """What each of the `tp` ranks of the range's capture reads (`extraction/rank.py`)."""
    from dflash_assets.target.ranks import TargetRankJob

    return TargetRankJob(
        stage="capture",
        model_dir=str(target_model.model_dir()),
        tp=tp,
        devices=devices.candidates(),
        lock_dir=str(devices.lock_directory()),
        holder=f"run {context.run.run_id}",
        timeout_s=settings.TARGET_TP_TIMEOUT_S.get_float(),
        work={
            **extraction,
            "staging_dir": str(extraction["staging_dir"]),
            "store_url": store.store_url(),
            "s3": store.s3_settings_fields(),
            "upload": store.uploader_fields(),
            "tokenized_prefix": tokenized.prefix,
            "tokenized_manifest": tokenized.manifest,
            "read_cache_dir": str(store.read_cache_dir()),
        },
    )


def _capture_over_devices(context, progress: RangeProgressReporter, job) -> _SplitCapture:
    """The range captured by `job.tp` ranks, each holding a shard of the target on a device of its own
    (`orchestration/execution/target_launch.py`); rank 0 writes the objects as one device would."""
    from dflash_assets.extraction.monitor import ExtractionProgress
    from dflash_assets.orchestration.execution.target_launch import run_target_ranks

    reports = SimpleNamespace(
        log=progress.log_line,
        warn=context.log.warning,
        status=progress.set_status,
        progress=lambda snapshot: progress(ExtractionProgress(**snapshot)),
    )
    layers = job.work["target_layer_ids"]
    progress.note(f"capturing over {job.tp} devices, one rank each (layers {layers})")
    return _SplitCapture(run_target_ranks(job, reports))


class RangeCheckConfig(Config):
    decode_samples: int = Field(
        default=1, description="Objects decoded fully (every object's checksum is compared either way)."
    )


@redacted
def _range_complete(
    context: AssetCheckExecutionContext,
    config: RangeCheckConfig,
    store: StoreResource,
    target_model: TargetModelResource,
) -> AssetCheckResult:
    from dflash_assets.extraction.verify import verify_hidden_state_partition

    object_store = store.check()
    key = context.partition_key
    prefix = partition_prefix("hidden_state_partitions", key)
    manifest = read_manifest(object_store, prefix) or {}
    tokenized = read_manifest(object_store, partition_prefix("tokenized_completions", key)) or manifest
    report = verify_hidden_state_partition(
        object_store,
        prefix,
        expected_indices=[int(i) for i in tokenized.get("sample_indices", [])],
        target_layer_ids=target_model.layer_ids(),
        decode_samples=config.decode_samples,
        hidden_state_dtype=manifest.get("hidden_state_dtype"),
    )
    if not report.passed:
        context.log.error(f"{key}: {report.summary}")
    return AssetCheckResult(
        passed=report.passed,
        severity=AssetCheckSeverity.ERROR,
        metadata=report.metadata(),
        description=report.summary,
    )


RANGE_CHECK_DESCRIPTION = (
    "Every sample of the tokenized range has its object in the store with the size and checksum the "
    "manifest recorded at commit (compared without downloading), and an object decodes with the range's "
    "layers, dtype and finite values. Blocking: a run that fails it does not go on to train; run it alone "
    "to re-verify a committed range."
)
# A partitioned check is a Dagster preview feature, used knowingly here; its PreviewWarning would print
# above every command's output and read as breakage.
with warnings.catch_warnings():
    warnings.filterwarnings("ignore", message="Specifying a partitions_def on an AssetCheckSpec")
    range_complete = asset_check(
        asset="hidden_state_partitions",
        name="range_complete",
        blocking=True,
        partitions_def=SAMPLE_RANGES,
        description=RANGE_CHECK_DESCRIPTION,
    )(_range_complete)
