"""What `drafter_checkpoints` needs around the training core: its run config (`TrainConfig`, every field
resolved at run time: run config, else its `DFLASH_*` setting, else the recipe's `TrainSettings`), the job
and this node's spec built from the resources, rank 0's reports turned into Dagster events, and the
outcome turned into metadata and the run's manifest."""

from __future__ import annotations

import math
import socket
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from dagster import AssetExecutionContext, AssetObservation, Config, MetadataValue
from pydantic import Field

from dflash_assets import settings, terminal
from dflash_assets.orchestration.progress import PROGRESS_TAG
from dflash_assets.orchestration.redaction import redacted_tags
from dflash_assets.orchestration.resources import StoreResource, TargetModelResource
from dflash_assets.storage.manifest import StoredPartition

if TYPE_CHECKING:
    from dflash_assets.orchestration.execution.train_launch import Launch, Reports
    from dflash_assets.training.job import TrainingJob
    from dflash_assets.training.rank import NodeSpec

AUTO = 0  # `nproc_per_node: 0` in run config, `DFLASH_TRAIN_NPROC_PER_NODE=auto`: the plan's split


class TrainConfig(Config):
    """Run config of `drafter_checkpoints`. Unset fields take their `DFLASH_*` setting, then the DFlash
    recipe's default (`training/settings.py`), when the run starts."""

    mode: str | None = Field(default=None, description="`offline` or `online` (DFLASH_TRAIN_MODE).")
    run_name: str | None = Field(
        default=None, description="checkpoints/<run>/, drafter/<run>/ (DFLASH_RUN_NAME)."
    )
    max_steps: int | None = Field(
        default=None,
        description="Exactly this many optimiser steps (DFLASH_TRAIN_MAX_STEPS; 0: the epochs decide).",
    )
    epochs: int | None = Field(default=None, description="Passes over the data (the recipe: 6).")
    cpu_bf16_autocast: bool | None = Field(
        default=None,
        description="On a CPU with bf16 matrix units, train under bf16 autocast (DFLASH_TRAIN_CPU_BF16).",
    )
    until_flat: bool | None = Field(
        default=None,
        description="Stop once the held-out tau curve is flat, max_steps (or the epochs) the cap, and export "
        "the best checkpoint (DFLASH_TRAIN_UNTIL_FLAT).",
    )
    global_batch_size: int | None = Field(
        default=None,
        description="Sequences per optimiser step, over all ranks (DFLASH_TRAIN_GLOBAL_BATCH_SIZE).",
    )
    micro_batch_gib: float | None = Field(
        default=None, description="Activation memory per micro-batch, GiB (unset: 70% of free device memory)."
    )
    lr: float | None = Field(default=None, description="AdamW peak learning rate (the recipe: 6e-4).")
    lr_schedule: str | None = Field(
        default=None,
        description="After warm-up: `cosine` (the recipe), `linear`, `constant` or `wsd` (hold, then decay; "
        "until flat, the decay starts where the curve went flat) (DFLASH_LR_SCHEDULE).",
    )
    lr_decay_ratio: float | None = Field(
        default=None, description="`wsd`: the part of the run its linear decay takes (0.2)."
    )
    max_length: int | None = Field(
        default=None, description="Tokens per sample trained on (DFLASH_MAX_LENGTH)."
    )
    num_anchors: int | None = Field(
        default=None,
        description="Random anchor positions per sequence (the recipe: 512; 64 on the bundled data).",
    )
    tokens_per_anchor: float | None = Field(
        default=None,
        description="One anchor per this many labelled tokens of a sequence, up to num_anchors (6: the "
        "recipe's density at 3072 tokens; unset or 1: every qualifying position up to num_anchors).",
    )
    gamma: float | None = Field(
        default=None, description="Loss weight exp(-(p-1)/gamma) at block position p."
    )
    seed: int | None = Field(default=None, description="Data order, anchors and initial weights.")
    mask_token_id: int | None = Field(
        default=None, description="Mask token id (DFLASH_MASK_TOKEN_ID; -1 or unset: from the tokenizer)."
    )
    drafter_shape: str | None = Field(default=None, description="`auto`/`dflash`, `dflash-swa` or `target`.")
    drafter_arch: str | None = Field(default=None, description="`dflash` or `dflash2` (DFLASH_DRAFTER_ARCH).")
    loss: str | None = Field(
        default=None, description="Position weights: `dpace` or `decay` (DFLASH_DRAFTER_LOSS)."
    )
    dpace_alpha: float | None = Field(default=None, description="D-PACE's smoothing (DFLASH_DPACE_ALPHA).")
    distill_weight: float | None = Field(
        default=None,
        description="Weight of distillation from the target's distribution, 0..1 (DFLASH_DISTILL_WEIGHT).",
    )
    block_size: int | None = Field(
        default=None,
        description="Drafter block size (DFLASH_BLOCK_SIZE; unset: 8 for dflash2, 16 for dflash).",
    )
    drafter_init: str | None = Field(
        default=None,
        description="A drafter directory in z-lab's layout to start from (DFLASH_DRAFTER_INIT).",
    )
    checkpoint_every_steps: int | None = Field(
        default=None, description="Checkpoint every N steps (DFLASH_CHECKPOINT_EVERY_STEPS; 0: by time only)."
    )
    checkpoint_every_minutes: float | None = Field(
        default=None, description="Checkpoint every M minutes (DFLASH_CHECKPOINT_EVERY_MINUTES)."
    )
    log_every_steps: int | None = Field(default=None, description="Steps between progress log lines.")
    eval_samples: int | None = Field(default=None, description="Held-out samples evaluated at checkpoints.")
    train_samples: int | None = Field(
        default=None,
        description="Train on the first N samples not held out (0 or unset: all): data sizes from one "
        "capture, each measured on the same held-out samples.",
    )
    spec_eval_prompts: int | None = Field(
        default=None, description="Held-out prompts decoded speculatively with the target at checkpoints."
    )
    spec_eval_max_new_tokens: int | None = Field(
        default=None, description="Tokens decoded per held-out prompt."
    )
    online_target_devices: int | None = Field(
        default=None,
        description="Online: devices per drafter rank that run target replicas (0: the target shares the "
        "rank's device). With nproc_per_node auto: the plan's split.",
    )
    cache_budget_bytes: int | None = Field(
        default=None, description="Offline: bound on a node's cache of streamed hidden states (16 GiB)."
    )
    nproc_per_node: int | None = Field(
        default=None,
        description="Drafter ranks per node (DFLASH_TRAIN_NPROC_PER_NODE; 0: auto, the plan's split).",
    )
    nnodes: int | None = Field(default=None, description="Nodes the run trains on (DFLASH_TRAIN_NNODES).")

    def train_settings(self):
        """The run's `TrainSettings` (device left to each rank's lease)."""
        from dflash_assets.training.settings import TrainSettings

        chosen = settings.given_or
        max_steps = chosen(self.max_steps, settings.train_max_steps)
        until_flat = chosen(self.until_flat, settings.TRAIN_UNTIL_FLAT.get_bool)
        every_steps = chosen(self.checkpoint_every_steps, settings.CHECKPOINT_EVERY_STEPS.get_int)
        if (
            until_flat
            and self.checkpoint_every_steps is None
            and not settings.CHECKPOINT_EVERY_STEPS.is_set()
        ):
            every_steps = 0  # the setting's default interval yields to the trainer's cadence for the curve
        every_minutes = chosen(self.checkpoint_every_minutes, settings.CHECKPOINT_EVERY_MINUTES.get_float)
        values = {
            "mode": chosen(self.mode, settings.TRAIN_MODE.get),
            "max_steps": max_steps or None,
            "global_batch_size": chosen(self.global_batch_size, settings.train_global_batch_size),
            "max_length": chosen(self.max_length, settings.MAX_LENGTH.get_int),
            "checkpoint_every_steps": every_steps or None,
            "checkpoint_every_minutes": every_minutes or None,
            "micro_batch_bytes": int(self.micro_batch_gib * 2**30) if self.micro_batch_gib else None,
            "loss": chosen(self.loss, settings.DRAFTER_LOSS.get),
            "dpace_alpha": chosen(self.dpace_alpha, settings.DPACE_ALPHA.get_float),
            "distill_weight": chosen(self.distill_weight, settings.DISTILL_WEIGHT.get_float),
            "block_size": self.block(),
            "drafter_init": chosen(self.drafter_init, settings.DRAFTER_INIT.get),
            "until_flat": until_flat,
            "lr_schedule": chosen(self.lr_schedule, settings.LR_SCHEDULE.get),
            "cpu_bf16_autocast": chosen(self.cpu_bf16_autocast, settings.TRAIN_CPU_BF16.get_bool),
            # The curve's prompts and budget are drafter_evaluations': its last point is the held_out τ.
            "spec_eval_prompts": chosen(self.spec_eval_prompts, settings.EVAL_PROMPTS.get_int),
            "spec_eval_max_new_tokens": chosen(
                self.spec_eval_max_new_tokens, settings.EVAL_NEW_TOKENS.get_int
            ),
        }
        recipe = (
            "epochs", "lr", "lr_decay_ratio", "gamma", "seed", "log_every_steps", "eval_samples",
            "train_samples",
        )  # fmt: skip
        values.update({name: getattr(self, name) for name in recipe if getattr(self, name) is not None})
        anchors = chosen(self.num_anchors, settings.train_num_anchors)
        if anchors is not None:
            values["num_anchors"] = anchors
        if self.tokens_per_anchor is not None:
            values["tokens_per_anchor"] = self.tokens_per_anchor
        return TrainSettings(**values)

    @property
    def run(self) -> str:
        return self.run_name or settings.RUN_NAME.get()

    def arch(self) -> str:
        return settings.given_or(self.drafter_arch, settings.DRAFTER_ARCH.get)

    def block(self) -> int:
        return settings.given_or(self.block_size, lambda: settings.block_size_for(self.arch()))

    def mask_token(self) -> int | None:
        value = self.mask_token_id
        if value is None and settings.MASK_TOKEN_ID.get():
            value = settings.MASK_TOKEN_ID.get_int()
        return value if value is not None and value >= 0 else None

    def launch(self, node_devices: int, mode: str, recommend=None):
        """How many ranks on how many nodes, and how they meet (`train_launch.Launch`); `recommend` gives
        the online split for `auto` (`capacity_plan.online_split_recommender`)."""
        from dflash_assets.orchestration.execution.train_launch import Launch

        nnodes = settings.given_or(self.nnodes, settings.TRAIN_NNODES.get_int)
        nproc = settings.given_or(self.nproc_per_node, settings.train_nproc_per_node)
        targets = self.online_target_devices if self.online_target_devices is not None else 0
        if nproc == AUTO:
            nproc, targets = auto_split(node_devices, mode, self.online_target_devices, recommend)
        if nproc < 1 or nnodes < 1:
            raise settings.SettingError(
                f"{settings.TRAIN_NPROC_PER_NODE.name}={nproc} and {settings.TRAIN_NNODES.name}={nnodes}: "
                "both must be at least 1 (`auto` for the plan's split)"
            )
        launch = Launch(
            nproc_per_node=nproc,
            nnodes=nnodes,
            rdzv_host=settings.TRAIN_RDZV_HOST.get(),
            rdzv_port=settings.TRAIN_RDZV_PORT.get_int(),
            rdzv_timeout_s=settings.TRAIN_RDZV_TIMEOUT_S.get_float(),
            max_restarts=settings.TRAIN_MAX_RESTARTS.get_int(),
        )
        return launch, targets


