"""`drafter_checkpoints`: train the DFlash drafter from the store (offline) or beside the target (online)."""

import contextlib
import math
import time
from pathlib import Path

from dagster import AssetExecutionContext, AssetIn, AssetObservation, Config, MetadataValue, asset
from pydantic import Field

from dflash_assets import settings
from dflash_assets.orchestration.assets.hidden_states import load_tokenized
from dflash_assets.orchestration.execution.k8s import gpu_step_tags
from dflash_assets.orchestration.execution.nodes import step_node
from dflash_assets.orchestration.io_manager import PartitionOutput
from dflash_assets.orchestration.progress import PROGRESS_TAG
from dflash_assets.orchestration.resources import DeviceLeaseResource, StoreResource, TargetModelResource
from dflash_assets.storage.manifest import StoredPartition


class TrainConfig(Config):
    mode: str = Field(default=settings.TRAIN_MODE.get(), description="`offline` or `online`.")
    run_name: str = Field(default=settings.RUN_NAME.get(), description="checkpoints/<run>/, drafter/<run>/.")
    max_steps: int = Field(
        default=settings.TRAIN_MAX_STEPS.get_optional_int() or 0,
        description="Exactly this many optimiser steps (0: the recipe's epochs decide).",
    )
    epochs: int = Field(default=6, description="Passes over the data (the DFlash recipe: 6).")
    global_batch_size: int = Field(
        default=settings.TRAIN_GLOBAL_BATCH_SIZE.get_int(),
        description="Sequences per optimiser step (gradient accumulation over micro-batches).",
    )
    micro_batch_gib: float = Field(
        default=0.0, description="Activation memory per micro-batch, GiB (0: 70% of free device memory)."
    )
    lr: float = Field(default=6e-4, description="AdamW peak learning rate.")
    max_length: int = Field(
        default=settings.MAX_LENGTH.get_int(), description="Tokens per sample trained on."
    )
    num_anchors: int = Field(default=512, description="Random anchor positions per sequence.")
    gamma: float = Field(default=7.0, description="Loss weight exp(-(p-1)/gamma) at block position p.")
    seed: int = Field(default=0, description="Data order, anchors and initial weights.")
    mask_token_id: int = Field(
        default=settings.MASK_TOKEN_ID.get_int() if settings.MASK_TOKEN_ID.get() else -1,
        description="Mask token id (-1: the tokenizer's mask_token, else the first id past its vocabulary).",
    )
    drafter_shape: str = Field(
        default=settings.DRAFTER_SHAPE.get(), description="`auto`/`dflash`, `dflash-swa` or `target`."
    )
    checkpoint_every_steps: int = Field(default=settings.CHECKPOINT_EVERY_STEPS.get_int())
    checkpoint_every_minutes: float = Field(default=settings.CHECKPOINT_EVERY_MINUTES.get_float())
    log_every_steps: int = Field(default=10, description="Steps between progress log lines.")
    eval_samples: int = Field(default=16, description="Held-out samples evaluated at every checkpoint.")
    spec_eval_prompts: int = Field(
        default=8, description="Held-out prompts decoded speculatively with the target at every checkpoint."
    )
    spec_eval_max_new_tokens: int = Field(default=64, description="Tokens decoded per held-out prompt.")
    online_target_devices: int = Field(
        default=0,
        description="Online mode: devices that run target replicas besides the drafter's (0: share it). "
        "A node with 8 GPUs: 7.",
    )
    cache_budget_bytes: int = Field(
        default=16 * 2**30, description="Offline: bound on the local cache of streamed hidden states."
    )


def _torch_device(leased: str) -> str:
    return "cpu" if leased.startswith("cpu") else leased  # "cpu:1" only names a simulated lease


def _block_metadata(prefix: str, metrics: dict | None) -> dict:
    """Numbers only, so the UI plots them across checkpoints and runs."""
    out = {}
    for name in ("loss", "acceptance_length_tau", "teacher_forced_tau"):
        value = (metrics or {}).get(name)
        if isinstance(value, int | float) and math.isfinite(value):
            out[f"{prefix}{name}"] = MetadataValue.float(float(value))
    for position, accuracy in enumerate((metrics or {}).get("per_position_accuracy") or [], start=1):
        if accuracy is not None:
            out[f"{prefix}accuracy_pos_{position:02d}"] = MetadataValue.float(float(accuracy))
    return out


