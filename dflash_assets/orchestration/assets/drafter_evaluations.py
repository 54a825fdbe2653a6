"""`drafter_evaluations`: what the configured run's drafter is worth on each prompt set, beside the free
floor (prompt lookup), one partition per set; its check warns when the drafter is below the floor."""

import json
import warnings
from typing import Any

from dagster import (
    AssetCheckResult,
    AssetCheckSeverity,
    AssetCheckSpec,
    AssetExecutionContext,
    AssetsDefinition,
    Config,
    MetadataValue,
    Output,
    StaticPartitionsDefinition,
    asset,
)
from pydantic import Field

from dflash_assets import settings
from dflash_assets.orchestration.execution.k8s import gpu_step_tags
from dflash_assets.orchestration.io_manager import PartitionOutput
from dflash_assets.orchestration.metadata import dagster_metadata
from dflash_assets.orchestration.redaction import redacted
from dflash_assets.orchestration.resources import (
    DeviceLeaseResource,
    StoreResource,
    TargetModelResource,
)
from dflash_assets.storage.layout import DRAFTER_PREFIX, EVALUATION_NAME, evaluation_prefix

CHECK_NAME = "tau_at_least_floor"


class EvaluationConfig(Config):
    """Run config of `drafter_evaluations`. Unset fields take their `DFLASH_*` setting."""

    run_name: str | None = Field(default=None, description=settings.RUN_NAME.field_description())
    prompts: int | None = Field(default=None, description=settings.EVAL_PROMPTS.field_description())
    new_tokens: int | None = Field(default=None, description=settings.EVAL_NEW_TOKENS.field_description())

    @property
    def run(self) -> str:
        return self.run_name or settings.RUN_NAME.get()

    def prompt_count(self) -> int:
        count = settings.given_or(self.prompts, settings.EVAL_PROMPTS.get_int)
        if count < 1:
            raise settings.SettingError(f"prompts: {count} must be 1 or more ({settings.EVAL_PROMPTS.name})")
        return count

    def token_count(self) -> int:
        count = settings.given_or(self.new_tokens, settings.EVAL_NEW_TOKENS.get_int)
        if count < 1:
            raise settings.SettingError(
                f"new_tokens: {count} must be 1 or more ({settings.EVAL_NEW_TOKENS.name})"
            )
        return count


def prompt_set_partitions() -> StaticPartitionsDefinition:
    """`held_out` and the sets `DFLASH_EVAL_SETS` names, read when the code location is built."""
    from dflash_assets.evaluation.prompt_sets import parse_eval_sets

    return StaticPartitionsDefinition([spec.name for spec in parse_eval_sets(settings.EVAL_SETS.get())])


def drafter_evaluations_asset() -> AssetsDefinition:
    """The asset, partitioned by the prompt sets the settings name when the code location is built."""
    partitions = prompt_set_partitions()
    # A verdict per set, so one set's pass never hides another's warning. A partitioned check is a Dagster
    # preview feature, used knowingly (as `range_complete` is); its PreviewWarning would read as breakage.
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="Specifying a partitions_def on an AssetCheckSpec")
        tau_check = AssetCheckSpec(
            CHECK_NAME,
            asset="drafter_evaluations",
            description="The drafter's τ on the prompt set is at least the training-free prompt-lookup "
            "drafter's on the same prompts and loop (a warning: below it, training bought nothing here).",
            partitions_def=partitions,
        )

    @asset(
        partitions_def=partitions,
        deps=["drafter_checkpoints"],
        io_manager_key="store_io_manager",
        group_name="dflash",
        pool="gpu",
        op_tags=gpu_step_tags(gpus=1),
        kinds={"pytorch", "s3"},
        check_specs=[tau_check],
        description="The configured run's drafter decoded with the target on one prompt set (a partition "
        "each: `held_out` and DFLASH_EVAL_SETS), beside prompt lookup, the free floor: τ, acceptance per "
        "draft position, τ by context length, outputs equal to the target's greedy ones.",
    )
    @redacted  # every event, log line, tag and error of the step masks secrets
    def drafter_evaluations(
        context: AssetExecutionContext,
        config: EvaluationConfig,
        store: StoreResource,
        target_model: TargetModelResource,
        devices: DeviceLeaseResource,
    ):
        from dflash_assets.evaluation.report import above_floor, check_description, summary_line

        object_store = store.check()
        run, name = config.run, context.partition_key
        record = evaluate_run_on_set(
            context, config, object_store, store, target_model, devices, run=run, set_name=name
        )
        prefix = evaluation_prefix(run, name)
        staged = store.staging_path(prefix) / EVALUATION_NAME
        staged.parent.mkdir(parents=True, exist_ok=True)
        staged.write_text(json.dumps(record, indent=1) + "\n")
        context.log.info(summary_line(record))
        yield Output(
            PartitionOutput(
                staged_files={EVALUATION_NAME: staged},
                prefix=prefix,
                manifest_fields={
                    "run": run,
                    "prompt_set": name,
                    "tau": record["tau"],
                    "floor_tau": record["floor_tau"],
                },
            ),
            metadata=evaluation_metadata(record, object_store.uri(f"{prefix}/{EVALUATION_NAME}")),
        )
        yield AssetCheckResult(
            check_name=CHECK_NAME,
            passed=above_floor(record),
            severity=AssetCheckSeverity.WARN,
            description=check_description(record),
            metadata={"tau": record["tau"], "floor_tau": record["floor_tau"], "prompt_set": name},
        )

    return drafter_evaluations