def launch_warnings(global_batch_size: int, launch: Launch) -> list[str]:
    """What the step says before launching about a launch that works but wastes devices."""
    warnings = []
    if global_batch_size < launch.world_size:
        idle = launch.world_size - global_batch_size
        warnings.append(
            f"WARNING: the global batch of {global_batch_size} sequence(s) a step "
            f"({settings.TRAIN_GLOBAL_BATCH_SIZE.name}, run config `global_batch_size`) is smaller than the "
            f"world size {launch.world_size}: {idle} of the {launch.world_size} ranks get no sample in any "
            f"step and only wait. Set the global batch to at least {launch.world_size}, or train on fewer "
            f"ranks ({settings.TRAIN_NPROC_PER_NODE.name}, {settings.TRAIN_NNODES.name})"
        )
    return warnings


def auto_split(
    node_devices: int, mode: str, online_target_devices: int | None, recommend=None
) -> tuple[int, int]:
    """(drafter ranks, target devices per rank) for this node's devices: offline, every device trains;
    online, the plan's split, `recommend(node_devices, online_target_devices)`
    (`planning/training_split.py`)."""
    if mode == "offline":
        return max(1, node_devices), 0
    if recommend is None:
        raise ValueError("online `auto` needs the plan's recommendation (recommend=...)")
    return recommend(node_devices, online_target_devices)