def _offline_data(hidden_states: list[StoredPartition], store, cache_dir: Path, budget: int):
    from dflash_assets.extraction.sample_format import parse_sample_object_name  # imports torch
    from dflash_assets.training.data import OfflineData

    if not hidden_states:
        raise ValueError(
            "No hidden-state ranges are materialised, so offline training has nothing to read: "
            "materialise hidden_state_partitions for some ranges first, or set DFLASH_TRAIN_MODE=online "
            "(run config `mode: online`) to run the target beside the trainer."
        )
    objects, dtypes = [], []
    for partition in hidden_states:
        for key, size in partition.object_keys():
            if parse_sample_object_name(key.rsplit("/", 1)[-1]) is not None:
                objects.append((key, size))
                dtypes.append(partition.manifest.get("hidden_state_dtype", "bf16"))  # bf16 before fp8 existed
    return OfflineData(
        store=store,
        objects=objects,
        cache_dir=cache_dir,
        cache_budget_bytes=budget,
        hidden_state_dtypes=dtypes,
    )


def _data_source(tokenized: list[StoredPartition]) -> dict:
    """Whose answers the ranges hold, from their manifests: the target's own (and how they were
    generated), or the dataset's; `mixed` when ranges disagree."""
    sources = {partition.manifest.get("completions", "dataset") for partition in tokenized}
    if sources != {"target"}:
        return {"completions": "mixed" if len(sources) > 1 else "dataset"}
    first = tokenized[0].manifest
    return {
        "completions": "target",
        "regenerated_by": first.get("regenerated_by"),
        "generation": first.get("generation"),
    }


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
    description="DFlash drafter trained on the materialised ranges; resumable checkpoints; exported model.",
)
def drafter_checkpoints(
    context: AssetExecutionContext,
    config: TrainConfig,
    hidden_states: list[StoredPartition],
    tokenized: list[StoredPartition],
    store: StoreResource,
    target_model: TargetModelResource,
    devices: DeviceLeaseResource,
) -> PartitionOutput:
    from dflash_assets.drafter.config import DrafterConfig
    from dflash_assets.drafter.model import config_summary
    from dflash_assets.drafter.speculative import TargetVerifier
    from dflash_assets.extraction.capture import HiddenStateCapture, ReplicatedCapture
    from dflash_assets.target.kernels import report_kernel_paths
    from dflash_assets.target.model import load_target_model
    from dflash_assets.training.data import OnlineData
    from dflash_assets.training.export import export_trained_drafter
    from dflash_assets.training.settings import TrainSettings
    from dflash_assets.training.train import train_drafter

    node = step_node(context)
    object_store = store.check()
    model_dir = target_model.model_dir()
    layer_ids = target_model.layer_ids()
    drafter_config = DrafterConfig.from_target(
        model_dir,
        num_layers=target_model.draft_layers(),
        target_layer_ids=layer_ids,
        mask_token_id=config.mask_token_id if config.mask_token_id >= 0 else None,
        shape=config.drafter_shape,
    )
    drafter_config.extra["target_model_name"] = target_model.name  # what hidden-state objects record
    context.log.info(
        f"mask token {drafter_config.mask_token_id}: {drafter_config.extra['mask_token_source']}; "
        f"drafter {config_summary(drafter_config)}"
    )
    work_dir = store.training_dir(config.run_name)  # local state of this store's run (resources.py)

    target_devices: list[str] = []
    holder, waits = f"run {context.run_id}", context.log.info  # a waiting run says whom it waits for
    with devices.lease(holder=holder, log=waits) as device, contextlib.ExitStack() as target_leases:
        context.log.info(f"training run {config.run_name!r} in {config.mode} mode on {device}")
        train_settings = TrainSettings(
            mode=config.mode,
            max_steps=config.max_steps or None,
            epochs=config.epochs,
            global_batch_size=config.global_batch_size,
            micro_batch_bytes=int(config.micro_batch_gib * 2**30) or None,
            lr=config.lr,
            max_length=config.max_length,
            num_anchors=config.num_anchors,
            gamma=config.gamma,
            seed=config.seed,
            checkpoint_every_steps=config.checkpoint_every_steps or None,
            checkpoint_every_minutes=config.checkpoint_every_minutes or None,
            log_every_steps=config.log_every_steps,
            eval_samples=config.eval_samples,
            spec_eval_prompts=config.spec_eval_prompts,
            spec_eval_max_new_tokens=config.spec_eval_max_new_tokens,
            device=_torch_device(device),
        )
        verifier = None  # offline: the target is loaded on the drafter's device for evaluation only
        if config.mode == "offline":
            data = _offline_data(
                hidden_states, object_store, store.train_cache_dir(config.run_name), config.cache_budget_bytes
            )
        else:
            if not tokenized:
                raise ValueError("No tokenized_completions ranges are materialised: materialise some first.")
            samples = [
                s for partition in tokenized for s in load_tokenized(partition, store.read_cache_dir())
            ]
            target_devices = [
                target_leases.enter_context(devices.lease(holder=holder, log=waits))
                for _ in range(config.online_target_devices)
            ] or [device]  # each replica's device is leased like any run's, so runs never share one
            context.log.info(f"target replicas on {', '.join(target_devices)}; drafter on {device}")
            captures = [
                HiddenStateCapture(load_target_model(model_dir, _torch_device(d)), layer_ids)
                for d in target_devices
            ]
            for capture, target_device in zip(captures, target_devices, strict=True):
                report_kernel_paths(capture.model, target_device, context.log.info, context.log.warning)
            data = OnlineData(
                samples=samples,
                target_hidden_states=ReplicatedCapture(captures, train_settings.device),
                partitions=[p.partition for p in tokenized],
            )
            verifier = lambda: TargetVerifier(captures[0].model, layer_ids)  # noqa: E731

        def on_checkpoint(report: dict) -> None:
            metadata = {"step": int(report.get("step", 0)), "checkpoint": str(report.get("checkpoint") or "")}
            metadata.update(_block_metadata("train_", report.get("train")))
            metadata.update(_block_metadata("eval_", report.get("eval")))
            metadata.update(_block_metadata("spec_", report.get("speculative")))
            context.log_event(AssetObservation(asset_key=context.asset_key, metadata=metadata))

        tagged_at = [0.0]

        def on_progress(snapshot) -> None:  # the Runs list's `dflash/progress`, as for extraction ranges
            if time.monotonic() - tagged_at[0] >= 5.0 or snapshot.done == snapshot.total:
                tagged_at[0] = time.monotonic()
                context.instance.add_run_tags(context.run_id, {PROGRESS_TAG: snapshot.figures()[:200]})

        with store.uploader() as uploader:
            result = train_drafter(
                drafter_config,
                train_settings,
                data,
                store=object_store,
                run=config.run_name,
                work_dir=work_dir,
                log=context.log.info,
                on_checkpoint=on_checkpoint,
                uploader=uploader,
                target_verifier=verifier,
                # Offline: a speculative evaluation that does not fit beside the drafter may borrow a
                # free device for the target (training/memory.py).
                spare_device=lambda: devices.try_lease(holder=holder, exclude=[device, *target_devices]),
                on_progress=on_progress,
            )
            export_dir, metrics = export_trained_drafter(
                result, drafter_config, work_dir / "export", run=config.run_name,
                target_model_name=target_model.name, data_source=_data_source(tokenized),
            )  # fmt: skip
            export_prefix = f"drafter/{config.run_name}"
            # config.json last: readers take a directory with a config as complete.
            for path in sorted(export_dir.iterdir(), key=lambda p: (p.name == "config.json", p.name)):
                uploader.submit(path, f"{export_prefix}/{path.name}")
                uploader.flush()

    speculative = result.speculative or {}
    context.add_output_metadata(
        {
            "steps": result.steps,
            "steps_per_epoch": result.steps_per_epoch,
            "global_batch_size": config.global_batch_size,
            "resumed_from_step": result.resumed_from_step if result.resumed_from_step is not None else -1,
            "tokens_per_s": MetadataValue.float(float(result.tokens_per_second)),
            "mode": config.mode,
            "device": device,
            "node": node,
            "target_devices": ", ".join(target_devices) or "none (offline)",
            "drafter_uri": object_store.uri(export_prefix),
            "mask_token_id": drafter_config.mask_token_id,
            "mask_token_source": drafter_config.extra["mask_token_source"],
            "drafter_shape": MetadataValue.json(config_summary(drafter_config)),
            "trained_partitions": MetadataValue.json(result.partitions),
            "training_data": MetadataValue.json(_data_source(tokenized)),
            "checkpoints_written": len(result.checkpoints),
            "spec_matches_target_greedy": bool(speculative.get("matches_target_greedy", False)),
            **_block_metadata("", {**metrics, "loss": result.final_loss}),  # loss: the last training window
            **_block_metadata("baseline_", (result.baseline or {}).get("speculative")),
            **_block_metadata("eval_", result.eval),
        }
    )
    return PartitionOutput(
        prefix=f"checkpoints/{config.run_name}",
        manifest_fields={
            "run": config.run_name,
            "mode": config.mode,
            "steps": result.steps,
            "trained_partitions": result.partitions,
            "trained_sample_ranges": result.trained_sample_ranges,
            "eval_sample_indices": result.eval_sample_indices,
            "checkpoints": result.checkpoints,
            "drafter": object_store.uri(export_prefix),
            "target_model": drafter_config.target_model,
            "target_layer_ids": layer_ids,
            "acceptance_length_tau": result.acceptance_length_tau,
            "baseline_acceptance_length_tau": metrics["baseline_acceptance_length_tau"],
        },
    )