def evaluate_run_on_set(
    context: AssetExecutionContext,
    config: EvaluationConfig,
    object_store: Any,
    store: StoreResource,
    target_model: TargetModelResource,
    devices: DeviceLeaseResource,
    *,
    run: str,
    set_name: str,
) -> dict[str, Any]:
    """Resolve the set, lease a device, load the target and the run's export, decode, report."""
    import time

    from dflash_assets.evaluation import runs
    from dflash_assets.evaluation.loaders import load_prompt_set, loaded_for_evaluation
    from dflash_assets.evaluation.measure import (
        measure_beside_floor,
        reference_identity,
        reference_precision,
    )
    from dflash_assets.evaluation.report import build_record

    started = time.monotonic()
    manifest = runs.run_manifest(object_store, run)
    new_tokens = config.token_count()
    identity = runs.export_identity(object_store, run)  # before the download: what is measured, not later
    export_dir = runs.download_export(object_store, run, store.read_cache_dir() / "exports" / run)
    prompt_set = load_prompt_set(
        set_name,
        settings.EVAL_SETS.get(),
        object_store=object_store,
        run_manifest=manifest,
        target_dir=target_model.model_dir(),
        count=config.prompt_count(),
        new_tokens=new_tokens,
        cache_dir=store.read_cache_dir(),
    )
    skipped = prompt_set.describe_skipped()
    context.log.info(
        f"{set_name}: {len(prompt_set.prompts)} prompts from {prompt_set.rows_read} rows"
        + (f"; {skipped}" if skipped else "")
    )
    for detail in prompt_set.skipped_details:
        context.log.info(f"{set_name}: skipped {detail}")
    log = context.log.info
    with (
        devices.lease(holder=f"run {context.run.run_id}", log=log) as device,
        loaded_for_evaluation(target_model.model_dir(), export_dir, device) as loaded,
    ):
        verifier, drafter, stops = loaded
        # The target's greedy output and the floor's figures, made once per target, prompts and budget.
        reference_key = reference_identity(
            target_model.name,
            reference_precision(device),
            prompt_set.prompts,
            max_new_tokens=new_tokens,
            stop_token_ids=stops,
        )
        stored = runs.read_reference(object_store, reference_key)
        measured = measure_beside_floor(
            verifier,
            drafter,
            prompt_set,
            max_new_tokens=new_tokens,
            stop_token_ids=stops,
            log=log,
            reference=stored,
        )
        if measured["reference"] != stored:  # new, or a floor at another block size added
            runs.write_reference(object_store, reference_key, measured["reference"])
    return build_record(
        run=run,
        prompt_set=prompt_set,
        measured=measured,
        run_manifest=manifest,
        drafter_uri=object_store.uri(f"{DRAFTER_PREFIX}/{run}"),
        export_identity=identity,
        target_model=target_model.name,
        max_new_tokens=new_tokens,
        seconds=time.monotonic() - started,
    )


def evaluation_metadata(record: dict[str, Any], evaluation_uri: str) -> dict[str, Any]:
    """The asset's metadata: `tau`, `floor_tau`, `prompts` and `lossless_prompts` are contracts (checks and
    plots read them by name); the table shows the drafter beside the floor."""
    from dflash_assets.drafter.speculative import describe_by_context_length
    from dflash_assets.evaluation.report import markdown_table

    drafter = record["drafter"]
    return dagster_metadata(
        {
            "tau": record["tau"],
            "floor_tau": record["floor_tau"],
            "ratio_to_floor": record["ratio"],
            "prompts": record["prompts"],
            "lossless_prompts": record["lossless_prompts"],
            "floor_lossless_prompts": record["floor_lossless_prompts"],
            "rounds": drafter["rounds"],
            "acceptance_by_position": drafter["acceptance_by_position"],
            "tau_by_context_length": drafter["by_context_length"],
            "tau_by_context_length_text": describe_by_context_length(drafter),
            "mismatched_prompts": [item["prompt"] for item in drafter["mismatched"]],
            "prompt_set": record["prompt_set"],
            "reference": record["reference"] or "(the run's held-out rows)",
            "run": record["run"],
            "drafter_uri": record["drafter_uri"],
            "evaluation_uri": MetadataValue.path(evaluation_uri),
            "max_new_tokens": record["max_new_tokens"],
            "rows_skipped": record["rows_skipped"],
            "seconds": record["seconds"],
            "table": MetadataValue.md(markdown_table(record)),
        }
    )