def data_source(tokenized: list[StoredPartition]) -> dict[str, Any]:
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


def configured_drafter(target_model: TargetModelResource, config: TrainConfig | None = None):
    """The drafter a run trains for the configured target (a `DrafterConfig`): run config where `config`
    gives it, else the `DFLASH_*` settings (`DFLASH_DRAFTER_ARCH`, `DFLASH_DRAFTER_SHAPE`,
    `DFLASH_BLOCK_SIZE`, `DFLASH_MASK_TOKEN_ID`, `DFLASH_NUM_DRAFT_LAYERS`, `DFLASH_TARGET_LAYER_IDS`).
    Its mask token is resolved here (`drafter.config.resolve_mask_token`): a target with no id to spare
    raises `MaskTokenError`, one line naming the setting."""
    from dflash_assets.drafter.config import DrafterConfig

    config = config or TrainConfig()
    return DrafterConfig.from_target(
        target_model.model_dir(),
        num_layers=target_model.draft_layers(),
        target_layer_ids=target_model.layer_ids(),
        mask_token_id=config.mask_token(),
        shape=config.drafter_shape or settings.DRAFTER_SHAPE.get(),
        arch=config.arch(),
        block_size=config.block(),
    )


def drafter_summary(drafter) -> str:
    """One line on the drafter a run will train: what `plan` prints and every data stage logs first."""
    return (
        f"{drafter.arch}, {drafter.num_layers} layers, block {drafter.block_size}, target layers "
        f"{drafter.target_layer_ids}; mask token {drafter.mask_token_id} ({drafter.mask_token!r}): "
        f"{drafter.extra['mask_token_source']}"
    )


def announce_drafter(target_model: TargetModelResource, log):
    """Before a stage that costs anything (regeneration, tokenizing, capture): the drafter these settings
    will train, logged with its mask token and why. A configuration no drafter can be trained from (a
    tokenizer with no id to spare and no `DFLASH_MASK_TOKEN_ID`) stops here, in one line, instead of at
    `drafter_checkpoints` after the target has regenerated and been captured."""
    drafter = configured_drafter(target_model)
    log(f"the drafter these settings train: {drafter_summary(drafter)}")
    return drafter


def training_job(
    config: TrainConfig,
    store: StoreResource,
    target_model: TargetModelResource,
    hidden_states: list[StoredPartition],
    tokenized: list[StoredPartition],
    *,
    online_target_devices: int,
    log,
):
    """The run's `TrainingJob`: the drafter's shape from the target, the ranges to train on, the
    settings; checked here, before any rank starts."""
    from dflash_assets.drafter.model import config_summary
    from dflash_assets.orchestration.target_span import online_target_span
    from dflash_assets.training.job import TrainingJob

    train_settings = config.train_settings()
    drafter_config = configured_drafter(target_model, config)
    drafter_config.extra["target_model_name"] = target_model.name  # what hidden-state objects record
    if train_settings.drafter_init:  # a mismatch is named here, before any rank starts
        from dflash_assets.drafter.published import check_initial_drafter

        check_initial_drafter(drafter_config, train_settings.drafter_init)
    if train_settings.distill_weight > 0 and train_settings.mode == "offline":
        check_final_states(hidden_states, train_settings.distill_weight)
    log(
        f"mask token {drafter_config.mask_token_id}: {drafter_config.extra['mask_token_source']}; "
        f"drafter {config_summary(drafter_config)}"
    )
    job_settings = train_settings.to_dict()
    job_settings.pop("device")
    span = online_target_span(target_model) if train_settings.mode == "online" else 1
    if span > 1 and (online_target_devices == 0 or online_target_devices % span):
        raise settings.SettingError(
            f"{settings.TARGET_TP.name} makes each online target replica span {span} devices, so a rank's "
            f"target devices come in whole replicas: set the run config `online_target_devices` to a "
            f"multiple of {span} (it is {online_target_devices}; 0 shares the drafter's one device)"
        )
    return TrainingJob(
        run=config.run,
        mode=train_settings.mode,
        store_url=store.store_url(),
        hidden_state_partitions=[p.prefix for p in hidden_states],
        tokenized_partitions=[p.prefix for p in tokenized],
        drafter_config=drafter_config.to_json(),
        target_model_name=target_model.name,
        settings=job_settings,
        data_source=data_source(tokenized) if tokenized else {"completions": "dataset"},
        online_target_devices=online_target_devices,
        target_span=span,
        cache_budget_bytes=config.cache_budget_bytes or 16 * 2**30,
        s3=store.s3_settings_fields(),
        upload=store.uploader_fields(),
    )


def check_final_states(hidden_states: list[StoredPartition], weight: float) -> None:
    """Distillation reads the target's final state from every object: a range captured without it (before
    it was captured, or with `DFLASH_CAPTURE_FINAL_STATE=0`) is named here, before any rank starts."""
    lacking = [
        p.prefix.rsplit("/", 1)[-1] for p in hidden_states if not p.manifest.get("final_hidden_states")
    ]
    if lacking:
        ranges = ", ".join(lacking[:3]) + (f" and {len(lacking) - 3} more" if len(lacking) > 3 else "")
        raise settings.SettingError(
            f"{settings.DISTILL_WEIGHT.name}={weight:g} reads the target's final hidden state, which "
            f"hidden-state range {ranges} does not hold: materialise hidden_state_partitions for it again "
            f"with {settings.CAPTURE_FINAL_STATE.name}=1, or train with {settings.DISTILL_WEIGHT.name}=0"
        )


def run_training(
    job: TrainingJob, launch: Launch, spec: NodeSpec, reports: Reports, *, run_id: str
) -> dict[str, Any]:
    """Train `job` as `launch` says: one rank in this process, or this node's ranks launched (and, over
    several nodes, the others joining: Celery worker nodes with DFLASH_EXECUTOR=celery, else each
    node's `dflash-assets train-join`). Returns rank 0's outcome."""
    from dflash_assets.orchestration.execution.train_launch import (
        network_address,
        published_joins,
        train_here,
        train_launched,
    )

    if launch.in_process:
        return train_here(job, spec, reports)
    if launch.nnodes == 1:
        host = launch.rdzv_host or "127.0.0.1"
    else:  # before any node is placed: a host the others cannot reach is refused here
        host = launch.rdzv_host or network_address(launch.nnodes) or socket.getfqdn()
    joins = None
    if launch.nnodes > 1:
        if settings.EXECUTOR.get() == "celery":
            from dflash_assets.orchestration.execution.celery_training import celery_joins

            joins = celery_joins(job, launch, spec, reports, run_id=run_id)
        else:
            joins = published_joins(job, reports)
    return train_launched(
        job,
        launch,
        spec,
        reports,
        rendezvous_host=host,
        setting=settings.TRAIN_NPROC_PER_NODE.name,
        joins=joins,
    )


# ------------------------------------------------------------------------------------ reports to Dagster


def _block_metadata(prefix: str, metrics: dict | None) -> dict[str, Any]:
    """Numbers only, so the UI plots them across checkpoints and runs."""
    out: dict[str, Any] = {}
    # A measurement's `tau` (evaluation/measure.py) is shown under the name the run's figures always had.
    names = (("loss", "loss"), ("acceptance_length_tau", "acceptance_length_tau"),
             ("tau", "acceptance_length_tau"), ("teacher_forced_tau", "teacher_forced_tau"))  # fmt: skip
    for name, shown in names:
        value = (metrics or {}).get(name)
        if isinstance(value, int | float) and math.isfinite(value):
            out[f"{prefix}{shown}"] = MetadataValue.float(float(value))
    for position, accuracy in enumerate((metrics or {}).get("per_position_accuracy") or [], start=1):
        if accuracy is not None:
            out[f"{prefix}accuracy_pos_{position:02d}"] = MetadataValue.float(float(accuracy))
    for bucket, entry in ((metrics or {}).get("by_context_length") or {}).items():
        tau = entry.get("tau")
        if isinstance(tau, int | float) and math.isfinite(tau):
            out[f"{prefix}tau_{bucket}"] = MetadataValue.float(float(tau))
    return out


class StepReports:
    """Rank 0's reports as the Dagster UI shows them: log lines in the event log, the progress tag on the
    run (every 5 s at most), an observation per committed checkpoint (the UI plots them), the terminal's
    status line (the demo)."""

    TAG_EVERY_S = 5.0

    def __init__(self, context: AssetExecutionContext) -> None:
        self.context = context
        self._tagged_at = 0.0

    def log(self, message: str) -> None:
        if message.startswith(("WARNING", "ERROR")):
            self.context.log.warning(message)
        else:
            self.context.log.info(message)

    def status(self, text: str) -> None:
        self._tag(text[:200])

    def _tag(self, text: str, force: bool = False) -> None:
        if force or time.monotonic() - self._tagged_at >= self.TAG_EVERY_S:
            self._tagged_at = time.monotonic()
            self.context.instance.add_run_tags(self.context.run.run_id, redacted_tags({PROGRESS_TAG: text}))

    def progress(self, snapshot: terminal.ProgressSnapshot) -> None:
        terminal.report(snapshot)
        self._tag(snapshot.figures()[:200], force=snapshot.done == snapshot.total)

    def checkpoint(self, report: dict[str, Any]) -> None:
        metadata: dict[str, Any] = {
            "step": int(report.get("step", 0)),
            "checkpoint": str(report.get("checkpoint") or ""),
        }
        metadata.update(_block_metadata("train_", report.get("train")))
        metadata.update(_block_metadata("eval_", report.get("eval")))
        metadata.update(_block_metadata("spec_", report.get("speculative")))
        self.context.log_event(AssetObservation(asset_key=self.context.asset_key, metadata=metadata))


def training_data_size(
    tokenized: Sequence[StoredPartition],
    trained_sample_ranges: Sequence[str],
    max_length: int,
    cache_dir: Path,
) -> dict[str, int]:
    """`{"training_conversations", "training_answer_tokens"}`: the samples the run trained on (its held-out
    ones left out) and their labelled tokens within `max_length`, read from the tokenized ranges' shards
    (small beside the hidden states). What τ against data size is plotted against."""
    from dflash_assets.conversations.sample_range import SampleRange
    from dflash_assets.conversations.shard import load_shard

    spans = [SampleRange.parse(key) for key in trained_sample_ranges]
    conversations = answer_tokens = 0
    for partition in tokenized:
        for sample in load_shard(partition, cache_dir):
            if any(span.start <= sample.sample_index <= span.end for span in spans):
                conversations += 1
                answer_tokens += int(sum(int(m) for m in sample.loss_mask[:max_length]))
    return {"training_conversations": conversations, "training_answer_tokens": answer_tokens}


def outcome_metadata(outcome: dict[str, Any], job, node: str) -> dict[str, Any]:
    """The materialisation's metadata: what the run did, where, how fast, and how well it drafts."""
    from dflash_assets.drafter.config import DrafterConfig
    from dflash_assets.drafter.model import config_summary
    from dflash_assets.drafter.speculative import describe_by_context_length

    drafter = DrafterConfig.from_json(job.drafter_config)
    world = outcome["world"]
    speculative = outcome.get("speculative") or {}
    rank_seconds = outcome.get("rank_step_seconds") or []
    return {
        "steps": outcome["steps"],
        "steps_per_epoch": outcome["steps_per_epoch"],
        "global_batch_size": job.settings["global_batch_size"],
        "resumed_from_step": outcome["resumed_from_step"] if outcome["resumed_from_step"] is not None else -1,
        "tokens_per_s": MetadataValue.float(float(outcome["tokens_per_second"])),  # every rank's summed
        "world_size": world["world_size"],
        "nodes": ", ".join(dict.fromkeys(world["nodes"])),
        "rank_devices": MetadataValue.json(
            [
                {"rank": r, "node": n, "device": d}
                for r, (n, d) in enumerate(zip(world["nodes"], world["devices"], strict=True))
            ]
        ),
        "rank_step_seconds": MetadataValue.json([round(s, 4) for s in rank_seconds]),
        "slowest_rank_step_s": MetadataValue.float(float(max(rank_seconds, default=0.0))),
        # Rank 0's seconds in held-out evaluations (teacher-forced and speculative), the rest being steps.
        "evaluation_seconds": MetadataValue.float(float(outcome.get("evaluation_seconds") or 0.0)),
        "trained_world_sizes": MetadataValue.json(outcome.get("world_sizes") or []),
        "mode": job.mode,
        "device": world["devices"][0],
        "node": node,
        "target_devices": "none (offline)"
        if job.mode == "offline"
        else ", ".join(world["target_devices"][0] or world["devices"][:1]),
        "drafter_uri": outcome["drafter_uri"],
        "mask_token_id": drafter.mask_token_id,
        "mask_token_source": drafter.extra.get("mask_token_source", ""),
        "drafter_shape": MetadataValue.json(config_summary(drafter)),
        "drafter_arch": drafter.arch,
        "objective": MetadataValue.json(
            {name: job.settings.get(name) for name in ("loss", "gamma", "dpace_alpha", "drafter_init")}
        ),
        "trained_partitions": MetadataValue.json(outcome["partitions"]),
        "training_data": MetadataValue.json(job.data_source),
        "checkpoints_written": len(outcome["checkpoints"]),
        # Why training ended (the flat curve's line, the cap) and whose weights the export holds: with
        # until_flat the best checkpoint's, whose figures the eval_ and spec_ entries are.
        "until_flat": bool(job.settings.get("until_flat")),
        "stop_reason": outcome.get("stop_reason") or "",
        "exported_step": int(outcome.get("exported_step") or outcome["steps"]),
        # Steps whose loss or summed gradient was not finite: skipped on every rank, over the whole run.
        "skipped_nonfinite_steps": int(outcome.get("skipped_nonfinite_steps") or 0),
        "spec_matches_target_greedy": bool(speculative.get("prompts")) and not speculative.get("mismatched"),
        # tau per bucket of held-out prompt lengths, each with its prompts and whether they are enough.
        "tau_by_context_length": MetadataValue.json(speculative.get("by_context_length") or {}),
        "tau_by_context_length_text": describe_by_context_length(speculative),
        **_block_metadata("spec_", {"by_context_length": speculative.get("by_context_length")}),
        **_block_metadata(
            "",
            {
                **outcome["metrics"],
                "loss": outcome["final_loss"],
                "per_position_accuracy": outcome["per_position_accuracy"],
            },
        ),  # fmt: skip
        **_block_metadata("baseline_", (outcome.get("baseline") or {}).get("speculative")),
        **_block_metadata("eval_", outcome.get("eval")),
    }


def manifest_fields(outcome: dict[str, Any], job) -> dict[str, Any]:
    """What `checkpoints/<run>/_manifest.json` records of the run."""
    from dflash_assets.drafter.config import DrafterConfig
    from dflash_assets.drafter.model import drafter_parameter_count
    from dflash_assets.training.train import device_seconds

    drafter = DrafterConfig.from_json(job.drafter_config)
    train_seconds, train_device_seconds = device_seconds(outcome.get("world_sizes") or [])
    return {
        "run": job.run,
        # What the drafter is and how it was trained, for `dflash-assets compare` beside its evaluations.
        "drafter_arch": drafter.arch,
        "block_size": drafter.block_size,
        "loss": job.settings.get("loss"),
        "distill_weight": job.settings.get("distill_weight"),
        "parameters": drafter_parameter_count(drafter),
        "train_seconds": round(train_seconds, 1),
        "train_device_seconds": round(train_device_seconds, 1),
        "mode": job.mode,
        "steps": outcome["steps"],
        "trained_partitions": outcome["partitions"],
        "trained_sample_ranges": outcome["trained_sample_ranges"],
        "eval_sample_indices": outcome["eval_sample_indices"],
        "checkpoints": outcome["checkpoints"],
        "drafter": outcome["drafter_uri"],
        "target_model": drafter.target_model,
        "target_layer_ids": drafter.target_layer_ids,
        "world_sizes": outcome.get("world_sizes") or [],
        "acceptance_length_tau": outcome["acceptance_length_tau"],
        "baseline_acceptance_length_tau": outcome["metrics"].get("baseline_acceptance_length_tau"),
        # τ at each evaluation, by step (`{step, tau, teacher_forced_tau, ce}`; step 0: the fresh weights),
        # beside the final τ: whether it was still rising. A resumed run's continues its checkpoint's.
        "curve": outcome.get("evaluations") or [],
        # Why it ended, and the step whose weights (and τ above) the export holds: with until_flat, the best.
        "until_flat": bool(job.settings.get("until_flat")),
        "stop_reason": outcome.get("stop_reason") or "",
        "exported_step": outcome.get("exported_step", outcome["steps"]),
    }
